// The standalone probes' CUDA check (they link nothing of the library): name the error and where, exit 1.
#pragma once
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define PROBE_CHECK(x)                                                                              \
  do {                                                                                              \
    cudaError_t e_ = (x);                                                                           \
    if (e_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
                   cudaGetErrorString(e_));                                                         \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

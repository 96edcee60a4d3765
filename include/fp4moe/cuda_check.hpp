// Every CUDA runtime / cuBLAS call goes through these: the error names the call, where, and why.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "fp4moe/error.hpp"

#define FP4MOE_CUDA_CHECK(call)                                                               \
  do {                                                                                        \
    cudaError_t fp4moe_err_ = (call);                                                         \
    if (fp4moe_err_ != cudaSuccess)                                                           \
      ::fp4moe::throw_error(FP4MOE_SOURCE_FILE, __LINE__,                                               \
                            fmt::format("CUDA call `{}` failed: {} ({})", #call,              \
                                        cudaGetErrorName(fp4moe_err_),                        \
                                        cudaGetErrorString(fp4moe_err_)));                    \
  } while (0)

// After a kernel launch: catches launch-configuration errors without synchronizing.
#define FP4MOE_CUDA_CHECK_LAUNCH() FP4MOE_CUDA_CHECK(cudaGetLastError())

#define FP4MOE_CUBLAS_CHECK(call)                                                             \
  do {                                                                                        \
    cublasStatus_t fp4moe_st_ = (call);                                                       \
    if (fp4moe_st_ != CUBLAS_STATUS_SUCCESS)                                                  \
      ::fp4moe::throw_error(FP4MOE_SOURCE_FILE, __LINE__,                                               \
                            fmt::format("cuBLAS call `{}` failed: {}", #call,                 \
                                        cublasGetStatusString(fp4moe_st_)));                  \
  } while (0)

namespace fp4moe {
// True when a CUDA device is usable. Never throws: used to decide CPU reference vs GPU and to skip
// GPU tests.
bool gpu_available();
}  // namespace fp4moe

// Every CUDA runtime / cuBLAS call goes through these: the error names the call, where, and why.
#pragma once
#include <cstddef>
#include <string>

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
// cudaMalloc of `bytes` for `what` (a phrase: "the layer workspace"). On failure throws fp4moe::Error
// saying how many bytes were requested, for what, and how much the device has free and in total
// (cudaMemGetInfo), not only the CUDA error name. bytes = 0 returns nullptr.
void* device_malloc(size_t bytes, const char* what);
// The message device_malloc throws (separate so that tests can check it without a GPU).
std::string device_malloc_failure_message(size_t bytes, const char* what, cudaError_t err, int device,
                                          const char* device_name, size_t free_bytes, size_t total_bytes);
// "1,234,567,890 B (1.15 GiB)"
std::string bytes_for_humans(size_t bytes);

// Host -> device copy whose bytes are in device memory when it returns, whatever stream reads them next.
// Why not cudaMemcpy: from pageable memory it may return once the data is staged, before the DMA reaches
// device memory (CUDA runtime docs, "API synchronization behavior"), and a kernel queued next on a
// non-blocking stream is not ordered after that DMA: it can read the allocation's old bytes (a GPU test
// read stale rows that way). The copy goes on the default stream, which is then synchronized.
inline void copy_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, 0));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(0));
}

// True when a CUDA device is usable. Never throws: used to decide CPU reference vs GPU and to skip
// GPU tests.
bool gpu_available();
}  // namespace fp4moe

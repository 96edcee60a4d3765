#include <atomic>

#include "fp4moe/cuda_check.hpp"
#include "launch.hpp"

namespace fp4moe {

std::string bytes_for_humans(size_t bytes) {
  std::string digits = std::to_string(bytes), grouped;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) grouped += ',';
    grouped += digits[i];
  }
  return fmt::format("{} B ({:.2f} GiB)", grouped, static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
}

std::string device_malloc_failure_message(size_t bytes, const char* what, cudaError_t err, int device,
                                          const char* device_name, size_t free_bytes, size_t total_bytes) {
  std::string have = total_bytes > 0 ? fmt::format("GPU {} ({}) has {} free of {}", device, device_name,
                                                   bytes_for_humans(free_bytes), bytes_for_humans(total_bytes))
                                     : fmt::format("GPU {}'s free memory could not be queried", device);
  return fmt::format("cannot allocate {} of device memory for {}: cudaMalloc failed with {} ({}); {}{}",
                     bytes_for_humans(bytes), what, cudaGetErrorName(err), cudaGetErrorString(err), have,
                     err == cudaErrorMemoryAllocation && total_bytes > 0 && bytes > free_bytes
                         ? fmt::format(", so the request is {} too large", bytes_for_humans(bytes - free_bytes))
                         : std::string());
}

void* device_malloc(size_t bytes, const char* what) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaSuccess) return p;
  cudaGetLastError();  // an out-of-memory error is not sticky; clear it so later calls start clean
  int device = -1;
  size_t free_b = 0, total_b = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    free_b = total_b = 0;
  }
  FP4MOE_FAIL("{}", device_malloc_failure_message(bytes, what, err, device, prop.name, free_b, total_b));
}

bool gpu_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error so later calls start clean
    return false;
  }
  return n > 0;
}

namespace detail {

bool pdl_supported() {
  // -1: not yet asked; per device (up to 64), so the launch path is a load after the first call.
  static std::atomic<int> cache[64] = {};
  static std::atomic<bool> init{false};
  if (!init.load(std::memory_order_acquire)) {
    for (auto& c : cache) c.store(-1, std::memory_order_relaxed);
    init.store(true, std::memory_order_release);
  }
  int dev = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return false;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v < 0) {
    int major = 0;
    FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    v = major >= 9 ? 1 : 0;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

void record_stage_event(cudaEvent_t event, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FP4MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status == cudaStreamCaptureStatusActive)
    FP4MOE_CUDA_CHECK(cudaEventRecordWithFlags(event, stream, cudaEventRecordExternal));
  else
    FP4MOE_CUDA_CHECK(cudaEventRecord(event, stream));
}

}  // namespace detail

}  // namespace fp4moe

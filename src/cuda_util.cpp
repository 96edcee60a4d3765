#include <atomic>

#include "fp4moe/cuda_check.hpp"
#include "launch.hpp"

namespace fp4moe {

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

}  // namespace detail

}  // namespace fp4moe

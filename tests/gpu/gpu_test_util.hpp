// Helpers shared by the GPU test suites.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"

// Without a GPU the test is reported as skipped (ctest's SKIP_REGULAR_EXPRESSION), never as passed.
#define FP4MOE_SKIP_WITHOUT_GPU() \
  if (!fp4moe::gpu_available()) GTEST_SKIP() << "no CUDA GPU"

namespace fp4moe::test {

// At least 16 bytes, so an empty input still gives a valid, aligned pointer.
template <class T>
DeviceBuffer<uint8_t> upload(const std::vector<T>& v) {
  DeviceBuffer<uint8_t> b(std::max<size_t>(v.size() * sizeof(T), 16));
  if (!v.empty()) FP4MOE_CUDA_CHECK(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}
template <class T>
std::vector<T> download(const void* p, size_t n) {
  std::vector<T> v(n);
  if (n > 0) FP4MOE_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

}  // namespace fp4moe::test

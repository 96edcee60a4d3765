// Helpers shared by the GPU test suites.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/format_math.hpp"

// Without a GPU the test is reported as skipped (ctest's SKIP_REGULAR_EXPRESSION), never as passed.
#define FP4MOE_SKIP_WITHOUT_GPU() \
  if (!fp4moe::gpu_available()) GTEST_SKIP() << "no CUDA GPU"

namespace fp4moe::test {

// At least 16 bytes, so an empty input still gives a valid, aligned pointer.
template <class T>
DeviceBuffer<uint8_t> upload(const std::vector<T>& v) {
  DeviceBuffer<uint8_t> b(std::max<size_t>(v.size() * sizeof(T), 16));
  copy_to_device(b.get(), v.data(), v.size() * sizeof(T));
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

// The combine's definition on the host: out[t, h] = bf16(sum over slots s < k, in order, of
// y[row_of[t * k + s], h] in fp32, then + shared[t, h] when shared is non-empty).
inline std::vector<uint16_t> combine_reference(const std::vector<uint16_t>& y, const std::vector<uint16_t>& shared,
                                               const std::vector<int32_t>& row_of, int64_t tokens, int k,
                                               int64_t hidden) {
  std::vector<uint16_t> out(static_cast<size_t>(tokens * hidden));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      float acc = 0.0f;
      for (int s = 0; s < k; ++s) acc += bf16_bits_to_float(y[row_of[t * k + s] * hidden + h]);
      if (!shared.empty()) acc += bf16_bits_to_float(shared[t * hidden + h]);
      out[t * hidden + h] = float_to_bf16_bits(acc);
    }
  return out;
}

// The permutation's expected output from the ids alone: a stable counting sort. off [E + 1]: expert
// offsets; row_of [n]: the row of flat entry i; row_scale [n]: entry i's weight at its row.
struct HostPermutation {
  std::vector<int32_t> off, row_of;
  std::vector<float> row_scale;
};
inline HostPermutation host_permutation(const std::vector<int32_t>& ids, const std::vector<float>& w, int E) {
  HostPermutation h;
  const size_t n = ids.size();
  h.off.assign(E + 1, 0);
  h.row_of.resize(n);
  h.row_scale.resize(n);
  for (int32_t e : ids) ++h.off[e + 1];
  for (int e = 0; e < E; ++e) h.off[e + 1] += h.off[e];
  std::vector<int32_t> next(h.off.begin(), h.off.end() - 1);
  for (size_t i = 0; i < n; ++i) {
    h.row_of[i] = next[ids[i]]++;
    h.row_scale[h.row_of[i]] = w[i];
  }
  return h;
}

}  // namespace fp4moe::test

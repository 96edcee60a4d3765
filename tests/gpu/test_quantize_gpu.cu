// GPU bf16 -> NVFP4 row quantizer against the host reference, bit for bit.
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe {
namespace {

// Owns one cudaMalloc allocation so that a failed ASSERT does not leak device memory.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { FP4MOE_CUDA_CHECK(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

// Gaussian bf16 with 1% outliers up to 1000x, whole zero rows, and rows so small (~1e-36) that their
// global scale amax / 2688 is a subnormal float: those catch a device build that flushes to zero.
std::vector<uint16_t> make_input(std::mt19937& rng, int64_t rows, int64_t cols) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<uint16_t> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const int kind = static_cast<int>(r % 5);
    for (int64_t c = 0; c < cols; ++c) {
      float v = nd(rng);
      if (u(rng) < 0.01f) v *= 1000.0f * u(rng);
      if (kind == 3) v = 0.0f;
      if (kind == 4) v *= 1e-36f;
      x[r * cols + c] = float_to_bf16_bits(v);
    }
  }
  return x;
}

void check_shape(int64_t rows, int64_t cols, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "rows " << rows << " cols " << cols);
  std::mt19937 rng(seed);
  const std::vector<uint16_t> x = make_input(rng, rows, cols);
  DeviceBuffer dx(x.size() * 2), dcodes(rows * cols / 2), dscales(rows * cols / 16), dglobal(rows * 4);
  copy_to_device(dx.ptr, x.data(), x.size() * 2);
  // Poison the outputs so that a byte the kernel forgets to write cannot match by luck.
  FP4MOE_CUDA_CHECK(cudaMemset(dcodes.ptr, 0xa5, rows * cols / 2));
  FP4MOE_CUDA_CHECK(cudaMemset(dscales.ptr, 0xa5, rows * cols / 16));
  FP4MOE_CUDA_CHECK(cudaMemset(dglobal.ptr, 0xa5, rows * 4));
  cudaStream_t stream;
  FP4MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  quantize_nvfp4_rows_device(dx.ptr, rows, cols, dcodes.as<uint8_t>(), dscales.as<uint8_t>(),
                             dglobal.as<float>(), stream);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  FP4MOE_CUDA_CHECK(cudaStreamDestroy(stream));

  std::vector<uint8_t> codes(rows * cols / 2), scales(rows * cols / 16);
  std::vector<float> global(rows);
  FP4MOE_CUDA_CHECK(cudaMemcpy(codes.data(), dcodes.ptr, codes.size(), cudaMemcpyDeviceToHost));
  FP4MOE_CUDA_CHECK(cudaMemcpy(scales.data(), dscales.ptr, scales.size(), cudaMemcpyDeviceToHost));
  FP4MOE_CUDA_CHECK(cudaMemcpy(global.data(), dglobal.ptr, rows * 4, cudaMemcpyDeviceToHost));

  for (int64_t r = 0; r < rows; ++r) {
    const Nvfp4Tensor ref =
        quantize_nvfp4_bf16(std::span<const uint16_t>(x.data() + r * cols, cols), 1, cols);
    ASSERT_EQ(float_bits(global[r]), float_bits(ref.global_scale)) << "row " << r;
    ASSERT_EQ(0, std::memcmp(scales.data() + r * cols / 16, ref.scales.data(), cols / 16)) << "row " << r;
    ASSERT_EQ(0, std::memcmp(codes.data() + r * cols / 2, ref.codes.data(), cols / 2)) << "row " << r;
  }
}

TEST(QuantizeGpu, MatchesHostBitExact) {
  if (!fp4moe::gpu_available()) GTEST_SKIP() << "no CUDA GPU";
  uint32_t seed = 1;
  for (int64_t rows : {1, 7, 130})
    for (int64_t cols : {16, 48, 2048, 6144}) check_shape(rows, cols, seed++);
}

TEST(QuantizeGpu, ZeroRowsIsANoOp) {
  if (!fp4moe::gpu_available()) GTEST_SKIP() << "no CUDA GPU";
  quantize_nvfp4_rows_device(nullptr, 0, 64, nullptr, nullptr, nullptr, nullptr);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace fp4moe

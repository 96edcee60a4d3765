// An allocation larger than the GPU fails with a message that names the request and the GPU's memory.
#include <string>

#include <gtest/gtest.h>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe {
namespace {

TEST(ErrorsGpu, OutOfMemoryMessageNamesBytesAndFreeMemory) {
  if (!gpu_available()) GTEST_SKIP() << "no GPU";
  size_t free_b = 0, total_b = 0;
  FP4MOE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t ask = total_b * 4;  // more than the device has
  try {
    DeviceBuffer<uint8_t> b(ask, "a test buffer four times the GPU's memory");
    FAIL() << "allocating " << ask << " bytes succeeded";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(bytes_for_humans(ask)), std::string::npos) << m;
    EXPECT_NE(m.find("a test buffer four times the GPU's memory"), std::string::npos) << m;
    EXPECT_NE(m.find("cudaErrorMemoryAllocation"), std::string::npos) << m;
    EXPECT_NE(m.find("free of " + bytes_for_humans(total_b)), std::string::npos) << m;
    EXPECT_EQ(m.find("(/"), std::string::npos) << m;
  }
  // The failure is not sticky: the next allocation works.
  DeviceBuffer<uint8_t> ok(1024, "a small buffer");
  EXPECT_NE(ok.get(), nullptr);
}

}  // namespace
}  // namespace fp4moe

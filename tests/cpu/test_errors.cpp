// Error messages: repository-relative source locations (never the build machine's absolute paths), and
// an out-of-memory message that says what was asked and what the GPU has.
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include "fp4moe/config.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/planner.hpp"

namespace fp4moe {
namespace {

std::string message_of(void (*f)()) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// No absolute path: the build directory and the source directory (absolute) never appear, and no
// location starts with '/'.
void expect_no_absolute_path(const std::string& msg) {
  EXPECT_EQ(msg.find(FP4MOE_TEST_SOURCE_DIR), std::string::npos) << msg;
  EXPECT_EQ(msg.find(FP4MOE_TEST_BINARY_DIR), std::string::npos) << msg;
  EXPECT_EQ(msg.find("(/"), std::string::npos) << msg;
}

TEST(ErrorMessages, LibraryErrorsNameARepositoryRelativeFile) {
  const std::string msg = message_of([] { (void)preset("no-such-model"); });
  ASSERT_FALSE(msg.empty());
  EXPECT_NE(msg.find("no-such-model"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(src/presets.cpp:"), std::string::npos) << msg;
  expect_no_absolute_path(msg);
}

TEST(ErrorMessages, HeaderAndTestLocationsAreRelativeToo) {
  const std::string in_test = message_of([] { FP4MOE_REQUIRE(1 + 1 == 3, "arithmetic = {} must hold", 2); });
  EXPECT_NE(in_test.find("(tests/cpu/test_errors.cpp:"), std::string::npos) << in_test;
  expect_no_absolute_path(in_test);
  const std::string in_lib = message_of([] { (void)arch_from_name("sm_42"); });
  EXPECT_NE(in_lib.find("(src/arch.cpp:"), std::string::npos) << in_lib;
  expect_no_absolute_path(in_lib);
}

TEST(ErrorMessages, AnAbsolutePathIsCutToItsFileName) {
  EXPECT_STREQ(source_location_for_users("/home/someone/build/src/x.cpp"), "x.cpp");
  EXPECT_STREQ(source_location_for_users("src/planner.cpp"), "src/planner.cpp");
  EXPECT_STREQ(source_location_for_users("x.cu"), "x.cu");
  static_assert(source_location_for_users("/a/b.hpp")[0] == 'b', "works at compile time");
  const std::string m = message_of([] { throw_error("/abs/dir/file.cpp", 7, "boom"); });
  EXPECT_EQ(m, "fp4moe: boom (file.cpp:7)");
}

TEST(ErrorMessages, OutOfMemorySaysWhatWasAskedAndWhatTheGpuHas) {
  const std::string m = device_malloc_failure_message(size_t{21} << 40, "the layer workspace of --tokens 100000000",
                                                      cudaErrorMemoryAllocation, 0, "NVIDIA H200",
                                                      size_t{140} << 30, size_t{143} << 30);
  EXPECT_NE(m.find("cannot allocate 23,089,744,183,296 B (21504.00 GiB) of device memory"), std::string::npos) << m;
  EXPECT_NE(m.find("the layer workspace of --tokens 100000000"), std::string::npos) << m;
  EXPECT_NE(m.find("cudaErrorMemoryAllocation"), std::string::npos) << m;
  EXPECT_NE(m.find("GPU 0 (NVIDIA H200) has 150,323,855,360 B (140.00 GiB) free of 153,545,080,832 B (143.00 GiB)"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("too large"), std::string::npos) << m;
  EXPECT_EQ(bytes_for_humans(1536), "1,536 B (0.00 GiB)");
}

TEST(ErrorMessages, DeviceMallocOfNothingAllocatesNothing) {
  // Zero bytes never reaches cudaMalloc, with or without a GPU.
  EXPECT_EQ(device_malloc(0, "nothing"), nullptr);
}

}  // namespace
}  // namespace fp4moe

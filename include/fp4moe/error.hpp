// Errors: every failed check throws fp4moe::Error with a sentence that names the argument, its value
// and the rule it broke, then the repository-relative file and line. Never a bare status code.
#pragma once
#include <stdexcept>
#include <string>

// fmt 9 turns its constexpr off under __NVCC__ (a workaround for old nvcc), but with C++20 it still
// marks some callers constexpr, and the host compiler then rejects constexpr code calling the
// non-constexpr helpers: every .cu file that includes this header failed to build with nvcc 13.
// nvcc 13 handles fmt's constexpr fine, so switch it back on.
#if defined(__CUDACC__) && !defined(FMT_USE_CONSTEXPR)
#define FMT_USE_CONSTEXPR 1
#endif
#include <fmt/format.h>

namespace fp4moe {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A config or shape that cannot be launched (resources, alignment): a distinct type so that callers
// (explain, the tuner) can tell "does not fit" from "bad input".
class ResourceError : public Error {
 public:
  using Error::Error;
};

// The source location shown in messages. fp4moe's own files are compiled with -ffile-prefix-map, so
// __FILE__ is already repository-relative ("src/presets.cpp"); a path that is still absolute (a
// caller's file, or a build without the flag) is cut to its file name, so that no message carries
// the build machine's directories.
constexpr const char* source_location_for_users(const char* file) {
  if (file == nullptr || file[0] != '/') return file;
  const char* base = file;
  for (const char* p = file; *p != '\0'; ++p)
    if (*p == '/') base = p + 1;
  return base;
}

[[noreturn]] inline void throw_error(const char* file, int line, const std::string& msg) {
  throw Error(fmt::format("fp4moe: {} ({}:{})", msg, source_location_for_users(file), line));
}

}  // namespace fp4moe

// The source location in messages: repository-relative (-ffile-prefix-map), and cut to the file's name
// by source_location_for_users() where it is still absolute.
#define FP4MOE_SOURCE_FILE __FILE__

// FP4MOE_REQUIRE(cond, "fmt", args...): the message must name the argument, the value and the rule,
// e.g. FP4MOE_REQUIRE(k % 16 == 0, "K = {} must be a multiple of 16 (the NVFP4 block)", k).
#define FP4MOE_REQUIRE(cond, ...)                                               \
  do {                                                                          \
    if (!(cond)) ::fp4moe::throw_error(FP4MOE_SOURCE_FILE, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define FP4MOE_FAIL(...) ::fp4moe::throw_error(FP4MOE_SOURCE_FILE, __LINE__, fmt::format(__VA_ARGS__))

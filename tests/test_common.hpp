// Helpers shared by the CPU and GPU test binaries (no CUDA, no JSON: both compilers take it).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace fp4moe::test {

// The fixtures: $FP4MOE_FIXTURES_DIR, else the source tree the tests were built from, else
// tests/fixtures under the working directory (a copied tree run from its root, e.g. the GPU machine).
inline std::string fixture(const std::string& name) {
  if (const char* env = std::getenv("FP4MOE_FIXTURES_DIR")) return std::string(env) + "/" + name;
  std::error_code ec;
  if (std::filesystem::is_directory(FP4MOE_FIXTURES_DIR, ec)) return std::string(FP4MOE_FIXTURES_DIR) + "/" + name;
  return "tests/fixtures/" + name;
}

// ||a - ref|| / ||ref|| in double (0 / 0 reads as 0).
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace fp4moe::test

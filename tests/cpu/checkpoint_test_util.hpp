// Helpers for the checkpoint tests: a scratch directory, a minimal safetensors writer (for files the
// exporters would never write: the bad-file matrix), fixture copies.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../test_common.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe::test {

namespace fs = std::filesystem;

// A fresh directory under the system temp dir, removed with the object.
struct ScratchDir {
  fs::path path;
  ScratchDir() {
    std::random_device rd;
    path = fs::temp_directory_path() / ("fp4moe-test-" + std::to_string(rd()) + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

struct StTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// The header JSON and data a well-formed writer produces (contiguous, in order).
inline std::string safetensors_bytes(const std::vector<StTensor>& ts, const std::string& header_override = "") {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  std::string data;
  for (const auto& t : ts) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  }
  std::string hs = header_override.empty() ? h.dump() : header_override;
  uint64_t n = hs.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + hs + data;
}

inline std::vector<uint8_t> bytes_of(size_t n, uint8_t seed = 1) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + 37 * i);
  return v;
}
inline std::vector<uint8_t> f32_bytes(float x) {
  std::vector<uint8_t> v(4);
  std::memcpy(v.data(), &x, 4);
  return v;
}

// Runs fn, expects an fp4moe::Error whose message contains every string of `must` and no absolute
// path of the scratch directory; returns the message.
template <class Fn>
std::string expect_error(Fn&& fn, const std::vector<std::string>& must, const std::string& forbidden = "") {
  try {
    fn();
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const auto& s : must) {
      EXPECT_NE(m.find(s), std::string::npos) << "missing '" << s << "' in: " << m;
    }
    if (!forbidden.empty()) {
      EXPECT_EQ(m.find(forbidden), std::string::npos) << "absolute path in: " << m;
    }
    return m;
  }
  ADD_FAILURE() << "no fp4moe::Error thrown (expected one mentioning '" << (must.empty() ? "" : must[0]) << "')";
  return "";
}

// Copies a fixture directory into the scratch dir (to be modified).
inline std::string copy_fixture(const ScratchDir& d, const std::string& name) {
  const fs::path dst = d.path / name;
  fs::copy(fixture(name), dst, fs::copy_options::recursive);
  return dst.string();
}

}  // namespace fp4moe::test

// libFuzzer target over the safetensors header parser and the index (weight_map) parser
// (src/safetensors.cpp). The first input byte picks the parser; the rest is the file or the JSON.
// Any exception other than fp4moe::Error, any sanitizer report or crash is a bug.
//   scripts/fuzz.sh [seconds]   (builds with clang + libFuzzer, ASan, UBSan; runs on fuzz/corpus)
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "fp4moe/error.hpp"
#include "fp4moe/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::span<const uint8_t> rest(data + 1, size - 1);
  try {
    if (data[0] & 1) {
      const auto idx = fp4moe::parse_safetensors_index(
          std::string_view(reinterpret_cast<const char*>(rest.data()), rest.size()), "fuzz.index.json");
      for (const auto& f : idx.files)
        if (f.empty() || f.front() == '/') __builtin_trap();  // the parser promised relative paths
    } else {
      const auto h = fp4moe::parse_safetensors_header(rest, "fuzz.safetensors");
      // The promises the loaders rely on: every tensor inside the data, sized by dtype x shape.
      for (const auto& t : h.tensors) {
        if (t.end < t.begin || t.end > h.data_bytes || h.data_offset + h.data_bytes != rest.size()) __builtin_trap();
        if (static_cast<uint64_t>(t.numel()) * fp4moe::dtype_size(t.dtype) != t.end - t.begin) __builtin_trap();
      }
    }
  } catch (const fp4moe::Error&) {
  }
  return 0;
}

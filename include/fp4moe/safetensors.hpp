// A safetensors reader: memory-mapped files whose header is validated before any tensor is touched,
// and sharded checkpoints through model.safetensors.index.json. Host code only, no CUDA.
//
// File format: u64 little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {..}}
// then the data buffer; offsets are relative to the buffer's start.
//
// Every check names the file (by the label the caller gives: a basename or a path relative to the
// checkpoint directory, never an absolute path) and the tensor:
//   - the file holds at least the 8-byte length, N <= kMaxSafetensorsHeaderBytes and 8 + N <= file size;
//   - the header is well-formed JSON, an object of objects, no duplicate names;
//   - dtype is known, shape is a list of non-negative integers, data_offsets = [begin, end] with
//     begin <= end <= data size, end - begin = numel * dtype size (no overflow anywhere);
//   - tensors do not overlap (the Rust reference implementation additionally requires no gaps; real
//     files have none, but a gap is harmless, so it is allowed).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fp4moe {

enum class SafetensorsDtype : uint8_t {
  kBool, kU8, kI8, kF8E4M3, kF8E5M2, kF8E8M0, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kI64, kU64, kF64,
};
std::string_view dtype_name(SafetensorsDtype d);  // "BF16", "F8_E4M3", ...
size_t dtype_size(SafetensorsDtype d);            // bytes per element

// The largest header accepted (the Rust reference implementation's limit): a larger one is refused
// before it is read, so a corrupt length cannot make the parser allocate gigabytes.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100u << 20;

struct SafetensorsTensorInfo {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data buffer
  int64_t numel() const;
  std::string shape_str() const;  // "[2, 64]"
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;  // N
  uint64_t data_offset = 0;   // 8 + N: where the data buffer starts in the file
  uint64_t data_bytes = 0;    // file size - data_offset
  std::vector<SafetensorsTensorInfo> tensors;  // sorted by name
  std::map<std::string, std::string> metadata;
  const SafetensorsTensorInfo* find(std::string_view name) const;  // null when absent
};

// Parses and validates the header of a whole file given as bytes (the file's full contents, or the
// mapped file). `label` names the file in error messages. Throws fp4moe::Error.
SafetensorsHeader parse_safetensors_header(std::span<const uint8_t> file, std::string_view label);

// model.safetensors.index.json: {"metadata": {...}, "weight_map": {"tensor name": "shard file", ...}}.
// Shard names must be relative paths inside the checkpoint directory (no absolute path, no "..").
struct SafetensorsIndex {
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> files;  // the distinct shard names, sorted
};
SafetensorsIndex parse_safetensors_index(std::string_view json_text, std::string_view label);

// A tensor's bytes inside a mapped file (valid while the file is open).
struct TensorRef {
  const SafetensorsTensorInfo* info = nullptr;
  const uint8_t* data = nullptr;
  std::string_view file;  // the file's label
  size_t bytes() const { return static_cast<size_t>(info->end - info->begin); }
};

// One memory-mapped .safetensors file. Opening maps the file and validates its header; tensor bytes
// are read only when used (the page cache serves them).
class SafetensorsFile {
 public:
  // path: where to open it; label: how errors name it (a basename or a path relative to the
  // checkpoint directory).
  SafetensorsFile(const std::string& path, std::string label);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& label() const { return label_; }
  const SafetensorsHeader& header() const { return header_; }
  uint64_t size() const { return size_; }
  // Throws naming the file and the tensor when absent.
  TensorRef tensor(std::string_view name) const;
  const SafetensorsTensorInfo* find(std::string_view name) const { return header_.find(name); }

 private:
  std::string label_;
  const uint8_t* map_ = nullptr;
  uint64_t size_ = 0;
  SafetensorsHeader header_;
};

// All tensors of a checkpoint directory: `model.safetensors.index.json` when present (every tensor
// looked up through its weight_map; shards opened on first use), else the directory's single
// `*.safetensors` file. Thread-safe for concurrent lookups.
class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(const std::string& dir);
  ~SafetensorsCheckpoint();
  SafetensorsCheckpoint(const SafetensorsCheckpoint&) = delete;
  SafetensorsCheckpoint& operator=(const SafetensorsCheckpoint&) = delete;

  const std::string& dir() const { return dir_; }
  bool sharded() const { return sharded_; }
  bool has(std::string_view name) const;
  // Throws naming the tensor (and the index / file that should hold it) when absent.
  TensorRef tensor(std::string_view name) const;
  // Every tensor name (sorted).
  std::vector<std::string> names() const;
  // The shard files (labels), in name order.
  std::vector<std::string> files() const;

 private:
  const SafetensorsFile& open_file(const std::string& label) const;
  struct State;
  std::string dir_;
  bool sharded_ = false;
  std::unique_ptr<State> st_;
};

}  // namespace fp4moe

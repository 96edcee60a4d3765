// safetensors reader (safetensors.hpp): header and index validation, memory-mapped files, sharded
// checkpoints. Plain C++ and POSIX; no CUDA, so the fuzzer (fuzz/) builds it with clang alone.
#include "fp4moe/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "fp4moe/error.hpp"

namespace fp4moe {

namespace {

using json = nlohmann::json;

struct DtypeEntry {
  SafetensorsDtype d;
  const char* name;
  size_t size;
};
constexpr DtypeEntry kDtypes[] = {
    {SafetensorsDtype::kBool, "BOOL", 1},       {SafetensorsDtype::kU8, "U8", 1},
    {SafetensorsDtype::kI8, "I8", 1},           {SafetensorsDtype::kF8E4M3, "F8_E4M3", 1},
    {SafetensorsDtype::kF8E5M2, "F8_E5M2", 1},  {SafetensorsDtype::kF8E8M0, "F8_E8M0", 1},
    {SafetensorsDtype::kI16, "I16", 2},         {SafetensorsDtype::kU16, "U16", 2},
    {SafetensorsDtype::kF16, "F16", 2},         {SafetensorsDtype::kBF16, "BF16", 2},
    {SafetensorsDtype::kI32, "I32", 4},         {SafetensorsDtype::kU32, "U32", 4},
    {SafetensorsDtype::kF32, "F32", 4},         {SafetensorsDtype::kI64, "I64", 8},
    {SafetensorsDtype::kU64, "U64", 8},         {SafetensorsDtype::kF64, "F64", 8},
};

// A JSON value in an error message, cut short: a hostile header may hold megabytes in one string.
std::string excerpt_json(const json& v) {
  std::string s = v.dump(-1, ' ', true, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}
std::string excerpt(std::string_view s) {
  std::string r(s.substr(0, 60));
  if (s.size() > 60) r.resize(57), r += "...";
  return json(r).dump(-1, ' ', true, json::error_handler_t::replace);
}

// Parses text as JSON, refusing duplicate keys in any object (nlohmann keeps the last one silently; a
// duplicate tensor name would hide a tensor). Returns false when the text is not valid JSON.
bool parse_json_strict(std::string_view text, json& out, std::string& duplicate) {
  // Keys seen per open object, by nesting depth.
  std::vector<std::set<std::string>> keys;
  bool dup = false;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) {
      if (keys.size() <= static_cast<size_t>(depth)) keys.resize(static_cast<size_t>(depth) + 1);
      keys[static_cast<size_t>(depth)].clear();
    } else if (ev == json::parse_event_t::key && !dup) {
      // a key at `depth` belongs to the object opened at depth - 1
      const size_t level = depth > 0 ? static_cast<size_t>(depth - 1) : 0;
      if (keys.size() <= level) keys.resize(level + 1);
      const std::string k = parsed.get<std::string>();
      if (!keys[level].insert(k).second) {
        dup = true;
        duplicate = k;
      }
    }
    return true;
  };
  out = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/false);
  if (out.is_discarded()) return false;
  return !dup;
}

bool checked_mul(uint64_t a, uint64_t b, uint64_t& r) { return !__builtin_mul_overflow(a, b, &r); }

}  // namespace

std::string_view dtype_name(SafetensorsDtype d) {
  for (const auto& e : kDtypes)
    if (e.d == d) return e.name;
  return "?";
}
size_t dtype_size(SafetensorsDtype d) {
  for (const auto& e : kDtypes)
    if (e.d == d) return e.size;
  return 0;
}

int64_t SafetensorsTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}
std::string SafetensorsTensorInfo::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

const SafetensorsTensorInfo* SafetensorsHeader::find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const SafetensorsTensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

SafetensorsHeader parse_safetensors_header(std::span<const uint8_t> file, std::string_view label) {
  SafetensorsHeader h;
  FP4MOE_REQUIRE(file.size() >= 8,
                 "{}: the file is {} bytes; a safetensors file starts with an 8-byte header length (truncated "
                 "or not a safetensors file)", label, file.size());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | file[static_cast<size_t>(i)];
  FP4MOE_REQUIRE(n <= kMaxSafetensorsHeaderBytes,
                 "{}: header length {} bytes exceeds the limit of {} bytes (corrupt length or not a safetensors "
                 "file)", label, n, kMaxSafetensorsHeaderBytes);
  FP4MOE_REQUIRE(n <= file.size() - 8,
                 "{}: header length {} bytes runs past the end of the file ({} bytes after the length field; "
                 "truncated file?)", label, n, file.size() - 8);
  h.header_bytes = n;
  h.data_offset = 8 + n;
  h.data_bytes = file.size() - h.data_offset;
  const std::string_view text(reinterpret_cast<const char*>(file.data() + 8), static_cast<size_t>(n));
  json j;
  std::string dup;
  const bool ok = parse_json_strict(text, j, dup);
  FP4MOE_REQUIRE(dup.empty(), "{}: the header names {} twice (duplicate keys are ambiguous)", label, excerpt(dup));
  FP4MOE_REQUIRE(ok, "{}: the {}-byte header is not well-formed JSON", label, n);
  FP4MOE_REQUIRE(j.is_object(), "{}: the header must be a JSON object; it is a {}", label, j.type_name());

  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      FP4MOE_REQUIRE(v.is_object(), "{}: __metadata__ must be an object of strings; it is a {}", label,
                     v.type_name());
      for (auto m = v.begin(); m != v.end(); ++m) {
        FP4MOE_REQUIRE(m.value().is_string(), "{}: __metadata__[{}] must be a string; it is {}", label,
                       excerpt(m.key()), excerpt_json(m.value()));
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string tn = excerpt(name);
    FP4MOE_REQUIRE(v.is_object(), "{}: tensor {}: the entry must be an object with dtype, shape, data_offsets; "
                   "it is {}", label, tn, excerpt_json(v));
    SafetensorsTensorInfo t;
    t.name = name;
    {
      auto d = v.find("dtype");
      FP4MOE_REQUIRE(d != v.end() && d->is_string(), "{}: tensor {}: missing or non-string dtype", label, tn);
      const std::string& ds = d->get_ref<const std::string&>();
      bool found = false;
      for (const auto& e : kDtypes)
        if (ds == e.name) t.dtype = e.d, found = true;
      FP4MOE_REQUIRE(found, "{}: tensor {}: unknown dtype {}", label, tn, excerpt(ds));
    }
    uint64_t numel = 1;
    {
      auto s = v.find("shape");
      FP4MOE_REQUIRE(s != v.end() && s->is_array(), "{}: tensor {}: missing shape (a list of integers)", label, tn);
      FP4MOE_REQUIRE(s->size() <= 16, "{}: tensor {}: shape has {} dimensions (more than 16)", label, tn, s->size());
      for (const json& dim : *s) {
        FP4MOE_REQUIRE(dim.is_number_unsigned() || (dim.is_number_integer() && dim.get<int64_t>() >= 0),
                       "{}: tensor {}: shape {} must hold non-negative integers", label, tn, excerpt_json(*s));
        const uint64_t dv = dim.get<uint64_t>();
        FP4MOE_REQUIRE(dv <= (uint64_t{1} << 48) && checked_mul(numel, dv, numel),
                       "{}: tensor {}: shape {} overflows the element count", label, tn, excerpt_json(*s));
        t.shape.push_back(static_cast<int64_t>(dv));
      }
    }
    {
      auto o = v.find("data_offsets");
      FP4MOE_REQUIRE(o != v.end() && o->is_array() && o->size() == 2 && (*o)[0].is_number_unsigned() &&
                         (*o)[1].is_number_unsigned(),
                     "{}: tensor {}: data_offsets must be [begin, end] with non-negative integers; got {}", label,
                     tn, o == v.end() ? std::string("nothing") : excerpt_json(*o));
      t.begin = (*o)[0].get<uint64_t>();
      t.end = (*o)[1].get<uint64_t>();
      FP4MOE_REQUIRE(t.begin <= t.end, "{}: tensor {}: data_offsets [{}, {}] end before they begin", label, tn,
                     t.begin, t.end);
      FP4MOE_REQUIRE(t.end <= h.data_bytes,
                     "{}: tensor {}: data_offsets [{}, {}] run past the end of the data ({} bytes; truncated file?)",
                     label, tn, t.begin, t.end, h.data_bytes);
    }
    uint64_t bytes = 0;
    FP4MOE_REQUIRE(checked_mul(numel, dtype_size(t.dtype), bytes),
                   "{}: tensor {}: shape {} x {} overflows the byte count", label, tn, t.shape_str(),
                   dtype_name(t.dtype));
    FP4MOE_REQUIRE(bytes == t.end - t.begin,
                   "{}: tensor {}: dtype {} x shape {} = {} bytes, but data_offsets [{}, {}] hold {} bytes", label, tn,
                   dtype_name(t.dtype), t.shape_str(), bytes, t.begin, t.end, t.end - t.begin);
    h.tensors.push_back(std::move(t));
  }
  // Overlap: sorted by begin, each tensor must start at or after the previous one's end (empty
  // tensors occupy nothing).
  std::vector<const SafetensorsTensorInfo*> by_offset;
  for (const auto& t : h.tensors)
    if (t.end > t.begin) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto* a = by_offset[i - 1];
    const auto* b = by_offset[i];
    FP4MOE_REQUIRE(b->begin >= a->end, "{}: tensors {} [{}, {}] and {} [{}, {}] overlap", label, excerpt(a->name),
                   a->begin, a->end, excerpt(b->name), b->begin, b->end);
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return h;
}

SafetensorsIndex parse_safetensors_index(std::string_view json_text, std::string_view label) {
  json j;
  std::string dup;
  const bool ok = parse_json_strict(json_text, j, dup);
  FP4MOE_REQUIRE(dup.empty(), "{}: names {} twice (duplicate keys are ambiguous)", label, excerpt(dup));
  FP4MOE_REQUIRE(ok, "{}: not well-formed JSON", label);
  FP4MOE_REQUIRE(j.is_object(), "{}: must be a JSON object with a weight_map; it is a {}", label, j.type_name());
  auto wm = j.find("weight_map");
  FP4MOE_REQUIRE(wm != j.end() && wm->is_object(), "{}: missing weight_map (an object: tensor name -> shard file)",
                 label);
  SafetensorsIndex idx;
  std::set<std::string> files;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    FP4MOE_REQUIRE(it.value().is_string(), "{}: weight_map[{}] must be a file name; it is {}", label,
                   excerpt(it.key()), excerpt_json(it.value()));
    const std::string& f = it.value().get_ref<const std::string&>();
    // Shards live inside the checkpoint directory: an absolute path or ".." would read elsewhere.
    bool bad = f.empty() || f.front() == '/' || f.find('\0') != std::string::npos;
    for (size_t p = 0; !bad && p <= f.size();) {
      const size_t q = std::min(f.find('/', p), f.size());
      const std::string_view part(f.data() + p, q - p);
      if (part == ".." || part.empty()) bad = true;
      p = q + 1;
    }
    FP4MOE_REQUIRE(!bad, "{}: weight_map[{}] = {} must be a relative path inside the checkpoint directory", label,
                   excerpt(it.key()), excerpt(f));
    idx.weight_map[it.key()] = f;
    files.insert(f);
  }
  idx.files.assign(files.begin(), files.end());
  return idx;
}

// ---------------------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(const std::string& path, std::string label) : label_(std::move(label)) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FP4MOE_REQUIRE(fd >= 0, "{}: cannot open ({})", label_, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    FP4MOE_FAIL("{}: not a regular file", label_);
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    FP4MOE_REQUIRE(p != MAP_FAILED, "{}: cannot map {} bytes ({})", label_, size_, std::strerror(err));
    map_ = static_cast<const uint8_t*>(p);
  } else {
    ::close(fd);
  }
  try {
    header_ = parse_safetensors_header(std::span<const uint8_t>(map_, size_), label_);
  } catch (...) {
    if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), size_);
}

TensorRef SafetensorsFile::tensor(std::string_view name) const {
  const SafetensorsTensorInfo* t = header_.find(name);
  FP4MOE_REQUIRE(t != nullptr, "{}: tensor '{}' is missing", label_, name);
  return TensorRef{t, map_ + header_.data_offset + t->begin, label_};
}

// ---------------------------------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------------------------------

struct SafetensorsCheckpoint::State {
  SafetensorsIndex index;          // sharded: the weight map; single file: built from the header
  std::string single;              // the single file's label when not sharded
  mutable std::mutex mu;
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> open;
};

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& dir) : dir_(dir), st_(std::make_unique<State>()) {
  namespace fs = std::filesystem;
  std::error_code ec;
  FP4MOE_REQUIRE(fs::is_directory(dir, ec), "checkpoint '{}': not a directory", dir);
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index_path, ec)) {
    sharded_ = true;
    std::ifstream f(index_path, std::ios::binary);
    FP4MOE_REQUIRE(f.good(), "model.safetensors.index.json: cannot be read");
    std::stringstream ss;
    ss << f.rdbuf();
    st_->index = parse_safetensors_index(ss.str(), "model.safetensors.index.json");
    FP4MOE_REQUIRE(!st_->index.weight_map.empty(), "model.safetensors.index.json: weight_map is empty");
    return;
  }
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".safetensors") found.push_back(e.path().filename().string());
  std::sort(found.begin(), found.end());
  FP4MOE_REQUIRE(!found.empty(), "checkpoint '{}': no model.safetensors.index.json and no *.safetensors file", dir);
  FP4MOE_REQUIRE(found.size() == 1,
                 "checkpoint '{}': {} .safetensors files ({}, ...) but no model.safetensors.index.json to say which "
                 "tensor is where", dir, found.size(), found[0]);
  st_->single = found[0];
  const SafetensorsFile& f = open_file(found[0]);
  for (const auto& t : f.header().tensors) st_->index.weight_map[t.name] = found[0];
  st_->index.files = {found[0]};
}

SafetensorsCheckpoint::~SafetensorsCheckpoint() = default;

const SafetensorsFile& SafetensorsCheckpoint::open_file(const std::string& label) const {
  std::lock_guard<std::mutex> lock(st_->mu);
  auto it = st_->open.find(label);
  if (it != st_->open.end()) return *it->second;
  const std::string path = (std::filesystem::path(dir_) / label).string();
  std::error_code ec;
  FP4MOE_REQUIRE(std::filesystem::exists(path, ec), "{}: the shard named by model.safetensors.index.json is missing",
                 label);
  auto f = std::make_unique<SafetensorsFile>(path, label);
  const SafetensorsFile& r = *f;
  st_->open.emplace(label, std::move(f));
  return r;
}

bool SafetensorsCheckpoint::has(std::string_view name) const {
  return st_->index.weight_map.count(std::string(name)) > 0;
}

TensorRef SafetensorsCheckpoint::tensor(std::string_view name) const {
  auto it = st_->index.weight_map.find(std::string(name));
  if (it == st_->index.weight_map.end()) {
    if (sharded_) FP4MOE_FAIL("model.safetensors.index.json: tensor '{}' is missing from the weight_map", name);
    FP4MOE_FAIL("{}: tensor '{}' is missing", st_->single, name);
  }
  const SafetensorsFile& f = open_file(it->second);
  const SafetensorsTensorInfo* t = f.find(name);
  FP4MOE_REQUIRE(t != nullptr, "{}: tensor '{}' is missing (model.safetensors.index.json places it in this file)",
                 f.label(), name);
  return f.tensor(name);
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> n;
  for (const auto& [k, v] : st_->index.weight_map) n.push_back(k);
  return n;
}

std::vector<std::string> SafetensorsCheckpoint::files() const { return st_->index.files; }

}  // namespace fp4moe

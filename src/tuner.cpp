// Tuner tables: keys, lookup, fallback (tuner.hpp). The GPU timing loop is src/tuner_run.cpp.
#include "fp4moe/tuner.hpp"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/planner.hpp"

namespace fp4moe {

namespace fs = std::filesystem;

std::string epilogue_name(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::kPlain: return "plain";
    case GemmEpilogue::kSwiGLU: return "swiglu";
    case GemmEpilogue::kGptOssSwiGLU: return "gptoss-swiglu";
  }
  return "unknown";
}

std::string TuneProblem::key() const {
  return fmt::format("E{}_N{}_K{}_{}_{}_{}", experts, n, k, weight_format, act_format, epilogue_name(epilogue));
}

std::string gemm_config_list_id() {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const TileConfig& c : kGemmConfigs) {
    for (char ch : c.name() + ";") {
      h ^= static_cast<unsigned char>(ch);
      h *= 0x100000001b3ull;
    }
  }
  return fmt::format("{}:{:016x}", kNumGemmConfigs, h);
}

nlohmann::json TuneKey::key_json() const {
  return {{"gpu", gpu}, {"cc", cc}, {"sms", sms}, {"config_list", config_list}};
}

nlohmann::json TuneKey::provenance_json() const {
  return {{"cuda_runtime", cuda_runtime}, {"cuda_driver", cuda_driver}, {"fp4moe_version", fp4moe_version}};
}

TuneKey current_tune_key(int device) {
  cudaDeviceProp p{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  TuneKey k;
  k.gpu = p.name;
  k.cc = fmt::format("{}.{}", p.major, p.minor);
  k.sms = p.multiProcessorCount;
  FP4MOE_CUDA_CHECK(cudaRuntimeGetVersion(&k.cuda_runtime));
  FP4MOE_CUDA_CHECK(cudaDriverGetVersion(&k.cuda_driver));
  return k;
}

TuneKey tune_key_from_json(const nlohmann::json& doc) {
  const std::string format = doc.value("format", std::string());
  const nlohmann::json& key = doc.at("key");
  TuneKey k;
  k.gpu = key.at("gpu").get<std::string>();
  k.cc = key.at("cc").get<std::string>();
  if (format == "fp4moe-tune/2") {
    k.sms = key.at("sms").get<int>();
    k.config_list = key.at("config_list").get<std::string>();
    const nlohmann::json& prov = doc.at("provenance");
    k.cuda_runtime = prov.value("cuda_runtime", 0);
    k.cuda_driver = prov.value("cuda_driver", 0);
    k.fp4moe_version = prov.value("fp4moe_version", std::string());
  } else if (format == "fp4moe-tune/1") {
    // The first format keyed on the versions and recorded neither the SM count nor the config list.
    k.sms = 0;
    k.config_list.clear();
    k.cuda_runtime = key.value("cuda_runtime", 0);
    k.cuda_driver = key.value("cuda_driver", 0);
    k.fp4moe_version = key.value("fp4moe_version", std::string());
  } else {
    FP4MOE_FAIL("format '{}' is not fp4moe-tune/2 (or the older fp4moe-tune/1)", format);
  }
  return k;
}

std::string tune_key_mismatch(const TuneKey& t, const TuneKey& p, std::vector<std::string>* notes) {
  if (t.gpu != p.gpu || t.cc != p.cc)
    return fmt::format("measured on {} (cc {}), this GPU is {} (cc {})", t.gpu, t.cc, p.gpu, p.cc);
  if (t.sms != 0 && p.sms != 0 && t.sms != p.sms)
    return fmt::format("measured on {} SMs, this {} has {} (the SM count decides the waves)", t.sms, p.gpu, p.sms);
  if (notes == nullptr) return "";
  if (t.sms == 0) notes->push_back("the table does not record its SM count");
  if (t.config_list.empty())
    notes->push_back(fmt::format("the table does not record its config list (this build: {})", p.config_list));
  else if (t.config_list != p.config_list)
    notes->push_back(fmt::format("measured over config list {}, this build has {}: `fp4moe tune` would also "
                                 "weigh the configs added since",
                                 t.config_list, p.config_list));
  std::string prov;
  auto differs = [&](const char* what, const std::string& table, const std::string& here) {
    if (table != here) prov += fmt::format("{}{} {} (this process {})", prov.empty() ? "" : ", ", what, table, here);
  };
  differs("CUDA runtime", std::to_string(t.cuda_runtime), std::to_string(p.cuda_runtime));
  differs("driver", std::to_string(t.cuda_driver), std::to_string(p.cuda_driver));
  differs("fp4moe", t.fp4moe_version, p.fp4moe_version);
  if (!prov.empty()) notes->push_back("provenance differs: " + prov);
  return "";
}

nlohmann::json tile_config_to_json(const TileConfig& c) {
  return {{"bn", c.bn}, {"bt", c.bt}, {"bk", c.bk}, {"stages", c.stages}, {"warps", c.warps}, {"mma", c.mma}, {"ctas", c.ctas}};
}

TileConfig tile_config_from_json(const nlohmann::json& j) {
  TileConfig c;
  c.bn = j.at("bn").get<int>();
  c.bt = j.at("bt").get<int>();
  c.bk = j.at("bk").get<int>();
  c.stages = j.at("stages").get<int>();
  c.warps = j.at("warps").get<int>();
  c.mma = j.value("mma", 0);
  c.ctas = j.value("ctas", 0);
  return c;
}

namespace {

void warn_once(const std::string& msg) {
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mu);
  if (seen.insert(msg).second) std::fprintf(stderr, "fp4moe: warning: %s\n", msg.c_str());
}

std::string exe_dir() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : p.parent_path().string();
}

bool in_build(const TileConfig& cfg) {
  for (const TileConfig& c : kGemmConfigs)
    if (c == cfg) return true;
  return false;
}

// One table file, read and matched against the process's key.
struct Table {
  fs::path file;
  std::shared_ptr<const nlohmann::json> doc;
  TuneKey key;
  std::vector<std::string> notes;  // differences that do not stop its use
};

// A table file parsed once per process while its size and modification time stay the same. Why: the
// layer looks up four problems at every resolution point when it is built (38 for 16k tokens), and a
// directory of tables holds megabytes of JSON; parsing them at each lookup made a layer's construction
// take seconds (an EP test went from 8 to 47 s when the tables and the points doubled).
struct ParsedTable {
  fs::file_time_type mtime{};
  uintmax_t size = 0;
  std::shared_ptr<const nlohmann::json> doc;
  TuneKey key;
  std::string error;  // why it cannot be used ("" when doc is set)
};

ParsedTable parse_table(const fs::path& file) {
  static std::mutex mu;
  static std::map<std::string, ParsedTable> cache;
  std::error_code ec1, ec2;
  const auto mtime = fs::last_write_time(file, ec1);
  const auto size = fs::file_size(file, ec2);
  const bool stamped = !ec1 && !ec2;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(file.string());
    if (stamped && it != cache.end() && it->second.mtime == mtime && it->second.size == size) return it->second;
  }
  ParsedTable p;
  p.mtime = mtime;
  p.size = size;
  std::ifstream in(file);
  if (!in) {
    p.error = fmt::format("tuner table {} cannot be read", file.string());
    return p;  // not cached: it may become readable
  }
  try {
    auto doc = std::make_shared<nlohmann::json>(nlohmann::json::parse(in));
    p.key = tune_key_from_json(*doc);
    p.doc = std::move(doc);
  } catch (const std::exception& e) {
    p.error = fmt::format("tuner table {} is corrupt ({})", file.string(), e.what());
  }
  if (stamped) {
    std::lock_guard<std::mutex> lock(mu);
    cache[file.string()] = p;
  }
  return p;
}

// Reads `file`; returns false (with a note) when it cannot be used for `key`.
bool read_table(const fs::path& file, const TuneKey& key, Table& t, std::vector<std::string>& notes) {
  const ParsedTable p = parse_table(file);
  if (!p.error.empty()) {
    notes.push_back(p.error);
    return false;
  }
  t.file = file;
  t.doc = p.doc;
  t.key = p.key;
  const std::string why = tune_key_mismatch(t.key, key, &t.notes);
  if (!why.empty()) {
    notes.push_back(fmt::format("tuner table {}: {}", file.string(), why));
    return false;
  }
  return true;
}

// Looks the problem up in one table of this GPU; true when it gave a config.
bool lookup_in_table(const Table& t, const TuneProblem& problem, int64_t tokens, TuneLookup& out,
                     std::vector<std::string>& notes) {
  try {
    for (const auto& entry : t.doc->at("entries")) {
      if (entry.at("problem_key").get<std::string>() != problem.key()) continue;
      std::vector<int64_t> tuned;
      for (const auto& b : entry.at("buckets")) tuned.push_back(b.at("tokens").get<int64_t>());
      const int64_t best_tokens = serving_bucket(tuned, tokens);
      const nlohmann::json* best = nullptr;
      for (const auto& b : entry.at("buckets"))
        if (b.at("tokens").get<int64_t>() == best_tokens) best = &b;
      if (best == nullptr) break;
      std::vector<std::string> skipped_notes;
      TileConfig cfg = tile_config_from_json(best->at("best"));
      if (!in_build(cfg)) {
        // The bucket's winner is not compiled into this build: the fastest measured config that is.
        const std::string missing = cfg.name();
        const nlohmann::json timings = best->value("timings", nlohmann::json::array());  // outlives `pick`
        const nlohmann::json* pick = nullptr;
        double pick_us = 0;
        for (const auto& tm : timings) {
          const TileConfig c = tile_config_from_json(tm.at("cfg"));
          const double us = tm.at("median_us").get<double>();
          if (in_build(c) && (pick == nullptr || us < pick_us)) pick = &tm, pick_us = us;
        }
        if (pick == nullptr) {
          notes.push_back(fmt::format("tuner table {} picks {} for {} at T = {}, which this build does not "
                                      "contain, and no other measured config is in the build",
                                      t.file.string(), missing, problem.key(), best_tokens));
          return false;
        }
        cfg = tile_config_from_json(pick->at("cfg"));
        skipped_notes.push_back(fmt::format("skipped {} (not in this build); {} is the fastest measured config "
                                            "the build contains",
                                            missing, cfg.name()));
      }
      out.config = cfg;
      out.bucket = best_tokens;
      out.table = t.file.string();
      out.source = "tuned table " + t.file.string();
      out.notes = t.notes;
      out.notes.insert(out.notes.end(), skipped_notes.begin(), skipped_notes.end());
      out.reason = fmt::format("measured best for {} at bucket T = {} ({} tokens asked: the tuned bucket nearest "
                               "to {} on a log scale); table key {}, {}, {} SMs",
                               problem.key(), best_tokens, tokens, layer_resolution_point(tokens),
                               t.key.gpu, t.key.cc, t.key.sms > 0 ? std::to_string(t.key.sms) : "?");
      for (const auto& n : out.notes) out.reason += "; " + n;
      return true;
    }
    notes.push_back(fmt::format("tuner table {} has no entry for {}", t.file.string(), problem.key()));
    return false;
  } catch (const std::exception& e) {
    notes.push_back(fmt::format("tuner table {} is corrupt ({})", t.file.string(), e.what()));
    return false;
  }
}

}  // namespace

std::string tune_cache_path() {
  if (const char* env = std::getenv("FP4MOE_TUNE_CACHE"); env != nullptr && *env != '\0') return env;
  const std::string dir = exe_dir();
  if (dir.empty()) return "";
  for (const char* rel : {"../tune", "../../tune", "../share/fp4moe/tune", "tune"}) {
    std::error_code ec;
    const fs::path p = fs::path(dir) / rel;
    if (fs::is_directory(p, ec)) return fs::weakly_canonical(p, ec).string();
  }
  return "";
}

TuneLookup lookup_tuned_config(const TuneProblem& problem, int64_t tokens, const TuneKey& key,
                               const std::string& path, bool warn) {
  TuneLookup out;
  out.source = "heuristic";
  std::vector<std::string> notes;
  try {
    std::error_code ec;
    std::vector<fs::path> files;
    if (path.empty()) {
      notes.push_back("no tuner table ($FP4MOE_TUNE_CACHE unset and no shipped tune/ directory found)");
    } else if (fs::is_directory(path, ec)) {
      for (const auto& e : fs::directory_iterator(path, ec))
        if (e.path().extension() == ".json") files.push_back(e.path());
      std::sort(files.begin(), files.end());
      if (files.empty()) notes.push_back(fmt::format("tuner table directory {} has no tables (*.json)", path));
    } else if (!fs::exists(path, ec)) {
      notes.push_back(fmt::format("tuner table {} does not exist", path));
    } else {
      files.push_back(path);
    }
    // Tables of this GPU; those measured over this build's config list first.
    std::vector<Table> tables;
    std::vector<std::string> table_notes;
    for (const auto& f : files) {
      Table t;
      if (read_table(f, key, t, table_notes)) tables.push_back(std::move(t));
    }
    std::stable_sort(tables.begin(), tables.end(), [&](const Table& a, const Table& b) {
      return (a.key.config_list == key.config_list) > (b.key.config_list == key.config_list);
    });
    for (const Table& t : tables)
      if (lookup_in_table(t, problem, tokens, out, table_notes)) return out;
    if (files.size() > 1) {
      // In a directory of tables for many GPUs, another GPU's table is not a problem; report only that
      // none matched, with the reasons.
      std::string all;
      for (const auto& n : table_notes) all += "; " + n;
      notes.push_back(fmt::format("no table in {} serves {} on {} (cc {}, {} SMs){}", path, problem.key(), key.gpu,
                                  key.cc, key.sms, all));
    } else {
      notes.insert(notes.end(), table_notes.begin(), table_notes.end());
    }
  } catch (const std::exception& e) {
    notes.push_back(fmt::format("tuner table {} could not be read ({})", path, e.what()));
  }
  std::string reason;
  for (const auto& n : notes) reason += (reason.empty() ? "" : "; ") + n;
  out.reason = reason + "; using the heuristic";
  if (warn) warn_once(out.reason);
  return out;
}

std::optional<TileConfig> tuned_config(const TuneProblem& problem, int64_t tokens) {
  try {
    if (!gpu_available()) return std::nullopt;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return std::nullopt;
    return lookup_tuned_config(problem, tokens, current_tune_key(device), tune_cache_path()).config;
  } catch (const std::exception& e) {
    warn_once(fmt::format("tuner table lookup failed ({}); using the heuristic", e.what()));
    return std::nullopt;
  }
}

TuneLookup choose_config(const TuneProblem& problem, int64_t tokens, const ArchInfo& arch) {
  TuneLookup l;
  try {
    if (arch.from_device) {
      int device = 0;
      FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
      l = lookup_tuned_config(problem, tokens, current_tune_key(device), tune_cache_path(), false);
    } else {
      l.source = "heuristic";
      l.reason = fmt::format("{} is described by the architecture table, not a present GPU, so no tuner table "
                             "applies; using the heuristic",
                             arch.name);
    }
  } catch (const std::exception& e) {
    l = TuneLookup{};
    l.source = "heuristic";
    l.reason = fmt::format("tuner table lookup failed ({}); using the heuristic", e.what());
  }
  if (l.config) {
    // A table of this GPU names configs valid on it; checked anyway, so nothing unproven is launched.
    const Verdict v = plan_sm80(*l.config, arch).verdict;
    const Verdict pv = check_problem_sm80(*l.config, problem.n, problem.k, problem.experts);
    if (!v.valid || !pv.valid) {
      l.reason = fmt::format("tuner table {} picks {}, which is not valid here ({}); using the heuristic", l.table,
                             l.config->name(), !v.valid ? v.reason : pv.reason);
      l.config.reset();
      l.table.clear();
    }
  }
  if (!l.config) {
    const double rows = problem.experts > 0 ? static_cast<double>(tokens) * problem.top_k / problem.experts : 0.0;
    std::string rule;
    l.config = heuristic_tile_config(problem.n, problem.k, rows, arch, &rule);
    l.source = "heuristic";
    l.reason += fmt::format(" (heuristic_tile_config(N = {}, K = {}, rows per expert = {:.2f}, {}): {})", problem.n,
                            problem.k, rows, arch.name, rule);
  }
  return l;
}

nlohmann::json merge_tune_cache(const nlohmann::json& existing, const nlohmann::json& fresh) {
  try {
    if (!existing.is_object() || existing.value("format", std::string()) != fresh.value("format", std::string()) ||
        existing.at("key") != fresh.at("key"))
      return fresh;
  } catch (const std::exception&) {
    return fresh;
  }
  nlohmann::json out = existing;
  if (fresh.contains("provenance")) out["provenance"] = fresh.at("provenance");
  for (const auto& e : fresh.at("entries")) {
    auto& entries = out["entries"];
    bool found = false;
    for (auto& old : entries) {
      if (old.at("problem_key") != e.at("problem_key")) continue;
      found = true;
      // Same problem: the new run's buckets replace the old ones of the same T, the others stay (a run
      // of one new bucket extends a table), in token order; the entry's other fields are the new run's.
      nlohmann::json buckets = old.value("buckets", nlohmann::json::array());
      for (const auto& b : e.value("buckets", nlohmann::json::array())) {
        bool replaced = false;
        for (auto& ob : buckets)
          if (ob.value("tokens", int64_t{-1}) == b.value("tokens", int64_t{-2})) ob = b, replaced = true;
        if (!replaced) buckets.push_back(b);
      }
      std::stable_sort(buckets.begin(), buckets.end(), [](const nlohmann::json& x, const nlohmann::json& y) {
        return x.value("tokens", int64_t{0}) < y.value("tokens", int64_t{0});
      });
      old = e;
      old["buckets"] = std::move(buckets);
    }
    if (!found) entries.push_back(e);
  }
  return out;
}

int64_t serving_bucket(const std::vector<int64_t>& buckets, int64_t tokens) {
  const int64_t q = layer_resolution_point(tokens);
  if (std::find(buckets.begin(), buckets.end(), q) != buckets.end()) return q;
  const int64_t p = coarse_resolution_point(tokens);
  int64_t lo = -1, hi = -1;  // the nearest buckets <= p and > p
  for (int64_t b : buckets) {
    if (b <= p && b > lo) lo = b;
    if (b > p && (hi < 0 || b < hi)) hi = b;
  }
  if (lo < 0) return hi;
  if (hi < 0) return lo;
  // log-nearest: p / lo against hi / p, i.e. p^2 against lo x hi (exact in doubles for the sizes here)
  return static_cast<double>(p) * static_cast<double>(p) > static_cast<double>(lo) * static_cast<double>(hi) ? hi : lo;
}

std::vector<TileConfig> tuner_bucket_candidates(const nlohmann::json& bucket, int n) {
  FP4MOE_REQUIRE(n >= 1, "tuner_bucket_candidates: n = {} must be >= 1", n);
  FP4MOE_REQUIRE(bucket.is_object() && bucket.contains("timings") && bucket.contains("rows_per_expert"),
                 "tuner bucket: expected an object with \"timings\" and \"rows_per_expert\"");
  const double rows = bucket.at("rows_per_expert").get<double>();
  const bool fused = bucket.value("shared_expert_fused", true);
  std::vector<std::pair<double, TileConfig>> eligible;
  for (const auto& t : bucket.at("timings")) {
    const TileConfig c = tile_config_from_json(t.at("cfg"));
    if (tuner_may_pick(c, rows, fused) && in_build(c)) eligible.emplace_back(t.at("median_us").get<double>(), c);
  }
  std::stable_sort(eligible.begin(), eligible.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<TileConfig> out;
  for (size_t i = 0; i < eligible.size() && out.size() < static_cast<size_t>(n); ++i) out.push_back(eligible[i].second);
  return out;
}

size_t choose_layer_pair(const std::vector<double>& scores, double margin) {
  FP4MOE_REQUIRE(!scores.empty(), "choose_layer_pair: no pairs were timed");
  FP4MOE_REQUIRE(margin >= 0.0 && margin < 1.0, "choose_layer_pair: margin = {} must be in [0, 1)", margin);
  size_t best = 0;
  for (size_t i = 1; i < scores.size(); ++i)
    if (scores[i] < scores[best]) best = i;
  return best != 0 && scores[best] < 1.0 - margin ? best : 0;
}

}  // namespace fp4moe

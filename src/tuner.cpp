// Tuner cache: keys, lookup, fallback (tuner.hpp). The GPU timing loop is src/tuner_run.cu.
#include "fp4moe/tuner.hpp"

#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
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

nlohmann::json TuneKey::to_json() const {
  return {{"gpu", gpu}, {"cc", cc}, {"cuda_runtime", cuda_runtime}, {"cuda_driver", cuda_driver},
          {"fp4moe_version", fp4moe_version}};
}

TuneKey current_tune_key(int device) {
  cudaDeviceProp p{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  TuneKey k;
  k.gpu = p.name;
  k.cc = fmt::format("{}.{}", p.major, p.minor);
  FP4MOE_CUDA_CHECK(cudaRuntimeGetVersion(&k.cuda_runtime));
  FP4MOE_CUDA_CHECK(cudaDriverGetVersion(&k.cuda_driver));
  return k;
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

// Tries one JSON file; returns true when it settled the lookup (config found, or a definite reason).
bool lookup_file(const fs::path& file, const TuneProblem& problem, int64_t tokens, const TuneKey& key,
                 TuneLookup& out, std::vector<std::string>& notes) {
  std::ifstream in(file);
  if (!in) {
    notes.push_back(fmt::format("tuner cache {} cannot be read", file.string()));
    return false;
  }
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    notes.push_back(fmt::format("tuner cache {} is corrupt ({})", file.string(), e.what()));
    return false;
  }
  try {
    if (doc.value("format", std::string()) != "fp4moe-tune/1") {
      notes.push_back(fmt::format("tuner cache {} is not format fp4moe-tune/1", file.string()));
      return false;
    }
    const nlohmann::json want = key.to_json();
    const nlohmann::json& have = doc.at("key");
    if (have != want) {
      std::string diff;
      for (auto it = want.begin(); it != want.end(); ++it)
        if (!have.contains(it.key()) || have.at(it.key()) != it.value())
          diff += fmt::format("{}{} {} (this process: {})", diff.empty() ? "" : ", ", it.key(),
                              have.contains(it.key()) ? have.at(it.key()).dump() : "missing", it.value().dump());
      notes.push_back(fmt::format("tuner cache {} is stale: {}", file.string(), diff));
      return false;
    }
    for (const auto& entry : doc.at("entries")) {
      if (entry.at("problem_key").get<std::string>() != problem.key()) continue;
      const nlohmann::json* best = nullptr;
      int64_t best_tokens = -1;
      const nlohmann::json* smallest = nullptr;
      int64_t smallest_tokens = LLONG_MAX;
      for (const auto& b : entry.at("buckets")) {
        const int64_t t = b.at("tokens").get<int64_t>();
        if (t <= tokens && t > best_tokens) best = &b, best_tokens = t;
        if (t < smallest_tokens) smallest = &b, smallest_tokens = t;
      }
      if (best == nullptr) best = smallest, best_tokens = smallest_tokens;
      if (best == nullptr) break;
      const TileConfig cfg = tile_config_from_json(best->at("best"));
      bool compiled = false;
      for (const TileConfig& c : kGemmConfigs) compiled = compiled || c == cfg;
      if (!compiled) {
        notes.push_back(fmt::format("tuner cache {} names {} which is not in kGemmConfigs", file.string(),
                                    cfg.name()));
        return false;
      }
      out.config = cfg;
      out.bucket = best_tokens;
      out.source = "tuned cache " + file.string();
      out.reason = fmt::format("measured best for {} at bucket T = {} ({} tokens asked{})", problem.key(),
                               best_tokens, tokens,
                               best_tokens <= tokens ? ": largest tuned bucket <= T" : ": below every bucket");
      return true;
    }
    notes.push_back(fmt::format("tuner cache {} has no entry for {}", file.string(), problem.key()));
    return false;
  } catch (const std::exception& e) {
    notes.push_back(fmt::format("tuner cache {} is corrupt ({})", file.string(), e.what()));
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
    if (path.empty()) {
      notes.push_back("no tuner cache ($FP4MOE_TUNE_CACHE unset and no shipped tune/ directory found)");
    } else if (fs::is_directory(path, ec)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(path, ec))
        if (e.path().extension() == ".json") files.push_back(e.path());
      std::sort(files.begin(), files.end());
      if (files.empty()) notes.push_back(fmt::format("tuner cache directory {} has no tables (*.json)", path));
      std::vector<std::string> file_notes;
      for (const auto& f : files)
        if (lookup_file(f, problem, tokens, key, out, file_notes)) return out;
      // In a directory of tables for many GPUs, a table of another GPU is not a problem; report only
      // that none matched, with the reasons.
      if (!files.empty()) {
        std::string all;
        for (const auto& n : file_notes) all += "; " + n;
        notes.push_back(fmt::format("no table in {} matches {} on {} (cc {}){}", path, problem.key(), key.gpu,
                                    key.cc, all));
      }
    } else if (!fs::exists(path, ec)) {
      notes.push_back(fmt::format("tuner cache {} does not exist", path));
    } else if (lookup_file(path, problem, tokens, key, out, notes)) {
      return out;
    }
  } catch (const std::exception& e) {
    notes.push_back(fmt::format("tuner cache {} could not be read ({})", path, e.what()));
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
    warn_once(fmt::format("tuner cache lookup failed ({}); using the heuristic", e.what()));
    return std::nullopt;
  }
}

TuneLookup choose_config(const TuneProblem& problem, int64_t tokens, int num_sms) {
  TuneLookup l;
  try {
    if (gpu_available()) {
      int device = 0;
      FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
      l = lookup_tuned_config(problem, tokens, current_tune_key(device), tune_cache_path(), false);
    } else {
      l.source = "heuristic";
      l.reason = "no GPU present, so no tuner cache key; using the heuristic";
    }
  } catch (const std::exception& e) {
    l = TuneLookup{};
    l.source = "heuristic";
    l.reason = fmt::format("tuner cache lookup failed ({}); using the heuristic", e.what());
  }
  if (!l.config) {
    const double rows = problem.experts > 0 ? static_cast<double>(tokens) * problem.top_k / problem.experts : 0.0;
    l.config = heuristic_tile_config(problem.n, problem.k, rows, num_sms);
    l.source = "heuristic";
    l.reason += fmt::format(" (heuristic_tile_config(N = {}, K = {}, rows per expert = {:.2f}, SMs = {}))",
                            problem.n, problem.k, rows, num_sms);
  }
  return l;
}

nlohmann::json merge_tune_cache(const nlohmann::json& existing, const nlohmann::json& fresh) {
  if (!existing.is_object() || existing.value("format", std::string()) != "fp4moe-tune/1" ||
      !existing.contains("key") || existing.at("key") != fresh.at("key"))
    return fresh;
  nlohmann::json out = existing;
  for (const auto& e : fresh.at("entries")) {
    auto& entries = out["entries"];
    bool replaced = false;
    for (auto& old : entries)
      if (old.at("problem_key") == e.at("problem_key")) old = e, replaced = true;
    if (!replaced) entries.push_back(e);
  }
  return out;
}

}  // namespace fp4moe

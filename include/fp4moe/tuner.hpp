// Autotuner: times every planner-valid config of the grouped GEMM per token bucket on the present GPU
// and writes a JSON cache; tuned_config() reads it back. Cache format: tune/README.md.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe {

// One GEMM of a MoE layer, as the cache keys it.
struct TuneProblem {
  int experts = 0;
  int top_k = 0;                 // routing fan-out: rows per expert = tokens * top_k / experts
  int64_t n = 0;
  int64_t k = 0;
  GemmEpilogue epilogue = GemmEpilogue::kPlain;
  std::string weight_format = "nvfp4";
  std::string act_format = "bf16";
  std::string key() const;       // "E256_N4096_K6144_nvfp4_bf16_swiglu"
};

// What makes a cache entry valid for this process: GPU, compute capability, CUDA runtime and driver
// versions, fp4moe version.
struct TuneKey {
  std::string gpu;
  std::string cc;                // "9.0"
  int cuda_runtime = 0;
  int cuda_driver = 0;
  std::string fp4moe_version = FP4MOE_VERSION;
  nlohmann::json to_json() const;
  bool operator==(const TuneKey&) const = default;
};
TuneKey current_tune_key(int device = 0);  // needs a GPU

struct TuneLookup {
  std::optional<TileConfig> config;
  std::string source;    // "tuned cache <path>" or "heuristic"
  std::string reason;    // why (bucket chosen, or why the cache was not used)
  int64_t bucket = -1;
};

// The cache path in effect: $FP4MOE_TUNE_CACHE (a file, or a directory of tables), else the shipped
// table directory tune/ found next to the executable (../tune, ../../tune, ../share/fp4moe/tune);
// "" when there is none.
std::string tune_cache_path();

// Looks the problem up in `path` (a JSON file, or a directory whose *.json files are tried in order)
// for `key`. The bucket used is the largest tuned bucket <= tokens, else the smallest. Never throws:
// a missing, stale (key mismatch) or corrupt cache gives no config and a reason; with warn = true the
// reason is also printed on stderr, once per distinct message per process.
TuneLookup lookup_tuned_config(const TuneProblem& problem, int64_t tokens, const TuneKey& key,
                               const std::string& path, bool warn = true);

// The API: tuned config for the present GPU from tune_cache_path(), or nullopt (caller falls back to
// heuristic_tile_config). Never throws.
std::optional<TileConfig> tuned_config(const TuneProblem& problem, int64_t tokens);
// The same with the explanation (explain prints it); falls back to heuristic_tile_config.
TuneLookup choose_config(const TuneProblem& problem, int64_t tokens, int num_sms);

// ---- running the tuner (needs a GPU) ----
struct TuneOptions {
  std::vector<int64_t> buckets{1, 8, 32, 128, 512, 1024, 4096};
  int warmup = 3;
  int reps = 15;
  uint64_t seed = 1234;
  bool progress = true;   // progress bar with time estimate on stderr
};
// Times every planner-valid config of kGemmConfigs for every (problem, bucket); returns the cache JSON
// (format in tune/README.md). Problems must satisfy check_problem_sm80 for at least one config.
nlohmann::json run_tuner(const std::vector<TuneProblem>& problems, const TuneOptions& opt, int device = 0);

// Merges `entries` of a new tuner run into an existing cache JSON of the same key (replacing equal
// problem keys); returns the new document. A different key replaces the document.
nlohmann::json merge_tune_cache(const nlohmann::json& existing, const nlohmann::json& fresh);

std::string epilogue_name(GemmEpilogue e);
nlohmann::json tile_config_to_json(const TileConfig& c);
TileConfig tile_config_from_json(const nlohmann::json& j);

}  // namespace fp4moe

// Autotuner: times every planner-valid config of the grouped GEMM per token bucket on the present GPU
// and writes a JSON cache; tuned_config() reads it back. Cache format: tune/README.md.
#pragma once
#include <bit>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fp4moe/arch.hpp"
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
  // The tuner's rule below one row per expert (tuner_may_pick): whether the layer fuses a shared
  // expert's rows into this GEMM's launch there. Not part of the key; recorded in each bucket.
  bool shared_expert_fused = true;
  // Whether the model's GEMM adds per-row biases (gpt-oss-120b), which the tuner then times too: each tile
  // end loads them, and in the one-CTA tma configs that round trip idles the SM (the GEMMs without them
  // ranked the configs unlike the layer; bench/NOTES.md, twenty-seventh session). Not part of the key.
  bool bias = false;
  std::string key() const;       // "E256_N4096_K6144_nvfp4_bf16_swiglu"
};

// The identity of this build's config list: "<count>:<FNV-1a 64 of the config names, in order>". A
// table measured over another list still serves (its picks were the best it measured), with a note.
std::string gemm_config_list_id();

// A table is keyed by what decides the best config, as vLLM's per-device JSON configs are: the GPU
// model, its compute capability and SM count (waves), and the config list it measured. Driver, CUDA
// runtime and fp4moe versions are provenance: recorded, reported when they differ, never a reason to
// ignore a table (the shipped H200 tables serve any H200 install). Format: tune/README.md.
struct TuneKey {
  std::string gpu;               // "NVIDIA H200" (cudaDeviceProp::name)
  std::string cc;                // "9.0"
  int sms = 0;                   // multiprocessors; 0 in a table: not recorded (fp4moe-tune/1)
  std::string config_list = gemm_config_list_id();  // the build's kGemmConfigs ("" in a table: unknown)
  // provenance
  int cuda_runtime = 0;
  int cuda_driver = 0;
  std::string fp4moe_version = FP4MOE_VERSION;
  nlohmann::json key_json() const;         // {"gpu", "cc", "sms", "config_list"}
  nlohmann::json provenance_json() const;  // {"cuda_runtime", "cuda_driver", "fp4moe_version"}
  bool operator==(const TuneKey&) const = default;
};
TuneKey current_tune_key(int device = 0);  // needs a GPU

// Reads a table's key and provenance (fp4moe-tune/2, or the older fp4moe-tune/1 whose key held the
// versions and no SM count or config list). Throws fp4moe::Error on another format or shape.
TuneKey tune_key_from_json(const nlohmann::json& doc);

// How a table relates to the running process: "" when it may be used, else why not (another GPU, cc
// or SM count); `notes` receives what differs but does not stop its use (config list, provenance).
std::string tune_key_mismatch(const TuneKey& table, const TuneKey& process, std::vector<std::string>* notes);

struct TuneLookup {
  std::optional<TileConfig> config;
  std::string source;    // "tuned table <path>" or "heuristic"
  std::string reason;    // why (bucket chosen, or why no table was used), with the notes
  std::string table;     // the table used ("" for the heuristic)
  std::vector<std::string> notes;  // how the table's provenance and config list differ; skipped configs
  int64_t bucket = -1;
};

// The cache path in effect: $FP4MOE_TUNE_CACHE (a file, or a directory of tables), else the shipped
// table directory tune/ found next to the executable (../tune, ../../tune, ../share/fp4moe/tune);
// "" when there is none.
std::string tune_cache_path();

// Looks the problem up in `path` (a JSON file, or a directory whose *.json files are tried in order)
// for `key`. Among the tables of this GPU (tune_key_mismatch() == ""), one measured over this build's
// config list is preferred. The bucket used is serving_bucket() of the tuned buckets (the bucket at T's
// resolution point, else the nearest to T's coarse point on a log scale);
// when the bucket's best config is not in this build, the fastest measured config that is takes its
// place (with a note). Never throws: a missing, foreign or corrupt table gives no config and a reason;
// with warn = true the reason is also printed on stderr, once per distinct message per process.
TuneLookup lookup_tuned_config(const TuneProblem& problem, int64_t tokens, const TuneKey& key,
                               const std::string& path, bool warn = true);

// The API: tuned config for the present GPU from tune_cache_path(), or nullopt (caller falls back to
// heuristic_tile_config). Never throws.
std::optional<TileConfig> tuned_config(const TuneProblem& problem, int64_t tokens);
// The config for a problem on an architecture, with the explanation (explain and bench print it): a
// tuner table when `arch` is the present GPU (arch_from_device) and a table serves it, else
// heuristic_tile_config. Always planner-valid on `arch`.
TuneLookup choose_config(const TuneProblem& problem, int64_t tokens, const ArchInfo& arch);

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

// Merges `entries` of a new tuner run into an existing table JSON of the same key: for a problem already
// there, the new run's buckets replace the buckets of the same T and the others are kept (so a run of
// one new bucket extends a table), sorted by T; a new problem is added; the provenance becomes the new
// run's. Returns the new document. A different key or format replaces the document.
nlohmann::json merge_tune_cache(const nlohmann::json& existing, const nlohmann::json& fresh);

// ---- which bucket serves a token count ----
// The layer resolves its configs at the token counts 1, 2, 3, 4, 6, 8, 12, ..., 256, 384 (the powers of
// two and 1.5 x them) and from 512 in quarter steps, 512, 640, 768, 896, 1024, 1280, ... (2^k x 1, 1.25,
// 1.5, 1.75), once, at construction; T tokens run with the configs of the largest such point <= T.
// Which tuned bucket serves a point (serving_bucket): the bucket at the point itself if the table has
// one; else the bucket nearest on a log scale (ties to the smaller) to the coarse point <= T, the last of
// 1, 2, 3, 4, 6, 8, 12, ... (2^k and 1.5 x 2^k only). So a table opts into the quarter points by
// having buckets there, and a table without them is read exactly as before.
// Why not "the largest bucket <= T": between two buckets the tile that wins changes with the rows per
// expert, and with that rule T = 255 ran on the T = 128 bucket's picks (GLM-5: 20% slower in the layer
// than on the T = 256 picks; bench/NOTES.md, seventeenth session). Why quarter steps from 512: there the
// tma kernel's token tiles (32..256 rows) decide the cost, and an expert whose rows outgrow a tile
// streams its weights twice; one pick cannot serve GLM-5's T = 768..1023 (the 32-row tiles are 10% faster
// at 768 and 17% slower at 1023, on the H200 and the H100 alike; bench/NOTES.md, eighteenth session).
inline constexpr int64_t kQuarterResolutionFrom = 512;
// The largest power of two <= n (n >= 1).
constexpr int64_t pow2_floor(int64_t n) { return static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(n))); }
// The coarse grid: 1, 2, 3, 4, 6, 8, 12, ... (2^k and 1.5 x 2^k), the largest point <= tokens.
constexpr int64_t coarse_resolution_point(int64_t tokens) {
  if (tokens <= 1) return 1;
  const int64_t p = pow2_floor(tokens);
  return p >= 2 && p / 2 * 3 <= tokens ? p / 2 * 3 : p;
}
// The layer's grid: the coarse grid below kQuarterResolutionFrom, quarter steps from there.
constexpr int64_t layer_resolution_point(int64_t tokens) {
  if (tokens < kQuarterResolutionFrom) return coarse_resolution_point(tokens);
  const int64_t p = pow2_floor(tokens);
  return p + (tokens - p) / (p / 4) * (p / 4);
}
constexpr int64_t next_layer_resolution_point(int64_t point) {
  const int64_t p = layer_resolution_point(point);
  if (p == 1) return 2;
  const int64_t pw = pow2_floor(p);
  if (pw >= kQuarterResolutionFrom) return p + pw / 4;  // 1.75 x 2^k + 2^k / 4 = 2^(k+1)
  // after 2^k comes 1.5 x 2^k (from 2: 3), after 1.5 x 2^k comes 2^(k+1)
  return p == pw ? p / 2 * 3 : p / 3 * 4;
}
static_assert(next_layer_resolution_point(384) == 512 && next_layer_resolution_point(512) == 640 &&
              next_layer_resolution_point(896) == 1024 && layer_resolution_point(1023) == 896 &&
              coarse_resolution_point(1023) == 768 && coarse_resolution_point(1536) == 1536);
// Every resolution point <= max_tokens, ascending: the buckets a table needs so that the layer reads each
// point's own measurement (`fp4moe tune --buckets points[:MAX]`).
inline std::vector<int64_t> layer_resolution_points(int64_t max_tokens) {
  std::vector<int64_t> out;
  for (int64_t p = 1; p <= max_tokens; p = next_layer_resolution_point(p)) out.push_back(p);
  return out;
}
// The bucket of `buckets` (any order, positive) that serves `tokens` (the rule above). -1 when there are none.
int64_t serving_bucket(const std::vector<int64_t>& buckets, int64_t tokens);

// ---- picks decided inside the layer (`fp4moe tune --in-layer`; the layer timing runs in the tool) ----
// The tuner times each GEMM alone. In the layer a GEMM also runs under its predecessor's tail
// (programmatic dependent launch: a stream config builds its schedule and fills its weight ring there)
// and, at decode, with the shared expert's rows fused into it, so picks that lie within a few percent of
// each other alone can order differently in the layer (bench/NOTES.md). The in-layer mode times the layer
// with the table's pair of routed picks (the incumbent) and with pairs of each GEMM's fastest eligible
// configs, alternating the pairs over rounds, and keeps a challenger only when it beats the incumbent
// by a margin. Its record is the bucket's "layer_pick" (tune/README.md).
//
// The n fastest configs of a tuned bucket that the tuner may pick there (tuner_may_pick with the bucket's
// rows per expert and recorded rule), fastest first. Throws fp4moe::Error on a malformed bucket.
std::vector<TileConfig> tuner_bucket_candidates(const nlohmann::json& bucket, int n);
// Which timed pair to keep. scores[i] is pair i's layer time relative to the incumbent's (the mean over
// the token counts timed of median / incumbent's median); scores[0] is the incumbent's own (1). Returns
// the index of the lowest score when it is below 1 - margin, else 0 (the incumbent stays).
size_t choose_layer_pair(const std::vector<double>& scores, double margin);

std::string epilogue_name(GemmEpilogue e);
nlohmann::json tile_config_to_json(const TileConfig& c);
TileConfig tile_config_from_json(const nlohmann::json& j);

}  // namespace fp4moe

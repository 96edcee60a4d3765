// `fp4moe tune`: times every planner-valid config of the grouped GEMM per token bucket on the present
// GPU and writes the JSON cache that tuned_config() reads (format: tune/README.md).
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "commands.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/tuner.hpp"
#include "layer_tune.hpp"

namespace fp4moe::cli {

namespace {

struct TuneArgs {
  std::string model;
  std::string buckets = "1,8,32,128,512,1024,4096";
  std::string out;
  int64_t n = 0, k = 0;
  int experts = 0, top_k = 0;
  std::string epilogue = "plain";
  int reps = 15, warmup = 3;
  bool quiet = false;
  // --in-layer N: decide the routed pair of each bucket by timing the layer (bench/layer_tune.hpp)
  int in_layer = 0;
  bool layer_only = false;
  int layer_rounds = 3;
  double layer_margin = 0.01;
};

// "1,8,32" or "points[:MAX]" (every resolution point of the layer up to MAX, default 16384), mixed as wanted;
// sorted, without repeats.
std::vector<int64_t> parse_buckets(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  auto positive = [](const std::string& text, const std::string& what) -> int64_t {
    try {
      size_t pos = 0;
      const long long v = std::stoll(text, &pos);
      if (pos != text.size() || v < 1) throw std::invalid_argument(text);
      return static_cast<int64_t>(v);
    } catch (const std::exception&) {
      FP4MOE_FAIL("--buckets: '{}' is not {} (expected e.g. 1,8,32 or points:4096)", text, what);
    }
  };
  while (std::getline(ss, item, ',')) {
    if (item == "points" || item.rfind("points:", 0) == 0) {
      const int64_t max = item == "points" ? 16384 : positive(item.substr(7), "a positive token count after points:");
      for (int64_t p : layer_resolution_points(max)) out.push_back(p);
    } else {
      out.push_back(positive(item, "a positive token count"));
    }
  }
  FP4MOE_REQUIRE(!out.empty(), "--buckets '{}' lists no token counts", s);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

void register_tune(CLI::App& app) {
  auto a = std::make_shared<TuneArgs>();
  CLI::App* cmd = app.add_subcommand("tune", "Time every valid GEMM tile config per token bucket; write the tuner cache");
  cmd->add_option("--model", a->model, "model preset: tunes GEMM1 (N = 2I, K = H, SwiGLU) and GEMM2 (N = H, K = I), and a shared expert's two GEMMs (one expert, every token)");
  cmd->add_option("--buckets", a->buckets,
                  "token counts T, comma-separated; points[:MAX] adds every point the layer resolves its configs at, "
                  "up to MAX (default 16384)");
  cmd->add_option("--out", a->out, "cache file to write (default: $FP4MOE_TUNE_CACHE if a file, else tune-<gpu>.json)");
  cmd->add_option("--n", a->n, "explicit problem: output features per expert");
  cmd->add_option("--k", a->k, "explicit problem: reduction size");
  cmd->add_option("--experts", a->experts, "explicit problem: experts E");
  cmd->add_option("--top-k", a->top_k, "explicit problem: experts per token");
  cmd->add_option("--epilogue", a->epilogue, "explicit problem: plain | swiglu | gptoss-swiglu");
  cmd->add_option("--reps", a->reps, "timed launches per config (median kept)");
  cmd->add_option("--warmup", a->warmup, "untimed launches per config");
  cmd->add_flag("--quiet", a->quiet, "no progress bar");
  cmd->add_option("--in-layer", a->in_layer,
                  "with --model: then time the whole layer (graph replay) with the table's pair of routed picks and "
                  "with pairs of each GEMM's N fastest configs, per bucket, and keep the fastest pair in the layer "
                  "(recorded as \"layer_pick\")");
  cmd->add_flag("--layer-only", a->layer_only,
                "with --in-layer: skip the GEMM-alone timing and decide the buckets of the existing --out table");
  cmd->add_option("--layer-rounds", a->layer_rounds, "with --in-layer: passes over the pairs (median kept)");
  cmd->add_option("--layer-margin", a->layer_margin,
                  "with --in-layer: fraction by which a pair must beat the table's pair in the layer");
  cmd->callback([a]() {
    FP4MOE_REQUIRE(a->in_layer >= 0, "--in-layer = {} must be >= 1 (configs per GEMM), or absent", a->in_layer);
    FP4MOE_REQUIRE(a->in_layer == 0 || !a->model.empty(), "--in-layer needs --model (it times the model's layer)");
    FP4MOE_REQUIRE(!a->layer_only || a->in_layer > 0, "--layer-only needs --in-layer N");
    FP4MOE_REQUIRE(!a->layer_only || !a->out.empty(), "--layer-only needs --out: the table whose buckets it decides");
    FP4MOE_REQUIRE(a->layer_rounds >= 1, "--layer-rounds = {} must be >= 1", a->layer_rounds);
    FP4MOE_REQUIRE(a->layer_margin >= 0.0 && a->layer_margin < 1.0, "--layer-margin = {} must be in [0, 1)",
                   a->layer_margin);
    const std::vector<int64_t> buckets = parse_buckets(a->buckets);  // bad input is named before any GPU work
    FP4MOE_REQUIRE(gpu_available(), "fp4moe tune needs a CUDA GPU (none is usable here)");
    std::vector<TuneProblem> problems;
    if (!a->model.empty()) {
      const MoeConfig& m = preset(a->model);
      TuneProblem g1, g2;
      g1.experts = g2.experts = m.num_experts;
      g1.top_k = g2.top_k = m.top_k;
      g1.n = m.gemm1_n();
      g1.k = m.gemm1_k();
      g1.epilogue = m.activation == Activation::kGptOssSwiGLU ? GemmEpilogue::kGptOssSwiGLU : GemmEpilogue::kSwiGLU;
      g2.n = m.gemm2_n();
      g2.k = m.gemm2_k();
      g2.epilogue = GemmEpilogue::kPlain;
      // the layer fuses a shared expert into the routed launches below one row per expert
      g1.shared_expert_fused = g2.shared_expert_fused = m.num_shared > 0;
      g1.bias = g2.bias = m.expert_bias;
      problems = {g1, g2};
      if (m.num_shared > 0) {
        // The shared expert's own launches (beyond 8 token tiles of the routed tile, the layer runs it
        // apart): one expert seeing every token, as moe_layer_tile_configs looks it up. Untuned, the
        // layer fell back to the heuristic there (GLM-5 T = 128: 32 CTAs of 128 x 256 for 128 rows).
        TuneProblem s1 = g1, s2 = g2;
        s1.experts = s2.experts = 1;
        s1.top_k = s2.top_k = 1;
        s1.n = 2 * m.kernel_shared_intermediate();
        s2.k = m.kernel_shared_intermediate();
        s1.shared_expert_fused = s2.shared_expert_fused = false;
        problems.push_back(s1);
        problems.push_back(s2);
      }
    } else {
      FP4MOE_REQUIRE(a->n > 0 && a->k > 0 && a->experts > 0 && a->top_k > 0,
                     "give --model, or all of --n ({}), --k ({}), --experts ({}), --top-k ({}) as positive numbers",
                     a->n, a->k, a->experts, a->top_k);
      TuneProblem p;
      p.experts = a->experts;
      p.top_k = a->top_k;
      p.n = a->n;
      p.k = a->k;
      if (a->epilogue == "plain") p.epilogue = GemmEpilogue::kPlain;
      else if (a->epilogue == "swiglu") p.epilogue = GemmEpilogue::kSwiGLU;
      else if (a->epilogue == "gptoss-swiglu") p.epilogue = GemmEpilogue::kGptOssSwiGLU;
      else FP4MOE_FAIL("--epilogue '{}' must be plain, swiglu or gptoss-swiglu", a->epilogue);
      problems = {p};
    }
    TuneOptions opt;
    opt.buckets = buckets;
    opt.reps = a->reps;
    opt.warmup = a->warmup;
    opt.progress = !a->quiet;
    nlohmann::json doc;
    if (a->layer_only) {
      std::ifstream in(a->out);
      FP4MOE_REQUIRE(static_cast<bool>(in), "--out {}: cannot open the table to decide in the layer", a->out);
      try {
        doc = nlohmann::json::parse(in);
      } catch (const std::exception& e) {
        FP4MOE_FAIL("--out {}: not a JSON tuner table ({})", a->out, e.what());
      }
      const std::string why = tune_key_mismatch(tune_key_from_json(doc), current_tune_key(), nullptr);
      FP4MOE_REQUIRE(why.empty(), "--out {}: its timings are not of this GPU: {}", a->out, why);
    } else {
      doc = run_tuner(problems, opt);
    }

    std::string out = a->out;
    if (out.empty()) {
      const std::string env = tune_cache_path();
      if (!env.empty() && env.size() > 5 && env.substr(env.size() - 5) == ".json") out = env;
      else {
        std::string gpu = doc["key"]["gpu"].get<std::string>();
        for (char& c : gpu) if (!std::isalnum(static_cast<unsigned char>(c))) c = '-';
        out = "tune-" + gpu + ".json";
      }
    }
    if (!a->layer_only) {
      nlohmann::json existing;
      if (std::ifstream in(out); in) {
        try { existing = nlohmann::json::parse(in); } catch (const std::exception&) { existing = nullptr; }
      }
      doc = merge_tune_cache(existing, doc);
    }
    if (a->in_layer > 0) {
      bench::LayerTuneOptions lo;
      lo.buckets = opt.buckets;
      lo.candidates = a->in_layer;
      lo.rounds = a->layer_rounds;
      lo.margin = a->layer_margin;
      cudaStream_t stream = nullptr;
      FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      try {
        bench::tune_pairs_in_layer(preset(a->model), problems[0].key(), problems[1].key(), doc, lo, stream);
      } catch (...) {
        cudaStreamDestroy(stream);
        throw;
      }
      FP4MOE_CUDA_CHECK(cudaStreamDestroy(stream));
    }
    std::ofstream f(out);
    FP4MOE_REQUIRE(static_cast<bool>(f), "--out {}: cannot open for writing", out);
    f << doc.dump(2) << "\n";
    FP4MOE_REQUIRE(static_cast<bool>(f), "--out {}: write failed", out);
    for (const auto& e : doc["entries"])
      for (const auto& b : e["buckets"])
        fmt::print("{} T={:<6} best {:<24} {:9.2f} us\n", e["problem_key"].get<std::string>(),
                   b["tokens"].get<int64_t>(), b["best_name"].get<std::string>(), b["best_us"].get<double>());
    fmt::print("wrote {}\n", out);
  });
}

}  // namespace fp4moe::cli

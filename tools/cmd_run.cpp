// `fp4moe run`: one MoE layer on synthetic weights and inputs, with a checksum of the output.
// Today it runs the CPU reference (include/fp4moe/reference.hpp); the GPU path is added later.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <optional>
#include <thread>
#include <string>

#include <fmt/format.h>

#include "commands.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::cli {

namespace {

struct RunArgs {
  std::string model;
  int64_t tokens = 4;
  uint64_t seed = 1;
  int64_t hidden = 0, intermediate = 0;
  int experts = 0, top_k = 0;
  int threads = 0;
  bool no_round = false;
};

const char* router_name(RouterKind r) {
  switch (r) {
    case RouterKind::kSoftmaxTopK: return "softmax top-k";
    case RouterKind::kSigmoidGrouped: return "sigmoid grouped";
    case RouterKind::kGptOss: return "gpt-oss (top-k logits, softmax over k)";
  }
  return "?";
}

// A preset, with any explicit shape replacing the preset's; without --model all four shapes define a
// plain softmax top-k SwiGLU layer.
MoeConfig make_config(const RunArgs& a) {
  MoeConfig c;
  if (!a.model.empty()) {
    c = preset(a.model);
  } else {
    FP4MOE_REQUIRE(a.hidden > 0 && a.intermediate > 0 && a.experts > 0 && a.top_k > 0,
                   "without --model, --hidden, --intermediate, --experts and --top-k are all required (got "
                   "{}, {}, {}, {})", a.hidden, a.intermediate, a.experts, a.top_k);
    c.name = "custom";
    c.router = RouterKind::kSoftmaxTopK;
    c.renormalize = true;
  }
  const bool overridden = a.hidden || a.intermediate || a.experts || a.top_k;
  if (a.hidden) c.hidden = a.hidden;
  if (a.intermediate) c.intermediate = a.intermediate;
  if (a.experts) c.num_experts = a.experts;
  if (a.top_k) c.top_k = a.top_k;
  if (overridden && !a.model.empty()) c.name += " (shapes overridden)";
  c.validate();
  return c;
}

// 64-bit FNV-1a over the output's bf16 bits: identical outputs <=> identical hashes (in practice), so
// a GPU run and the CPU reference, or two machines, can be compared from the printed line.
uint64_t bf16_hash(const std::vector<float>& v) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (float x : v) {
    const uint16_t b = float_to_bf16_bits(x);
    for (int i = 0; i < 2; ++i) {
      h ^= (b >> (8 * i)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

void run(const RunArgs& a) {
  using clock = std::chrono::steady_clock;
  const auto seconds = [](clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); };
  const MoeConfig cfg = make_config(a);
  FP4MOE_REQUIRE(a.tokens > 0, "--tokens = {} must be > 0", a.tokens);
  FP4MOE_REQUIRE(a.threads >= 0, "--threads = {} must be >= 0 (0 = all cores)", a.threads);
  const int64_t t_count = a.tokens;

  fmt::print("model: {}: H = {}, I = {}, {} routed experts, top-{}, {} shared\n", cfg.name, cfg.hidden,
             cfg.intermediate, cfg.num_experts, cfg.top_k, cfg.num_shared);
  fmt::print("  router {}{}{}, routed scaling {}; activation {}{}; weights {}\n", router_name(cfg.router),
             cfg.router == RouterKind::kSigmoidGrouped
                 ? fmt::format(" (n_group {}, topk_group {})", cfg.n_group, cfg.topk_group)
                 : std::string(),
             cfg.renormalize && cfg.router != RouterKind::kGptOss ? ", renormalized" : "", cfg.routed_scaling,
             cfg.activation == Activation::kGptOssSwiGLU ? "clamped SwiGLU (gpt-oss)" : "SwiGLU",
             cfg.expert_bias ? " with biases" : "", "NVFP4");
  fmt::print("tokens: {}, seed: {}\n", t_count, a.seed);
  const ReferenceOptions opts{.round_intermediates = !a.no_round, .threads = a.threads};
  const int threads = a.threads > 0 ? a.threads : std::max(1u, std::thread::hardware_concurrency());
  fmt::print("device: CPU reference (no GPU path used), {} thread{}, {}\n", threads, threads == 1 ? "" : "s",
             opts.round_intermediates ? "GPU rounding points (bf16 activations and outputs)"
                                      : "pure float path (no bf16 rounding)");

  const auto t_start = clock::now();
  const std::clock_t cpu_start = std::clock();
  const std::vector<float> hidden = make_synthetic_hidden(cfg, a.seed, t_count);
  const std::vector<float> logits = make_synthetic_router_logits(cfg, a.seed, t_count);
  const std::vector<float> bias = make_synthetic_router_bias(cfg, a.seed);
  auto t0 = clock::now();
  const Routing routing = route_reference(cfg, logits, bias, t_count);
  const double route_s = seconds(t0);
  std::vector<int> per_expert(static_cast<size_t>(cfg.num_experts), 0);
  for (int32_t e : routing.ids) ++per_expert[e];
  const int active = static_cast<int>(std::count_if(per_expert.begin(), per_expert.end(), [](int n) { return n > 0; }));
  const int max_rows = *std::max_element(per_expert.begin(), per_expert.end());

  // No cache: each expert is built, used and freed, so memory stays at a few experts (GLM-5: ~21 MB
  // of NVFP4 and ~150 MB of float staging per expert being built).
  SyntheticExperts experts(cfg, a.seed, /*cache=*/false);
  t0 = clock::now();
  const std::vector<float> out = moe_reference(cfg, experts, hidden, t_count, routing, opts);
  const double layer_s = seconds(t0);
  const double total_s = seconds(t_start);
  // CPU time of all threads: on a shared machine wall time alone says little.
  const double cpu_s = static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC;

  double sum = 0, sumsq = 0;
  for (float v : out) {
    sum += v;
    sumsq += static_cast<double>(v) * v;
  }
  fmt::print("routing: {:.3f} ms; {} active experts of {} (at most {} row{} per expert)\n", route_s * 1e3, active,
             cfg.num_experts, max_rows, max_rows == 1 ? "" : "s");
  fmt::print("layer: {:.3f} s for {} experts built (synthetic generation + NVFP4 quantization) and computed\n",
             layer_s, experts.built());
  fmt::print("wall time: {:.3f} s (CPU time {:.3f} s)\n", total_s, cpu_s);
  fmt::print("output [{}, {}]{}: sum = {:.9e}, sum of squares = {:.9e}, hash = {:016x}\n", t_count, cfg.hidden,
             opts.round_intermediates ? " bf16" : " fp32", sum, sumsq, bf16_hash(out));
}

}  // namespace

void register_run(CLI::App& app) {
  auto* cmd = app.add_subcommand("run", "Run one MoE layer on synthetic weights and inputs (CPU reference "
                                        "without a GPU path) and print a checksum of the output");
  auto a = std::make_shared<RunArgs>();
  cmd->add_option("-m,--model", a->model, "Preset: " + [] {
    std::string s;
    for (const auto& n : preset_names()) s += (s.empty() ? "" : ", ") + n;
    return s;
  }());
  cmd->add_option("-t,--tokens", a->tokens, "Tokens in the batch")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Seed of the synthetic weights and inputs")->capture_default_str();
  cmd->add_option("--hidden", a->hidden, "Hidden size H (overrides the preset)");
  cmd->add_option("--intermediate", a->intermediate, "Expert intermediate size I (overrides the preset)");
  cmd->add_option("--experts", a->experts, "Routed experts E (overrides the preset)");
  cmd->add_option("--top-k", a->top_k, "Experts per token (overrides the preset)");
  cmd->add_option("--threads", a->threads, "CPU threads (0 = all cores)")->capture_default_str();
  cmd->add_flag("--no-round", a->no_round, "Skip the GPU's bf16 rounding points (pure float path)");
  cmd->callback([a] { run(*a); });
}

}  // namespace fp4moe::cli

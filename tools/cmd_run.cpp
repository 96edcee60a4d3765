// `fp4moe run`: one MoE layer on synthetic weights and inputs, with a checksum of the output. With a
// GPU it runs fp4moe::MoeLayer (and, with --check, the CPU reference on the same data to compare);
// without one, or with --cpu, the CPU reference (include/fp4moe/reference.hpp).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <unistd.h>
#include <optional>
#include <thread>
#include <string>

#include <fmt/format.h>

#include "checkpoint_cli.hpp"
#include "commands.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
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
  int tp = 1;  // tensor-parallel slice of the experts
  int threads = 0;
  bool no_round = false;
  bool cpu = false;
  bool check = false;
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
  return tensor_parallel_slice(c, a.tp);
}

// The GPU layer on the same synthetic weights (generated on the device, bit-identical to the host
// recipe) and inputs. Returns the output as floats (bf16 values) and the median forward time.
std::vector<float> run_gpu(const MoeConfig& cfg, const RunArgs& a, double* forward_us) {
  cudaStream_t s;
  FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  SyntheticDeviceLayer syn = make_synthetic_layer_device(cfg, a.seed, s);
  MoeLayer layer(cfg, syn.weights, a.tokens, s);
  const std::string ws_what = fmt::format("the layer workspace of --tokens {} (MoeLayer::workspace_bytes())", a.tokens);
  DeviceBuffer<uint8_t> ws(layer.workspace_bytes(), ws_what.c_str());
  DeviceBuffer<uint16_t> hidden(a.tokens * cfg.hidden, "the input activations"),
      out(a.tokens * cfg.hidden, "the layer output");
  DeviceBuffer<float> logits(a.tokens * cfg.num_experts, "the router logits");
  make_synthetic_hidden_device(cfg, a.seed, a.tokens, hidden.get(), s);
  make_synthetic_router_logits_device(cfg, a.seed, a.tokens, logits.get(), s);
  cudaEvent_t e0, e1;
  FP4MOE_CUDA_CHECK(cudaEventCreate(&e0));
  FP4MOE_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> times;
  for (int i = 0; i < 6; ++i) {  // the first call loads kernels; the median of the rest is reported
    FP4MOE_CUDA_CHECK(cudaEventRecord(e0, s));
    layer.forward(s, hidden.get(), a.tokens, logits.get(), out.get(), ws.get(), ws.bytes());
    FP4MOE_CUDA_CHECK(cudaEventRecord(e1, s));
    FP4MOE_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i > 0) times.push_back(ms * 1e3);
  }
  std::sort(times.begin(), times.end());
  *forward_us = times[times.size() / 2];
  FP4MOE_CUDA_CHECK(cudaEventDestroy(e0));
  FP4MOE_CUDA_CHECK(cudaEventDestroy(e1));
  const std::vector<uint16_t> bits = out.download();
  FP4MOE_CUDA_CHECK(cudaStreamDestroy(s));
  std::vector<float> r(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) r[i] = bf16_bits_to_float(bits[i]);
  return r;
}

void print_checksum(const std::vector<float>& out, int64_t t, int64_t h, bool bf16) {
  double sum = 0, sumsq = 0;
  for (float v : out) {
    sum += v;
    sumsq += static_cast<double>(v) * v;
  }
  fmt::print("output [{}, {}]{}: sum = {:.9e}, sum of squares = {:.9e}, hash = {:016x}\n", t, h, bf16 ? " bf16" : " fp32",
             sum, sumsq, bf16_hash(out));
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
             cfg.expert_bias ? " with biases" : "", cfg.format == WeightFormat::kMxfp4 ? "MXFP4" : "NVFP4");
  fmt::print("tokens: {}, seed: {}\n", t_count, a.seed);
  std::vector<float> gpu_out;
  if (!a.cpu && gpu_available()) {
    FP4MOE_REQUIRE(!a.no_round, "--no-round applies to the CPU reference only; add --cpu");
    cudaDeviceProp prop{};
    FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    fmt::print("device: GPU {} (sm_{}{}), fp4moe::MoeLayer\n", prop.name, prop.major, prop.minor);
    double us = 0;
    gpu_out = run_gpu(cfg, a, &us);
    fmt::print("layer forward: {:.1f} us (median of 5 eager calls, after one warm-up)\n", us);
    print_checksum(gpu_out, t_count, cfg.hidden, true);
    if (!a.check) return;
    fmt::print("--check: running the CPU reference on the same weights and inputs\n");
  } else if (!a.cpu) {
    fmt::print("no CUDA GPU found: ");
  }
  const ReferenceOptions opts{.round_intermediates = !a.no_round, .threads = a.threads};
  const int threads = a.threads > 0 ? a.threads : std::max(1u, std::thread::hardware_concurrency());
  fmt::print("device: CPU reference, {} thread{}, {}\n", threads, threads == 1 ? "" : "s",
             opts.round_intermediates ? "GPU rounding points (bf16 activations and outputs)"
                                      : "pure float path (no bf16 rounding)");

  {
    // Inputs, logits and the output in float, before anything is allocated: a clear error instead of
    // std::bad_alloc.
    const double need = static_cast<double>(t_count) * static_cast<double>(2 * cfg.hidden + cfg.num_experts) * 4.0;
    const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
    FP4MOE_REQUIRE(have <= 0 || need <= have,
                   "--tokens {}: the CPU reference needs at least {} of host memory (activations, router logits "
                   "and output in float), and this machine has {} in total",
                   t_count, bytes_for_humans(static_cast<size_t>(std::min(need, 1.8e19))),
                   bytes_for_humans(static_cast<size_t>(have)));
  }
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

  fmt::print("routing: {:.3f} ms; {} active experts of {} (at most {} row{} per expert)\n", route_s * 1e3, active,
             cfg.num_experts, max_rows, max_rows == 1 ? "" : "s");
  fmt::print("layer: {:.3f} s for {} experts built (synthetic generation + NVFP4 quantization) and computed\n",
             layer_s, experts.built());
  fmt::print("wall time: {:.3f} s (CPU time {:.3f} s)\n", total_s, cpu_s);
  print_checksum(out, t_count, cfg.hidden, opts.round_intermediates);
  if (!gpu_out.empty()) {
    double err2 = 0, ref2 = 0;
    size_t equal = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      err2 += (static_cast<double>(gpu_out[i]) - out[i]) * (static_cast<double>(gpu_out[i]) - out[i]);
      ref2 += static_cast<double>(out[i]) * out[i];
      equal += gpu_out[i] == out[i];
    }
    const double rel = std::sqrt(err2 / std::max(ref2, 1e-300));
    fmt::print("GPU vs CPU reference: relative L2 error {:.3e}, {:.2f}% of elements bit-identical\n", rel,
               100.0 * static_cast<double>(equal) / static_cast<double>(out.size()));
    FP4MOE_REQUIRE(rel < 1e-2, "--check: GPU output differs from the CPU reference (relative L2 error {:.3e} >= 1e-2)",
                   rel);
  }
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
  cmd->add_option("--tp", a->tp, "One rank of an N-way tensor-parallel split of the experts (intermediate / N; the "
                  "output is that rank's partial sum)")->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU threads (0 = all cores)")->capture_default_str();
  cmd->add_flag("--no-round", a->no_round, "Skip the GPU's bf16 rounding points (pure float path; with --cpu)");
  cmd->add_flag("--cpu", a->cpu, "Run the CPU reference even when a GPU is present");
  cmd->add_flag("--check", a->check, "With a GPU: also run the CPU reference and compare");
  auto ck = std::make_shared<CheckpointRunArgs>();
  cmd->add_option("--checkpoint", ck->dir, "Run a real checkpoint's MoE layer (config.json + safetensors directory)");
  cmd->add_option("--layer", ck->layer, "With --checkpoint: the decoder layer (default: the first MoE layer)");
  cmd->add_flag("--routed-only", ck->routed_only, "With --checkpoint: routed experts only (no shared expert)");
  cmd->callback([a, ck] {
    if (ck->dir.empty()) return run(*a);
    FP4MOE_REQUIRE(a->model.empty() && !a->hidden && !a->intermediate && !a->experts && !a->top_k && a->tp == 1,
                   "--checkpoint takes its shapes from the checkpoint; drop --model/--hidden/--intermediate/"
                   "--experts/--top-k/--tp");
    ck->tokens = a->tokens;
    ck->seed = a->seed;
    ck->cpu = a->cpu;
    ck->check = a->check;
    ck->threads = a->threads;
    run_checkpoint(*ck);
  });
}

}  // namespace fp4moe::cli

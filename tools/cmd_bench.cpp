// `fp4moe bench`: GPU benchmarks with the ceilings and the bf16 baseline measured in the same run.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "bench_common.hpp"
#include "checkpoint_cli.hpp"
#include "commands.hpp"
#include "ep_bench.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/arch.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/tuner.hpp"
#include "gemm_bench.hpp"
#include "layer_bench.hpp"

namespace fp4moe::cli {
namespace {

struct BenchArgs {
  std::string model = "glm-5";  // one preset, a comma-separated list, or "all" (parse_preset_list)
  int tp = 1;                   // tensor-parallel slice of the experts (tensor_parallel_slice)
  std::string mode = "layer";
  std::vector<int64_t> tokens;
  bool no_baseline = false;
  bool breakdown = false;
  bool timeline = false;
  bool compare_heuristic = false;
  bool trace = false;
  int reps = 20;
  std::string json;
  std::string tile1, tile2;
  int ep = 0;
  double capacity_factor = 0.0;
};

// A config name of kGemmConfigs (e.g. stream_bt8_w24_d4_c1, bn128_bt32_bk128_s5_w8) or BNxBTxBKxSTAGESxWARPS.
TileConfig parse_tile(const std::string& s) {
  for (const TileConfig& c : kGemmConfigs)
    if (c.name() == s) return c;
  TileConfig c;
  FP4MOE_REQUIRE(std::sscanf(s.c_str(), "%dx%dx%dx%dx%d", &c.bn, &c.bt, &c.bk, &c.stages, &c.warps) == 5,
                 "--tile '{}' must be a config name of kGemmConfigs (fp4moe explain lists them) or "
                 "BNxBTxBKxSTAGESxWARPS, e.g. 128x32x128x5x8",
                 s);
  return c;
}

// The commit measured, for the results file: $FP4MOE_COMMIT (scripts/gpu_check.sh sets it from git; a
// copy of the tree without git history can pass it by hand).
std::string commit_id() {
  const char* c = std::getenv("FP4MOE_COMMIT");
  return c ? c : "unknown";
}

void run_gemm_mode(const BenchArgs& a, const MoeConfig& cfg, const bench::Ceilings& c, cudaStream_t s,
                   nlohmann::json& out) {
  bench::GemmBenchOptions o;
  o.tokens = a.tokens.empty() ? std::vector<int64_t>{1, 8, 32, 128, 512, 1024, 4096, 16384} : a.tokens;
  o.baseline = !a.no_baseline;
  o.reps = a.reps;
  if (!a.tile1.empty()) o.force1 = parse_tile(a.tile1);
  if (!a.tile2.empty()) o.force2 = parse_tile(a.tile2);
  o.compare_heuristic = a.compare_heuristic;
  o.trace = a.trace;
  const auto rows = bench::run_gemm_bench(cfg, o, s);
  std::printf("\n%s expert GEMMs (GEMM1 N=%lld K=%lld SwiGLU + GEMM2 N=%lld K=%lld), NVFP4 weights, bf16 activations\n",
              cfg.name.c_str(), (long long)cfg.gemm1_n(), (long long)cfg.gemm1_k(), (long long)cfg.gemm2_n(),
              (long long)cfg.gemm2_k());
  std::printf("%7s %6s %10s %8s %7s %8s %7s %9s %7s %8s  %s\n", "tokens", "active", "fp4 us", "TB/s", "xread", "TFLOP/s",
              "xbf16", "bf16 us", "speedup", "x floor", "configs (GEMM1 | GEMM2)");
  for (const auto& r : rows) {
    const double tbps = r.weight_bytes / (r.fp4_us * 1e-6) / 1e12;
    const double tflops = r.flops / (r.fp4_us * 1e-6) / 1e12;
    const double floor_us = r.weight_bytes / (c.stream_read_tbps * 1e12) * 1e6;
    std::printf("%7lld %6d %10.1f %8.2f %7.3f %8.1f %7.3f %9.1f %7.2f %8.2f  %s | %s\n", (long long)r.tokens,
                r.active_experts, r.fp4_us, tbps, tbps / c.stream_read_tbps, tflops, tflops / c.bf16_tflops, r.bf16_us,
                r.bf16_us > 0 ? r.bf16_us / r.fp4_us : 0.0, r.fp4_us / floor_us, r.cfg1.name().c_str(),
                r.cfg2.name().c_str());
    out["gemm"].push_back({{"tokens", r.tokens},
                           {"active_experts", r.active_experts},
                           {"weight_bytes", r.weight_bytes},
                           {"flops", r.flops},
                           {"fp4_us", r.fp4_us},
                           {"weight_tbps", tbps},
                           {"ratio_stream_read", tbps / c.stream_read_tbps},
                           {"tflops", tflops},
                           {"ratio_bf16_gemm", tflops / c.bf16_tflops},
                           {"bf16_baseline_us", r.bf16_us},
                           {"speedup_vs_bf16", r.bf16_us > 0 ? r.bf16_us / r.fp4_us : 0.0},
                           {"time_over_weight_floor", r.fp4_us / floor_us},
                           {"config_gemm1", r.cfg1.name()},
                           {"config_gemm2", r.cfg2.name()},
                           {"configs_from", r.tuned ? "tuner table" : "heuristic"},
                           {"config_source_gemm1", r.source1},
                           {"config_source_gemm2", r.source2},
                           {"heuristic_us", r.heuristic_us},
                           {"heuristic_config_gemm1", r.heuristic_us > 0 ? r.hcfg1.name() : ""},
                           {"heuristic_config_gemm2", r.heuristic_us > 0 ? r.hcfg2.name() : ""},
                           {"tuned_speedup_over_heuristic", r.heuristic_us > 0 ? r.heuristic_us / r.fp4_us : 0.0}});
  }
  if (a.trace) {
    std::printf("\nstream-kernel timelines (one eager pass per token count, L2 flushed first; warps that ran)\n");
    for (const auto& r : rows) std::printf("%s", r.trace.empty() ? "  (no stream config at this T)\n" : r.trace.c_str());
  }
  if (a.compare_heuristic) {
    std::printf("\ntuned vs heuristic configs (%s)\n%7s %12s %12s %8s  %s\n", cfg.name.c_str(), "tokens", "picked us",
                "heuristic us", "gain", "heuristic configs (GEMM1 | GEMM2)");
    for (const auto& r : rows)
      std::printf("%7lld %12.1f %12.1f %7.2fx  %s | %s%s\n", (long long)r.tokens, r.fp4_us, r.heuristic_us,
                  r.heuristic_us / r.fp4_us, r.hcfg1.name().c_str(), r.hcfg2.name().c_str(),
                  r.tuned ? "" : "  (no tuner table matched: picked = heuristic)");
  }
}

// Which tuner table serves this GPU (or why none does), and how its provenance and config list
// differ from this process's: the tables are keyed by GPU, compute capability, SM count and config
// list, so another driver or fp4moe version still uses them, and says so here.
void print_tuner_tables(const MoeConfig& cfg, nlohmann::json& out) {
  int dev = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&dev));
  const ArchInfo arch = arch_from_device(dev);
  std::vector<TuneLookup> why;
  moe_layer_tile_configs(cfg, 1, arch, &why);
  const char* names[] = {"GEMM1", "GEMM2", "shared GEMM1", "shared GEMM2"};
  out["tuner_tables"] = nlohmann::json::array();
  for (size_t i = 0; i < why.size(); ++i) {
    const TuneLookup& l = why[i];
    std::printf("%s: tuner table for %s: %s\n", cfg.name.c_str(), names[i], l.table.empty() ? "none" : l.table.c_str());
    if (l.table.empty()) std::printf("  why: %s\n", l.reason.c_str());
    for (const auto& n : l.notes) std::printf("  note: %s\n", n.c_str());
    out["tuner_tables"].push_back({{"gemm", names[i]}, {"table", l.table}, {"notes", l.notes},
                                   {"reason", l.table.empty() ? l.reason : ""}});
  }
}

}  // namespace

void register_bench(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  auto* sub = app.add_subcommand("bench", "Benchmark on the GPU: ceilings, bf16 baseline, fp4moe (needs a CUDA GPU)");
  sub->add_option("--model", args->model,
                  "preset, comma-separated presets (glm-5,kimi-k2,gpt-oss-120b,qwen3-30b), or all (every model "
                  "preset): one run, the ceilings measured once")
      ->capture_default_str();
  sub->add_option("--tp", args->tp,
                  "benchmark one rank of an N-way tensor-parallel split of the experts (intermediate / N per rank)")
      ->capture_default_str();
  sub->add_option("--mode", args->mode, "layer (whole MoE layer), gemm (the two expert GEMMs) or both")
      ->check(CLI::IsMember({"layer", "gemm", "both"}))
      ->capture_default_str();
  sub->add_option("--tokens", args->tokens, "token counts (default: the issue's list for the mode)")->delimiter(',');
  sub->add_flag("--no-baseline", args->no_baseline, "skip the bf16 baseline");
  sub->add_flag("--breakdown", args->breakdown, "layer mode: time each stage");
  sub->add_flag("--timeline", args->timeline,
                "layer mode: under each row, the kernels of one graph replay on the GPU clock (start, end, gap; "
                "CUPTI activity records, libcupti of the CUDA toolkit loaded at run time)");
  sub->add_option("--reps", args->reps, "timed graph replays per measurement (median reported)")->capture_default_str();
  sub->add_option("--json", args->json, "also write the results as JSON to this file");
  sub->add_option("--tile1", args->tile1,
                  "force GEMM1's config (a config name, or BNxBTxBKxSTAGESxWARPS); in layer mode the routed GEMM1 at "
                  "every token count");
  sub->add_option("--tile2", args->tile2, "force GEMM2's config (layer mode: the routed GEMM2)");
  sub->add_flag("--compare-heuristic", args->compare_heuristic,
                "gemm mode: also time the heuristic's configs and show the tuner's gain");
  sub->add_flag("--trace", args->trace,
                "gemm mode, in a build configured with -DFP4MOE_STREAM_TRACE=ON: one more eager pass with the "
                "stream kernels' per-warp timeline (kernel events, round barriers, activation-row loads, CTA "
                "finishing spread), summarized over the warps");
  sub->add_option("--ep", args->ep,
                  "expert parallel over N GPUs of this host (one thread per GPU, NCCL; N = 1: one GPU): layer time "
                  "per rank, bytes moved, communication share, scaling efficiency (default tokens per rank 1,8,128,1024)");
  sub->add_option("--capacity-factor", args->capacity_factor,
                  "with --ep: EpCapacity::capacity_factor (0 = worst-case message sizes)")
      ->capture_default_str();
  auto ck = std::make_shared<CheckpointBenchArgs>();
  sub->add_option("--checkpoint", ck->dir, "Benchmark a real checkpoint's MoE layer instead of a preset");
  sub->add_option("--layer", ck->layer, "With --checkpoint: the decoder layer (default: the first MoE layer)");
  sub->add_flag("--routed-only", ck->routed_only, "With --checkpoint: routed experts only (no shared expert)");
  sub->callback([args, ck] {
    if (!ck->dir.empty()) {
      ck->tokens = args->tokens;
      ck->reps = args->reps;
      ck->json = args->json;
      return bench_checkpoint(*ck);
    }
    FP4MOE_REQUIRE(!args->trace || kStreamTraceBuilt,
                   "--trace: this build has no stream-kernel timeline (configure with -DFP4MOE_STREAM_TRACE=ON)");
    FP4MOE_REQUIRE(!args->trace || args->mode == "gemm", "--trace applies to --mode gemm, not --mode {}", args->mode);
    FP4MOE_REQUIRE(!args->timeline || args->mode == "layer", "--timeline applies to --mode layer, not --mode {}",
                   args->mode);
    std::vector<MoeConfig> cfgs;  // the arguments first: a bad model name is reported without a GPU too
    for (const std::string& name : parse_preset_list(args->model))
      cfgs.push_back(tensor_parallel_slice(preset(name), args->tp));
    FP4MOE_REQUIRE(gpu_available(), "bench needs a CUDA GPU and none was found (try `fp4moe run` for the CPU reference)");
    if (args->ep > 0) {
      FP4MOE_REQUIRE(cfgs.size() == 1, "--ep takes one --model; got {} ('{}')", cfgs.size(), args->model);
      bench::EpBenchOptions o;
      o.ranks = args->ep;
      o.tokens = args->tokens;
      o.capacity_factor = args->capacity_factor;
      o.reps = args->reps;
      bench::run_ep_bench_command(cfgs[0], o, args->json, commit_id());
      return;
    }
    cudaStream_t s;
    FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::fprintf(stderr, "measuring ceilings...\n");
    const bench::Ceilings c = bench::measure_ceilings(s);
    int driver = 0, runtime = 0;
    FP4MOE_CUDA_CHECK(cudaDriverGetVersion(&driver));
    FP4MOE_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    std::printf("GPU: %s  (driver %d, runtime %d), fp4moe %s, commit %s\n", c.gpu.c_str(), driver, runtime,
                FP4MOE_VERSION, commit_id().c_str());
    std::printf("ceilings measured in this run: streaming read %.2f TB/s, cuBLAS bf16 GEMM 8192^3 %.1f TFLOP/s\n",
                c.stream_read_tbps, c.bf16_tflops);
    nlohmann::json out = {{"gpu", c.gpu},
                          {"driver", driver},
                          {"runtime", runtime},
                          {"commit", commit_id()},
                          {"ceilings", {{"stream_read_tbps", c.stream_read_tbps}, {"bf16_gemm_tflops", c.bf16_tflops}}}};
    // One model: its results at the top level (the format of earlier results files); several: a list.
    for (const MoeConfig& cfg : cfgs) {
      nlohmann::json m = {{"model", cfg.name}, {"tp", args->tp}};
      print_tuner_tables(cfg, m);
      if (args->mode == "gemm" || args->mode == "both") run_gemm_mode(*args, cfg, c, s, m);
      if (args->mode == "layer" || args->mode == "both") {
        bench::LayerBenchOptions o;
        o.tokens = args->tokens;
        o.baseline = !args->no_baseline;
        o.breakdown = args->breakdown;
        o.timeline = args->timeline;
        o.reps = args->reps;
        if (!args->tile1.empty()) o.force1 = parse_tile(args->tile1);
        if (!args->tile2.empty()) o.force2 = parse_tile(args->tile2);
        bench::run_layer_bench(cfg, o, c, s, m);
      }
      if (cfgs.size() == 1) out.update(m);
      else out["models"].push_back(m);
    }
    if (!args->json.empty()) {
      std::ofstream f(args->json);
      FP4MOE_REQUIRE(f.good(), "--json {}: cannot open for writing", args->json);
      f << out.dump(2) << "\n";
    }
    FP4MOE_CUDA_CHECK(cudaStreamDestroy(s));
  });
}

}  // namespace fp4moe::cli

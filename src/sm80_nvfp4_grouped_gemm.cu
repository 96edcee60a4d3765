// Host launcher of the sm80-nvfp4-grouped kernel: argument checks, config lookup, per-device launch
// attributes (cached), persistent grid sizing. Never synchronizes; allocates nothing.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <tuple>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "launch.hpp"
#include "fp4moe/planner.hpp"
#include "sm80_nvfp4_grouped_gemm_internal.hpp"
#include "sm90_tensor_maps.hpp"

namespace fp4moe {

std::string TileConfig::name() const {
  if (mma == 2) return fmt::format("stream_bt{}_w{}_d{}_c{}", bt, warps, stages, ctas);
  return fmt::format("bn{}_bt{}_bk{}_s{}_w{}{}{}", bn, bt, bk, stages, warps,
                     mma == 1 ? "_wgmma" : mma == 3 ? "_tma" : "",
                     ctas > 0 ? fmt::format("_c{}", ctas) : "");
}

namespace {

int config_index(const TileConfig& cfg) {
  for (int i = 0; i < kNumGemmConfigs; ++i)
    if (kGemmConfigs[i] == cfg) return i;
  std::string known;
  for (const auto& c : kGemmConfigs) known += (known.empty() ? "" : ", ") + c.name();
  FP4MOE_FAIL("tile config {} is not instantiated; the instantiated configs are: {}", cfg.name(), known);
}

detail::GemmKernelFn kernel_for(int idx, GemmEpilogue epi) {
  switch (epi) {
    case GemmEpilogue::kPlain: return detail::gemm_kernels_plain()[idx];
    case GemmEpilogue::kSwiGLU: return detail::gemm_kernels_swiglu()[idx];
    case GemmEpilogue::kGptOssSwiGLU: return detail::gemm_kernels_gptoss()[idx];
  }
  FP4MOE_FAIL("epilogue {} is not a GemmEpilogue value", static_cast<int>(epi));
}

// The tma configs' cut tables (tma_cut_table), computed once per config, by config_index(): a launch
// copies one into its parameters.
const TmaCutTable& tma_cut_table_of(int idx) {
  static const std::vector<TmaCutTable> tables = [] {
    std::vector<TmaCutTable> t(kNumGemmConfigs);
    for (int i = 0; i < kNumGemmConfigs; ++i)
      if (kGemmConfigs[i].mma == 3) t[i] = tma_cut_table(kGemmConfigs[i]);
    return t;
  }();
  return tables[idx];
}

struct LaunchInfo {
  bool ready = false;
  int sms = 0;
  int ctas_per_sm = 0;
  size_t smem = 0;
};

// Dynamic shared memory of a launch: fixed per config, except stream configs, whose activation rows span
// the whole K.
size_t launch_smem_bytes(const TileConfig& cfg, int64_t k) {
  return cfg.mma == 2 ? stream_smem_layout(cfg, k).total_bytes : gemm_smem_layout(cfg).total_bytes;
}

// Per (device, kernel): raise the dynamic shared-memory limit once and record the occupancy, so the
// per-call cost is a table lookup (and the call stays legal inside CUDA-graph capture).
// Keyed by (device, kernel, shared memory): stream configs need different bytes per K.
LaunchInfo& launch_info(int device, detail::GemmKernelFn fn, const TileConfig& cfg, int64_t k) {
  static std::mutex mu;
  static std::vector<std::pair<std::pair<int, detail::GemmKernelFn>, LaunchInfo>> cache;
  std::lock_guard<std::mutex> lock(mu);
  const size_t smem = launch_smem_bytes(cfg, k);
  for (auto& [key, info] : cache)
    if (key.first == device && key.second == fn && info.smem == smem) return info;
  LaunchInfo info;
  info.smem = smem;
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if ((cfg.mma == 1 || cfg.mma == 3) && prop.major != 9)
    throw ResourceError(fmt::format("fp4moe: tile config {} uses wgmma{}, which exists on sm_90a only; {} is sm_{}{}",
                                    cfg.name(), cfg.mma == 3 ? " and setmaxnreg" : "", prop.name, prop.major,
                                    prop.minor));
  if (smem > prop.sharedMemPerBlockOptin)
    throw ResourceError(fmt::format(
        "fp4moe: tile config {} needs {} B of shared memory per block{}; {} (sm_{}{}) allows {} B (over by {} B)",
        cfg.name(), smem,
        cfg.mma == 2 ? fmt::format(" (activations bt * K * 2 = {} * {} * 2 B)", cfg.bt, k) : std::string(),
        prop.name, prop.major, prop.minor, prop.sharedMemPerBlockOptin, smem - prop.sharedMemPerBlockOptin));
  // The limit only ever grows (the largest K seen so far): a CUDA graph captured with a larger K must
  // stay launchable after a call with a smaller one.
  size_t limit = smem;
  for (const auto& [key, other] : cache)
    if (key.first == device && key.second == fn) limit = std::max(limit, other.smem);
  FP4MOE_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(fn),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit)));
  FP4MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.ctas_per_sm, reinterpret_cast<const void*>(fn),
                                                                  cfg.threads(), smem));
  if (info.ctas_per_sm < 1)
    throw ResourceError(fmt::format("fp4moe: tile config {} cannot be resident on {} (registers or shared memory); "
                                    "see `fp4moe explain`",
                                    cfg.name(), prop.name));
  info.sms = prop.multiProcessorCount;
  info.ready = true;
  cache.emplace_back(std::make_pair(device, fn), info);
  return cache.back().second;
}

bool aligned(const void* p, size_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

}  // namespace

namespace {

void launch_grouped_gemm(const GroupedWeightsView& w, const GroupedGemmArgs& args, const GroupedWeightsView* xw,
                         const GroupedGemmArgs* xa, const TileConfig& cfg, cudaStream_t stream) {
  FP4MOE_REQUIRE(w.num_experts >= 1 && w.num_experts <= kMaxExperts,
                 "num_experts = {} must be in [1, {}]", w.num_experts, kMaxExperts);
  FP4MOE_REQUIRE(w.n > 0 && w.n % 16 == 0, "weights n = {} must be a positive multiple of 16", w.n);
  FP4MOE_REQUIRE(w.k > 0 && w.k % 64 == 0, "weights k = {} must be a positive multiple of 64", w.k);
  FP4MOE_REQUIRE(w.k % cfg.bk == 0 || tile_config_has_k_tail(cfg),
                 "weights k = {} must be a multiple of the tile config's bk = {} ({}; only the tma configs have a "
                 "K tail)",
                 w.k, cfg.bk, cfg.name());
  FP4MOE_REQUIRE(w.n * w.k <= INT_MAX && args.max_rows * w.k <= (int64_t{1} << 40),
                 "problem too large: n * k = {} (limit {})", w.n * w.k, INT_MAX);
  FP4MOE_REQUIRE(args.max_rows > 0 && args.max_rows <= INT_MAX, "max_rows = {} must be in [1, {}]", args.max_rows,
                 INT_MAX);
  FP4MOE_REQUIRE(w.codes != nullptr && aligned(w.codes, 16), "weights codes = {} must be non-null and 16-byte aligned",
                 fmt::ptr(w.codes));
  FP4MOE_REQUIRE(w.scales != nullptr && aligned(w.scales, 16),
                 "weights scales = {} must be non-null and 16-byte aligned", fmt::ptr(w.scales));
  FP4MOE_REQUIRE(w.global_scale != nullptr, "weights global_scale must be non-null");
  FP4MOE_REQUIRE(args.act != nullptr && aligned(args.act, 16), "act = {} must be non-null and 16-byte aligned",
                 fmt::ptr(args.act));
  FP4MOE_REQUIRE(args.expert_offsets != nullptr, "expert_offsets must be non-null");
  FP4MOE_REQUIRE(args.out != nullptr && aligned(args.out, 4), "out = {} must be non-null and 4-byte aligned",
                 fmt::ptr(args.out));
  const bool swiglu = args.epilogue != GemmEpilogue::kPlain;
  FP4MOE_REQUIRE(swiglu == w.gate_up_interleaved,
                 "epilogue {} needs weights repacked with gate_up_interleave = {} (they were repacked with {})",
                 swiglu ? "SwiGLU" : "plain", swiglu, w.gate_up_interleaved);
  FP4MOE_REQUIRE(!swiglu || args.row_scale == nullptr, "row_scale is only supported by the plain epilogue");
  FP4MOE_REQUIRE(swiglu || w.global_scale_up == nullptr, "global_scale_up is only meaningful for a SwiGLU epilogue");

  if (xw != nullptr) {
    FP4MOE_REQUIRE(xw->num_experts == 1, "extra weight set: num_experts = {} must be 1", xw->num_experts);
    FP4MOE_REQUIRE(xw->n == w.n && xw->k == w.k, "extra weight set: n x k = {} x {} must equal the routed set's {} x {}",
                   xw->n, xw->k, w.n, w.k);
    FP4MOE_REQUIRE(xw->gate_up_interleaved == w.gate_up_interleaved && xa->epilogue == args.epilogue,
                   "extra weight set: epilogue and repack row order must equal the routed set's");
    FP4MOE_REQUIRE(xw->codes != nullptr && aligned(xw->codes, 16) && xw->scales != nullptr && aligned(xw->scales, 16) &&
                       xw->global_scale != nullptr,
                   "extra weight set: codes/scales must be non-null and 16-byte aligned, global_scale non-null");
    FP4MOE_REQUIRE(xa->act != nullptr && aligned(xa->act, 16) && xa->out != nullptr && aligned(xa->out, 4) &&
                       xa->expert_offsets != nullptr,
                   "extra weight set: act (16-byte aligned), out (4-byte aligned) and expert_offsets must be non-null");
    FP4MOE_REQUIRE(xa->max_rows > 0 && xa->max_rows <= INT_MAX, "extra weight set: max_rows = {} must be in [1, {}]",
                   xa->max_rows, INT_MAX);
    FP4MOE_REQUIRE(xa->row_scale == nullptr, "extra weight set: row_scale is not supported");
    FP4MOE_REQUIRE(xw->format == w.format, "extra weight set: format {} must equal the routed set's {} (one scale "
                   "decode per launch)", xw->format == WeightFormat::kMxfp4 ? "MXFP4" : "NVFP4",
                   w.format == WeightFormat::kMxfp4 ? "MXFP4" : "NVFP4");
    FP4MOE_REQUIRE(w.num_experts + 1 <= kMaxExperts + 1, "routed experts + the extra set exceed {}", kMaxExperts + 1);
  }
  if (args.route_ids != nullptr) {
    FP4MOE_REQUIRE(aligned(args.route_ids, 4) && args.route_entries >= 0 && args.route_entries <= INT_MAX,
                   "route_ids = {} must be 4-byte aligned and route_entries = {} in [0, {}]", fmt::ptr(args.route_ids),
                   args.route_entries, INT_MAX);
    FP4MOE_REQUIRE(args.route_entries <= args.max_rows,
                   "route_entries = {} must not exceed max_rows = {} (each routed entry is one row)",
                   args.route_entries, args.max_rows);
  }
  FP4MOE_REQUIRE(cfg.mma != 3 || aligned(args.tile_counter, 8),
                 "tile_counter = {} must be 8-byte aligned (int32[2]: tiles claimed, CTAs done)",
                 fmt::ptr(args.tile_counter));
  // Segments (expert, token tile) the problem can have at most: the routed rows and the extra set's.
  const int64_t segments = args.max_rows / cfg.bt + w.num_experts + (xa ? xa->max_rows / cfg.bt + 1 : 0);
  if (cfg.mma == 2) {
    // The stream kernel counts work units (expert, token tile, m16 tile) and chunk slices in int32.
    FP4MOE_REQUIRE(segments * (w.n / 16) < (int64_t{1} << 31) && (w.n / 16) * (w.k / 64) * cfg.warps < (int64_t{1} << 31),
                   "tile config {}: (max_rows / bt + experts) * n / 16 = {} work units must stay below 2^31; use a "
                   "pipeline config for this size",
                   cfg.name(), segments * (w.n / 16));
  }
  FP4MOE_REQUIRE(args.max_ctas >= 0, "max_ctas = {} must be >= 0 (0: every resident CTA)", args.max_ctas);
  FP4MOE_REQUIRE(args.max_ctas == 0 || cfg.mma != 2,
                 "max_ctas = {} applies to tile-scheduled configs; {} is a stream config, which splits its work "
                 "over every resident CTA",
                 args.max_ctas, cfg.name());
  const int idx = config_index(cfg);
  const detail::GemmKernelFn fn = kernel_for(idx, args.epilogue);
  int device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  const LaunchInfo& info = launch_info(device, fn, cfg, w.k);

  // Work tiles <= (rows / bt + experts) * feature tiles; more CTAs than that would only exit.
  const int64_t ftiles = (w.n + cfg.bn - 1) / cfg.bn;
  const int64_t max_tiles = segments * ftiles;
  // Stream configs split all work evenly over the CTAs that are resident at once (a CTA that waited for a
  // slot would double the time), so they always launch exactly that many.
  const int64_t resident = int64_t{info.sms} * info.ctas_per_sm;
  const int64_t cap = args.max_ctas > 0 ? std::min<int64_t>(resident, args.max_ctas) : resident;
  const int grid = static_cast<int>(cfg.mma == 2 ? resident : std::max<int64_t>(1, std::min<int64_t>(max_tiles, cap)));
  if (cfg.mma == 2) {
    // stream_split (tile_config.hpp) multiplies the segment count by a CTA index in 32 bits.
    FP4MOE_REQUIRE(segments * grid < (int64_t{1} << 31),
                   "tile config {}: (max_rows / bt + experts) = {} segments times {} CTAs must stay below 2^31; use a "
                   "pipeline config for this size", cfg.name(), segments, grid);
  }

  kernels::GroupedGemmParams p{};
  p.codes = w.codes;
  p.scales = w.scales;
  p.global_scale = w.global_scale;
  p.global_scale_up = w.global_scale_up;
  p.bias = w.bias;
  p.act = static_cast<const __nv_bfloat16*>(args.act);
  p.offsets = args.expert_offsets;
  p.row_scale = args.row_scale;
  p.out = static_cast<__nv_bfloat16*>(args.out);
  p.num_experts = w.num_experts;
  p.n = static_cast<int>(w.n);
  p.k = static_cast<int>(w.k);
  p.max_rows = static_cast<int>(args.max_rows);
  p.alpha = args.swiglu_alpha;
  p.limit = args.swiglu_limit;
  const bool mx = w.format == WeightFormat::kMxfp4;
  p.scale_mul = mx ? layout::kMxfp4ScaleMul : layout::kNvfp4ScaleMul;
  p.scale_add = mx ? layout::kMxfp4ScaleAdd : layout::kNvfp4ScaleAdd;
  const bool ids = cfg.mma == 2 && args.programmatic_launch && args.route_ids != nullptr;
  p.weights_before_wait = args.programmatic_launch && (args.offsets_ready_at_launch || ids) ? 1 : 0;
  p.route_ids = ids ? args.route_ids : nullptr;
  p.route_n = ids ? static_cast<int>(args.route_entries) : 0;
  // What a round change costs a CTA, in chunks of its stream (stream_split).
  p.round_cost = cfg.mma == 2 ? kStreamRoundCostChunks * cfg.warps : 0;
  if (cfg.mma == 3) p.tma_cut = tma_cut_table_of(idx);
  if (xw != nullptr) {
    p.x_codes = xw->codes;
    p.x_scales = xw->scales;
    p.x_global_scale = xw->global_scale;
    p.x_global_scale_up = xw->global_scale_up;
    p.x_bias = xw->bias;
    p.x_act = static_cast<const __nv_bfloat16*>(xa->act);
    p.x_offsets = xa->expert_offsets;
    p.x_out = static_cast<__nv_bfloat16*>(xa->out);
    p.x_max_rows = static_cast<int>(xa->max_rows);
  }
  if (args.trace != nullptr && cfg.mma == 2) {
    FP4MOE_REQUIRE(kStreamTraceBuilt, "trace = {}: this build has no stream-kernel timeline (configure with "
                   "-DFP4MOE_STREAM_TRACE=ON)", fmt::ptr(args.trace));
    const size_t need = static_cast<size_t>(grid) * cfg.warps * kStreamTraceSlots;
    FP4MOE_REQUIRE(args.trace_capacity >= need && aligned(args.trace, 8),
                   "trace = {} (capacity {} values) must be 8-byte aligned and hold {} values: {} CTAs x {} warps x "
                   "{} (grouped_gemm_trace_values)", fmt::ptr(args.trace), args.trace_capacity, need, grid, cfg.warps,
                   kStreamTraceSlots);
    p.trace = args.trace;
  }
  if (cfg.mma == 3) {
    p.tile_counter = args.tile_counter;
    detail::encode_tma_maps(p.tma, cfg, w, args, xw, xa);
  }
  detail::launch(fn, dim3(grid), dim3(cfg.threads()), info.smem, stream, args.programmatic_launch, p);
}

}  // namespace

void grouped_gemm_nvfp4(const GroupedWeightsView& w, const GroupedGemmArgs& args, const TileConfig& cfg,
                        cudaStream_t stream) {
  launch_grouped_gemm(w, args, nullptr, nullptr, cfg, stream);
}

void grouped_gemm_nvfp4(const GroupedWeightsView& w, const GroupedGemmArgs& args, const GroupedWeightsView& extra_w,
                        const GroupedGemmArgs& extra_args, const TileConfig& cfg, cudaStream_t stream) {
  launch_grouped_gemm(w, args, &extra_w, &extra_args, cfg, stream);
}

cudaFuncAttributes grouped_gemm_kernel_attributes(const TileConfig& cfg, GemmEpilogue epilogue) {
  const detail::GemmKernelFn fn = kernel_for(config_index(cfg), epilogue);
  cudaFuncAttributes attr{};
  FP4MOE_CUDA_CHECK(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(fn)));
  return attr;
}

size_t grouped_gemm_trace_values(const TileConfig& cfg, GemmEpilogue epilogue, int64_t k) {
  if (cfg.mma != 2) return 0;
  const detail::GemmKernelFn fn = kernel_for(config_index(cfg), epilogue);
  int device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  const LaunchInfo& info = launch_info(device, fn, cfg, k);
  return static_cast<size_t>(info.sms) * info.ctas_per_sm * cfg.warps * kStreamTraceSlots;
}

int grouped_gemm_max_active_ctas(const TileConfig& cfg, GemmEpilogue epilogue, int64_t k) {
  const detail::GemmKernelFn fn = kernel_for(config_index(cfg), epilogue);
  int device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  return launch_info(device, fn, cfg, k).ctas_per_sm;
}

TileConfig heuristic_tile_config(int64_t n, int64_t k, double rows_per_expert, const ArchInfo& arch,
                                 std::string* why) {
  // The pick for Hopper, by rows per expert; then, if the arch cannot run it (no wgmma, less shared
  // memory) or the shape cannot use it, the nearest config that is valid there. A pure function of its
  // arguments, so that the choice for any GPU can be checked on a CPU.
  const bool k128 = k % 128 == 0;
  // Rows of an active expert vary around the mean (random routing); cover ~1.5x the mean in one tile
  // so that each expert's weights stream once.
  const double r = rows_per_expert * 1.5;
  // decode: the stream kernel (bt 8 up to ~8 rows per expert, bt 16 up to ~16); at ~1 row per expert
  // two CTAs per SM where two CTAs' activation rows fit an SM
  const TileConfig c2{192, 8, 64, 4, 12, 2, 2};
  const bool c2_fits = 2 * (stream_smem_layout(c2, k).total_bytes + arch.reserved_smem_per_block) <= arch.smem_per_sm;
  TileConfig want;
  if (r <= 1.5 && c2_fits) want = c2;
  else if (r <= 8) want = TileConfig{320, 8, 64, 8, 20, 2, 1};
  else if (r <= 16 && !(arch.has(kWgmma) && k128)) want = TileConfig{256, 16, 64, 8, 16, 2, 1};
  // Hopper, 8 rows per expert and more: the TMA-fed wgmma kernel, whose per-tile width follows the rows
  // (GLM-5 GEMMs, bench/NOTES.md: T = 256 0.77 of the read ceiling vs 0.68, T = 512 0.71 vs 0.48,
  // T = 1024 0.54 vs 0.47, T = 4096 0.58 of the bf16 rate vs 0.42); 64-wide K stages where K is
  // not a multiple of 128
  else if (arch.has(kWgmma) && r <= 32 && k128) want = TileConfig{256, 32, 128, 8, 8, 3};
  else if (arch.has(kWgmma) && r <= 64) want = TileConfig{256, 64, 64, 12, 8, 3};
  else if (arch.has(kWgmma)) want = TileConfig{128, 256, 64, 5, 8, 3};
  // elsewhere mma.sync pipelines
  else if (!k128) want = rows_per_expert <= 48 ? TileConfig{128, 32, 64, 8, 8} : TileConfig{256, 64, 64, 4, 8};
  else if (r <= 32) want = TileConfig{128, 32, 128, 5, 8};
  else if (r <= 64) want = TileConfig{128, 64, 128, 4, 8};
  else want = TileConfig{128, 128, 64, 4, 8};
  const int experts = 1;  // the expert count does not change which configs are valid below kMaxExperts
  auto usable = [&](const TileConfig& c) {  // stream configs: their activation rows span K
    return plan_sm80(c, arch, 0, k).verdict.valid && check_problem_sm80(c, n, k, experts, &arch).valid;
  };
  if (usable(want)) {
    if (why != nullptr) *why = fmt::format("{} rows per expert -> {}", rows_per_expert, want.name());
    return want;
  }
  // Nearest valid config: the same token tile if possible (it decides how often weights are re-read),
  // then the same K stage, then the deepest pipeline.
  const TileConfig* best = nullptr;
  auto score = [&](const TileConfig& c) {
    return std::make_tuple(std::abs(c.bt - want.bt), c.bk == want.bk ? 0 : 1, -c.stages, c.mma, c.ctas);
  };
  for (const TileConfig& c : kGemmConfigs)
    if (usable(c) && (best == nullptr || score(c) < score(*best))) best = &c;
  FP4MOE_REQUIRE(best != nullptr,
                 "no config of kGemmConfigs can run N = {}, K = {} on {} (see `fp4moe explain --arch {}`)", n, k,
                 arch.name, arch.name);
  if (why != nullptr) {
    const Verdict v = plan_sm80(want, arch, 0, k).verdict;
    *why = fmt::format("{} rows per expert -> {}, which cannot run here ({}); the nearest valid config is {}",
                       rows_per_expert, want.name(),
                       !v.valid ? v.reason : check_problem_sm80(want, n, k, experts, &arch).reason, best->name());
  }
  return *best;
}

}  // namespace fp4moe

// Tile planner (planner.hpp). The sm80 arithmetic is recounted from the kernel's data layout (bytes per
// element), deliberately not by calling gemm_smem_layout, so a test can catch either drifting.
#include "fp4moe/planner.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "fp4moe/error.hpp"

namespace fp4moe {

std::string with_commas(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

void Verdict::fail(std::string sentence) {
  if (valid) reason = sentence;
  valid = false;
  failures.push_back(std::move(sentence));
}

namespace {

size_t pad_to(size_t x, size_t a) { return (a - x % a) % a; }

}  // namespace

// ---------------------------------------------------------------------------------------------------
// sm80-nvfp4-grouped
// ---------------------------------------------------------------------------------------------------

namespace {

// Stream configs: activation rows of the whole K, partial-accumulator slots, the scheduler's prefix.
Sm80SmemPlan plan_stream_smem(const TileConfig& c, int64_t k) {
  Sm80SmemPlan p;
  p.k = k;
  // bt rows x K bf16 (2 bytes); 128-byte aligned (ldmatrix rows, 16-byte cp.async chunks).
  const size_t act = static_cast<size_t>(c.bt) * static_cast<size_t>(std::max<int64_t>(k, 0)) * 2;
  const size_t act_pad = pad_to(act, 128);
  p.act_bytes = act + act_pad;
  // One C fragment set per warp for the piece of a split m-tile: (bt/8) n-tiles x 32 lanes x 4 fp32.
  p.slots_bytes = static_cast<size_t>(c.warps) * (c.bt / 8) * 32 * 4 * 4;
  const size_t sched = (static_cast<size_t>(kMaxExperts) + 1) * 4 + 4;
  const size_t sched_pad = pad_to(sched, 128);
  p.sched_bytes = sched + sched_pad;
  p.sched_offset = p.act_bytes + p.slots_bytes;
  // Per warp: the cold state of its work cursor (kernels::StreamWarpState, 64 bytes).
  p.warp_state_bytes = static_cast<size_t>(c.warps) * 64;
  p.total_bytes = p.sched_offset + p.sched_bytes + p.warp_state_bytes;
  p.padding_bytes = act_pad + sched_pad;
  p.lines.push_back({"activation rows (whole K)",
                     fmt::format("bt * K * 2 = {} * {} * 2 (bf16){}", c.bt, k,
                                 act_pad ? fmt::format(" + {} pad", act_pad) : ""),
                     p.act_bytes});
  p.lines.push_back({"partial accumulators",
                     fmt::format("warps * (bt/8) * 32 lanes * 16 = {} * {} * 32 * 16", c.warps, c.bt / 8),
                     p.slots_bytes});
  p.lines.push_back({"scheduler", fmt::format("(kMaxExperts + 2) * 4 = ({} + 2) * 4{}", kMaxExperts,
                                              sched_pad ? fmt::format(" + {} pad", sched_pad) : ""),
                     p.sched_bytes});
  p.lines.push_back({"warp state", fmt::format("warps * 64 = {} * 64", c.warps), p.warp_state_bytes});
  p.lines.push_back({"total dynamic shared memory", "activations + partials + scheduler + warp state",
                     p.total_bytes});
  return p;
}

}  // namespace

Sm80SmemPlan plan_sm80_smem(const TileConfig& c, int64_t k) {
  if (c.mma == 2) return plan_stream_smem(c, k);
  Sm80SmemPlan p;
  // Activations first: bt rows x bk bf16 (2 bytes), in 128-byte swizzled rows.
  const size_t act = static_cast<size_t>(c.bt) * c.bk * 2;
  // Weights of one stage: bn rows x bk K-elements, e2m1 = 4 bits each.
  const size_t codes = static_cast<size_t>(c.bn) * c.bk * 4 / 8;
  // One E4M3 scale (1 byte) per 16 K-elements of a row.
  const size_t scales = static_cast<size_t>(c.bn) * (c.bk / 16);
  // Each part starts 128-byte aligned (cp.async 16-byte chunks, ldmatrix rows); a stage is a 1024-byte
  // multiple so every stage's activations start on the 1024-byte period of wgmma's 128-byte swizzle.
  const size_t act_pad = pad_to(act, 128), codes_pad = pad_to(codes, 128), scales_pad = pad_to(scales, 128);
  p.act_bytes = act + act_pad;
  p.codes_bytes = codes + codes_pad;
  p.scales_bytes = scales + scales_pad;
  const size_t parts = p.act_bytes + p.codes_bytes + p.scales_bytes;
  const size_t stage_pad = pad_to(parts, 1024);
  p.stage_bytes = parts + stage_pad;
  p.sched_offset = p.stage_bytes * static_cast<size_t>(c.stages);
  // Scheduler: tile prefix of every expert slot 0..kMaxExperts plus the total, int32 each.
  const size_t sched = (static_cast<size_t>(kMaxExperts) + 1) * 4 + 4;
  const size_t sched_pad = pad_to(sched, 128);
  p.sched_bytes = sched + sched_pad;
  p.total_bytes = p.sched_offset + p.sched_bytes;
  p.padding_bytes = (codes_pad + scales_pad + act_pad + stage_pad) * c.stages + sched_pad;

  auto line = [&](std::string what, std::string formula, size_t bytes) {
    p.lines.push_back({std::move(what), std::move(formula), bytes});
  };
  line("activations per stage", fmt::format("bt * bk * 2 = {} * {} * 2 (bf16){}", c.bt, c.bk,
                                            act_pad ? fmt::format(" + {} pad", act_pad) : ""),
       p.act_bytes);
  line("codes per stage", fmt::format("bn * bk / 2 = {} * {} / 2 (e2m1, 4 bit){}", c.bn, c.bk,
                                      codes_pad ? fmt::format(" + {} pad", codes_pad) : ""),
       p.codes_bytes);
  line("scales per stage", fmt::format("bn * bk / 16 = {} * {} / 16 (E4M3 per 16){}", c.bn, c.bk,
                                       scales_pad ? fmt::format(" + {} pad", scales_pad) : ""),
       p.scales_bytes);
  line("stage", fmt::format("activations + codes + scales, to a 1024-byte multiple{}",
                            stage_pad ? fmt::format(" (+ {} pad)", stage_pad) : ""),
       p.stage_bytes);
  line("pipeline", fmt::format("stages * stage = {} * {}", c.stages, with_commas(p.stage_bytes)), p.sched_offset);
  line("scheduler", fmt::format("(kMaxExperts + 2) * 4 = ({} + 2) * 4{}", kMaxExperts,
                                sched_pad ? fmt::format(" + {} pad", sched_pad) : ""),
       p.sched_bytes);
  line("total dynamic shared memory", "pipeline + scheduler", p.total_bytes);
  return p;
}

RegisterEstimate estimate_registers_sm80(const TileConfig& c) {
  RegisterEstimate r;
  const int wm = c.mma == 2 ? 1 : c.wm(), nt = c.bt / 8;
  r.accumulators = wm * nt * 4;
  // stream: the B fragments of a whole 64-K chunk (two ldmatrix.x4 per n-tile); the raw weights are the
  // register ring, `stages` chunks of 16 B codes + 8 B scales
  r.b_fragments = c.mma == 2 ? nt * 8 : nt * 2;
  r.a_fragments = 4;
  r.raw_weights = c.mma == 2 ? c.stages * 6 : wm * 6;
  r.addressing = 40;
  const int sum = r.accumulators + r.b_fragments + r.a_fragments + r.raw_weights + r.addressing;
  r.estimate = std::min(255, (sum + 7) / 8 * 8);
  // The kernel's __launch_bounds__(threads, (wm == 2 && bt >= 128) ? 1 : 2).
  r.min_blocks = gemm_min_ctas_per_sm(c);
  r.launch_bounds_cap = std::min(255, 65536 / (r.min_blocks * c.threads()) / 8 * 8);
  r.expected = std::min(r.estimate, r.launch_bounds_cap);
  r.formula = c.mma == 2
                  ? fmt::format("acc (bt/8)*4 = {} + B (bt/8)*8 = {} + A 4 + ring stages*6 = {} + addressing 40 = {} "
                                "-> {} (x8); launch-bounds cap 65536/({}*{}) = {}",
                                r.accumulators, r.b_fragments, r.raw_weights, sum, r.estimate, r.min_blocks,
                                c.threads(), r.launch_bounds_cap)
                  : fmt::format("acc wm*(bt/8)*4 = {} + B (bt/8)*2 = {} + A 4 + raw wm*6 = {} + addressing 40 = {} "
                                "-> {} (x8); launch-bounds cap 65536/({}*{}) = {}",
                                r.accumulators, r.b_fragments, r.raw_weights, sum, r.estimate, r.min_blocks,
                                c.threads(), r.launch_bounds_cap);
  return r;
}

Occupancy occupancy(const ArchInfo& a, int threads, int regs, size_t dynamic_smem, size_t static_smem) {
  Occupancy o;
  const size_t per_cta_smem = dynamic_smem + static_smem + a.reserved_smem_per_block;
  o.by_smem = per_cta_smem == 0 ? a.max_ctas_per_sm : static_cast<int>(a.smem_per_sm / per_cta_smem);
  const int warps = (threads + 31) / 32;
  const int regs_per_warp = ((std::max(regs, 1) * 32 + a.reg_alloc_unit_per_warp - 1) / a.reg_alloc_unit_per_warp) *
                            a.reg_alloc_unit_per_warp;
  o.by_registers = (a.regs_per_sm / regs_per_warp) / warps;
  o.by_threads = a.max_threads_per_sm / threads;
  o.by_cta_cap = a.max_ctas_per_sm;
  o.ctas_per_sm = std::min({o.by_smem, o.by_registers, o.by_threads, o.by_cta_cap});
  if (o.ctas_per_sm == o.by_smem) o.limiter = "shared memory";
  else if (o.ctas_per_sm == o.by_registers) o.limiter = "registers";
  else if (o.ctas_per_sm == o.by_threads) o.limiter = "threads";
  else o.limiter = "CTA cap";
  return o;
}

Sm80Plan plan_sm80(const TileConfig& cfg, const ArchInfo& arch, size_t static_smem, int64_t k) {
  Sm80Plan p;
  p.cfg = cfg;
  p.arch = arch;
  Verdict& v = p.verdict;
  if (!tile_config_well_formed(cfg)) {
    v.fail(fmt::format("tile {}: malformed (needs bn % (16 * warps) == 0 with wm = bn/(16*warps) in 1..2, "
                       "bt a multiple of 8 in 8..128, bk a multiple of 64, stages >= 2)",
                       cfg.name()));
    return p;
  }
  p.smem = plan_sm80_smem(cfg, k);
  p.regs = estimate_registers_sm80(cfg);
  p.occ = occupancy(arch, cfg.threads(), p.regs.expected, p.smem.total_bytes, static_smem);
  const size_t limit = arch.smem_optin_per_block;
  if (cfg.mma == 2) {
    const size_t fixed = p.smem.slots_bytes + p.smem.sched_bytes + p.smem.warp_state_bytes + static_smem;
    p.max_k_that_fits = limit > fixed ? static_cast<int64_t>((limit - fixed) / (2 * cfg.bt) / 64 * 64) : 0;
  } else {
    const size_t fixed = p.smem.sched_bytes + static_smem;
    p.max_stages_that_fit = limit > fixed ? static_cast<int>((limit - fixed) / p.smem.stage_bytes) : 0;
  }

  if (cfg.mma == 1 && !arch.has(kWgmma))
    v.fail(fmt::format("instruction: the config needs wgmma (sm_90a), {} has {}", arch.name, arch.families_string()));
  if (!arch.has(kMmaSync))
    v.fail(fmt::format("instruction: the kernel needs mma.sync (sm_80+), {} has {}", arch.name,
                       arch.families_string()));
  bool compiled = false;
  for (const TileConfig& c : kGemmConfigs) compiled = compiled || c == cfg;
  if (!compiled)
    v.fail(fmt::format("instantiation: {} is not in kGemmConfigs (include/fp4moe/tile_config.hpp), so no "
                       "kernel exists for it",
                       cfg.name()));
  if (cfg.threads() > arch.max_threads_per_block)
    v.fail(fmt::format("threads: needs {} per block, {} allows {}", cfg.threads(), arch.name,
                       arch.max_threads_per_block));
  const size_t need = p.smem.total_bytes + static_smem;
  if (need > limit && cfg.mma == 2)
    v.fail(fmt::format("shared memory: needs {} B per block at K = {}, {} allows {} B (over by {} B); K <= {} "
                       "would fit",
                       with_commas(need), k, arch.name, with_commas(limit), with_commas(need - limit),
                       p.max_k_that_fits));
  else if (need > limit)
    v.fail(fmt::format("shared memory: needs {} B per block, {} allows {} B (over by {} B); {} stages of {} B "
                       "would fit",
                       with_commas(need), arch.name, with_commas(limit), with_commas(need - limit),
                       p.max_stages_that_fit, with_commas(p.smem.stage_bytes)));
  if (static_cast<int64_t>(p.regs.expected) * cfg.threads() > arch.regs_per_block_max)
    v.fail(fmt::format("registers: needs {} x {} threads = {} per block, {} allows {}", p.regs.expected,
                       cfg.threads(), p.regs.expected * cfg.threads(), arch.name, arch.regs_per_block_max));
  if (v.valid && p.occ.ctas_per_sm < 1)
    v.fail(fmt::format("occupancy: not one CTA fits an SM ({} limits it)", p.occ.limiter));
  return p;
}

GemmProblem GemmProblem::uniform(int experts, int64_t rows_per_expert, int64_t n, int64_t k) {
  GemmProblem p;
  p.rows.assign(static_cast<size_t>(experts), rows_per_expert);
  p.n = n;
  p.k = k;
  return p;
}

WorkEstimate work_estimate(const GemmProblem& p, int bn, int bt, int num_sms, int ctas_per_sm) {
  FP4MOE_REQUIRE(bn > 0 && bt > 0, "tile bn = {}, bt = {} must be positive", bn, bt);
  WorkEstimate w;
  const int64_t ftiles = (p.n + bn - 1) / bn;
  for (int64_t r : p.rows) w.tiles += (std::max<int64_t>(r, 0) + bt - 1) / bt * ftiles;
  w.slots = static_cast<int64_t>(std::max(num_sms, 0)) * std::max(ctas_per_sm, 0);
  if (w.slots > 0) {
    w.waves = static_cast<double>(w.tiles) / static_cast<double>(w.slots);
    w.full_waves = (w.tiles + w.slots - 1) / w.slots;
    const int64_t last = w.tiles - (w.full_waves - 1) * w.slots;
    w.last_wave_fill = w.tiles == 0 ? 0.0 : static_cast<double>(last) / static_cast<double>(w.slots);
  }
  return w;
}

Verdict check_problem_sm80(const TileConfig& cfg, int64_t n, int64_t k, int experts, const ArchInfo* arch) {
  Verdict v;
  if (experts < 1 || experts > kMaxExperts)
    v.fail(fmt::format("experts: E = {} must be in 1..{} (kMaxExperts, the scheduler's table)", experts,
                       kMaxExperts));
  if (n <= 0 || n % 16 != 0)
    v.fail(fmt::format("alignment: N = {} must be a positive multiple of 16 (an m16 weight tile)", n));
  if (k <= 0 || k % 64 != 0)
    v.fail(fmt::format("alignment: K = {} must be a positive multiple of 64 (the repacked NVFP4 chunk)", k));
  else if (k % cfg.bk != 0)
    v.fail(fmt::format("alignment: K = {} must be a multiple of the tile's bk = {} (the pipeline has no K "
                       "tail; K % bk = {})",
                       k, cfg.bk, k % cfg.bk));
  if (arch != nullptr && cfg.mma == 2 && v.valid) {
    const Sm80Plan p = plan_sm80(cfg, *arch, 0, k);
    if (!p.verdict.valid) v.fail(p.verdict.reason);
  }
  return v;
}

std::vector<TileConfig> valid_sm80_configs(const ArchInfo& arch) {
  std::vector<TileConfig> out;
  for (const TileConfig& c : kGemmConfigs)
    if (plan_sm80(c, arch).verdict.valid) out.push_back(c);
  return out;
}

// ---------------------------------------------------------------------------------------------------
// cutlass-sm120-nvfp4-grouped: CUTLASS's sm_120 block-scaled NVFP4 ptr-array (grouped) GEMM
// ---------------------------------------------------------------------------------------------------
// Terms and where they come from (public NVIDIA/cutlass sources, 4.2-era unless said):
//  capacity      cutlass/arch/arch.h: sm120_smem_capacity_bytes = 101376.
//  stage count   gemm/collective/builders/sm120_blockscaled_mma_builder.inl calls
//                sm100_compute_stage_count_or_override_blockscaled<sm120_smem_capacity_bytes, ...>
//                (defined in builders/sm100_blockscaled_umma_builder.inl) with StageCountAutoCarveout<C>:
//                  stage_bytes = bits(A) * M * K / 8 + bits(B) * N * K / 8
//                              + sizeof(PipelineTmaUmmaAsync<1>::SharedStorage)          (16 B)
//                              + size(filter_zeros(SmemLayoutAtomSFA)) + size(filter_zeros(SmemLayoutAtomSFB))
//                  stages = (capacity - C) / stage_bytes
//                C is what the kernel's author passes, conventionally
//                sizeof(CollectiveEpilogue::SharedStorage). CUTLASS 4.5 instead subtracts the scheduler
//                pipeline, tensor maps and tensor-map pipeline first (ReducedSmemCapacityBytes).
//  SFA / SFB     the builder's SmemLayoutAtomSFA/SFB: blocks of Blk_MN = 128 rows x Blk_SF = 4 scale
//                bytes along K (Sm1xxBlockScaledConfig<16>), i.e. ceil(M/128)*128 * K/16 bytes per
//                stage (and likewise N), one E4M3 byte per 16 elements.
//  kernel        gemm/collective/sm120_blockscaled_mma_array_tma.hpp, CollectiveMma::SharedStorage:
//                TensorStorage { alignas(1024) smem_A[S]; alignas(1024) smem_B[S]; alignas(16) smem_SFA[S];
//                alignas(16) smem_SFB[S]; }  TensorMapStorage { 4 x TmaDescriptor (128 B) }
//                PipelineStorage = PipelineTmaAsync<S>::SharedStorage (full + empty barrier, 8 B each).
//                gemm/kernel/sm90_gemm_array_tma_warpspecialized_cooperative.hpp, SharedStorage:
//                tensors { mainloop; epilogue } (aligned 128, but the alignas(1024) members make it 1024),
//                pipelines { scheduler PipelineAsync<8>, mainloop, epilogue load, OrderedSequenceBarrier<1,2> }
//                (each alignas 16), scheduler_response[8] (alignas 16), tensormaps { mainloop; epilogue }
//                (alignas 128). sizeof rounds the whole struct to its 1024-byte alignment: the kernel's
//                footprint is always a multiple of 1 KB.
// Modelled, not read from a compiled kernel: the scheduler response (16 B each), the epilogue's load
// pipeline (one stage: 16 B) and the epilogue model below. CutlassEpilogueModel lets explain take the
// real figures (--epilogue-bytes).

CutlassEpilogueModel cutlass_default_epilogue(const CutlassTile& t) {
  CutlassEpilogueModel e;
  // sm90 epilogue builder, EpilogueTileAuto for the cooperative schedule: (min(M,128) x min(N,32));
  // StagesD = 2; bf16 D; no C source. smem_D is alignas(1024) (128-byte swizzle), and the fusion
  // callbacks' storage (empty members, 1 byte each in C++) starts a new 1024-byte aligned slot.
  const size_t d = 2 * static_cast<size_t>(std::min(t.m, 128)) * std::min(t.n, 32) * 2;
  e.tensor_bytes = align_up(d, 1024) + 1024;
  e.carveout_bytes = e.tensor_bytes;
  e.tensormaps = 2;
  e.description = fmt::format("TMA store, bf16 D, no C, epilogue tile {}x{}, 2 stages = {} B + fusion slot "
                              "1,024 B (modelled)",
                              std::min(t.m, 128), std::min(t.n, 32), with_commas(d));
  return e;
}

namespace {

struct CutlassLayout {
  size_t mainloop_tensors, tensors, pipelines, responses, tensormaps, footprint;
};

CutlassLayout cutlass_layout(const CutlassTile& t, int S, const CutlassEpilogueModel& epi, size_t a, size_t b,
                             size_t sfa, size_t sfb) {
  CutlassLayout L{};
  size_t off = 0;
  off = align_up(off, 1024) + S * a;      // smem_A
  off = align_up(off, 1024) + S * b;      // smem_B
  off = align_up(off, 16) + S * sfa;      // smem_SFA
  off = align_up(off, 16) + S * sfb;      // smem_SFB
  L.mainloop_tensors = align_up(off, 1024);  // struct alignment 1024
  L.tensors = align_up(L.mainloop_tensors + epi.tensor_bytes, 1024);
  (void)t;
  off = L.tensors;
  const size_t start_pipes = off;
  off = align_up(off, 16) + 8 * 2 * 8;            // scheduler PipelineAsync<8>: full + empty barriers
  off = align_up(off, 16) + static_cast<size_t>(S) * 16;  // mainloop PipelineTmaAsync<S>
  off = align_up(off, 16) + 16;                   // epilogue load pipeline (1 stage, modelled)
  off = align_up(off, 16) + 2 * 8;                // OrderedSequenceBarrier<1,2>
  off = align_up(off, 16);
  L.pipelines = off - start_pipes;
  const size_t start_resp = off;
  off = align_up(off, 16) + 8 * 16;               // scheduler_response[8] (16 B each, modelled)
  L.responses = off - start_resp;
  const size_t start_maps = off;
  off = align_up(off, 128) + 4 * 128;             // mainloop: A, B, SFA, SFB descriptors
  off = align_up(off, 128) + static_cast<size_t>(epi.tensormaps) * 128;
  L.tensormaps = off - start_maps;
  L.footprint = align_up(off, 1024);
  return L;
}

}  // namespace

CutlassSm120Plan plan_cutlass_sm120(const CutlassTile& t, int stages_override,
                                    std::optional<CutlassEpilogueModel> epilogue, size_t capacity) {
  CutlassSm120Plan p;
  p.tile = t;
  p.capacity = capacity;
  p.epilogue = epilogue ? *epilogue : cutlass_default_epilogue(t);
  Verdict& v = p.verdict;
  if (t.m <= 0 || t.n <= 0 || t.k <= 0 || t.m % 64 != 0 || t.n % 32 != 0 || t.k % 64 != 0) {
    v.fail(fmt::format("tile {}x{}x{}: CUTLASS sm_120 block-scaled tiles need M % 64 == 0, N % 32 == 0 "
                       "(the builder asserts N >= 32), K % 64 == 0",
                       t.m, t.n, t.k));
    return p;
  }
  p.a_stage = static_cast<size_t>(t.m) * t.k / 2;
  p.b_stage = static_cast<size_t>(t.n) * t.k / 2;
  p.sfa_stage = static_cast<size_t>((t.m + 127) / 128 * 128) * (t.k / 16);
  p.sfb_stage = static_cast<size_t>((t.n + 127) / 128 * 128) * (t.k / 16);
  p.barrier_stage = 16;
  p.per_stage = p.a_stage + p.b_stage + p.sfa_stage + p.sfb_stage + p.barrier_stage;
  p.auto_stages = capacity > p.epilogue.carveout_bytes
                      ? static_cast<int>((capacity - p.epilogue.carveout_bytes) / p.per_stage)
                      : 0;
  p.stages = stages_override > 0 ? stages_override : p.auto_stages;
  for (int s = 1; s < 64; ++s)
    if (cutlass_layout(t, s, p.epilogue, p.a_stage, p.b_stage, p.sfa_stage, p.sfb_stage).footprint <= capacity)
      p.max_stages_that_fit = s;

  auto line = [&](std::string what, std::string formula, size_t bytes) {
    p.lines.push_back({std::move(what), std::move(formula), bytes});
  };
  line("A per stage", fmt::format("M * K / 2 = {} * {} / 2 (e2m1)", t.m, t.k), p.a_stage);
  line("B per stage", fmt::format("N * K / 2 = {} * {} / 2 (e2m1)", t.n, t.k), p.b_stage);
  line("SFA per stage", fmt::format("ceil(M/128)*128 * K/16 = {} * {}", (t.m + 127) / 128 * 128, t.k / 16),
       p.sfa_stage);
  line("SFB per stage", fmt::format("ceil(N/128)*128 * K/16 = {} * {}", (t.n + 127) / 128 * 128, t.k / 16),
       p.sfb_stage);
  line("pipeline barrier per stage", "sizeof(PipelineTmaUmmaAsync<1>::SharedStorage)", p.barrier_stage);
  line("per stage (StageCountAutoCarveout)", "A + B + SFA + SFB + barrier", p.per_stage);
  line("epilogue carveout", p.epilogue.description, p.epilogue.carveout_bytes);
  line("auto stages", fmt::format("({} - {}) / {} = {}", with_commas(capacity),
                                  with_commas(p.epilogue.carveout_bytes), with_commas(p.per_stage), p.auto_stages),
       static_cast<size_t>(p.auto_stages));
  if (p.stages < 1) {
    v.fail(fmt::format("shared memory: not one stage of {} B fits beside the {} B epilogue in {} B",
                       with_commas(p.per_stage), with_commas(p.epilogue.carveout_bytes), with_commas(capacity)));
    return p;
  }
  const CutlassLayout L = cutlass_layout(t, p.stages, p.epilogue, p.a_stage, p.b_stage, p.sfa_stage, p.sfb_stage);
  p.mainloop_tensors = L.mainloop_tensors;
  p.tensors = L.tensors;
  p.pipelines = L.pipelines;
  p.scheduler_responses = L.responses;
  p.tensormaps = L.tensormaps;
  p.footprint = L.footprint;
  const size_t counted = p.per_stage * p.stages + p.epilogue.carveout_bytes;
  p.ignored_by_auto = p.footprint > counted ? p.footprint - counted : 0;
  p.over_by = static_cast<int64_t>(p.footprint) - static_cast<int64_t>(capacity);
  line("auto's estimate", fmt::format("stages * per stage + carveout = {} * {} + {}", p.stages,
                                      with_commas(p.per_stage), with_commas(p.epilogue.carveout_bytes)),
       counted);
  line("mainloop tensors", "A, B (alignas 1024), SFA, SFB (alignas 16), struct aligned to 1024",
       p.mainloop_tensors);
  line("tensors", fmt::format("mainloop + epilogue {} B, aligned to 1024", with_commas(p.epilogue.tensor_bytes)),
       p.tensors);
  line("pipelines", fmt::format("scheduler 128 + mainloop {} * 16 + epilogue load 16 + load order 16",
                                p.stages),
       p.pipelines);
  line("scheduler responses", "8 x 16 (alignas 16)", p.scheduler_responses);
  line("tensor maps", fmt::format("(4 + {}) x 128-byte TMA descriptors, alignas 128", p.epilogue.tensormaps),
       p.tensormaps);
  line("kernel SharedStorage", "sum, rounded to the struct's 1024-byte alignment", p.footprint);
  line("ignored by the auto count", "SharedStorage - auto's estimate", p.ignored_by_auto);
  if (p.over_by > 0)
    v.fail(fmt::format("shared memory: needs {} B per block, sm_120 allows {} B (over by {} B); the auto "
                       "count picked {} stages of {} B, {} stage{} fit{}",
                       with_commas(p.footprint), with_commas(capacity), with_commas(p.over_by), p.stages,
                       with_commas(p.per_stage), p.max_stages_that_fit, p.max_stages_that_fit == 1 ? "" : "s",
                       p.max_stages_that_fit >= 2 ? fmt::format(" (use StageCount<{}>)", p.max_stages_that_fit)
                                                  : " (a smaller tile is needed: 2 stages are the minimum)"));
  else if (p.stages < 2)
    v.fail(fmt::format("pipeline: {} stage{} of {} B fit{}; the mainloop needs at least 2", p.stages,
                       p.stages == 1 ? "" : "s", with_commas(p.per_stage), p.stages == 1 ? "s" : ""));
  return p;
}

}  // namespace fp4moe

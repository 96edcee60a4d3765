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
  // Segment prefix of every expert slot + total, then the rows: routed offsets 0..kMaxExperts and the
  // extra set's two (kStreamSchedInts).
  const size_t sched = (static_cast<size_t>(kMaxExperts) + 2) * 4 + (static_cast<size_t>(kMaxExperts) + 3) * 4;
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
  p.lines.push_back({"scheduler (prefix + expert rows)",
                     fmt::format("((kMaxExperts + 2) + (kMaxExperts + 3)) * 4 = ({} + 2 + {} + 3) * 4{}", kMaxExperts,
                                 kMaxExperts, sched_pad ? fmt::format(" + {} pad", sched_pad) : ""),
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
  // Scheduler: tile prefix of every expert slot 0..kMaxExperts plus the total, int32 each; tma configs
  // reserve kTmaTileSlots int32 for the ring through which the producer hands claimed tiles to the consumers.
  const size_t slots = c.mma == 3 ? static_cast<size_t>(kTmaTileSlots) * 4 : 0;
  const size_t sched = (static_cast<size_t>(kMaxExperts) + 1) * 4 + 4 + slots;
  const size_t sched_pad = pad_to(sched, 128);
  p.sched_bytes = sched + sched_pad;
  // tma configs: a "full" and an "empty" mbarrier of 8 bytes per stage, after the scheduler; then each
  // consumer warp's copy of the tile's row scales, bt floats.
  const size_t bars = c.mma == 3 ? static_cast<size_t>(c.stages) * 2 * 8 : 0;
  const size_t bars_pad = pad_to(bars, 128);
  p.barrier_bytes = bars + bars_pad;
  const size_t rs = c.mma == 3 ? static_cast<size_t>(c.warps) * c.bt * 4 : 0;
  const size_t rs_pad = pad_to(rs, 128);
  p.row_scale_bytes = rs + rs_pad;
  // and its copy of the tile's biases, 16 floats per m16 tile it holds (where the launch has biases)
  const size_t bias = tma_stages_bias(c) ? static_cast<size_t>(c.warps) * c.wm() * 16 * 4 : 0;
  const size_t bias_pad = pad_to(bias, 128);
  p.bias_bytes = bias + bias_pad;
  p.total_bytes = p.sched_offset + p.sched_bytes + p.barrier_bytes + p.row_scale_bytes + p.bias_bytes;
  p.padding_bytes =
      (codes_pad + scales_pad + act_pad + stage_pad) * c.stages + sched_pad + bars_pad + rs_pad + bias_pad;

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
  const bool tma = c.mma == 3;
  line("scheduler", fmt::format("(kMaxExperts + 2{}) * 4 = ({} + 2{}) * 4{}", tma ? " + tile slots" : "", kMaxExperts,
                                tma ? fmt::format(" + {}", kTmaTileSlots) : "",
                                sched_pad ? fmt::format(" + {} pad", sched_pad) : ""),
       p.sched_bytes);
  if (c.mma == 3) {
    line("mbarriers", fmt::format("stages * 2 * 8 = {} * 2 * 8 (full + empty per stage){}", c.stages,
                                  bars_pad ? fmt::format(" + {} pad", bars_pad) : ""),
         p.barrier_bytes);
    line("row scales", fmt::format("warps * bt * 4 = {} * {} * 4 (fp32, a copy per consumer warp){}", c.warps,
                                   c.bt, rs_pad ? fmt::format(" + {} pad", rs_pad) : ""),
         p.row_scale_bytes);
    if (tma_stages_bias(c))
      line("biases", fmt::format("warps * wm * 16 * 4 = {} * {} * 16 * 4 (fp32, a copy per consumer warp){}", c.warps,
                                 c.wm(), bias_pad ? fmt::format(" + {} pad", bias_pad) : ""),
           p.bias_bytes);
  }
  line("total dynamic shared memory",
       c.mma == 3 ? (tma_stages_bias(c) ? "pipeline + scheduler + mbarriers + row scales + biases"
                                   : "pipeline + scheduler + mbarriers + row scales")
                  : "pipeline + scheduler", p.total_bytes);
  return p;
}

RegisterEstimate estimate_registers_sm80(const TileConfig& c) {
  RegisterEstimate r;
  const int wm = c.mma == 2 ? 1 : c.wm(), nt = c.bt / 8;
  r.accumulators = wm * nt * 4;
  if (c.mma == 3) {
    // tma consumers: A-fragment sets of a stage's k16 steps (four with two m64 tiles per warpgroup), the
    // stage's raw codes + scales (24 B per chunk and m16 tile); the producer warpgroup gives registers
    // to them with setmaxnreg, so the cap is tma_consumer_regs (the launch-bounds cap is 65536 / threads)
    const int ks = c.bk / 16, nb = wm == 2 ? 4 : ks;
    r.b_fragments = 0;
    r.a_fragments = nb * wm * 4;
    r.raw_weights = wm * (c.bk / 64) * 6;
    r.addressing = 40;
    const int sum = r.accumulators + r.a_fragments + r.raw_weights + r.addressing;
    r.estimate = (sum + 7) / 8 * 8;
    r.min_blocks = gemm_min_ctas_per_sm(c);
    r.launch_bounds_cap = std::min(255, 65536 / (r.min_blocks * c.threads()) / 8 * 8);
    // occupancy is decided by the launch's per-thread count, the launch-bounds cap
    r.expected = r.launch_bounds_cap;
    r.formula = fmt::format("consumers: acc wm*(bt/8)*4 = {} + A sets {}*wm*4 = {} + raw wm*(bk/64)*6 = {} + "
                            "addressing 40 = {} -> {} of setmaxnreg's {}; launch: 65536/({}*{}) = {}",
                            r.accumulators, nb, r.a_fragments, r.raw_weights, sum, r.estimate,
                            tma_consumer_regs(c.warps, c.ctas), r.min_blocks, c.threads(), r.launch_bounds_cap);
    return r;
  }
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
    // tma configs: each stage also has two 8-byte mbarriers (their region padded to 128 bytes), and the
    // row-scale and bias copies follow
    while (cfg.mma == 3 && p.max_stages_that_fit > 0 &&
           fixed + p.max_stages_that_fit * p.smem.stage_bytes + (p.max_stages_that_fit * 16 + 127) / 128 * 128 +
                   p.smem.row_scale_bytes + p.smem.bias_bytes >
               limit)
      --p.max_stages_that_fit;
  }

  if ((cfg.mma == 1 || cfg.mma == 3) && !arch.has(kWgmma))
    v.fail(fmt::format("instruction: the config needs wgmma{} (sm_90a), {} has {}",
                       cfg.mma == 3 ? ", TMA and setmaxnreg" : "", arch.name, arch.families_string()));
  if (cfg.mma == 3 && p.regs.estimate > tma_consumer_regs(cfg.warps, cfg.ctas))
    v.fail(fmt::format("registers: the consumers need ~{} per thread, setmaxnreg gives them {} ({})",
                       p.regs.estimate, tma_consumer_regs(cfg.warps, cfg.ctas), p.regs.formula));
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
  else if (k % cfg.bk != 0 && !tile_config_has_k_tail(cfg))
    v.fail(fmt::format("alignment: K = {} must be a multiple of the tile's bk = {} (only the tma configs have a "
                       "K tail; K % bk = {})",
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
// cutlass-sm120-nvfp4-grouped: the arithmetic is cutlass_sm120_model.hpp (sources cited there); this
// adds the verdict, the largest count that fits, the fix and explain's lines.
// ---------------------------------------------------------------------------------------------------

CutlassSm120Plan plan_cutlass_sm120(const CutlassTile& t, const CutlassSm120Options& o) {
  namespace cm = cutlass_sm120;
  CutlassSm120Plan p;
  p.tile = t;
  p.options = o;
  p.capacity = o.capacity;
  Verdict& v = p.verdict;
  if (!cm::tile_supported(t)) {
    v.fail(fmt::format("tile {}x{}x{}: the sm_120 block-scaled builder's scale-factor atoms are 128 rows by 64 "
                       "elements of K, so M and N must be multiples of 128 and K of 64",
                       t.m, t.n, t.k));
    p.fix = "use a tile with M and N multiples of 128 and K a multiple of 64 (128x128x128, 128x128x256, "
            "128x256x128, 256x128x128)";
    return p;
  }
  const bool pingpong = o.schedule == CutlassSchedule::kPingpong;
  p.epilogue = cm::epilogue(t, o.epilogue);
  p.carveout = o.carveout ? *o.carveout : p.epilogue.shared_storage;
  p.auto_stages = cm::auto_stages(t, p.carveout, o.capacity);
  p.stages = o.stages > 0 ? o.stages : p.auto_stages;
  p.mainloop = cm::mainloop(t, p.stages);
  p.kernel = cm::kernel(t, p.stages, p.epilogue, o.schedule);
  p.max_stages_that_fit = cm::max_stages_that_fit(t, p.epilogue, o.schedule, o.capacity);
  const size_t per = p.mainloop.auto_stage_bytes;
  // StageCountAutoCarveout<C> picks floor((capacity - C) / per); it picks <= S exactly when
  // C > capacity - (S + 1) * per.
  const size_t need = static_cast<size_t>(p.max_stages_that_fit + 1) * per;
  p.carveout_for_max_stages = o.capacity >= need ? o.capacity - need + 1 : 0;
  p.counted_by_auto = per * static_cast<size_t>(std::max(p.stages, 0)) + p.carveout;
  p.ignored_by_auto = static_cast<int64_t>(p.kernel.footprint) - static_cast<int64_t>(p.counted_by_auto);
  p.over_by = static_cast<int64_t>(p.kernel.footprint) - static_cast<int64_t>(o.capacity);

  auto line = [&](std::string what, std::string formula, size_t bytes) {
    p.lines.push_back({std::move(what), std::move(formula), bytes});
  };
  const CutlassEpilogueSpec& e = o.epilogue;
  line("A per stage", fmt::format("M * K / 2 = {} * {} / 2 (e2m1)", t.m, t.k), p.mainloop.a_stage);
  line("B per stage", fmt::format("N * K / 2 = {} * {} / 2 (e2m1)", t.n, t.k), p.mainloop.b_stage);
  line("SFA per stage", fmt::format("M * K / 16 = {} * {} / 16 (E4M3)", t.m, t.k), p.mainloop.sfa_stage);
  line("SFB per stage", fmt::format("N * K / 16 = {} * {} / 16 (E4M3)", t.n, t.k), p.mainloop.sfb_stage);
  line("pipeline barrier per stage", "sizeof(PipelineTmaUmmaAsync<1>::SharedStorage)", p.mainloop.barrier_stage);
  line("per stage (the auto count's divisor)", "A + B + SFA + SFB + barrier", per);
  line("epilogue D (and C) buffers",
       fmt::format("tile {}x{}, {} D stage{}{}, {}-major, swizzle alignment {}", e.tile_m, e.tile_n,
                   p.epilogue.stages_d, p.epilogue.stages_d == 1 ? "" : "s",
                   !e.has_c ? ", no C"
                   : p.epilogue.reuse_smem ? fmt::format(", C reuses them ({} stages)", p.epilogue.stages_c)
                                           : fmt::format(", {} C stages", p.epilogue.stages_c),
                   e.column_major ? "column" : "row", with_commas(static_cast<int64_t>(p.epilogue.alignment))),
       p.epilogue.collective_bytes);
  line("epilogue TensorStorage", fmt::format("buffers + fusion storage {} B, aligned to {}", e.fusion_bytes,
                                             with_commas(static_cast<int64_t>(p.epilogue.alignment))),
       p.epilogue.tensor_bytes);
  line("epilogue SharedStorage", fmt::format("TensorStorage + load pipeline {} * 16, aligned", p.epilogue.stages_c),
       p.epilogue.shared_storage);
  line("carveout", o.carveout ? "--carveout" : "sizeof(CollectiveEpilogue::SharedStorage), as TensorRT-LLM passes it",
       p.carveout);
  line("auto stages", fmt::format("({} - {}) / {} = {}", with_commas(static_cast<int64_t>(o.capacity)),
                                  with_commas(static_cast<int64_t>(p.carveout)), with_commas(static_cast<int64_t>(per)),
                                  p.auto_stages),
       static_cast<size_t>(p.auto_stages));
  if (p.stages < 1) {
    v.fail(fmt::format("shared memory: not one stage of {} B fits beside the {} B carveout in {} B",
                       with_commas(static_cast<int64_t>(per)), with_commas(static_cast<int64_t>(p.carveout)),
                       with_commas(static_cast<int64_t>(o.capacity))));
    p.fix = "none: use a smaller tile";
    return p;
  }
  line("the auto count's budget", fmt::format("stages * per stage + carveout = {} * {} + {}", p.stages,
                                              with_commas(static_cast<int64_t>(per)),
                                              with_commas(static_cast<int64_t>(p.carveout))),
       p.counted_by_auto);
  line("mainloop TensorStorage", fmt::format("{} stages of A, B (each aligned to 1,024), SFA, SFB, aligned", p.stages),
       p.mainloop.tensor_bytes);
  line("kernel TensorStorage", "mainloop + epilogue, aligned to 1,024", p.kernel.tensors);
  line("kernel PipelineStorage",
       fmt::format("scheduler 8 * 16 + mainloop {} * 16 + epilogue load {} * 16 + load order 16{}", p.stages,
                   p.epilogue.stages_c, pingpong ? " + math order 32" : ""),
       p.kernel.pipelines);
  line("scheduler responses", "8 * 16", p.kernel.responses);
  line("tensor maps", fmt::format("(4 + {}) TMA descriptors of 128 B", p.epilogue.tensormaps), p.kernel.tensormaps);
  line("kernel SharedStorage", "sum, aligned to 1,024: the launch's dynamic shared memory", p.kernel.footprint);
  line("not in the auto count's budget", "SharedStorage - budget",
       static_cast<size_t>(std::max<int64_t>(p.ignored_by_auto, 0)));

  const int S = p.max_stages_that_fit;
  if (p.over_by > 0) {
    v.fail(fmt::format("shared memory: needs {} B per block, the limit is {} B (over by {} B); {} stages of {} B "
                       "were {}; at most {} fit",
                       with_commas(static_cast<int64_t>(p.kernel.footprint)),
                       with_commas(static_cast<int64_t>(o.capacity)), with_commas(p.over_by), p.stages,
                       with_commas(static_cast<int64_t>(per)),
                       o.stages > 0 ? "requested" : "picked by StageCountAutoCarveout", S));
  } else if (p.stages < 2) {
    v.fail(fmt::format("pipeline: {} stage of {} B fits; the mainloop needs at least 2",
                       p.stages, with_commas(static_cast<int64_t>(per))));
  }
  if (S < 2) {
    p.fix = fmt::format("none with this tile: {} stage{} fit{}, the pipeline needs 2; use a smaller tile", S,
                        S == 1 ? "" : "s", S == 1 ? "s" : "");
  } else if (v.valid && p.stages == S) {
    p.fix = fmt::format("none needed: {} stages is the largest count that fits", S);
  } else if (v.valid) {
    p.fix = fmt::format("none needed; StageCount<{}> would fit too", S);
  } else if (o.stages > 0) {
    p.fix = fmt::format("pass StageCount<{}> (the largest count that fits)", S);
  } else {
    p.fix = fmt::format("pass StageCount<{}>, or subtract {} B more: StageCountAutoCarveout<{}>", S,
                        with_commas(static_cast<int64_t>(p.carveout_for_max_stages - p.carveout)),
                        p.carveout_for_max_stages);
  }
  return p;
}

}  // namespace fp4moe

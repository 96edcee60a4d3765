// `fp4moe explain`: the planner's arithmetic for one tile config (or every config of a kernel family)
// on an architecture, line by line, and the verdict. Exit 0 when valid, 2 when not.
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "commands.hpp"
#include "fp4moe/arch.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/planner.hpp"
#include "fp4moe/tuner.hpp"

namespace fp4moe::cli {

namespace {

struct ExplainArgs {
  std::string arch;
  std::string kernel = kFamilySm80Grouped;
  std::string tile;
  int stages = 0;
  int warps = 0;
  int ctas = -1;
  bool wgmma = false;
  bool tma = false;
  std::string model;
  int64_t tokens = 0;
  int sms = 0;
  int64_t carveout = -1;
  std::string schedule = "auto";
  bool no_source = false;
  bool row_major = false;
};

void print_lines(const std::vector<SmemLine>& lines) {
  for (const auto& l : lines) fmt::print("  {:<36} {:>10}   {}\n", l.what, with_commas(static_cast<int64_t>(l.bytes)), l.formula);
}

void print_arch(const ArchInfo& a) {
  fmt::print("arch {} ({}): opt-in shared memory {} B per block, {} B per SM, {} B reserved per block; "
             "{} registers per SM; {} threads and {} CTAs per SM; {} SMs ({}); {}\n",
             a.name, a.from_device ? a.device_name : "table", with_commas(a.smem_optin_per_block),
             with_commas(a.smem_per_sm), with_commas(a.reserved_smem_per_block), a.regs_per_sm,
             a.max_threads_per_sm, a.max_ctas_per_sm, a.num_sms, a.sms_source, a.families_string());
}

int parse_tile(const std::string& s, int (&v)[3]) {
  if (std::sscanf(s.c_str(), "%dx%dx%d", &v[0], &v[1], &v[2]) != 3)
    throw CLI::ValidationError("--tile", fmt::format("'{}' is not MxNxK (e.g. 128x64x128)", s));
  return 0;
}

void print_problem_sm80(const Sm80Plan& p, const ExplainArgs& a, const ArchInfo& arch, Verdict& v) {
  if (a.model.empty()) return;
  const MoeConfig& m = preset(a.model);
  const int64_t T = a.tokens > 0 ? a.tokens : 1;
  const double rows = static_cast<double>(T) * m.top_k / m.num_experts;
  fmt::print("problem: {} at T = {} tokens: rows per expert = T * top_k / E = {} * {} / {} = {:.2f}\n", m.name, T,
             T, m.top_k, m.num_experts, rows);
  const int64_t r = static_cast<int64_t>(std::ceil(rows));
  for (int g = 1; g <= 2; ++g) {
    const int64_t n = g == 1 ? m.gemm1_n() : m.gemm2_n(), k = g == 1 ? m.gemm1_k() : m.gemm2_k();
    const Verdict pv = check_problem_sm80(p.cfg, n, k, m.num_experts);
    const WorkEstimate w = work_estimate(GemmProblem::uniform(m.num_experts, r, n, k), p.cfg.bn, p.cfg.bt,
                                         arch.num_sms, p.occ.ctas_per_sm);
    fmt::print("  GEMM{} N = {}, K = {}: tiles = E * ceil({}/{}) * ceil({}/{}) = {}; slots = {} SMs * {} CTAs = "
               "{}; waves = {:.2f} ({} rounds, last {:.0f}% full)\n",
               g, n, k, r, p.cfg.bt, n, p.cfg.bn, with_commas(w.tiles), arch.num_sms, p.occ.ctas_per_sm, w.slots,
               w.waves, w.full_waves, 100.0 * w.last_wave_fill);
    for (const auto& f : pv.failures) {
      fmt::print("    not runnable: {}\n", f);
      v.fail(fmt::format("GEMM{}: {}", g, f));
    }
  }
}

int explain_sm80(const ExplainArgs& a, const ArchInfo& arch) {
  if (!a.tile.empty()) {
    int t[3];
    parse_tile(a.tile, t);
    FP4MOE_REQUIRE(!(a.wgmma && a.tma), "--wgmma and --tma name different kernels; give one");
    TileConfig cfg{t[0], t[1], t[2], 4, 8, a.tma ? 3 : a.wgmma ? 1 : 0};
    // Defaults for stages / warps: the instantiated config with this bn x bt x bk (and MMA kind), if any.
    for (const TileConfig& c : kGemmConfigs)
      if (c.bn == cfg.bn && c.bt == cfg.bt && c.bk == cfg.bk && c.mma == cfg.mma &&
          (a.ctas < 0 || c.ctas == a.ctas) && (a.warps <= 0 || c.warps == a.warps)) {
        cfg.stages = c.stages;
        cfg.warps = c.warps;
        cfg.ctas = c.ctas;
        break;
      }
    if (a.stages > 0) cfg.stages = a.stages;
    if (a.warps > 0) cfg.warps = a.warps;
    if (a.ctas >= 0) cfg.ctas = a.ctas;
    const Sm80Plan p = plan_sm80(cfg, arch);
    fmt::print("kernel {} tile {} (--tile is BN x BT x BK: features x tokens x K per CTA tile; {} stages, {} "
               "warps, {} threads)\n",
               kFamilySm80Grouped, cfg.name(), cfg.stages, cfg.warps, cfg.threads());
    Verdict v = p.verdict;
    if (tile_config_well_formed(cfg)) {
      fmt::print("shared memory (recounted by the planner):\n");
      print_lines(p.smem.lines);
      fmt::print("  stages that fit {} B: ({} - {}) / {} = {}{}\n", with_commas(arch.smem_optin_per_block),
                 with_commas(arch.smem_optin_per_block), with_commas(p.smem.sched_bytes),
                 with_commas(p.smem.stage_bytes), p.max_stages_that_fit,
                 cfg.mma == 3 ? " (with 16 B of mbarriers per stage, in 128-byte blocks, and the row scales' and "
                                "biases' copies)"
                              : "");
      fmt::print("registers (estimate): {}\n", p.regs.formula);
      if (cfg.mma == 3) {
        // the instruction widths this config's kernel is instantiated for (tile_config.hpp, tma_widths)
        const TmaWidths tw = tma_widths(cfg);
        std::string ws;
        for (int i = 0; i < tw.n; ++i) ws += (i ? ", " : "") + std::to_string(tw.w[i]);
        fmt::print("  setmaxnreg: producer warpgroup {}, consumers {} per thread\n", tma_producer_regs(cfg.warps),
                   tma_consumer_regs(cfg.warps, cfg.ctas));
        fmt::print("wgmma widths per tile: {} (a tile of r rows runs the narrowest >= r; its activation copy is that "
                   "width rounded up to a multiple of bt/4 = {} rows)\n",
                   tw.n > 0 ? ws : "none (no list for this tile)", cfg.bt / 4);
      }
      fmt::print("  expected per thread: {}\n", p.regs.expected);
      fmt::print("CTAs per SM: shared memory {} ({} / ({} + {} reserved)), registers {}, threads {}, CTA cap {} "
                 "-> {} ({} limits)\n",
                 p.occ.by_smem, with_commas(arch.smem_per_sm), with_commas(p.smem.total_bytes),
                 with_commas(arch.reserved_smem_per_block), p.occ.by_registers, p.occ.by_threads, p.occ.by_cta_cap,
                 p.occ.ctas_per_sm, p.occ.limiter);
      print_problem_sm80(p, a, arch, v);
    }
    if (v.valid) {
      fmt::print("verdict: valid on {}\n", arch.name);
      return 0;
    }
    fmt::print("verdict: NOT valid on {}: {}\n", arch.name, v.reason);
    for (size_t i = 1; i < v.failures.size(); ++i) fmt::print("  also: {}\n", v.failures[i]);
    return 2;
  }
  // Without --tile: every config, and the pick for the problem.
  fmt::print("kernel {}: configs of kGemmConfigs on {} (BN x BT x BK, stages, warps):\n", kFamilySm80Grouped, arch.name);
  int valid = 0;
  for (const TileConfig& c : kGemmConfigs) {
    const Sm80Plan p = plan_sm80(c, arch);
    valid += p.verdict.valid;
    // Stream configs also hold their activation rows for the whole K: bt x K x 2 B more, per problem.
    const std::string act = c.mma == 2 ? fmt::format(" + {} B x K", c.bt * 2) : std::string();
    fmt::print("  {:<24} smem {:>9} B{}  regs~{:>3}  CTAs/SM {}  {}\n", c.name(), with_commas(p.smem.total_bytes), act,
               p.regs.expected, p.occ.ctas_per_sm, p.verdict.valid ? "valid" : "NOT valid: " + p.verdict.reason);
  }
  fmt::print("{} of {} configs valid on {}\n", valid, kNumGemmConfigs, arch.name);
  if (!a.model.empty()) {
    // What the layer would run on this arch at T tokens: moe_layer_tile_configs is the layer's own choice.
    const MoeConfig& m = preset(a.model);
    const int64_t T = a.tokens > 0 ? a.tokens : 1;
    std::vector<TuneLookup> why;
    const MoeResolvedTileConfigs picks = moe_layer_tile_configs(m, T, arch, &why);
    const TileConfig cfgs[] = {picks.gemm1, picks.gemm2, picks.shared_gemm1, picks.shared_gemm2};
    const int64_t Is = m.kernel_shared_intermediate();  // as the kernels run it (zero-padded to 64)
    const int64_t ns[] = {m.gemm1_n(), m.gemm2_n(), 2 * Is, m.hidden}, ks[] = {m.gemm1_k(), m.gemm2_k(), m.hidden, Is};
    const int es[] = {m.num_experts, m.num_experts, 1, 1};
    const double rows[] = {static_cast<double>(T) * m.top_k / m.num_experts, static_cast<double>(T) * m.top_k / m.num_experts,
                           static_cast<double>(T), static_cast<double>(T)};
    const char* names[] = {"GEMM1 (gate+up)", "GEMM2 (down)", "shared GEMM1", "shared GEMM2"};
    fmt::print("\n{} at T = {} on {}: what the layer runs (moe_layer_tile_configs)\n", m.name, T, arch.name);
    for (size_t g = 0; g < why.size(); ++g) {
      const TileConfig& c = cfgs[g];
      const Sm80Plan p = plan_sm80(c, arch, 0, ks[g]);  // stream configs: the rows of this K counted
      const Verdict pv = check_problem_sm80(c, ns[g], ks[g], es[g]);
      const int64_t r = static_cast<int64_t>(std::ceil(rows[g]));
      const WorkEstimate w = work_estimate(GemmProblem::uniform(es[g], r, ns[g], ks[g]), c.bn, c.bt, arch.num_sms,
                                           p.occ.ctas_per_sm);
      fmt::print("{} N = {}, K = {}, {} expert{}, ~{:.2f} rows each: {}\n", names[g], ns[g], ks[g], es[g],
                 es[g] == 1 ? "" : "s", rows[g], c.name());
      fmt::print("  from: {}\n  why: {}\n", why[g].source, why[g].reason);
      fmt::print("  fits: {} B of {} B shared memory, {} CTAs/SM ({} limits), {:.2f} waves on {} SMs\n",
                 with_commas(static_cast<int64_t>(p.smem.total_bytes)),
                 with_commas(static_cast<int64_t>(arch.smem_optin_per_block)), p.occ.ctas_per_sm, p.occ.limiter,
                 w.waves, arch.num_sms);
      if (!p.verdict.valid || !pv.valid)
        fmt::print("  warning: the pick is not valid here: {}\n", !p.verdict.valid ? p.verdict.reason : pv.reason);
    }
  }
  return valid > 0 ? 0 : 2;
}

int explain_cutlass(const ExplainArgs& a, const ArchInfo& arch) {
  if (arch.cc_major != 12)
    fmt::print("note: {} is CUTLASS's sm_120 kernel; shared-memory capacity taken from {} ({} B)\n",
               kFamilyCutlassSm120, arch.name, with_commas(static_cast<int64_t>(arch.smem_optin_per_block)));
  std::vector<CutlassTile> tiles;
  if (!a.tile.empty()) {
    int t[3];
    parse_tile(a.tile, t);
    tiles.push_back({t[0], t[1], t[2]});
  } else {
    tiles = {{128, 128, 128}, {128, 128, 256}, {128, 256, 128}, {256, 128, 128}};
  }
  CutlassSm120Options o;
  o.stages = a.stages;
  if (a.carveout >= 0) o.carveout = static_cast<size_t>(a.carveout);
  if (a.schedule == "pingpong") o.schedule = CutlassSchedule::kPingpong;
  else if (a.schedule != "cooperative" && a.schedule != "auto")
    FP4MOE_FAIL("--schedule '{}' must be auto, cooperative or pingpong", a.schedule);
  o.epilogue.has_c = !a.no_source;
  o.epilogue.column_major = !a.row_major;
  o.capacity = arch.smem_optin_per_block;
  fmt::print("CUTLASS 4.2 sm_120 block-scaled NVFP4 grouped GEMM as TensorRT-LLM's MoE launcher builds it "
             "({} schedule, TMA epilogue, bf16 D{}, {}-major); arithmetic proven against the compiled CUTLASS "
             "types by tests/cutlass/\n\n",
             o.schedule == CutlassSchedule::kPingpong ? "pingpong" : "cooperative",
             o.epilogue.has_c ? " and C" : ", no C", o.epilogue.column_major ? "column" : "row");
  int rc = 0;
  for (const CutlassTile& t : tiles) {
    const CutlassSm120Plan p = plan_cutlass_sm120(t, o);
    fmt::print("kernel {} tile {}x{}x{} (M x N x K), {} stages{}:\n", kFamilyCutlassSm120, t.m, t.n, t.k, p.stages,
               a.stages > 0 ? " (--stages: StageCount)"
                            : fmt::format(" (StageCountAutoCarveout<{}>)", p.carveout));
    print_lines(p.lines);
    if (p.verdict.valid)
      fmt::print("verdict: fits ({} B spare)\n", with_commas(-p.over_by));
    else
      fmt::print("verdict: NOT valid on {}: {}\n", arch.name, p.verdict.reason);
    fmt::print("largest stage count that fits: {}\n", p.max_stages_that_fit);
    fmt::print("fix: {}\n", p.fix);
    if (!p.verdict.valid) rc = 2;
    if (tiles.size() > 1) fmt::print("\n");
  }
  return tiles.size() > 1 ? 0 : rc;
}

}  // namespace

void register_explain(CLI::App& app) {
  auto args = std::make_shared<ExplainArgs>();
  CLI::App* cmd = app.add_subcommand(
      "explain", "Shared memory, registers, occupancy, waves and the verdict for a tile config on an architecture");
  cmd->add_option("--arch", args->arch,
                  "sm_80|86|89|90|100|103|120|121 (default: the present GPU, else sm_90; cutlass: sm_120)");
  cmd->add_option("--kernel", args->kernel, "sm80-nvfp4-grouped (default) | cutlass-sm120-nvfp4-grouped");
  cmd->add_option("--tile", args->tile,
                  "sm80-nvfp4-grouped: BNxBTxBK (features x tokens x K); cutlass: MxNxK. Without it: every config");
  cmd->add_option("--stages", args->stages, "pipeline stages (default: the instantiated config's; cutlass: StageCountAutoCarveout)");
  cmd->add_option("--warps", args->warps, "math warps (sm80-nvfp4-grouped)");
  cmd->add_option("--ctas", args->ctas,
                  "sm80-nvfp4-grouped: CTAs per SM the kernel is compiled for (default: the instantiated config's)");
  cmd->add_flag("--wgmma", args->wgmma, "sm80-nvfp4-grouped: the wgmma (sm_90a) variant of the tile");
  cmd->add_flag("--tma", args->tma,
                "sm80-nvfp4-grouped: the tma kernel's variant of the tile (sm_90a: TMA producer + wgmma consumers)");
  cmd->add_option("--model", args->model, "model preset for the problem (glm-5, deepseek-v3, ...)");
  cmd->add_option("--tokens", args->tokens, "tokens T of the problem (rows per expert = T * top_k / E)");
  cmd->add_option("--sms", args->sms, "number of SMs (default: the device's, else the table's product)");
  cmd->add_option("--carveout", args->carveout,
                  "cutlass: bytes passed to StageCountAutoCarveout (default: the epilogue's SharedStorage)");
  cmd->add_option("--schedule", args->schedule, "cutlass: auto (= cooperative) | cooperative | pingpong");
  cmd->add_flag("--no-source", args->no_source, "cutlass: ElementC = void (no C operand)");
  cmd->add_flag("--row-major", args->row_major, "cutlass: row-major C/D (TensorRT-LLM's are column-major)");
  cmd->callback([args]() {
    // CUTLASS's sm_120 kernel is explained for sm_120 unless another arch is asked for.
    ArchInfo arch = !args->arch.empty()                     ? arch_from_name(args->arch)
                    : args->kernel == kFamilyCutlassSm120 ? arch_from_name("sm_120")
                                                          : default_arch();
    if (args->sms > 0) arch.num_sms = args->sms, arch.sms_source = "--sms";
    print_arch(arch);
    int rc = 0;
    if (args->kernel == kFamilySm80Grouped) rc = explain_sm80(*args, arch);
    else if (args->kernel == kFamilyCutlassSm120) rc = explain_cutlass(*args, arch);
    else
      FP4MOE_FAIL("--kernel '{}' is not a kernel family (known: {}, {})", args->kernel, kFamilySm80Grouped,
                  kFamilyCutlassSm120);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace fp4moe::cli

// Planner, architecture table and CUTLASS sm_120 model tests (CPU only). Tuner tables:
// test_tuner_tables.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include "fp4moe/arch.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/planner.hpp"
#include "fp4moe/tile_config.hpp"
#include "fp4moe/tuner.hpp"

namespace fp4moe {
namespace {

TEST(Arch, TableFiguresAndNames) {
  EXPECT_EQ(arch_from_name("sm_120").smem_optin_per_block, 101376u);
  EXPECT_EQ(arch_from_name("120").smem_per_sm, 102400u);
  EXPECT_EQ(arch_from_name("sm90a").smem_optin_per_block, 232448u);
  EXPECT_EQ(arch_from_name("9.0").smem_per_sm, 233472u);
  EXPECT_EQ(arch_from_name("sm_100").smem_optin_per_block, 232448u);
  EXPECT_EQ(arch_from_name("sm_80").smem_optin_per_block, 163u * 1024);
  EXPECT_EQ(arch_from_name("sm_86").smem_optin_per_block, 99u * 1024);
  EXPECT_EQ(arch_from_name("compute_89").max_threads_per_sm, 1536);
  EXPECT_TRUE(arch_from_name("sm_90").has(kWgmma));
  EXPECT_FALSE(arch_from_name("sm_100").has(kWgmma));
  EXPECT_TRUE(arch_from_name("sm_103").has(kTcgen05));
  EXPECT_TRUE(arch_from_name("sm_121").has(kMmaSyncBlockScaledFp4));
  EXPECT_FALSE(arch_from_name("sm_90").has(kMmaSyncBlockScaledFp4));
  for (const ArchInfo& a : arch_table()) {
    EXPECT_EQ(a.reserved_smem_per_block, 1024u) << a.name;
    EXPECT_EQ(a.smem_optin_per_block + a.reserved_smem_per_block, a.smem_per_sm) << a.name;
    EXPECT_EQ(a.regs_per_sm, 65536) << a.name;
    EXPECT_EQ(a.regs_per_thread_max, 255) << a.name;
  }
  try {
    arch_from_name("sm_75");
    FAIL() << "sm_75 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sm_120"), std::string::npos) << e.what();
  }
}

// The planner recounts every buffer independently; it must agree with the kernel's constexpr layout.
TEST(Planner, SmemEqualsKernelLayoutForEveryConfig) {
  for (const TileConfig& c : kGemmConfigs) {
    if (c.mma == 2) {  // stream configs: the activation rows span K
      for (int64_t k : {64, 2048, 2880, 6144, 7168}) {
        const StreamSmemLayout l = stream_smem_layout(c, k);
        const Sm80SmemPlan p = plan_sm80_smem(c, k);
        EXPECT_EQ(p.act_bytes, l.act_bytes) << c.name() << " k=" << k;
        EXPECT_EQ(p.slots_bytes, l.slots_bytes) << c.name() << " k=" << k;
        EXPECT_EQ(p.sched_offset, l.sched_offset) << c.name() << " k=" << k;
        EXPECT_EQ(p.sched_bytes, l.sched_bytes) << c.name() << " k=" << k;
        EXPECT_EQ(p.warp_state_bytes, l.warp_state_bytes) << c.name() << " k=" << k;
        EXPECT_EQ(p.total_bytes, l.total_bytes) << c.name() << " k=" << k;
      }
      continue;
    }
    const GemmSmemLayout l = gemm_smem_layout(c);
    const Sm80SmemPlan p = plan_sm80_smem(c);
    EXPECT_EQ(p.codes_bytes, l.codes_bytes) << c.name();
    EXPECT_EQ(p.scales_bytes, l.scales_bytes) << c.name();
    EXPECT_EQ(p.act_bytes, l.act_bytes) << c.name();
    EXPECT_EQ(p.stage_bytes, l.stage_bytes) << c.name();
    EXPECT_EQ(p.sched_offset, l.sched_offset) << c.name();
    EXPECT_EQ(p.sched_bytes, l.sched_bytes) << c.name();
    EXPECT_EQ(p.total_bytes, l.total_bytes) << c.name();
  }
}

// tma configs: every tile of 1..bt rows gets a listed wgmma width that covers its rows and fits the
// activation box the producer copies (that width rounded up to bt/4, at most bt); hand-checked widths.
TEST(Planner, TmaWidthsCoverEveryTileAndFitTheCopy) {
  for (const TileConfig& c : kGemmConfigs) {
    if (c.mma != 3) continue;
    SCOPED_TRACE(c.name());
    const TmaWidths t = tma_widths(c);
    ASSERT_TRUE(tma_widths_well_formed(c));
    ASSERT_GE(t.n, c.ctas == 2 || c.warps == 16 ? 2 : 4);
    for (int rows = 1; rows <= c.bt; ++rows) {
      const int w = tma_width_for(c, rows);
      const int box = (w + c.bt / 4 - 1) / (c.bt / 4) * (c.bt / 4);
      EXPECT_GE(w, rows);
      EXPECT_EQ(w % 8, 0);
      EXPECT_LE(box, c.bt);
      // two warpgroups at one CTA per SM: never wider than the copy box (the width before the lists)
      if (c.ctas == 0 && c.warps == 8) {
        EXPECT_LE(w, (rows + c.bt / 4 - 1) / (c.bt / 4) * (c.bt / 4)) << "rows " << rows;
      }
    }
  }
  const auto width = [](int bn, int bt, int bk, int stages, int warps, int ctas, int rows) {
    return tma_width_for(TileConfig{bn, bt, bk, stages, warps, 3, ctas}, rows);
  };
  EXPECT_EQ(width(128, 64, 128, 8, 8, 0, 33), 40);
  EXPECT_EQ(width(256, 64, 64, 12, 8, 0, 33), 48);
  EXPECT_EQ(width(128, 256, 64, 5, 8, 0, 129), 144);
  EXPECT_EQ(width(128, 256, 64, 5, 8, 0, 161), 192);
  EXPECT_EQ(width(128, 128, 64, 10, 8, 0, 65), 72);
  EXPECT_EQ(width(256, 32, 128, 8, 8, 0, 1), 8);
  EXPECT_EQ(width(128, 64, 64, 8, 8, 2, 1), 40);
  EXPECT_EQ(width(128, 32, 64, 12, 8, 2, 17), 24);
  EXPECT_EQ(width(256, 64, 64, 12, 16, 0, 1), 32);
  EXPECT_EQ(width(256, 64, 64, 12, 16, 0, 33), 40);
  EXPECT_EQ(width(256, 64, 64, 12, 16, 0, 41), 64);
  EXPECT_EQ(width(256, 32, 64, 16, 16, 0, 9), 16);
  EXPECT_FALSE(tma_widths_well_formed(TileConfig{128, 48, 64, 8, 8, 3}));  // no list for that tile
  EXPECT_FALSE(tile_config_well_formed(TileConfig{256, 128, 64, 8, 16, 3}));  // four warpgroups: bt <= 64
  EXPECT_FALSE(tile_config_well_formed(TileConfig{256, 64, 128, 8, 16, 3}));  // four warpgroups: bk 64
}

// tma configs: an expert's token tiles cover its rows once and in order, as many tiles as the plain cut
// (the work list and the planner count ceil(n / bt)), every tile 1..bt rows, all but the last two full,
// and the widths' sum (each at least bt/4) never above the plain cut's; hand-checked cuts.
TEST(Planner, TmaTokenTilesCoverTheRowsWithNoMoreWidth) {
  for (const TileConfig& c : kGemmConfigs) {
    if (c.mma != 3) continue;
    SCOPED_TRACE(c.name());
    for (int n = 1; n <= 5 * c.bt + 3; ++n) {
      const int nt = (n + c.bt - 1) / c.bt;
      int next = 0, cost = 0, plain_cost = 0;
      for (int tt = 0; tt < nt; ++tt) {
        const TokenTile t = tma_token_tile(c, n, tt);
        ASSERT_EQ(t.first, next) << "rows " << n << " tile " << tt;
        ASSERT_GE(t.rows, 1) << "rows " << n << " tile " << tt;
        ASSERT_LE(t.rows, c.bt) << "rows " << n << " tile " << tt;
        if (tt < nt - 2) {
          EXPECT_EQ(t.rows, c.bt);
        }
        next += t.rows;
        cost += tma_tile_cost(c, t.rows);
        plain_cost += tma_tile_cost(c, std::min(c.bt, n - tt * c.bt));
      }
      ASSERT_EQ(next, n);
      EXPECT_LE(cost, plain_cost) << "rows " << n;
    }
  }
  // the launcher's table (what the kernel reads) holds the same cuts
  for (const TileConfig& c : kGemmConfigs) {
    if (c.mma != 3) continue;
    const TmaCutTable t = tma_cut_table(c);
    for (int R = c.bt + 1; R <= 2 * c.bt; ++R) {
      ASSERT_EQ(t.cut8[R - c.bt - 1] * 8, tma_last_pair_cut(c, R)) << c.name() << " rest " << R;
      ASSERT_EQ(tma_token_tile(c, R, 0).rows, tma_last_pair_cut(c, R)) << c.name() << " rest " << R;
    }
  }
  const TileConfig t256{128, 256, 64, 5, 8, 3};
  const auto cut = [](const TileConfig& c, int n, int tt) {
    const TokenTile t = tma_token_tile(c, n, tt);
    return std::pair<int, int>{t.first, t.rows};
  };
  // 534 rows: 256 + 144 + 134 (widths 256 + 144 + 144 against 256 + 256 + 64)
  EXPECT_EQ(cut(t256, 534, 0), (std::pair<int, int>{0, 256}));
  EXPECT_EQ(cut(t256, 534, 1), (std::pair<int, int>{256, 144}));
  EXPECT_EQ(cut(t256, 534, 2), (std::pair<int, int>{400, 134}));
  // 278: 144 + 134 (288 columns against 320); 300: no pair beats 256 + 64, the plain cut stays
  EXPECT_EQ(cut(t256, 278, 0), (std::pair<int, int>{0, 144}));
  EXPECT_EQ(cut(t256, 278, 1), (std::pair<int, int>{144, 134}));
  EXPECT_EQ(cut(t256, 300, 0), (std::pair<int, int>{0, 256}));
  EXPECT_EQ(cut(t256, 300, 1), (std::pair<int, int>{256, 44}));
  EXPECT_EQ(cut(t256, 200, 0), (std::pair<int, int>{0, 200}));  // one tile: nothing to cut
  // bt 128, 150 rows: 72 + 78 (72 + 80 columns against 128 + 32)
  const TileConfig t128{128, 128, 64, 10, 8, 3};
  EXPECT_EQ(cut(t128, 150, 0), (std::pair<int, int>{0, 72}));
  EXPECT_EQ(cut(t128, 150, 1), (std::pair<int, int>{72, 78}));
}

TEST(Planner, StreamConfigHandCountedAndKLimit) {
  // stream_bt8_w24_d4_c1 at GLM-5's K = 6144: rows 8 * 6144 * 2 = 98,304; partials 24 * 1 * 32 * 16 =
  // 12,288; scheduler (512 + 2 + 512 + 3) * 4 = 4,116 -> 4,224; warp state 24 * 64 = 1,536: 116,352 B.
  const TileConfig c{384, 8, 64, 4, 24, 2, 1};
  const Sm80SmemPlan p = plan_sm80_smem(c, 6144);
  EXPECT_EQ(p.sched_bytes, 4224u);
  EXPECT_EQ(p.total_bytes, 98304u + 12288u + 4224u + 1536u);
  // On sm_120 (101,376 B per block) it does not fit; the verdict names K and the largest K that does.
  const Sm80Plan on120 = plan_sm80(c, arch_from_name("sm_120"), 0, 6144);
  EXPECT_FALSE(on120.verdict.valid);
  EXPECT_NE(on120.verdict.reason.find("at K = 6144"), std::string::npos) << on120.verdict.reason;
  EXPECT_EQ(on120.max_k_that_fits, (101376 - 12288 - 4224 - 1536) / 16 / 64 * 64);
  EXPECT_TRUE(plan_sm80(c, arch_from_name("sm_90"), 0, 6144).verdict.valid);
  const ArchInfo sm120 = arch_from_name("sm_120");
  EXPECT_FALSE(check_problem_sm80(c, 4096, 6144, 256, &sm120).valid);
  EXPECT_TRUE(check_problem_sm80(c, 4096, 2048, 256, &sm120).valid);
}

TEST(Planner, HandCountedConfig) {
  // bn 128, bt 64, bk 128, 4 stages: act 64*128*2 = 16384, codes 128*128/2 = 8192, scales 128*8 = 1024:
  // 25600 is a 1024-byte multiple already.
  const Sm80SmemPlan p = plan_sm80_smem(TileConfig{128, 64, 128, 4, 8});
  EXPECT_EQ(p.stage_bytes, 25600u);
  EXPECT_EQ(p.sched_bytes, 2176u);  // (512 + 2) * 4 = 2056 -> 2176 (120 B of padding)
  EXPECT_EQ(p.total_bytes, 4u * 25600 + 2176);
  EXPECT_EQ(p.padding_bytes, 120u);
}

TEST(Planner, TmaConfigHandCounted) {
  // tma_bn128_bt256_bk64_s5: act 256*64*2 = 32768, codes 128*64/2 = 4096, scales 128*4 = 512: 37376 ->
  // 37888 per stage; scheduler (512 + 2 + 16 tile slots) * 4 = 2120 -> 2176; mbarriers 5 * 2 * 8 = 80 ->
  // 128; row scales 8 warps * 256 * 4 = 8192.
  const TileConfig c{128, 256, 64, 5, 8, 3};
  const Sm80SmemPlan p = plan_sm80_smem(c);
  EXPECT_EQ(p.stage_bytes, 37888u);
  EXPECT_EQ(p.sched_bytes, 2176u);
  EXPECT_EQ(p.barrier_bytes, 128u);
  EXPECT_EQ(p.row_scale_bytes, 8192u);
  EXPECT_EQ(p.bias_bytes, 0u);  // bt 256: the biases are prefetched into L1, not staged (tma_stages_bias)
  EXPECT_EQ(p.total_bytes, 5u * 37888 + 2176 + 128 + 8192);
  EXPECT_EQ(p.padding_bytes, 5u * 512 + 16 + 48);
  // the kernel's own layout (gemm_smem_layout) agrees, and the claimed tiles' ring (two 16-byte tile slots,
  // the first 16-byte aligned, four scale pairs and the slots' mbarriers) fits in the slots reserved after
  // the prefix, within the scheduler's 128-byte padding as before
  const GemmSmemLayout l = gemm_smem_layout(c);
  EXPECT_EQ(l.total_bytes, p.total_bytes);
  EXPECT_EQ(TmaTileRing::kOffset, 2064u);
  EXPECT_EQ(TmaTileRing::kBytes, 96u);  // 2 x 16 (tiles) + 4 x 8 (scales) + 2 x 2 x 8 (barriers)
  EXPECT_EQ(kTmaTileSlots, 26);
  EXPECT_LE(TmaTileRing::kOffset + TmaTileRing::kBytes, (kMaxExperts + 2 + kTmaTileSlots) * 4u);
  EXPECT_LE((kMaxExperts + 2 + kTmaTileSlots) * 4u, l.sched_bytes);
  EXPECT_EQ((l.sched_offset + TmaTileRing::kOffset + TmaTileRing::kFullOffset) % 8, 0u);
}

TEST(Planner, OverflowOnSm120NamesTheBytes) {
  const Sm80Plan p = plan_sm80(TileConfig{128, 64, 128, 4, 8}, arch_from_name("sm_120"));
  EXPECT_FALSE(p.verdict.valid);
  EXPECT_NE(p.verdict.reason.find("shared memory: needs 104,576 B per block, sm_120 allows 101,376 B (over by "
                                  "3,200 B)"),
            std::string::npos)
      << p.verdict.reason;
  EXPECT_EQ(p.max_stages_that_fit, 3);  // (101376 - 2176) / 25600
  // The same config fits Hopper.
  EXPECT_TRUE(plan_sm80(TileConfig{128, 64, 128, 4, 8}, arch_from_name("sm_90")).verdict.valid);
}

TEST(Planner, EveryConfigValidOnHopperAndOnlyCompiledOnesAccepted) {
  EXPECT_EQ(valid_sm80_configs(arch_from_name("sm_90")).size(), static_cast<size_t>(kNumGemmConfigs));
  const Sm80Plan p = plan_sm80(TileConfig{128, 48, 128, 3, 8}, arch_from_name("sm_90"));
  EXPECT_FALSE(p.verdict.valid);
  EXPECT_NE(p.verdict.reason.find("not in kGemmConfigs"), std::string::npos) << p.verdict.reason;
  const Sm80Plan bad = plan_sm80(TileConfig{96, 64, 128, 4, 8}, arch_from_name("sm_90"));
  EXPECT_FALSE(bad.verdict.valid);
  EXPECT_NE(bad.verdict.reason.find("malformed"), std::string::npos) << bad.verdict.reason;
}

TEST(Planner, RegisterEstimateAndOccupancy) {
  // wm = 1, bt = 16: acc 8 + B 4 + A 4 + raw 6 + 40 = 62 -> 64; __launch_bounds__(256, 2) caps at 128.
  const RegisterEstimate r = estimate_registers_sm80(TileConfig{128, 16, 128, 6, 8});
  EXPECT_EQ(r.estimate, 64);
  EXPECT_EQ(r.launch_bounds_cap, 128);
  EXPECT_EQ(r.expected, 64);
  // wm = 2, bt = 128: acc 2*16*4 = 128 + B 32 + A 4 + raw 12 + 40 = 216; min blocks 1 -> cap 255.
  const RegisterEstimate big = estimate_registers_sm80(TileConfig{256, 128, 64, 3, 8});
  EXPECT_EQ(big.min_blocks, 1);
  EXPECT_EQ(big.launch_bounds_cap, 255);
  EXPECT_EQ(big.expected, 216);
  // wm = 1, bt = 128: 64 accumulators > 48, so min blocks 1 (gemm_min_ctas_per_sm) and the cap is 255:
  // 64 + 32 + 4 + 6 + 40 = 146 -> 152 fits under it.
  const RegisterEstimate wide = estimate_registers_sm80(TileConfig{128, 128, 64, 4, 8});
  EXPECT_EQ(wide.min_blocks, 1);
  EXPECT_EQ(wide.estimate, 152);
  EXPECT_EQ(wide.expected, 152);
  // wm = 1, bt = 64: 32 accumulators, min blocks 2 -> cap 128.
  EXPECT_EQ(estimate_registers_sm80(TileConfig{128, 64, 128, 4, 8}).launch_bounds_cap, 128);
  // Occupancy on sm_90 for 256 threads, 64 regs, 82,048 B: smem 233472 / 83072 = 2; regs 65536/(8*2048) = 4.
  const Occupancy o = occupancy(arch_from_name("sm_90"), 256, 64, 82048);
  EXPECT_EQ(o.by_smem, 2);
  EXPECT_EQ(o.by_registers, 4);
  EXPECT_EQ(o.by_threads, 8);
  EXPECT_EQ(o.ctas_per_sm, 2);
  EXPECT_EQ(o.limiter, "shared memory");
}

TEST(Planner, TilesAndWavesHandExample) {
  GemmProblem p;
  p.rows = {0, 1, 17, 40};  // tiles of 16 rows: 0, 1, 2, 3
  p.n = 256;                // 2 feature tiles of 128
  p.k = 1024;
  const WorkEstimate w = work_estimate(p, 128, 16, 4, 2);
  EXPECT_EQ(w.tiles, 12);
  EXPECT_EQ(w.slots, 8);
  EXPECT_DOUBLE_EQ(w.waves, 1.5);
  EXPECT_EQ(w.full_waves, 2);
  EXPECT_DOUBLE_EQ(w.last_wave_fill, 0.5);
  // GLM-5 GEMM1 at T = 1024: 32 rows per expert, N = 4096: 256 * 2 * 32 = 16384 tiles.
  const WorkEstimate g = work_estimate(GemmProblem::uniform(256, 32, 4096, 6144), 128, 16, 132, 2);
  EXPECT_EQ(g.tiles, 16384);
  EXPECT_NEAR(g.waves, 16384.0 / 264.0, 1e-12);
}

TEST(Planner, OddKIsRejectedWithTheRule) {
  const TileConfig k128{128, 32, 128, 5, 8};
  const Verdict v = check_problem_sm80(k128, 5760, 2880, 128);  // gpt-oss: K = 2880 = 22.5 * 128
  EXPECT_FALSE(v.valid);
  EXPECT_NE(v.reason.find("K = 2880 must be a multiple of the tile's bk = 128"), std::string::npos) << v.reason;
  EXPECT_NE(v.reason.find("K % bk = 64"), std::string::npos) << v.reason;
  EXPECT_NE(v.reason.find("only the tma configs have a K tail"), std::string::npos) << v.reason;
  EXPECT_TRUE(check_problem_sm80(TileConfig{128, 32, 64, 8, 8}, 5760, 2880, 128).valid);
  // The tma configs run a partial last stage (tile_config_has_k_tail): 128-wide stages at K = 2880 and at
  // K = 64, where the only stage is partial; K must still be a multiple of 64.
  const TileConfig tma128{256, 32, 128, 8, 8, 3};
  EXPECT_TRUE(tile_config_has_k_tail(tma128));
  EXPECT_FALSE(tile_config_has_k_tail(k128));
  EXPECT_TRUE(check_problem_sm80(tma128, 5760, 2880, 128).valid) << check_problem_sm80(tma128, 5760, 2880, 128).reason;
  EXPECT_TRUE(check_problem_sm80(tma128, 2880, 64, 128).valid);
  EXPECT_FALSE(check_problem_sm80(tma128, 2880, 2880 + 32, 128).valid);
  const Verdict odd = check_problem_sm80(k128, 4096, 100, 8);
  EXPECT_FALSE(odd.valid);
  EXPECT_NE(odd.reason.find("multiple of 64"), std::string::npos) << odd.reason;
  const Verdict n = check_problem_sm80(k128, 4100, 4096, 8);
  EXPECT_NE(n.reason.find("N = 4100"), std::string::npos) << n.reason;
  EXPECT_FALSE(check_problem_sm80(k128, 4096, 4096, kMaxExperts + 1).valid);
}

// CUTLASS 4.2's sm_120 block-scaled NVFP4 grouped GEMM as TensorRT-LLM builds it. These numbers are
// proven equal to the compiled CUTLASS types by tests/cutlass/ (fp4moe_cutlass_tests); here the
// planner's verdicts, the largest count that fits and the fix are checked.
TEST(CutlassSm120, FourTiles) {
  struct Want {
    CutlassTile t;
    size_t per_stage;
    int auto_stages;
    size_t footprint;
    int max_fit;
  };
  const Want want[] = {
      {{128, 128, 128}, 8192 + 8192 + 1024 + 1024 + 16, 4, 89088, 4},
      {{128, 128, 256}, 16384 + 16384 + 2048 + 2048 + 16, 2, 89088, 2},
      {{128, 256, 128}, 8192 + 16384 + 1024 + 2048 + 16, 3, 98304, 3},
      {{256, 128, 128}, 16384 + 8192 + 2048 + 1024 + 16, 3, 98304, 3},
  };
  for (const Want& w : want) {
    const CutlassSm120Plan p = plan_cutlass_sm120(w.t);
    const std::string tile = std::to_string(w.t.m) + "x" + std::to_string(w.t.n) + "x" + std::to_string(w.t.k);
    EXPECT_EQ(p.mainloop.auto_stage_bytes, w.per_stage) << tile;
    EXPECT_EQ(p.carveout, 14336u) << tile;  // the epilogue's SharedStorage: 3 x 4 KB C/D stages + pipeline
    EXPECT_EQ(p.auto_stages, w.auto_stages) << tile;
    EXPECT_EQ(p.kernel.footprint, w.footprint) << tile;
    EXPECT_EQ(p.over_by, static_cast<int64_t>(w.footprint) - 101376) << tile;
    EXPECT_EQ(p.max_stages_that_fit, w.max_fit) << tile;
    EXPECT_TRUE(p.verdict.valid) << tile << ": " << p.verdict.reason;
    EXPECT_EQ(p.kernel.footprint % 1024, 0u) << tile;
    EXPECT_NE(p.fix.find("none needed"), std::string::npos) << tile << ": " << p.fix;
  }
}

TEST(CutlassSm120, ExplicitCountThatOverflowsNamesTheCountThatFits) {
  CutlassSm120Options o;
  o.stages = 4;
  const CutlassSm120Plan p = plan_cutlass_sm120({128, 256, 128}, o);
  EXPECT_FALSE(p.verdict.valid);
  EXPECT_EQ(p.kernel.footprint, 125952u);
  EXPECT_NE(p.verdict.reason.find("needs 125,952 B per block, the limit is 101,376 B (over by 24,576 B)"),
            std::string::npos)
      << p.verdict.reason;
  EXPECT_EQ(p.fix, "pass StageCount<3> (the largest count that fits)");
}

TEST(CutlassSm120, TooSmallCarveoutGivesTheCarveoutFix) {
  // StageCountAutoCarveout<0> (no epilogue budget): 128x128x128 gets 101,376 / 18,448 = 5 stages.
  CutlassSm120Options o;
  o.carveout = 0;
  const CutlassSm120Plan p = plan_cutlass_sm120({128, 128, 128}, o);
  EXPECT_EQ(p.auto_stages, 5);
  EXPECT_FALSE(p.verdict.valid);
  EXPECT_EQ(p.max_stages_that_fit, 4);
  // Auto picks 4 once the carveout exceeds 101,376 - 5 * 18,448 = 9,136.
  EXPECT_EQ(p.carveout_for_max_stages, 9137u);
  EXPECT_EQ(p.fix, "pass StageCount<4>, or subtract 9,137 B more: StageCountAutoCarveout<9137>");
  o.carveout = 9137;
  EXPECT_EQ(plan_cutlass_sm120({128, 128, 128}, o).auto_stages, 4);
  EXPECT_TRUE(plan_cutlass_sm120({128, 128, 128}, o).verdict.valid);
}

TEST(CutlassSm120, EpilogueVariants) {
  CutlassSm120Options o;
  o.epilogue.has_c = false;  // ElementC = void: two D stages, no reuse
  const CutlassSm120Plan p = plan_cutlass_sm120({128, 256, 128}, o);
  EXPECT_EQ(p.epilogue.stages_d, 2);
  EXPECT_EQ(p.epilogue.shared_storage, 10240u);
  EXPECT_EQ(p.kernel.footprint, 94208u);
  o.epilogue.has_c = true;
  o.epilogue.column_major = false;  // row-major D: 64-byte rows, 512-byte swizzle atom
  EXPECT_EQ(plan_cutlass_sm120({128, 128, 128}, o).epilogue.shared_storage, 13312u);
  CutlassSm120Options pp;
  pp.schedule = CutlassSchedule::kPingpong;
  EXPECT_EQ(plan_cutlass_sm120({128, 256, 128}, pp).kernel.pipelines,
            plan_cutlass_sm120({128, 256, 128}).kernel.pipelines + 32);
  EXPECT_FALSE(plan_cutlass_sm120({100, 128, 128}).verdict.valid);
  EXPECT_FALSE(plan_cutlass_sm120({128, 64, 128}).verdict.valid);
}

}  // namespace
}  // namespace fp4moe

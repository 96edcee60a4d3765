// The layer's tile-config choice is a pure function of the architecture, so the choice for a GPU that
// is not here can be checked on a CPU: on Blackwell (sm_120: RTX PRO 6000, 188 SMs, 101,376 B per
// block; sm_100: B200) it never picks a wgmma config nor exceeds the shared-memory limit, for every
// preset and token count.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fp4moe/arch.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/planner.hpp"
#include "fp4moe/tuner.hpp"

namespace fp4moe {
namespace {

void expect_layer_choice_fits(const ArchInfo& arch) {
  for (const std::string& name : preset_names()) {
    const MoeConfig& cfg = preset(name);
    const int64_t Is = cfg.intermediate * cfg.num_shared;
    for (int64_t T = 1; T <= 16384; T *= 2) {
      std::vector<TuneLookup> why;
      const MoeResolvedTileConfigs r = moe_layer_tile_configs(cfg, T, arch, &why);
      ASSERT_EQ(why.size(), cfg.num_shared > 0 ? 4u : 2u);
      struct Gemm {
        const TileConfig& c;
        int64_t n, k;
        int experts;
      } gemms[] = {{r.gemm1, cfg.gemm1_n(), cfg.gemm1_k(), cfg.num_experts},
                   {r.gemm2, cfg.gemm2_n(), cfg.gemm2_k(), cfg.num_experts},
                   {r.shared_gemm1, 2 * Is, cfg.hidden, 1},
                   {r.shared_gemm2, cfg.hidden, Is, 1}};
      for (size_t g = 0; g < why.size(); ++g) {
        const TileConfig& c = gemms[g].c;
        SCOPED_TRACE(name + " T=" + std::to_string(T) + " GEMM " + std::to_string(g) + ": " + c.name());
        // stream configs (mma 2, mma.sync) hold activation rows of the whole K: judged at this K
        const int64_t k = gemms[g].k;
        const Sm80Plan p = plan_sm80(c, arch, 0, c.mma == 2 ? k : 0);
        EXPECT_TRUE(p.verdict.valid) << p.verdict.reason;
        const size_t bytes = c.mma == 2 ? stream_smem_layout(c, k).total_bytes : gemm_smem_layout(c).total_bytes;
        EXPECT_LE(bytes, arch.smem_optin_per_block);
        EXPECT_GE(p.occ.ctas_per_sm, 1);
        if (!arch.has(kWgmma)) {
          EXPECT_NE(c.mma, 1) << "a wgmma config on " << arch.name;
        }
        EXPECT_TRUE(check_problem_sm80(c, gemms[g].n, k, gemms[g].experts, &arch).valid);
        EXPECT_EQ(why[g].source, "heuristic");  // no tuner table describes a GPU from the arch table
      }
    }
  }
}

ArchInfo rtx_pro_6000() {
  ArchInfo a = arch_from_name("sm_120");
  EXPECT_EQ(a.num_sms, 188);
  EXPECT_EQ(a.smem_optin_per_block, 101376u);
  EXPECT_FALSE(a.from_device);
  return a;
}

TEST(ArchChoice, Sm120RtxPro6000NeverExceedsItsLimit) { expect_layer_choice_fits(rtx_pro_6000()); }

TEST(ArchChoice, OtherArchitecturesToo) {
  for (const char* a : {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_103", "sm_121"}) {
    SCOPED_TRACE(a);
    expect_layer_choice_fits(arch_from_name(a));
  }
}

TEST(ArchChoice, HopperPicksWgmmaForPrefillBlackwellDoesNot) {
  const ArchInfo h = arch_from_name("sm_90"), b = rtx_pro_6000();
  // GLM-5 GEMM1 at T = 4096: 128 rows per expert (the TMA-fed wgmma kernel); T = 512: 16 rows.
  EXPECT_EQ(heuristic_tile_config(4096, 6144, 128.0, h).mma, 3);
  EXPECT_EQ(heuristic_tile_config(4096, 6144, 16.0, h).mma, 3);
  EXPECT_EQ(heuristic_tile_config(4096, 6144, 16.0, b).mma, 0);
  EXPECT_EQ(heuristic_tile_config(4096, 6144, 128.0, b).mma, 0);
  EXPECT_EQ(heuristic_tile_config(4096, 6144, 128.0, arch_from_name("sm_100")).mma, 0);
}

TEST(ArchChoice, HopperPickThatDoesNotFitSm120IsReplacedByTheNearestValidOne) {
  // ~40 rows per expert: Hopper's pick is the tma config bn256_bt64_bk64_s12_w8_tma: wgmma, TMA and
  // setmaxnreg (sm_90a only), 12 stages of 17,408 B, more than sm_120's 101,376 B too.
  const TileConfig hopper = heuristic_tile_config(4096, 6144, 40.0, arch_from_name("sm_90"));
  EXPECT_EQ(hopper, (TileConfig{256, 64, 64, 12, 8, 3}));
  EXPECT_FALSE(plan_sm80(hopper, rtx_pro_6000()).verdict.valid);
  const TileConfig b = heuristic_tile_config(4096, 6144, 40.0, rtx_pro_6000());
  EXPECT_TRUE(plan_sm80(b, rtx_pro_6000()).verdict.valid) << b.name();
  EXPECT_EQ(b.bt, 64) << b.name();  // the same token tile, so weights are re-read as often
}

TEST(ArchChoice, LauncherAndPlannerRefuseWgmmaOffHopper) {
  for (const TileConfig& c : kGemmConfigs) {
    if (c.mma != 1 && c.mma != 3) continue;
    for (const char* a : {"sm_100", "sm_120"}) {
      const Sm80Plan p = plan_sm80(c, arch_from_name(a));
      EXPECT_FALSE(p.verdict.valid) << c.name() << " on " << a;
      EXPECT_NE(p.verdict.reason.find("wgmma"), std::string::npos) << p.verdict.reason;
    }
  }
  const std::vector<TileConfig> v = valid_sm80_configs(arch_from_name("sm_120"));
  EXPECT_FALSE(v.empty());
  for (const TileConfig& c : v) {  // mma.sync configs (pipeline and stream) only
    EXPECT_NE(c.mma, 1) << c.name();
    EXPECT_NE(c.mma, 3) << c.name();
  }
}

TEST(ArchChoice, ChooseConfigForATableArchNeedsNoGpuAndSaysWhy) {
  const TuneProblem p{256, 8, 4096, 6144, GemmEpilogue::kSwiGLU};
  const TuneLookup l = choose_config(p, 32, rtx_pro_6000());
  ASSERT_TRUE(l.config.has_value());
  EXPECT_EQ(l.source, "heuristic");
  EXPECT_NE(l.reason.find("architecture table"), std::string::npos) << l.reason;
  EXPECT_NE(l.reason.find("sm_120"), std::string::npos) << l.reason;
}

}  // namespace
}  // namespace fp4moe

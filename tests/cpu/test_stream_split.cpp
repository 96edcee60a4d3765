// The stream kernel's split of the work units over its CTAs (stream_split, tile_config.hpp): the same
// constexpr function runs in the kernel, so these properties hold for what the GPU does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <vector>

#include "fp4moe/tile_config.hpp"

namespace fp4moe {
namespace {

struct SplitCase {
  int segs, mt, kc, warps, grid;
};

// Decode shapes of the presets (segments = active experts at bt 8, the fused shared expert included where
// the layer has one), GEMM1 and GEMM2, with the grids their stream configs launch on 132 SMs.
std::vector<SplitCase> cases() {
  return {
      {58, 256, 96, 20, 132},  {58, 384, 32, 20, 132},  // GLM-5 T = 8
      {53, 96, 32, 12, 264},   {53, 128, 12, 12, 264},  // qwen3-30b T = 8, two CTAs per SM
      {30, 360, 45, 20, 132},  {30, 180, 45, 20, 132},  // gpt-oss-120b T = 8
      {9, 256, 96, 12, 264},   {9, 384, 32, 12, 264},   // GLM-5 T = 1 with the shared expert
      {4, 360, 45, 24, 132},   {8, 96, 32, 12, 264},    // gpt-oss-120b, qwen3-30b T = 1
      {163, 384, 32, 20, 132}, {508, 384, 32, 20, 132}, // GLM-5 GEMM2 T = 32, 128
      {1, 16, 1, 20, 132},     {3, 5, 7, 12, 264},      // fewer units than CTAs
  };
}

std::vector<int> cuts(const SplitCase& c, int round_cost) {
  std::vector<int> u;
  for (int i = 0; i <= c.grid; ++i) u.push_back(stream_split(c.segs, c.mt, c.kc, round_cost, i, c.grid));
  return u;
}

// A CTA's time in per-warp chunk-times: its chunks over its warps, plus `rc` for each round it runs.
double cta_cost(const SplitCase& c, int a, int b, int rc) {
  if (b <= a) return 0;
  const int rounds = (b - 1) / c.mt - a / c.mt + 1;
  return static_cast<double>(b - a) * c.kc / c.warps + static_cast<double>(rc) * rounds;
}

TEST(StreamSplit, CoversEveryUnitOnceInOrder) {
  for (const SplitCase& c : cases())
    for (int rc : {0, kStreamRoundCostChunks * c.warps, 1000000}) {
      const std::vector<int> u = cuts(c, rc);
      EXPECT_EQ(u.front(), 0);
      EXPECT_EQ(u.back(), c.segs * c.mt) << "segs " << c.segs << " rc " << rc;
      EXPECT_TRUE(std::is_sorted(u.begin(), u.end())) << "segs " << c.segs << " rc " << rc;
    }
}

TEST(StreamSplit, WithoutRoundCostItIsTheEvenSplit) {
  for (const SplitCase& c : cases()) {
    const std::vector<int> u = cuts(c, 0);
    const int64_t units = int64_t{c.segs} * c.mt;
    for (int i = 0; i <= c.grid; ++i) EXPECT_EQ(u[i], static_cast<int>(units * i / c.grid)) << "cut " << i;
  }
}

TEST(StreamSplit, CutsOnSegmentStartsStayThere) {
  // 8 segments on 264 CTAs: 33 CTAs per segment, so the even split already starts a CTA at every segment
  // and no CTA crosses one. The round cost must not move those cuts (no CTA pays for a round it skips).
  const SplitCase c{8, 96, 32, 12, 264};
  const std::vector<int> u = cuts(c, kStreamRoundCostChunks * c.warps);
  const std::set<int> at(u.begin(), u.end());
  for (int s = 0; s <= c.segs; ++s) EXPECT_TRUE(at.count(s * c.mt)) << "segment " << s;
}

TEST(StreamSplit, EveryCtaKeepsWorkAndTheSlowestGetsFaster) {
  for (const SplitCase& c : cases()) {
    if (int64_t{c.segs} * c.mt < 4 * int64_t{c.grid}) continue;  // fewer than 4 units per CTA: not the point
    const int rc = kStreamRoundCostChunks * c.warps;
    const std::vector<int> even = cuts(c, 0), split = cuts(c, rc);
    double max_even = 0, max_split = 0;
    for (int i = 0; i < c.grid; ++i) {
      EXPECT_GT(split[i + 1], split[i]) << "CTA " << i << " of " << c.grid << " got no units (segs " << c.segs << ")";
      max_even = std::max(max_even, cta_cost(c, even[i], even[i + 1], kStreamRoundCostChunks));
      max_split = std::max(max_split, cta_cost(c, split[i], split[i + 1], kStreamRoundCostChunks));
    }
    EXPECT_LE(max_split, max_even) << "segs " << c.segs << " mt " << c.mt << " kc " << c.kc;
  }
}

}  // namespace
}  // namespace fp4moe

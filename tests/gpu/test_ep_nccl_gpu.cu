// The expert-parallel layer across TWO GPUs over NCCL (one process, one thread per GPU, communicators
// from ncclCommInitAll): bit-identical to the single-GPU MoeLayer over both ranks' tokens for every
// router kind, including a rank with no tokens and all tokens routed to one rank's experts; CUDA-graph
// replay; an overflow reported on both ranks. Skipped, visibly, without two GPUs or without NCCL.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ep_test_util.hpp"
#include "fp4moe/ep_moe_layer.hpp"
#include "fp4moe/ep_nccl.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe {
namespace {

using test::EpCase;
using test::EpInputs;
using test::MakeEpLayer;
using test::RankResult;
using test::ReferenceRun;
using test::Stream;

class EpNcclTwoGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (!gpu_available() || cudaGetDeviceCount(&n) != cudaSuccess || n < 2)
      GTEST_SKIP() << "needs 2 GPUs (found " << n << ")";
    std::string why;
    if (!nccl_available(&why)) GTEST_SKIP() << "NCCL unavailable: " << why;
    nccl_default_environment();  // NVLink SHARP (multicast) stays off
    comms_ = nccl_comm_init_all({0, 1});
  }
  void TearDown() override {
    for (ncclComm_t c : comms_) nccl_comm_destroy(c);
  }

  std::vector<RankResult> run(const EpCase& c, const EpInputs& in, const MoeTileConfigs* tiles,
                              const test::RankRunOptions& ro = {}) {
    const MoeConfig cfg = c.cfg;
    return test::run_ep_ranks(
        c, in, {0, 1}, tiles,
        [&](int r) -> MakeEpLayer {
          return [this, r, cfg](const MoeLayerWeights& w, int begin, int count, const EpCapacity& cap, cudaStream_t s) {
            return EpMoeLayer(comms_[r], r, 2, cfg, w, begin, count, cap, s);
          };
        },
        ro);
  }

  static ReferenceRun reference(const EpCase& c, const EpInputs& in) {
    FP4MOE_CUDA_CHECK(cudaSetDevice(0));
    Stream st;
    SyntheticDeviceLayer L = make_synthetic_layer_device(c.cfg, c.seed, st.s);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
    return test::run_single_gpu_reference(c, in, L.weights, st.s);
  }

  std::vector<ncclComm_t> comms_;
};

TEST_F(EpNcclTwoGpu, EqualsSingleGpuLayerEveryRouterKind) {
  for (const MoeConfig& cfg : test::ep_router_configs())
    for (const std::vector<int64_t>& tokens : {std::vector<int64_t>{37, 5}, {0, 23}, {1, 1}, {300, 129}}) {
      EpCase c;
      c.cfg = cfg;
      c.seed = 500 + tokens[0] + tokens[1];
      c.tokens = tokens;
      const EpInputs in = test::make_ep_inputs(c);
      const ReferenceRun ref = reference(c, in);
      const std::vector<RankResult> res = run(c, in, &ref.tiles, {2, false});
      test::expect_bit_identical(c, ref, res,
                                 cfg.name + " tokens " + std::to_string(tokens[0]) + " " + std::to_string(tokens[1]));
      EXPECT_EQ(res[0].rows_received + res[1].rows_received, c.total() * cfg.top_k) << cfg.name;
    }
}

TEST_F(EpNcclTwoGpu, AllTokensOnOneRanksExperts) {
  for (const MoeConfig& cfg : test::ep_router_configs())
    for (int target : {0, 1}) {
      EpCase c;
      c.cfg = cfg;
      c.seed = 600 + target;
      c.tokens = {40, 24};
      c.skew_to_rank = target;
      const EpInputs in = test::make_ep_inputs(c);
      const ReferenceRun ref = reference(c, in);
      const std::vector<RankResult> res = run(c, in, &ref.tiles);
      const std::string what = cfg.name + " skewed to rank " + std::to_string(target);
      test::expect_bit_identical(c, ref, res, what);
      for (int r = 0; r < 2; ++r)
        EXPECT_EQ(res[r].rows_received, r == target ? c.total() * cfg.top_k : 0) << what << ": rank " << r;
    }
}

TEST_F(EpNcclTwoGpu, GraphReplayIsBitIdentical) {
  for (const MoeConfig& cfg : {preset("tiny"), test::ep_grouped_wide_shared_config()}) {
    EpCase c;
    c.cfg = cfg;
    c.seed = 700;
    c.tokens = {50, 0};
    c.max_tokens = 64;
    c.step_tokens = {56, 56};
    const EpInputs in = test::make_ep_inputs(c);
    const ReferenceRun ref = reference(c, in);
    const std::vector<RankResult> res = run(c, in, &ref.tiles, {1, true});
    for (int r = 0; r < 2; ++r) EXPECT_EQ(res[r].out, res[r].eager_out) << cfg.name << ": rank " << r;
    test::expect_bit_identical(c, ref, res, cfg.name + " graph replay");
  }
}

TEST_F(EpNcclTwoGpu, OverflowIsReportedOnBothRanks) {
  EpCase c;
  c.cfg = test::ep_softmax_config();  // E = 16, k = 4, 8 experts per rank
  c.seed = 800;
  c.tokens = {30, 20};
  c.skew_to_rank = 1;
  c.capacity_factor = 0.5;  // rank 1's messages hold ceil(0.5 * 30 * 4 * 8 / 16) = 30 rows
  const EpInputs in = test::make_ep_inputs(c);
  const std::vector<RankResult> res = run(c, in, nullptr);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(res[r].error.empty()) << "rank " << r << ": " << res[r].error;
    EXPECT_TRUE(res[r].guard_intact) << "rank " << r;
    EXPECT_EQ(res[r].status.code, static_cast<int32_t>(EpStatusCode::kCapacityOverflow)) << "rank " << r;
    EXPECT_EQ(res[r].status.src, 0) << "rank " << r;
    EXPECT_EQ(res[r].status.dst, 1) << "rank " << r;
    EXPECT_EQ(res[r].status.rows, 120) << "rank " << r;
    EXPECT_EQ(res[r].status.capacity, 30) << "rank " << r;
  }
  EXPECT_EQ(res[1].rows_received, 30 + 30);  // each sender cut at 30 rows (rank 1's own 80 too)
}

}  // namespace
}  // namespace fp4moe

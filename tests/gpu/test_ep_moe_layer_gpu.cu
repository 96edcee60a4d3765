// The expert-parallel layer (ep_moe_layer.hpp) on ONE GPU:
//   - world size 1 (no communication): equal to MoeLayer bit for bit, with its own automatic tile
//     configs too (they are chosen as MoeLayer chooses them for world_size * T tokens), eager and in a
//     CUDA graph, with a one-rank NCCL communicator when NCCL is present;
//   - 2..4 ranks as threads on the one GPU through an in-process transport (ep_test_util.hpp): the whole
//     multi-rank dataflow (messages, capacity, replies, combine) against the single-GPU layer over all
//     ranks' tokens, bit for bit, for every router kind, ranks with no tokens, uneven slices, all tokens
//     on one rank's experts, the chunked permutations, overflow and step-size mismatch reports.
// The NCCL transport across two GPUs: test_ep_nccl_gpu.cu.
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
using test::LoopbackHub;
using test::LoopbackTransport;
using test::MakeEpLayer;
using test::RankResult;
using test::ReferenceRun;
using test::Stream;

// Builds the full synthetic layer once for the single-GPU reference.
ReferenceRun reference(const EpCase& c, const EpInputs& in) {
  Stream st;
  SyntheticDeviceLayer L = make_synthetic_layer_device(c.cfg, c.seed, st.s);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  return test::run_single_gpu_reference(c, in, L.weights, st.s);
}

MakeEpLayer world_one_layer(const MoeConfig& cfg) {
  return [cfg](const MoeLayerWeights& w, int begin, int count, const EpCapacity& cap, cudaStream_t s) {
    return EpMoeLayer(nullptr, 0, 1, cfg, w, begin, count, cap, s);
  };
}

std::vector<RankResult> run_loopback(const EpCase& c, const EpInputs& in, const MoeTileConfigs* tiles,
                                     LoopbackHub* hub_out = nullptr, const test::RankRunOptions& ro = {}) {
  LoopbackHub local(c.world());
  LoopbackHub& hub = hub_out != nullptr ? *hub_out : local;
  int dev = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&dev));
  const MoeConfig cfg = c.cfg;
  return test::run_ep_ranks(
      c, in, std::vector<int>(c.world(), dev), tiles,
      [&](int r) -> MakeEpLayer {
        return [&, r, cfg](const MoeLayerWeights& w, int begin, int count, const EpCapacity& cap, cudaStream_t s) {
          return EpMoeLayer(std::make_shared<LoopbackTransport>(hub, r), cfg, w, begin, count, cap, s);
        };
      },
      ro);
}

// ---- world size 1 ----

TEST(EpMoeLayerGpu, WorldOneEqualsMoeLayerEveryRouterKind) {
  FP4MOE_SKIP_WITHOUT_GPU();
  for (const MoeConfig& cfg : test::ep_router_configs())
    for (int64_t T : {1, 37, 300}) {
      EpCase c;
      c.cfg = cfg;
      c.seed = 11 + T;
      c.tokens = {T};
      const EpInputs in = test::make_ep_inputs(c);
      const ReferenceRun ref = reference(c, in);
      const std::string what = cfg.name + " T=" + std::to_string(T);
      // The automatic configs: the same choice as MoeLayer's for T tokens.
      auto auto_tiles = test::run_ep_rank(c, in, 0, nullptr, world_one_layer(cfg));
      test::expect_bit_identical(c, ref, {auto_tiles}, what + " (automatic tiles)");
      auto forced = test::run_ep_rank(c, in, 0, &ref.tiles, world_one_layer(cfg), {2, false});
      test::expect_bit_identical(c, ref, {forced}, what + " (the reference's tiles, second forward)");
    }
}

TEST(EpMoeLayerGpu, WorldOneGraphReplayIsBitIdentical) {
  FP4MOE_SKIP_WITHOUT_GPU();
  for (const MoeConfig& cfg : {preset("tiny"), test::ep_gptoss_config()}) {
    EpCase c;
    c.cfg = cfg;
    c.seed = 5;
    c.tokens = {70};
    c.max_tokens = 128;
    c.step_tokens = {96};  // a step bound between T and max_tokens
    const EpInputs in = test::make_ep_inputs(c);
    const ReferenceRun ref = reference(c, in);
    const RankResult r = test::run_ep_rank(c, in, 0, &ref.tiles, world_one_layer(cfg), {1, true});
    EXPECT_EQ(r.out, r.eager_out) << cfg.name << ": graph replay != eager";
    test::expect_bit_identical(c, ref, {r}, cfg.name + " graph replay");
  }
}

TEST(EpMoeLayerGpu, WorldOneWithAOneRankNcclCommunicator) {
  FP4MOE_SKIP_WITHOUT_GPU();
  std::string why;
  if (!nccl_available(&why)) GTEST_SKIP() << "NCCL unavailable: " << why;
  nccl_default_environment();
  int dev = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&dev));
  const std::vector<ncclComm_t> comms = nccl_comm_init_all({dev});
  EpCase c;
  c.cfg = preset("tiny");
  c.seed = 21;
  c.tokens = {45};
  const EpInputs in = test::make_ep_inputs(c);
  const ReferenceRun ref = reference(c, in);
  const MoeConfig cfg = c.cfg;
  const RankResult r = test::run_ep_rank(
      c, in, 0, nullptr, [&](const MoeLayerWeights& w, int begin, int count, const EpCapacity& cap, cudaStream_t s) {
        return EpMoeLayer(comms[0], 0, 1, cfg, w, begin, count, cap, s);
      });
  test::expect_bit_identical(c, ref, {r}, "one-rank NCCL communicator");
  for (ncclComm_t comm : comms) nccl_comm_destroy(comm);
}

TEST(EpMoeLayerGpu, WorldOneZeroTokensAndArgumentChecks) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const MoeConfig& cfg = preset("tiny");
  Stream st;
  SyntheticDeviceLayer L = make_synthetic_layer_device(cfg, 3, st.s);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  EpCapacity cap;
  cap.max_tokens = 16;
  EpMoeLayer layer(nullptr, 0, 1, cfg, L.weights, 0, cfg.num_experts, cap, st.s);
  DeviceBuffer<uint8_t> ws(layer.workspace_bytes()), buf(64 * cfg.hidden * 2), lg(64 * cfg.num_experts * 4);
  // No tokens: nothing to route, the output is not touched, no error.
  EXPECT_NO_THROW(layer.forward(st.s, nullptr, 0, nullptr, nullptr, ws.get(), ws.bytes()));
  EXPECT_NO_THROW(layer.check(st.s));
  auto err = [&](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  const float* logits = lg.as<float>();
  EpForwardOptions step8;
  step8.step_tokens = 8;
  EXPECT_NE(err([&] { layer.forward(st.s, buf.get(), 9, logits, buf.get(), ws.get(), ws.bytes(), step8); })
                .find("tokens = 9 must be in [0, step_tokens = 8]"),
            std::string::npos);
  EpForwardOptions step99;
  step99.step_tokens = 99;
  EXPECT_NE(err([&] { layer.forward(st.s, buf.get(), 4, logits, buf.get(), ws.get(), ws.bytes(), step99); })
                .find("step_tokens = 99 must be in [1, max_tokens = 16]"),
            std::string::npos);
  EXPECT_NE(err([&] { layer.forward(st.s, buf.get(), 17, logits, buf.get(), ws.get(), ws.bytes()); }).find("tokens = 17"),
            std::string::npos);
  EXPECT_NE(err([&] { layer.forward(st.s, buf.get(), 4, nullptr, buf.get(), ws.get(), ws.bytes()); })
                .find("router_logits"),
            std::string::npos);
  EXPECT_NE(err([&] { layer.forward(st.s, buf.get(), 4, logits, buf.get(), ws.get(), ws.bytes() - 1); })
                .find("workspace_size"),
            std::string::npos);
  EXPECT_NE(err([&] { layer.forward(st.s, buf.get() + 2, 4, logits, buf.get(), ws.get(), ws.bytes()); })
                .find("16-byte aligned"),
            std::string::npos);
  // Construction: the slice must cover all experts at world size 1; a router weight is refused; a
  // null communicator needs world size 1.
  EXPECT_NE(err([&] { EpMoeLayer(nullptr, 0, 1, cfg, ep_slice_weights(cfg, L.weights, 0, 4), 0, 4, cap, st.s); })
                .find("they must cover all E = 8"),
            std::string::npos);
  EXPECT_NE(err([&] { EpMoeLayer(nullptr, 1, 2, cfg, L.weights, 0, cfg.num_experts, cap, st.s); })
                .find("comm is null"),
            std::string::npos);
  MoeLayerWeights with_router = L.weights;
  with_router.router_weight = L.weights.w13_codes;
  EXPECT_NE(err([&] { EpMoeLayer(nullptr, 0, 1, cfg, with_router, 0, cfg.num_experts, cap, st.s); })
                .find("router_weight must be null"),
            std::string::npos);
}

TEST(EpMoeLayerGpu, WorldOneOverflowIsReportedAndNothingIsWrittenOutOfBounds) {
  FP4MOE_SKIP_WITHOUT_GPU();
  EpCase c;
  c.cfg = preset("tiny");  // E = 8, k = 2: T tokens give 2T rows, the cut at 0.25 keeps ceil(0.5 T)
  c.seed = 9;
  c.tokens = {40};
  c.capacity_factor = 0.25;
  const EpInputs in = test::make_ep_inputs(c);
  const RankResult r = test::run_ep_rank(c, in, 0, nullptr, world_one_layer(c.cfg));
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_TRUE(r.guard_intact);
  EXPECT_EQ(r.status.code, static_cast<int32_t>(EpStatusCode::kCapacityOverflow));
  EXPECT_EQ(r.status.src, 0);
  EXPECT_EQ(r.status.dst, 0);
  EXPECT_EQ(r.status.rows, 80);
  EXPECT_EQ(r.status.capacity, 20);
  EXPECT_EQ(r.rows_received, 20);  // exactly the capacity was computed
  const std::string msg = ep_status_message(r.status, c.capacity_factor);
  EXPECT_NE(msg.find("rank 0 routed 80 (token, slot) rows to rank 0, whose messages hold 20 rows"), std::string::npos)
      << msg;
  // The output stays finite: dropped slots contribute the zero row.
  for (uint16_t v : r.out) ASSERT_NE(v & 0x7f80, 0x7f80) << "non-finite output";
  // check() waits for the stream and throws; so does every later forward().
  Stream st;
  SyntheticDeviceLayer L = make_synthetic_layer_device(c.cfg, c.seed, st.s);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  EpCapacity cap;
  cap.max_tokens = 40;
  cap.capacity_factor = 0.25;
  EpMoeLayer layer(nullptr, 0, 1, c.cfg, L.weights, 0, c.cfg.num_experts, cap, st.s);
  const int64_t T = 40, H = c.cfg.hidden;
  DeviceBuffer<uint8_t> ws(layer.workspace_bytes()), dh = test::upload(in.hidden), dl = test::upload(in.logits),
      out(T * H * 2);
  layer.forward(st.s, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes());
  std::string e1, e2;
  try {
    layer.check(st.s);
  } catch (const Error& e) {
    e1 = e.what();
  }
  try {
    layer.forward(st.s, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes());
  } catch (const Error& e) {
    e2 = e.what();
  }
  EXPECT_NE(e1.find("whose messages hold 20 rows"), std::string::npos) << e1;
  EXPECT_NE(e2.find("whose messages hold 20 rows"), std::string::npos) << e2;
}

// ---- several ranks on one GPU ----

TEST(EpMoeLayerGpu, LoopbackRanksEqualMoeLayerEveryRouterKind) {
  FP4MOE_SKIP_WITHOUT_GPU();
  struct Shape {
    std::vector<int64_t> tokens;
    std::vector<int> counts;  // empty: even
  };
  for (const MoeConfig& cfg : test::ep_router_configs()) {
    const int E = cfg.num_experts;
    const std::vector<Shape> shapes = {
        {{5, 3}, {}},
        {{37, 0}, {}},                   // a rank with no tokens
        {{0, 0, 19}, {}},                // two of three idle
        {{1, 1, 1, 1}, {}},              // decode-sized, four ranks
        {{64, 17, 33}, {E / 2 - 1, 2, E - E / 2 - 1}},  // uneven slices
        {{200, 150}, {1, E - 1}},        // one rank holds a single expert
    };
    for (const Shape& sh : shapes) {
      EpCase c;
      c.cfg = cfg;
      c.seed = 100 + sh.tokens.size() * 7 + sh.tokens[0];
      c.tokens = sh.tokens;
      c.expert_counts = sh.counts;
      const EpInputs in = test::make_ep_inputs(c);
      const ReferenceRun ref = reference(c, in);
      const std::vector<RankResult> res = run_loopback(c, in, &ref.tiles);
      std::string what = cfg.name + " tokens";
      for (int64_t t : sh.tokens) {  // (two appends: GCC 12 warns falsely on " " + std::string, -Wrestrict)
        what += ' ';
        what += std::to_string(t);
      }
      test::expect_bit_identical(c, ref, res, what);
      // The device's dispatch plan equals the host reference (ep_dispatch_plan).
      const EpPartition part = c.partition();
      for (int r = 0; r < c.world(); ++r) {
        if (!res[r].error.empty()) continue;
        const EpStepLayout step = ep_step_layout(cfg, part, r, c.capacity_tokens(), c.capacity_factor);
        const EpDispatchPlan plan = ep_dispatch_plan(cfg, part, step, res[r].topk_ids);
        EXPECT_EQ(res[r].pos_of, plan.pos_of) << what << ": rank " << r << " pos_of";
      }
      // Every routed row was computed exactly once, somewhere.
      int64_t rows = 0;
      for (const RankResult& r : res) rows += r.rows_received;
      EXPECT_EQ(rows, c.total() * cfg.top_k) << what;
    }
  }
}

TEST(EpMoeLayerGpu, LoopbackAllTokensOnOneRanksExperts) {
  FP4MOE_SKIP_WITHOUT_GPU();
  for (const MoeConfig& cfg : test::ep_router_configs())
    for (int world : {2, 3}) {
      EpCase c;
      c.cfg = cfg;
      c.seed = 300 + world;
      c.tokens = world == 2 ? std::vector<int64_t>{23, 40} : std::vector<int64_t>{12, 0, 30};
      c.skew_to_rank = world - 1;
      const EpInputs in = test::make_ep_inputs(c);
      const ReferenceRun ref = reference(c, in);
      const std::vector<RankResult> res = run_loopback(c, in, &ref.tiles);
      const std::string what = cfg.name + " skewed to rank " + std::to_string(world - 1);
      test::expect_bit_identical(c, ref, res, what);
      for (int r = 0; r < world; ++r)
        EXPECT_EQ(res[r].rows_received, r == world - 1 ? c.total() * cfg.top_k : 0) << what << ": rank " << r;
    }
}

TEST(EpMoeLayerGpu, LoopbackChunkedPermutationsAndRepeatedForwards) {
  FP4MOE_SKIP_WITHOUT_GPU();
  // T * k > 4096 on a sender and received rows > 4096: the multi-kernel permutation on both sides.
  EpCase c;
  c.cfg = test::ep_softmax_config();
  c.seed = 77;
  c.tokens = {1100, 700};
  const EpInputs in = test::make_ep_inputs(c);
  const ReferenceRun ref = reference(c, in);
  const std::vector<RankResult> res = run_loopback(c, in, &ref.tiles, nullptr, {3, false});
  test::expect_bit_identical(c, ref, res, "chunked permutations, third forward");
}

TEST(EpMoeLayerGpu, LoopbackOverflowIsReportedOnEveryRank) {
  FP4MOE_SKIP_WITHOUT_GPU();
  EpCase c;
  c.cfg = test::ep_softmax_config();  // E = 16, k = 4; two ranks of 8 experts
  c.seed = 41;
  c.tokens = {30, 10, 20};
  c.expert_counts = {6, 5, 5};
  c.skew_to_rank = 0;
  c.capacity_factor = 0.5;  // rank 0 receives 4 rows per token, the cut keeps ceil(0.5 * 30 * 4 * 6 / 16) = 23
  const EpInputs in = test::make_ep_inputs(c);
  const std::vector<RankResult> res = run_loopback(c, in, nullptr);
  for (int r = 0; r < c.world(); ++r) {
    ASSERT_TRUE(res[r].error.empty()) << "rank " << r << ": " << res[r].error;
    EXPECT_TRUE(res[r].guard_intact) << "rank " << r;
    // Every rank hears of the first overflow of the lowest rank that had one, in the same forward.
    EXPECT_EQ(res[r].status.code, static_cast<int32_t>(EpStatusCode::kCapacityOverflow)) << "rank " << r;
    EXPECT_EQ(res[r].status.reporter, r);
    EXPECT_EQ(res[r].status.src, 0) << "rank " << r;
    EXPECT_EQ(res[r].status.dst, 0) << "rank " << r;
    EXPECT_EQ(res[r].status.rows, 30 * 4) << "rank " << r;
    EXPECT_EQ(res[r].status.capacity, 23) << "rank " << r;
    for (uint16_t v : res[r].out) ASSERT_NE(v & 0x7f80, 0x7f80) << "rank " << r << ": non-finite output";
  }
  EXPECT_EQ(res[0].rows_received, 3 * 23);  // three senders, each cut at 23 rows
}

TEST(EpMoeLayerGpu, LoopbackStepMismatchIsReportedNotWritten) {
  FP4MOE_SKIP_WITHOUT_GPU();
  // Ranks disagreeing on step_tokens send messages of different sizes. NCCL would hang or misread;
  // the in-process transport copies the shorter length, and the layer's header check must report it
  // without writing anything out of bounds.
  EpCase c;
  c.cfg = preset("tiny");
  c.seed = 8;
  c.tokens = {2, 3};
  c.max_tokens = 16;
  c.step_tokens = {4, 8};
  const EpInputs in = test::make_ep_inputs(c);
  LoopbackHub hub(2);
  const std::vector<RankResult> res = run_loopback(c, in, nullptr, &hub);
  EXPECT_GT(hub.size_mismatches(), 0);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(res[r].error.empty()) << "rank " << r << ": " << res[r].error;
    EXPECT_TRUE(res[r].guard_intact) << "rank " << r;
    EXPECT_EQ(res[r].status.code, static_cast<int32_t>(EpStatusCode::kStepMismatch)) << "rank " << r;
    EXPECT_EQ(res[r].status.src, 1 - r) << "rank " << r;
    const std::string msg = ep_status_message(res[r].status, 0.0);
    EXPECT_NE(msg.find("every rank must pass the same EpForwardOptions::step_tokens"), std::string::npos) << msg;
  }
}

TEST(EpMoeLayerGpu, LoopbackHandshakeRefusesMismatchedLayers) {
  FP4MOE_SKIP_WITHOUT_GPU();
  // Rank 1 is built with another max_tokens: both constructors throw, naming the field.
  const MoeConfig& cfg = preset("tiny");
  LoopbackHub hub(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      try {
        Stream st;
        SyntheticDeviceLayer L = make_synthetic_layer_device(cfg, 1, st.s);
        FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
        EpCapacity cap;
        cap.max_tokens = r == 0 ? 8 : 9;
        EpMoeLayer layer(std::make_shared<LoopbackTransport>(hub, r), cfg, ep_slice_weights(cfg, L.weights, 4 * r, 4),
                         4 * r, 4, cap, st.s);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : th) t.join();
  EXPECT_NE(errors[0].find("max_tokens = 8 on rank 0 but 9 on rank 1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("max_tokens = 9 on rank 1 but 8 on rank 0"), std::string::npos) << errors[1];
}

}  // namespace
}  // namespace fp4moe

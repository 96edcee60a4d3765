// Expert parallelism's host arithmetic (ep_plan.hpp): partitions, message sizes and their agreement
// between senders and receivers, workspace layout, the dispatch plan, and a CPU simulation of the
// whole multi-rank dataflow (messages, replies, combine) against the single-GPU combine, bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fp4moe/ep_nccl.hpp"
#include "fp4moe/ep_plan.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format_math.hpp"

namespace fp4moe {
namespace {

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

MoeConfig cfg_of(int E, int k, int64_t H = 128, int64_t I = 64, int shared = 0) {
  MoeConfig c;
  c.name = "ep-test";
  c.hidden = H;
  c.intermediate = I;
  c.num_experts = E;
  c.top_k = k;
  c.num_shared = shared;
  c.router = RouterKind::kSoftmaxTopK;
  return c;
}

// Random top-k ids: k distinct experts per token, seeded.
std::vector<int32_t> random_ids(int64_t T, int E, int k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids;
  std::vector<int32_t> all(E);
  for (int e = 0; e < E; ++e) all[e] = e;
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + k);
  }
  return ids;
}

TEST(EpPlan, EvenAndExplicitPartitions) {
  const EpPartition p = ep_even_partition(256, 8);
  ASSERT_EQ(p.world(), 8);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(p.begin(r), 32 * r);
    EXPECT_EQ(p.count(r), 32);
  }
  const EpPartition q = ep_even_partition(10, 3);
  EXPECT_EQ(q.expert_begin, (std::vector<int>{0, 4, 7, 10}));
  for (int e = 0; e < 10; ++e) EXPECT_EQ(q.owner(e), e < 4 ? 0 : e < 7 ? 1 : 2) << e;
  const EpPartition u = ep_partition_from_counts(12, {1, 9, 2});
  EXPECT_EQ(u.expert_begin, (std::vector<int>{0, 1, 10, 12}));
  EXPECT_EQ(u.owner(0), 0);
  EXPECT_EQ(u.owner(1), 1);
  EXPECT_EQ(u.owner(9), 1);
  EXPECT_EQ(u.owner(10), 2);
  EXPECT_EQ(ep_even_partition(7, 1).count(0), 7);
}

TEST(EpPlan, PartitionErrorsNameTheNumbers) {
  EXPECT_NE(error_of([] { ep_even_partition(4, 8); }).find("E = 4 experts cannot be split over 8 ranks"), std::string::npos);
  EXPECT_NE(error_of([] { ep_even_partition(256, 0); }).find("world size = 0 must be in [1, 64]"), std::string::npos);
  EXPECT_NE(error_of([] { ep_even_partition(512, 65); }).find("world size = 65"), std::string::npos);
  EXPECT_NE(error_of([] { ep_partition_from_counts(8, {4, 0, 4}); }).find("rank 1 holds 0 experts"), std::string::npos);
  EXPECT_NE(error_of([] { ep_partition_from_counts(8, {4, 3}); }).find("hold 7 experts in total; they must cover all E = 8"),
            std::string::npos);
  EXPECT_NE(error_of([] { ep_partition_from_counts(8, {4, 5}); }).find("more than E = 8"), std::string::npos);
  EXPECT_NE(error_of([] { ep_even_partition(8, 2).owner(8); }).find("expert = 8 must be in [0, 8)"), std::string::npos);
}

TEST(EpPlan, RowsPerPeerWorstCaseCapacityFactorAndMonotone) {
  // GLM-5-like: E = 256, k = 8 over 8 ranks: 32 experts each.
  const MoeConfig glm = cfg_of(256, 8);
  const EpPartition p8 = ep_even_partition(256, 8);
  EXPECT_EQ(ep_rows_per_peer(glm, p8, 3, 1, 0.0), 8);       // one token: up to 8 rows to one rank
  EXPECT_EQ(ep_rows_per_peer(glm, p8, 3, 1024, 0.0), 8192);
  // balanced share 1024 * 8 * 32 / 256 = 1024 rows; x1.25 = 1280
  EXPECT_EQ(ep_rows_per_peer(glm, p8, 3, 1024, 1.25), 1280);
  EXPECT_EQ(ep_rows_per_peer(glm, p8, 3, 1, 1.25), 8);       // never below one token's rows
  EXPECT_EQ(ep_rows_per_peer(glm, p8, 3, 1024, 64.0), 8192); // never above the worst case
  // fewer local experts than k: a token sends a rank at most `local` rows
  const MoeConfig k4 = cfg_of(8, 4);
  const EpPartition p4 = ep_even_partition(8, 4);
  EXPECT_EQ(ep_rows_per_peer(k4, p4, 0, 10, 0.0), 20);
  // ceil: 0.3 * 7 * 4 * 2 / 8 = 2.1 -> 3, but at least min(k, local) = 2 -> 3
  EXPECT_EQ(ep_rows_per_peer(k4, p4, 0, 7, 0.3), 3);
  // exact integer arithmetic against a long double formula, and monotone in step_tokens
  for (double cf : {0.0, 0.001, 0.5, 1.0, 1.1, 1.25, 2.0, 3.333}) {
    int64_t prev = 0;
    for (int64_t t = 1; t <= 5000; t += (t < 64 ? 1 : 37)) {
      const int64_t r = ep_rows_per_peer(glm, p8, 0, t, cf);
      EXPECT_GE(r, prev) << "cf " << cf << " t " << t;
      prev = r;
      const int64_t worst = t * 8;
      if (cf == 0.0) {
        EXPECT_EQ(r, worst);
      } else {
        const long double milli = std::llround(cf * 1000.0);
        const auto want = static_cast<int64_t>(std::ceil(milli * t * 8 * 32 / (1000.0L * 256) - 1e-12L));
        EXPECT_EQ(r, std::min<int64_t>(worst, std::max<int64_t>(8, want))) << "cf " << cf << " t " << t;
      }
    }
  }
}

TEST(EpPlan, CapacityChecks) {
  const MoeConfig c = cfg_of(16, 4);
  EXPECT_NE(error_of([&] { validate_ep_capacity(c, {0, 0.0}); }).find("max_tokens = 0 must be >= 1"), std::string::npos);
  EXPECT_NE(error_of([&] { validate_ep_capacity(c, {8, -1.0}); }).find("capacity_factor = -1"), std::string::npos);
  EXPECT_NE(error_of([&] { validate_ep_capacity(c, {8, NAN}); }).find("capacity_factor = nan"), std::string::npos);
  EXPECT_NE(error_of([&] { validate_ep_capacity(c, {8, 65.0}); }).find("(0, 64]"), std::string::npos);
  EXPECT_NE(error_of([&] { validate_ep_capacity(c, {8, 0.0004}); }).find("below the resolution of 0.001"),
            std::string::npos);
  EXPECT_NE(error_of([&] { validate_ep_capacity(c, {int64_t{1} << 30, 0.0}); }).find("int32 row range"), std::string::npos);
  EXPECT_NO_THROW(validate_ep_capacity(c, {4096, 1.5}));
  EXPECT_EQ(ep_capacity_milli(1.25), 1250);
  EXPECT_EQ(ep_capacity_milli(0.0), 0);
}

// For every (sender, receiver) pair, the sender's message size equals the receiver's expectation:
// NCCL's counts must match on both sides or it hangs.
TEST(EpPlan, StepLayoutsAgreeBetweenSendersAndReceivers) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 9);
    const int E = world + static_cast<int>(rng() % 40);
    const int k = 1 + static_cast<int>(rng() % std::min(E, 16));
    std::vector<int> counts(world, 1);
    for (int e = world; e < E; ++e) ++counts[rng() % world];
    const EpPartition part = ep_partition_from_counts(E, counts);
    const MoeConfig c = cfg_of(E, k);
    const int64_t step = 1 + rng() % 700;
    const double cf = (rng() % 3 == 0) ? 0.0 : 0.05 * (1 + rng() % 60);
    std::vector<EpStepLayout> L;
    for (int r = 0; r < world; ++r) L.push_back(ep_step_layout(c, part, r, step, cf));
    int64_t sent = 0, received = 0;
    for (int s = 0; s < world; ++s) {
      const EpStepLayout& a = L[s];
      EXPECT_EQ(a.rows_from, a.rows_to[s]);
      for (int d = 0; d < world; ++d) EXPECT_EQ(a.rows_to[d], L[d].rows_from) << "trial " << trial << " " << s << "->" << d;
      // offsets: contiguous, self excluded from the send buffers, included in the replies
      int64_t so = 0, mo = 0, ro = 0;
      for (int d = 0; d < world; ++d) {
        EXPECT_EQ(a.ret_row_offset[d], ro);
        ro += a.rows_to[d];
        if (d == s) {
          EXPECT_EQ(a.send_row_offset[d], -1);
          EXPECT_EQ(a.send_meta_offset[d], -1);
          continue;
        }
        EXPECT_EQ(a.send_row_offset[d], so);
        EXPECT_EQ(a.send_meta_offset[d], mo);
        so += a.rows_to[d];
        mo += ep_meta_ints(a.rows_to[d]);
      }
      EXPECT_EQ(a.send_rows, so);
      EXPECT_EQ(a.send_meta_ints, mo);
      EXPECT_EQ(a.zero_row, ro);
      EXPECT_EQ(a.ret_rows, ro + 1);
      EXPECT_EQ(a.recv_rows, world * a.rows_from);
      EXPECT_EQ(a.recv_meta_ints, world * ep_meta_ints(a.rows_from));
      sent += a.bytes_sent(c.hidden);
      received += a.bytes_received(c.hidden);
    }
    EXPECT_EQ(sent, received) << "trial " << trial;
  }
}

TEST(EpPlan, WorkspaceLayoutIsAlignedDisjointAndHoldsEverySmallerStep) {
  const MoeConfig c = cfg_of(24, 4, 256, 128, 1);
  const EpPartition part = ep_partition_from_counts(24, {5, 11, 8});
  for (int rank = 0; rank < 3; ++rank)
    for (double cf : {0.0, 1.3}) {
      const EpCapacity cap{300, cf};
      const EpWorkspaceLayout l = ep_workspace_layout(c, part, rank, cap);
      const std::vector<size_t> offs = {l.topk_ids, l.topk_weights, l.chunk_counts, l.expert_offsets, l.row_of,
                                        l.row_scale, l.pos_of, l.shared_offsets, l.send_rows, l.send_meta,
                                        l.ret_recv, l.recv_rows, l.recv_meta, l.recv_ids, l.recv_weights,
                                        l.recv_chunk_counts, l.local_offsets, l.recv_row_of, l.recv_row_scale,
                                        l.sorted, l.gemm1_out, l.gemm2_out, l.ret_send, l.shared_gemm1_out,
                                        l.shared_gemm2_out};
      for (size_t i = 0; i < offs.size(); ++i) {
        EXPECT_EQ(offs[i] % 256, 0u) << i;
        if (i > 0) {
          EXPECT_GT(offs[i], offs[i - 1]) << i;  // every region is non-empty here
        }
      }
      const EpStepLayout& m = l.max_step;
      const int64_t H = c.hidden;
      EXPECT_GE(l.ret_send, l.gemm2_out + static_cast<size_t>(m.recv_rows * H * 2));
      EXPECT_GE(l.total, l.shared_gemm2_out + static_cast<size_t>(300 * H * 2));
      for (int64_t step = 1; step <= 300; step += 7) {
        const EpStepLayout s = ep_step_layout(c, part, rank, step, cf);
        EXPECT_LE(s.send_rows, m.send_rows);
        EXPECT_LE(s.send_meta_ints, m.send_meta_ints);
        EXPECT_LE(s.ret_rows, m.ret_rows);
        EXPECT_LE(s.recv_rows, m.recv_rows);
        EXPECT_LE(s.recv_meta_ints, m.recv_meta_ints);
      }
    }
  EXPECT_NE(error_of([&] { ep_workspace_layout(cfg_of(16, 4), part, 0, {8, 0.0}); }).find("partition covers 24"),
            std::string::npos);
}

TEST(EpPlan, DispatchPlanOrderPositionsAndOverflow) {
  const MoeConfig c = cfg_of(20, 4);
  const EpPartition part = ep_partition_from_counts(20, {6, 4, 10});
  const int64_t T = 57;
  const std::vector<int32_t> ids = random_ids(T, 20, 4, 3);
  for (double cf : {0.0, 0.6}) {
    const EpStepLayout step = ep_step_layout(c, part, 1, T, cf);
    const EpDispatchPlan plan = ep_dispatch_plan(c, part, step, ids);
    int64_t total = 0;
    std::set<int32_t> used;
    for (int d = 0; d < 3; ++d) {
      total += plan.count_to[d];
      EXPECT_EQ(static_cast<int64_t>(plan.entries_to[d].size()), std::min(plan.count_to[d], step.rows_to[d]));
      // order: expert ascending, then flat entry (token, slot) ascending; every expert owned by d
      for (size_t j = 0; j < plan.entries_to[d].size(); ++j) {
        const int32_t i = plan.entries_to[d][j];
        EXPECT_EQ(part.owner(ids[i]), d);
        if (j > 0) {
          const int32_t h = plan.entries_to[d][j - 1];
          EXPECT_TRUE(ids[h] < ids[i] || (ids[h] == ids[i] && h < i)) << "d " << d << " j " << j;
        }
        EXPECT_EQ(plan.pos_of[i], step.ret_row_offset[d] + static_cast<int64_t>(j));
        EXPECT_TRUE(used.insert(plan.pos_of[i]).second);
      }
    }
    EXPECT_EQ(total, T * 4);
    int dropped = 0;
    for (int32_t p : plan.pos_of) dropped += p == step.zero_row;
    int64_t kept = 0;
    for (int d = 0; d < 3; ++d) kept += plan.entries_to[d].size();
    EXPECT_EQ(dropped + kept, T * 4);
    int first = -1;
    for (int d = 0; d < 3 && first < 0; ++d)
      if (plan.count_to[d] > step.rows_to[d]) first = d;
    EXPECT_EQ(plan.overflow_dst, first);
    if (cf == 0.0) EXPECT_EQ(plan.overflow_dst, -1);
    else EXPECT_GE(plan.overflow_dst, 0);  // 0.6 of the balanced share cannot hold a random routing
  }
}

// The whole dataflow on the CPU, with the device's index arithmetic: every rank routes its tokens,
// packs its messages (rows = token ids, metadata = local expert + weight, padding -1), "sends" them;
// every receiver computes a stand-in GEMM2 result per received row (a bf16 value depending on the
// token, the expert and the weight), replies in received order; every sender finds each slot's
// result through pos_of and sums in slot order in fp32. That must equal the single-GPU combine of
// the same per-(token, slot) values bit for bit, for ragged token counts (including zero) and any
// partition; with a capacity cut, exactly the dropped slots are missing.
TEST(EpPlan, SimulatedDataflowEqualsTheSingleGpuCombine) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 60; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 5);
    const int E = world * (1 + static_cast<int>(rng() % 5)) + static_cast<int>(rng() % 3);
    const int k = 1 + static_cast<int>(rng() % std::min(E, 8));
    std::vector<int> counts(world, 1);
    for (int e = world; e < E; ++e) ++counts[rng() % world];
    const EpPartition part = ep_partition_from_counts(E, counts);
    const MoeConfig c = cfg_of(E, k);
    std::vector<int64_t> T(world);
    int64_t step = 1;
    for (int r = 0; r < world; ++r) {
      T[r] = rng() % 4 == 0 ? 0 : 1 + rng() % 40;
      step = std::max(step, T[r]);
    }
    const double cf = trial % 3 == 2 ? 0.7 : 0.0;
    // global token ids and their routing
    std::vector<std::vector<int32_t>> ids(world);
    std::vector<std::vector<float>> wts(world);
    for (int r = 0; r < world; ++r) {
      ids[r] = random_ids(T[r], E, k, 1000 * trial + r);
      for (size_t i = 0; i < ids[r].size(); ++i) wts[r].push_back(0.01f * static_cast<float>(1 + rng() % 97));
    }
    auto y_of = [&](int src, int64_t t, int e, float w) {  // the stand-in result of one (token, slot)
      return float_to_bf16_bits(w * static_cast<float>((src * 1000 + t) % 37 - 18) + 0.125f * e);
    };
    std::vector<EpStepLayout> L;
    std::vector<EpDispatchPlan> P;
    for (int r = 0; r < world; ++r) {
      L.push_back(ep_step_layout(c, part, r, step, cf));
      P.push_back(ep_dispatch_plan(c, part, L[r], ids[r]));
    }
    // messages: per (src, dst) rows_to[dst] entries {token, local expert or -1, weight}
    struct Row {
      int64_t token = -1;
      int32_t expert = -1;
      float weight = 0;
    };
    std::vector<std::vector<std::vector<Row>>> msg(world, std::vector<std::vector<Row>>(world));
    for (int s = 0; s < world; ++s)
      for (int d = 0; d < world; ++d) {
        msg[s][d].assign(L[s].rows_to[d], Row{});
        for (size_t j = 0; j < P[s].entries_to[d].size(); ++j) {
          const int32_t i = P[s].entries_to[d][j];
          msg[s][d][j] = {i / k, ids[s][i] - part.begin(d), wts[s][i]};
        }
      }
    // receivers: recv[d] = concatenation over sources, then replies in received order
    std::vector<std::vector<std::vector<uint16_t>>> reply(world, std::vector<std::vector<uint16_t>>(world));
    for (int d = 0; d < world; ++d) {
      ASSERT_EQ(static_cast<int64_t>(msg[0][d].size()) * world, L[d].recv_rows);
      for (int s = 0; s < world; ++s) {
        ASSERT_EQ(static_cast<int64_t>(msg[s][d].size()), L[d].rows_from);
        for (const Row& row : msg[s][d])
          reply[d][s].push_back(row.expert >= 0 ? y_of(s, row.token, part.begin(d) + row.expert, row.weight) : 0xdead);
      }
    }
    // senders: ret_recv in send order, then the combine through pos_of
    for (int s = 0; s < world; ++s) {
      std::vector<uint16_t> ret(L[s].ret_rows, 0xbeef);
      for (int d = 0; d < world; ++d) {
        ASSERT_EQ(static_cast<int64_t>(reply[d][s].size()), L[s].rows_to[d]);
        std::copy(reply[d][s].begin(), reply[d][s].end(), ret.begin() + L[s].ret_row_offset[d]);
      }
      ret[L[s].zero_row] = 0;
      for (int64_t t = 0; t < T[s]; ++t) {
        float got = 0.0f, want = 0.0f;
        for (int j = 0; j < k; ++j) {
          const int32_t i = static_cast<int32_t>(t * k + j);
          got += bf16_bits_to_float(ret[P[s].pos_of[i]]);
          const bool kept = P[s].pos_of[i] != L[s].zero_row;
          if (kept) want += bf16_bits_to_float(y_of(s, t, ids[s][i], wts[s][i]));
          if (cf == 0.0) {
            ASSERT_TRUE(kept);
          }
        }
        ASSERT_EQ(float_to_bf16_bits(got), float_to_bf16_bits(want)) << "trial " << trial << " rank " << s << " token " << t;
      }
    }
  }
}

TEST(EpPlan, HandshakeAcceptsAgreementAndNamesEveryDisagreement) {
  const MoeConfig c = cfg_of(16, 4);
  const EpCapacity cap{64, 1.5};
  auto all_of = [&](std::vector<int> counts) {
    std::vector<EpHandshake> v;
    int b = 0;
    for (int r = 0; r < static_cast<int>(counts.size()); ++r) {
      v.push_back(ep_handshake(c, r, static_cast<int>(counts.size()), b, counts[r], cap));
      b += counts[r];
    }
    return v;
  };
  const EpPartition p = ep_check_handshake(all_of({6, 6, 4}), 1);
  EXPECT_EQ(p.expert_begin, (std::vector<int>{0, 6, 12, 16}));
  {
    auto v = all_of({8, 8});
    v[1].hidden = 256;
    EXPECT_NE(error_of([&] { ep_check_handshake(v, 0); }).find("hidden = 128 on rank 0 but 256 on rank 1"),
              std::string::npos);
  }
  {
    auto v = all_of({8, 8});
    v[0].capacity_milli = 1000;
    EXPECT_NE(error_of([&] { ep_check_handshake(v, 1); }).find("capacity_factor (thousandths) = 1500 on rank 1 but 1000 on rank 0"),
              std::string::npos);
  }
  {
    auto v = all_of({8, 8});
    v[1].expert_begin = 9;
    EXPECT_NE(error_of([&] { ep_check_handshake(v, 0); }).find("rank 1 holds experts [9, 17)"), std::string::npos);
  }
  {
    auto v = all_of({8, 8});
    v[1].rank = 0;
    EXPECT_NE(error_of([&] { ep_check_handshake(v, 0); }).find("entry 1 says rank 0 of 2"), std::string::npos);
  }
  {
    auto v = all_of({8, 7});
    EXPECT_NE(error_of([&] { ep_check_handshake(v, 0); }).find("they must cover all E = 16"), std::string::npos);
  }
  {
    auto v = all_of({8, 8});
    v[1].magic = 0;
    EXPECT_NE(error_of([&] { ep_check_handshake(v, 0); }).find("not an EpMoeLayer handshake"), std::string::npos);
  }
}

TEST(EpPlan, SliceWeightsOffsetsEveryRoutedTensor) {
  MoeConfig c = cfg_of(8, 2, 256, 128, 1);
  c.expert_bias = true;
  MoeLayerWeights all;
  auto at = [](uintptr_t a) { return reinterpret_cast<const uint8_t*>(a); };
  auto atf = [](uintptr_t a) { return reinterpret_cast<const float*>(a); };
  all.w13_codes = at(0x100000);
  all.w13_scales = at(0x200000);
  all.w13_global = atf(0x300000);
  all.b13 = atf(0x400000);
  all.w2_codes = at(0x500000);
  all.w2_scales = at(0x600000);
  all.w2_global = atf(0x700000);
  all.b2 = atf(0x800000);
  all.router_bias = atf(0x900000);
  all.shared_w13_codes = at(0xa00000);
  const MoeLayerWeights w = ep_slice_weights(c, all, 3, 2);
  const int64_t H = 256, I = 128;
  EXPECT_EQ(w.w13_codes, all.w13_codes + 3 * (2 * I * H / 2));
  EXPECT_EQ(w.w13_scales, all.w13_scales + 3 * (2 * I * H / 16));
  EXPECT_EQ(w.w13_global, all.w13_global + 3);
  EXPECT_EQ(w.w13_global_up, nullptr);  // absent stays absent
  EXPECT_EQ(w.b13, all.b13 + 3 * 2 * I);
  EXPECT_EQ(w.w2_codes, all.w2_codes + 3 * (H * I / 2));
  EXPECT_EQ(w.w2_scales, all.w2_scales + 3 * (H * I / 16));
  EXPECT_EQ(w.w2_global, all.w2_global + 3);
  EXPECT_EQ(w.b2, all.b2 + 3 * H);
  EXPECT_EQ(w.router_bias, all.router_bias);          // routing sees all experts
  EXPECT_EQ(w.shared_w13_codes, all.shared_w13_codes);  // the shared expert is whole on every rank
  EXPECT_NE(error_of([&] { ep_slice_weights(c, all, 7, 2); }).find("experts [7, 9) must lie in [0, E = 8)"),
            std::string::npos);
}

TEST(EpPlan, StatusMessagesCarryTheNumbers) {
  EpStatus s;
  s.code = static_cast<int32_t>(EpStatusCode::kCapacityOverflow);
  s.reporter = 2;
  s.src = 1;
  s.dst = 3;
  s.rows = 1500;
  s.capacity = 1280;
  s.step_tokens = 1024;
  const std::string m = ep_status_message(s, 1.25);
  EXPECT_NE(m.find("rank 1 routed 1500 (token, slot) rows to rank 3, whose messages hold 1280 rows at step_tokens = 1024 "
                   "(capacity_factor = 1.25)"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("seen by rank 2"), std::string::npos);
  s.code = static_cast<int32_t>(EpStatusCode::kStepMismatch);
  s.rows = 16;
  s.capacity = 8;
  s.step_tokens = 8;
  s.expected_step = 4;
  const std::string m2 = ep_status_message(s, 0.0);
  EXPECT_NE(m2.find("the message from rank 1 holds 16 rows (its step_tokens = 8) but this rank expected 8 rows "
                    "(step_tokens = 4)"),
            std::string::npos)
      << m2;
  s.code = 0;
  EXPECT_EQ(ep_status_message(s, 0.0), "no error");
}

TEST(EpPlan, NcclAvailabilityNeverThrows) {
  // Whether or not this machine has NCCL, the answer comes with a reason and no exception.
  std::string why;
  bool ok = false;
  EXPECT_NO_THROW(ok = nccl_available(&why));
  EXPECT_FALSE(why.empty());
  if (!ok) EXPECT_THROW(nccl_version(), Error);
  else EXPECT_GE(nccl_version(), 21800);
}

}  // namespace
}  // namespace fp4moe

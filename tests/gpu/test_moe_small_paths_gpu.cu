// The small-T fast paths of the MoE stages (moe_layer.hpp):
//   - the one-launch permutation + gather (PermutePath::kSmall) and the chunked multi-kernel path give
//     identical expert_offsets, row_of, row_scale, shared offsets and sorted rows for the same ids, at
//     T * k on both sides of the switch (kSmallPermuteMaxEntries) and for k = 1 .. 16, E up to 512,
//     and both equal a host stable counting sort;
//   - the combine kernel (one thread per column, all slot loads issued first) at k = 1 .. 16 and a
//     hidden size that spans several blocks per token, bit-exact against the host formula;
//   - the router's order-preserving score key: +0 and -0 tie (lower index wins), as float compares do;
//   - GEMM1's stream configs counting the routing ids themselves (GroupedGemmArgs::route_ids, before the
//     programmatic-launch wait, while the permutation runs) equal the same launch reading its offsets.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/arch.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/planner.hpp"
#include "fp4moe/reference.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe {
namespace {


constexpr int64_t kSwitch = kMoeSmallPermuteMaxEntries;

using test::download;
using test::Stream;
using test::upload;


struct PermuteOut {
  std::vector<int32_t> offsets, row_of, shared;
  std::vector<float> row_scale;
  std::vector<uint16_t> sorted;
};

PermuteOut run_permute(PermutePath path, int E, int k, int64_t T, int64_t H, const OwnedDeviceBuffer& d_ids,
                       const OwnedDeviceBuffer& d_w, const OwnedDeviceBuffer& d_h, cudaStream_t s) {
  const int64_t n = T * k;
  OwnedDeviceBuffer cc(std::max<int64_t>(moe_permute_chunks(n), 1) * E * 4), off((E + 1) * 4), row(n * 4),
      rs(n * 4), sh(16), sorted(n * H * 2);
  // Poison everything the kernels must write, on the kernels' stream: `s` does not synchronize with the
  // legacy default stream, and a plain cudaMemset there could land after the kernels' writes.
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(off.get(), 0xff, off.bytes(), s));
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(row.get(), 0xff, row.bytes(), s));
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(rs.get(), 0xff, rs.bytes(), s));
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(sh.get(), 0xff, sh.bytes(), s));
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(sorted.get(), 0xff, sorted.bytes(), s));
  moe_permute_gather(E, k, T, d_ids.as<int32_t>(), d_w.as<float>(), cc.as<int32_t>(), off.as<int32_t>(),
                     row.as<int32_t>(), rs.as<float>(), sh.as<int32_t>(), d_h.get(), H, sorted.get(), s, path);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  PermuteOut o;
  o.offsets = download<int32_t>(off.get(), E + 1);
  o.row_of = download<int32_t>(row.get(), n);
  o.row_scale = download<float>(rs.get(), n);
  o.shared = download<int32_t>(sh.get(), 2);
  o.sorted = download<uint16_t>(sorted.get(), n * H);
  return o;
}

// One-launch permutation (and its gather) against the chunked path and a host counting sort, bit for
// bit: offsets, rows, row scales, the shared expert's offsets and every gathered row.
void check_small_equals_chunked(int E, int k, int64_t T, int64_t H, int skew, std::mt19937_64& rng,
                                cudaStream_t stream) {
  SCOPED_TRACE(testing::Message() << "E=" << E << " k=" << k << " T=" << T << " H=" << H << " skew=" << skew);
  std::vector<int32_t> ids(T * k);
  std::vector<float> w(T * k);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int s = 0; s < k; ++s) {
      ids[t * k + s] = skew ? (s + static_cast<int>(t)) % k : perm[s];  // skew: k experts own everything
      w[t * k + s] = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
    }
  }
  std::vector<uint16_t> hidden(T * H);
  for (auto& v : hidden) v = static_cast<uint16_t>(rng());
  const test::HostPermutation hp = test::host_permutation(ids, w, E);
  const std::vector<int32_t>&off = hp.off, &row_of = hp.row_of;
  const std::vector<float>& row_scale = hp.row_scale;
  OwnedDeviceBuffer d_ids = upload(ids), d_w = upload(w), d_h = upload(hidden);
  const PermuteOut chunked = run_permute(PermutePath::kChunked, E, k, T, H, d_ids, d_w, d_h, stream);
  const PermuteOut automatic = run_permute(PermutePath::kAuto, E, k, T, H, d_ids, d_w, d_h, stream);
  ASSERT_EQ(chunked.offsets, off);
  ASSERT_EQ(chunked.row_of, row_of);
  ASSERT_EQ(chunked.row_scale, row_scale);
  ASSERT_EQ(chunked.shared, (std::vector<int32_t>{0, static_cast<int32_t>(T)}));
  for (int64_t i = 0; i < T * k; ++i)
    ASSERT_EQ(0, std::memcmp(&chunked.sorted[row_of[i] * H], &hidden[(i / k) * H], H * 2)) << "entry " << i;
  auto same = [&](const PermuteOut& o) {
    ASSERT_EQ(o.offsets, chunked.offsets);
    ASSERT_EQ(o.row_of, chunked.row_of);
    ASSERT_EQ(o.row_scale, chunked.row_scale);
    ASSERT_EQ(o.shared, chunked.shared);
    ASSERT_EQ(o.sorted, chunked.sorted);
  };
  same(automatic);
  if (T * k <= kSwitch) {
    const PermuteOut small = run_permute(PermutePath::kSmall, E, k, T, H, d_ids, d_w, d_h, stream);
    same(small);
    // permute only (no gather), as moe_permute runs it
    OwnedDeviceBuffer cc(moe_permute_chunks(T * k) * E * 4), d_off((E + 1) * 4), d_row(T * k * 4),
        d_rs(T * k * 4);
    moe_permute(E, k, T, d_ids.as<int32_t>(), d_w.as<float>(), cc.as<int32_t>(), d_off.as<int32_t>(),
                d_row.as<int32_t>(), d_rs.as<float>(), nullptr, stream);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    ASSERT_EQ(download<int32_t>(d_off.get(), E + 1), off);
    ASSERT_EQ(download<int32_t>(d_row.get(), T * k), row_of);
    ASSERT_EQ(download<float>(d_rs.get(), T * k), row_scale);
  } else {
    EXPECT_THROW(run_permute(PermutePath::kSmall, E, k, T, H, d_ids, d_w, d_h, stream), Error);
  }
}

TEST(MoeSmallPathsGpu, OneLaunchPermutationEqualsChunkedPath) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Stream st;
  std::mt19937_64 rng(123);
  struct Case {
    int E, k;
    std::vector<int64_t> tokens;
  };
  // T * k just below / at / above the switch, tiny T, and blocks owning several tokens (k = 1, 3).
  const std::vector<Case> cases = {{256, 8, {1, 2, 7, 128, 511, 512, 513}},
                                   {512, 16, {1, 5, 255, 256, 257}},
                                   {40, 3, {1, 300, 1365, 1366, 1367}},
                                   {8, 1, {1, 257, 1000, 4095, 4096, 4097}},
                                   {128, 4, {3, 1024, 1025}}};
  for (const Case& c : cases)
    for (int64_t T : c.tokens)
      for (int skew = 0; skew < 2; ++skew)
        ASSERT_NO_FATAL_FAILURE(check_small_equals_chunked(c.E, c.k, T, 24 * 8, skew, rng, st.s));  // 24 columns
}

// Wide rows: the one-launch kernel cuts each token block's gather into column slices (one block each,
// kernels/moe_permute.cuh); row widths that the slices do not divide, up to the 16 slices' cap, and
// blocks owning several tokens.
TEST(MoeSmallPathsGpu, OneLaunchPermutationSlicesWideRows) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Stream st;
  std::mt19937_64 rng(321);
  struct Case {
    int E, k;
    int64_t H;
    std::vector<int64_t> tokens;
  };
  const std::vector<Case> cases = {{256, 8, 6144, {1, 2, 9, 64, 300, 512}},
                                   {384, 8, 7168, {1, 3}},
                                   {128, 4, 2880, {1, 5, 1024}},
                                   {40, 3, 773 * 8, {1, 700, 1366}},
                                   {8, 1, 16384, {1, 4096}}};
  for (const Case& c : cases)
    for (int64_t T : c.tokens) ASSERT_NO_FATAL_FAILURE(check_small_equals_chunked(c.E, c.k, T, c.H, T % 2, rng, st.s));
}

TEST(MoeSmallPathsGpu, CombineEveryTopKAndWideRows) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Stream st;
  std::mt19937_64 rng(5);
  for (int k : {1, 2, 3, 4, 5, 8, 9, 16}) {
    for (int64_t T : {1, 2, 9}) {
      for (int64_t H : {int64_t{8}, int64_t{1032}, int64_t{6144}}) {  // 1, 129 (2 blocks, ragged), 768 columns
        SCOPED_TRACE(testing::Message() << "k=" << k << " T=" << T << " H=" << H);
        // row_of: a random permutation of the T * k rows
        std::vector<int32_t> row_of(T * k);
        std::iota(row_of.begin(), row_of.end(), 0);
        std::shuffle(row_of.begin(), row_of.end(), rng);
        std::vector<uint16_t> y(T * k * H), shared(T * H);
        for (auto& v : y) v = float_to_bf16_bits(std::normal_distribution<float>()(rng));
        for (auto& v : shared) v = float_to_bf16_bits(std::normal_distribution<float>()(rng));
        OwnedDeviceBuffer d_row = upload(row_of), d_y = upload(y), d_s = upload(shared), d_out(T * H * 2);
        for (int with_shared = 0; with_shared < 2; ++with_shared) {
          FP4MOE_CUDA_CHECK(cudaMemsetAsync(d_out.get(), 0xff, d_out.bytes(), st.s));
          moe_combine(d_y.get(), with_shared ? d_s.get() : nullptr, d_row.as<int32_t>(), k, T, H, d_out.get(), st.s);
          FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
          const std::vector<uint16_t> out = download<uint16_t>(d_out.get(), T * H);
          const std::vector<uint16_t> ref =
              test::combine_reference(y, with_shared ? shared : std::vector<uint16_t>{}, row_of, T, k, H);
          for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(out[i], ref[i]) << "t " << i / H << " h " << i % H;
        }
      }
    }
  }
}

TEST(MoeSmallPathsGpu, SignedZeroScoresTieToTheLowerIndex) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Stream st;
  MoeConfig c;
  c.name = "gptoss-zeros";
  c.hidden = 128;
  c.intermediate = 64;
  c.num_experts = 64;
  c.top_k = 8;
  c.router = RouterKind::kGptOss;
  c.renormalize = false;
  c.activation = Activation::kGptOssSwiGLU;
  c.expert_bias = true;
  const int64_t T = 16;
  std::mt19937_64 rng(9);
  std::vector<float> logits(T * c.num_experts);
  for (auto& v : logits) {
    const uint64_t r = rng() % 4;
    v = r == 0 ? 0.0f : r == 1 ? -0.0f : r == 2 ? -1.0f : -2.0f;  // many +0 / -0 ties at the top
  }
  OwnedDeviceBuffer d_l = upload(logits), ids(T * c.top_k * 4), w(T * c.top_k * 4);
  moe_route(c, d_l.as<float>(), nullptr, T, ids.as<int32_t>(), w.as<float>(), st.s);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  const Routing ref = route_reference(c, logits, {}, T);
  EXPECT_EQ(download<int32_t>(ids.get(), T * c.top_k), ref.ids);
  const std::vector<float> got = download<float>(w.get(), T * c.top_k);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], ref.weights[i], 1e-6f * std::abs(ref.weights[i]));
}

// The layer's GEMM1 follows the permutation with programmatic dependent launch and, on the stream
// configs, builds its schedule from the routing ids (GroupedGemmArgs::route_ids) before waiting, while the
// permutation is still writing the offsets, the sorted rows and the shared expert's offsets. Its output
// must equal the same launch reading those offsets afterwards, bit for bit: ids out of range (dropped by
// both), empty experts, one expert holding many rows (several token tiles), the fused shared expert, and
// every stream config.
TEST(MoeSmallPathsGpu, GemmCountingTheRouteIdsEqualsReadingTheOffsets) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Stream st;
  std::mt19937_64 rng(77);
  const int E = 24, k = 3;
  const int64_t K = 1024, N = 192;  // SwiGLU: gate and up rows, N / 2 outputs per row
  // Repacked weights need no meaning here, only valid scale bytes (re-encoded E4M3, E in [-3, 3]).
  auto random_bytes = [&](int64_t n, int lo, int hi) {
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(lo + static_cast<int>(rng() % (hi - lo + 1)));
    return v;
  };
  OwnedDeviceBuffer codes = upload(random_bytes(E * N * K / 2, 0, 255)), scales = upload(random_bytes(E * N * K / 16, 48, 100));
  OwnedDeviceBuffer x_codes = upload(random_bytes(N * K / 2, 0, 255)), x_scales = upload(random_bytes(N * K / 16, 48, 100));
  OwnedDeviceBuffer gs = upload(std::vector<float>(E, 1.0f / 256)), x_gs = upload(std::vector<float>(1, 1.0f / 128));
  GroupedWeightsView w;
  w.num_experts = E; w.n = N; w.k = K; w.gate_up_interleaved = true;
  w.codes = codes.as<uint8_t>(); w.scales = scales.as<uint8_t>(); w.global_scale = gs.as<float>();
  GroupedWeightsView xw = w;
  xw.num_experts = 1; xw.codes = x_codes.as<uint8_t>(); xw.scales = x_scales.as<uint8_t>(); xw.global_scale = x_gs.as<float>();
  int checked = 0;
  for (const TileConfig& cfg : kGemmConfigs) {
    if (cfg.mma != 2 || !plan_sm80(cfg, arch_from_device(0), 0, K).verdict.valid) continue;
    for (int64_t T : {1, 6, 37}) {
      SCOPED_TRACE(testing::Message() << cfg.name() << " T=" << T);
      const int64_t n = T * k;
      std::vector<int32_t> ids(n);
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t r = rng() % 8;
        ids[i] = r == 0 ? -1 : r == 1 ? E + 2 : r == 2 ? 5 : static_cast<int32_t>(rng() % (E / 2)) * 2;  // odd: empty
      }
      std::vector<float> wts(n, 0.5f);
      std::vector<uint16_t> hidden(T * K);
      for (auto& v : hidden) v = float_to_bf16_bits(std::normal_distribution<float>()(rng));
      int32_t valid = 0;
      for (int32_t e : ids) valid += e >= 0 && e < E;
      OwnedDeviceBuffer d_ids = upload(ids), d_w = upload(wts), d_h = upload(hidden);
      OwnedDeviceBuffer cc(std::max<int64_t>(moe_permute_chunks(n), 1) * E * 4), off((E + 1) * 4), row(n * 4),
          rs(n * 4), sh(16), sorted(n * K * 2);
      std::vector<uint16_t> outs[2], x_outs[2];
      for (int counted = 1; counted >= 0; --counted) {
        OwnedDeviceBuffer out(n * N), x_out(T * N);  // bf16 [rows, N / 2]
        if (counted) {  // everything the permutation writes is poisoned until it runs
          for (const OwnedDeviceBuffer* b : {&off, &row, &rs, &sh, &sorted})
            FP4MOE_CUDA_CHECK(cudaMemsetAsync(b->get(), 0xff, b->bytes(), st.s));
        }
        FP4MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), st.s));
        FP4MOE_CUDA_CHECK(cudaMemsetAsync(x_out.get(), 0xff, x_out.bytes(), st.s));
        if (counted)
          moe_permute_gather(E, k, T, d_ids.as<int32_t>(), d_w.as<float>(), cc.as<int32_t>(), off.as<int32_t>(),
                             row.as<int32_t>(), rs.as<float>(), sh.as<int32_t>(), d_h.get(), K, sorted.get(), st.s,
                             PermutePath::kAuto, /*programmatic_launch=*/true);
        GroupedGemmArgs a;
        a.act = sorted.get(); a.expert_offsets = off.as<int32_t>(); a.max_rows = n; a.out = out.get();
        a.epilogue = GemmEpilogue::kSwiGLU;
        a.programmatic_launch = counted != 0;
        a.route_ids = counted ? d_ids.as<int32_t>() : nullptr;
        a.route_entries = counted ? n : 0;
        GroupedGemmArgs xa;
        xa.act = d_h.get(); xa.expert_offsets = sh.as<int32_t>(); xa.max_rows = T; xa.out = x_out.get();
        xa.epilogue = GemmEpilogue::kSwiGLU;
        grouped_gemm_nvfp4(w, a, xw, xa, cfg, st.s);
        FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
        outs[counted] = download<uint16_t>(out.get(), valid * N / 2);
        x_outs[counted] = download<uint16_t>(x_out.get(), T * N / 2);
      }
      EXPECT_EQ(download<int32_t>(off.get(), E + 1).back(), valid);
      int64_t unwritten = 0;
      for (uint16_t v : outs[1]) unwritten += v == 0xffff;
      for (uint16_t v : x_outs[1]) unwritten += v == 0xffff;
      EXPECT_EQ(unwritten, 0);
      EXPECT_TRUE(outs[1] == outs[0]) << "routed rows differ";
      EXPECT_TRUE(x_outs[1] == x_outs[0]) << "shared expert rows differ";
      ++checked;
    }
  }
  EXPECT_GT(checked, 0) << "no stream config fits K = " << K << " here";
}

}  // namespace
}  // namespace fp4moe

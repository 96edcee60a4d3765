// The GPU MoE layer (moe_layer.hpp) against the CPU reference (reference.hpp).
//
// Error bound: ||out - ref|| / ||ref|| < kRelL2Bound = 5e-3. The reference rounds to bf16 at the GPU's
// points (GEMM1 output, GEMM2 output per (token, slot), final sum), so the two differ only where the
// GEMM's fp32 accumulation (vs the reference's double) lands on the other side of a bf16 rounding
// boundary: a 1-ulp (2^-8 relative) change on a small fraction of intermediates, ~1e-4 expected in
// the L2 norm. 5e-3 leaves headroom and still catches a dropped slot (>= 1/k of the signal), a wrong
// scale, a wrong row or a wrong weight.
// Routing: ids equal; weights within 1e-6 relative. A token whose ids differ is accepted only when the
// swapped experts' selection scores differ by a few ulps but are not equal (device and host expf may
// differ by an ulp); exact ties must follow the lower-index rule exactly.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/planner.hpp"
#include "fp4moe/reference.hpp"
#include "../test_common.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe {
namespace {

constexpr double kRelL2Bound = 5e-3;


using test::download;
using test::rel_l2;
using test::Stream;
using test::upload;
std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = float_to_bf16_bits(x[i]);
  return b;
}
std::vector<float> from_bf16(const std::vector<uint16_t>& b) {
  std::vector<float> x(b.size());
  for (size_t i = 0; i < b.size(); ++i) x[i] = bf16_bits_to_float(b[i]);
  return x;
}


// ---- configs ----
MoeConfig small_softmax(bool renormalize, int E, int k) {
  MoeConfig c;
  c.name = "softmax-small";
  c.hidden = 128;
  c.intermediate = 64;
  c.num_experts = E;
  c.top_k = k;
  c.router = RouterKind::kSoftmaxTopK;
  c.renormalize = renormalize;
  return c;
}
MoeConfig small_gptoss(int num_shared) {
  MoeConfig c;
  c.name = "gptoss-small";
  c.hidden = 128;
  c.intermediate = 192;
  c.num_experts = 8;
  c.top_k = 2;
  c.num_shared = num_shared;
  c.router = RouterKind::kGptOss;
  c.renormalize = false;
  c.activation = Activation::kGptOssSwiGLU;
  c.expert_bias = true;
  return c;
}
MoeConfig small_grouped() {
  MoeConfig c;
  c.name = "grouped-small";
  c.hidden = 128;
  c.intermediate = 64;
  c.num_experts = 32;
  c.top_k = 4;
  c.num_shared = 2;
  c.router = RouterKind::kSigmoidGrouped;
  c.n_group = 4;
  c.topk_group = 2;
  c.routed_scaling = 2.5f;
  return c;
}

// ---- a layer whose weights come from the HOST generator (make_synthetic_expert), stacked ----
struct HostLayer {
  std::vector<ExpertWeights> experts;  // E routed (+ the shared one last)
  std::vector<float> router_bias;
  std::vector<OwnedDeviceBuffer> bufs;
  MoeLayerWeights w;
};

HostLayer build_host_layer(const MoeConfig& cfg, uint64_t seed) {
  HostLayer L;
  for (int e = 0; e < cfg.num_experts; ++e) L.experts.push_back(make_synthetic_expert(cfg, seed, e));
  if (cfg.num_shared > 0) L.experts.push_back(make_synthetic_expert(cfg, seed, kSharedExpert));
  L.router_bias = make_synthetic_router_bias(cfg, seed);
  auto stack = [&](int first, int count, auto get) {
    std::vector<uint8_t> v;
    for (int e = first; e < first + count; ++e) {
      const auto& part = get(L.experts[e]);
      v.insert(v.end(), part.begin(), part.end());
    }
    L.bufs.push_back(upload(v));
    return L.bufs.back().template as<uint8_t>();
  };
  auto stackf = [&](int first, int count, auto get) {
    std::vector<float> v;
    for (int e = first; e < first + count; ++e) {
      const std::vector<float> part = get(L.experts[e]);
      v.insert(v.end(), part.begin(), part.end());
    }
    L.bufs.push_back(upload(v));
    return L.bufs.back().template as<float>();
  };
  auto codes13 = [](const ExpertWeights& x) {
    std::vector<uint8_t> v = x.gate.codes;
    v.insert(v.end(), x.up.codes.begin(), x.up.codes.end());
    return v;
  };
  auto scales13 = [](const ExpertWeights& x) {
    std::vector<uint8_t> v = x.gate.scales;
    v.insert(v.end(), x.up.scales.begin(), x.up.scales.end());
    return v;
  };
  auto g13 = [](const ExpertWeights& x) { return std::vector<float>{x.gate.global_scale}; };
  auto g2 = [](const ExpertWeights& x) { return std::vector<float>{x.down.global_scale}; };
  auto b13 = [](const ExpertWeights& x) {
    std::vector<float> v = x.bias_gate;
    v.insert(v.end(), x.bias_up.begin(), x.bias_up.end());
    return v;
  };
  auto b2 = [](const ExpertWeights& x) { return x.bias_down; };
  auto c2 = [](const ExpertWeights& x) { return x.down.codes; };
  auto s2 = [](const ExpertWeights& x) { return x.down.scales; };
  const int E = cfg.num_experts;
  MoeLayerWeights& w = L.w;
  w.w13_codes = stack(0, E, codes13);
  w.w13_scales = stack(0, E, scales13);
  w.w13_global = stackf(0, E, g13);
  w.w2_codes = stack(0, E, c2);
  w.w2_scales = stack(0, E, s2);
  w.w2_global = stackf(0, E, g2);
  if (cfg.expert_bias) {
    w.b13 = stackf(0, E, b13);
    w.b2 = stackf(0, E, b2);
  }
  if (cfg.num_shared > 0) {
    w.shared_w13_codes = stack(E, 1, codes13);
    w.shared_w13_scales = stack(E, 1, scales13);
    w.shared_w13_global = stackf(E, 1, g13);
    w.shared_w2_codes = stack(E, 1, c2);
    w.shared_w2_scales = stack(E, 1, s2);
    w.shared_w2_global = stackf(E, 1, g2);
    if (cfg.expert_bias) {
      w.shared_b13 = stackf(E, 1, b13);
      w.shared_b2 = stackf(E, 1, b2);
    }
  }
  if (!L.router_bias.empty()) {
    L.bufs.push_back(upload(L.router_bias));
    w.router_bias = L.bufs.back().as<float>();
  }
  return L;
}

// ---- experts read back from a device-generated layer (GLM-5: no host generation of 256 experts) ----
class DeviceExperts final : public ExpertProvider {
 public:
  explicit DeviceExperts(const SyntheticDeviceLayer& L) : L_(L) {}
  std::shared_ptr<const ExpertWeights> expert(int e) const override {
    const MoeConfig& c = L_.cfg;
    const bool shared = e == kSharedExpert;
    const int64_t H = c.hidden, W = shared ? c.intermediate * c.num_shared : c.intermediate;
    const int64_t idx = shared ? 0 : e;
    const MoeLayerWeights& w = L_.weights;
    auto x = std::make_shared<ExpertWeights>();
    auto tensor = [&](Nvfp4Tensor& t, const uint8_t* codes, const uint8_t* scales, const float* global,
                      int64_t rows, int64_t cols, int64_t row0, int64_t stacked_rows) {
      t.rows = rows;
      t.cols = cols;
      const int64_t base = idx * stacked_rows + row0;
      t.codes = download<uint8_t>(codes + base * cols / 2, static_cast<size_t>(rows * cols / 2));
      t.scales = download<uint8_t>(scales + base * cols / 16, static_cast<size_t>(rows * cols / 16));
      t.global_scale = download<float>(global + idx, 1)[0];
    };
    const uint8_t* c13 = shared ? w.shared_w13_codes : w.w13_codes;
    const uint8_t* s13 = shared ? w.shared_w13_scales : w.w13_scales;
    const float* g13 = shared ? w.shared_w13_global : w.w13_global;
    tensor(x->gate, c13, s13, g13, W, H, 0, 2 * W);
    tensor(x->up, c13, s13, g13, W, H, W, 2 * W);
    tensor(x->down, shared ? w.shared_w2_codes : w.w2_codes, shared ? w.shared_w2_scales : w.w2_scales,
           shared ? w.shared_w2_global : w.w2_global, H, W, 0, H);
    if (c.expert_bias) {
      const std::vector<float> b13 = download<float>((shared ? w.shared_b13 : w.b13) + idx * 2 * W, 2 * W);
      x->bias_gate.assign(b13.begin(), b13.begin() + W);
      x->bias_up.assign(b13.begin() + W, b13.end());
      x->bias_down = download<float>((shared ? w.shared_b2 : w.b2) + idx * H, H);
    }
    return x;
  }

 private:
  const SyntheticDeviceLayer& L_;
};

// Selection score of expert e as route_reference ranks it.
float selection_score(const MoeConfig& cfg, const float* logits_row, const std::vector<float>& bias, int e) {
  const float b = bias.empty() ? 0.0f : bias[e];
  switch (cfg.router) {
    case RouterKind::kSoftmaxTopK: return logits_row[e];
    case RouterKind::kSigmoidGrouped: return 1.0f / (1.0f + std::exp(-logits_row[e])) + b;
    case RouterKind::kGptOss: return logits_row[e] + b;
  }
  return 0.0f;
}

// Checks GPU routing against route_reference, accepting a few tokens whose experts swap on a rounding
// near-tie. Selection on raw logits (softmax) admits none.
void expect_routing_matches(const MoeConfig& cfg, const std::vector<float>& logits, const std::vector<float>& bias,
                           int64_t T, const std::vector<int32_t>& ids, const std::vector<float>& w) {
  const Routing ref = route_reference(cfg, logits, bias, T);
  const int k = cfg.top_k;
  int near_ties = 0;
  for (int64_t t = 0; t < T; ++t) {
    bool same = true;
    for (int s = 0; s < k; ++s) same = same && ids[t * k + s] == ref.ids[t * k + s];
    if (same) {
      for (int s = 0; s < k; ++s) {
        const float a = w[t * k + s], r = ref.weights[t * k + s];
        EXPECT_LE(std::fabs(a - r), 1e-6f * std::fabs(r) + 1e-30f)
            << cfg.name << " token " << t << " slot " << s << " expert " << ids[t * k + s];
      }
      continue;
    }
    // Different ids: every differing slot must swap experts whose scores differ by a few ulps.
    const float* row = logits.data() + t * cfg.num_experts;
    for (int s = 0; s < k; ++s) {
      const int a = ids[t * k + s], r = ref.ids[t * k + s];
      ASSERT_TRUE(a >= 0 && a < cfg.num_experts) << "token " << t << " slot " << s << " id " << a;
      if (a == r) continue;
      const float sa = selection_score(cfg, row, bias, a), sr = selection_score(cfg, row, bias, r);
      const bool near = cfg.router != RouterKind::kSoftmaxTopK && sa != sr &&
                        std::fabs(sa - sr) <= 4e-7f * std::max(1.0f, std::fabs(sr));
      ASSERT_TRUE(near) << cfg.name << " token " << t << " slot " << s << ": GPU expert " << a << " (score " << sa
                        << ") vs reference expert " << r << " (score " << sr << ")";
    }
    ++near_ties;
  }
  EXPECT_LE(near_ties, std::max<int64_t>(2, T / 100)) << cfg.name << ": too many near-tie routing differences";
}

// Logits with ties: rows t%4 == 0 all zero; t%4 == 1 rounded to integers (many exact ties); others as
// make_synthetic_router_logits.
std::vector<float> logits_with_ties(const MoeConfig& cfg, uint64_t seed, int64_t T) {
  std::vector<float> l = make_synthetic_router_logits(cfg, seed, T);
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < cfg.num_experts; ++e) {
      float& v = l[t * cfg.num_experts + e];
      if (t % 4 == 0) v = 0.0f;
      else if (t % 4 == 1) v = std::round(v);
    }
  return l;
}

// ---------------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------------

std::vector<MoeConfig> routing_configs() {
  std::vector<MoeConfig> v = {preset("tiny"), preset("glm-5"), preset("deepseek-v3"), preset("kimi-k2"),
                              preset("qwen3-30b"), preset("gpt-oss-120b"), preset("mixtral-8x7b"),
                              small_softmax(false, 40, 3), small_grouped(), small_gptoss(0)};
  MoeConfig big = small_softmax(true, 512, 16);
  big.name = "softmax-512x16";
  v.push_back(big);
  MoeConfig nonorm = preset("glm-5");
  nonorm.name = "sigmoid-no-renorm";
  nonorm.renormalize = false;
  v.push_back(nonorm);
  // Grouped selection with groups that straddle the CTA kernel's warps (30 experts per group, 64 per warp)
  // and with groups of 32 over 384 experts (the fourth warp holds none).
  MoeConfig straddle = preset("deepseek-v3");
  straddle.name = "grouped-240-straddling";
  straddle.num_experts = 240;
  straddle.topk_group = 3;
  v.push_back(straddle);
  MoeConfig g384 = preset("kimi-k2");
  g384.name = "grouped-384x12";
  g384.n_group = 12;
  g384.topk_group = 5;
  v.push_back(g384);
  return v;
}

void run_routing_case(const MoeConfig& cfg, const std::vector<float>& logits, const std::vector<float>& bias,
                      int64_t T) {
  Stream st;
  OwnedDeviceBuffer dl = upload(logits), db = upload(bias);
  OwnedDeviceBuffer ids(T * cfg.top_k * 4), w(T * cfg.top_k * 4);
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(ids.get(), 0xff, ids.bytes(), st.s));  // on the non-blocking stream
  moe_route(cfg, dl.as<float>(), bias.empty() ? nullptr : db.as<float>(), T, ids.as<int32_t>(), w.as<float>(), st.s);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  expect_routing_matches(cfg, logits, bias, T, download<int32_t>(ids.get(), T * cfg.top_k),
                         download<float>(w.get(), T * cfg.top_k));
}

TEST(MoeRoutingGpu, MatchesReferenceEveryRouterKind) {
  FP4MOE_SKIP_WITHOUT_GPU();
  for (const MoeConfig& cfg : routing_configs()) {
    SCOPED_TRACE(cfg.name);
    for (int64_t T : {1, 3, 1000}) {
      const std::vector<float> logits = make_synthetic_router_logits(cfg, 11 + T, T);
      run_routing_case(cfg, logits, make_synthetic_router_bias(cfg, 5), T);
    }
  }
}

TEST(MoeRoutingGpu, TiesGoToTheLowerExpertIndex) {
  FP4MOE_SKIP_WITHOUT_GPU();
  for (const MoeConfig& cfg : routing_configs()) {
    SCOPED_TRACE(cfg.name);
    const int64_t T = 64;
    const std::vector<float> logits = logits_with_ties(cfg, 3, T);
    run_routing_case(cfg, logits, make_synthetic_router_bias(cfg, 5), T);
    if (cfg.router != RouterKind::kSoftmaxTopK) run_routing_case(cfg, logits, {}, T);  // no bias: pure ties
  }
}

// The CTA-per-token kernel (decode) against the warp-per-token one: the same ids in the same slots and
// the same weights bit for bit, on random logits and on logits with many exact ties, at token counts on
// both sides of the automatic switch; the automatic path too, grouped selection included. Configs it does
// not apply to (k > 8) are refused when forced.
TEST(MoeRoutingGpu, CtaPerTokenEqualsWarpPerToken) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Stream st;
  int covered = 0;
  for (const MoeConfig& cfg : routing_configs()) {
    SCOPED_TRACE(cfg.name);
    const bool applies = cfg.top_k <= 8;
    const int k = cfg.top_k;
    if (!applies) {
      const int64_t T = 1;
      OwnedDeviceBuffer dl(T * cfg.num_experts * 4), ids(T * k * 4), w(T * k * 4);
      EXPECT_THROW(moe_route(cfg, dl.as<float>(), nullptr, T, ids.as<int32_t>(), w.as<float>(), st.s,
                             RoutingPath::kCtaPerToken),
                   std::exception);
      continue;
    }
    ++covered;
    for (int64_t T : {int64_t{1}, int64_t{3}, kRoutingCtaMaxTokens, kRoutingCtaMaxTokens + 5}) {
      for (int ties = 0; ties < 2; ++ties) {
        SCOPED_TRACE(testing::Message() << "T=" << T << " ties=" << ties);
        const std::vector<float> logits =
            ties ? logits_with_ties(cfg, 21 + T, T) : make_synthetic_router_logits(cfg, 31 + T, T);
        const std::vector<float> bias = make_synthetic_router_bias(cfg, 7);
        OwnedDeviceBuffer dl = upload(logits), db = upload(bias);
        auto run = [&](RoutingPath path) {
          OwnedDeviceBuffer ids(T * k * 4), w(T * k * 4);
          FP4MOE_CUDA_CHECK(cudaMemsetAsync(ids.get(), 0xff, ids.bytes(), st.s));
          FP4MOE_CUDA_CHECK(cudaMemsetAsync(w.get(), 0xff, w.bytes(), st.s));
          moe_route(cfg, dl.as<float>(), bias.empty() ? nullptr : db.as<float>(), T, ids.as<int32_t>(), w.as<float>(),
                    st.s, path);
          FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
          return std::make_pair(download<int32_t>(ids.get(), T * k), download<float>(w.get(), T * k));
        };
        const auto warp = run(RoutingPath::kWarpPerToken), cta = run(RoutingPath::kCtaPerToken),
                   automatic = run(RoutingPath::kAuto);
        ASSERT_EQ(cta.first, warp.first);
        ASSERT_EQ(0, std::memcmp(cta.second.data(), warp.second.data(), warp.second.size() * 4));
        ASSERT_EQ(automatic.first, warp.first);
        ASSERT_EQ(0, std::memcmp(automatic.second.data(), warp.second.data(), warp.second.size() * 4));
        if (ties == 0) expect_routing_matches(cfg, logits, bias, T, cta.first, cta.second);
      }
    }
  }
  EXPECT_GE(covered, 13);  // every config but the k = 16 softmax
}

// ---------------------------------------------------------------------------------------------------
// Permutation, gather, combine
// ---------------------------------------------------------------------------------------------------

TEST(MoePermuteGpu, StableExpertSortedRows) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Stream st;
  std::mt19937_64 rng(7);
  const int E = 256, k = 8;
  for (int64_t T : {1, 3, 257, 1000, 16384}) {
    for (int skew = 0; skew < 3; ++skew) {
      SCOPED_TRACE(testing::Message() << "T=" << T << " skew=" << skew);
      // skew 0: uniform; 1: every token uses experts 0..7 (one expert owns T rows, 248 empty);
      // 2: expert 5 always in slot 0, the rest random (distinct per token).
      std::vector<int32_t> ids(T * k);
      std::vector<float> w(T * k);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int> perm(E);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        if (skew == 2) std::swap(perm[0], *std::find(perm.begin(), perm.end(), 5));
        for (int s = 0; s < k; ++s) {
          ids[t * k + s] = skew == 1 ? (s + static_cast<int>(t)) % k : perm[s];
          w[t * k + s] = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
        }
      }
      const test::HostPermutation hp = test::host_permutation(ids, w, E);
      const std::vector<int32_t>&off = hp.off, &row_of = hp.row_of;
      const std::vector<float>& row_scale = hp.row_scale;
      OwnedDeviceBuffer d_ids = upload(ids), d_w = upload(w);
      OwnedDeviceBuffer d_cc(moe_permute_chunks(T * k) * E * 4), d_off((E + 1) * 4), d_row(T * k * 4),
          d_rs(T * k * 4), d_sh(16);
      for (int rep = 0; rep < 2; ++rep) {  // a second run must give the same answer (no stale state)
        FP4MOE_CUDA_CHECK(cudaMemsetAsync(d_row.get(), 0xff, d_row.bytes(), st.s));
        moe_permute(E, k, T, d_ids.as<int32_t>(), d_w.as<float>(), d_cc.as<int32_t>(), d_off.as<int32_t>(),
                    d_row.as<int32_t>(), d_rs.as<float>(), d_sh.as<int32_t>(), st.s);
        FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
        ASSERT_EQ(download<int32_t>(d_off.get(), E + 1), off);
        ASSERT_EQ(download<int32_t>(d_row.get(), T * k), row_of);
        ASSERT_EQ(download<float>(d_rs.get(), T * k), row_scale);
        ASSERT_EQ(download<int32_t>(d_sh.get(), 2), (std::vector<int32_t>{0, static_cast<int32_t>(T)}));
      }
      if (T > 1000) continue;
      // Gather and combine, bit-exact against the host formulas.
      const int64_t H = 64;
      std::vector<uint16_t> hidden(T * H), y(T * k * H), shared(T * H);
      for (auto& v : hidden) v = float_to_bf16_bits(std::normal_distribution<float>()(rng));
      for (auto& v : y) v = float_to_bf16_bits(std::normal_distribution<float>()(rng));
      for (auto& v : shared) v = float_to_bf16_bits(std::normal_distribution<float>()(rng));
      OwnedDeviceBuffer d_h = upload(hidden), d_sorted(T * k * H * 2), d_y = upload(y), d_s = upload(shared),
                        d_out(T * H * 2);
      moe_gather(d_h.get(), T, H, d_row.as<int32_t>(), k, d_sorted.get(), st.s);
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
      const std::vector<uint16_t> sorted = download<uint16_t>(d_sorted.get(), T * k * H);
      for (int64_t i = 0; i < T * k; ++i)
        ASSERT_EQ(0, std::memcmp(&sorted[row_of[i] * H], &hidden[(i / k) * H], H * 2)) << "entry " << i;
      for (int with_shared = 0; with_shared < 2; ++with_shared) {
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

// ---------------------------------------------------------------------------------------------------
// The layer
// ---------------------------------------------------------------------------------------------------

struct LayerResult {
  std::vector<uint16_t> out;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Poisons out with NaN (0xffff bf16) first, so a row the layer fails to write is caught.
LayerResult run_layer(const MoeLayer& layer, const void* hidden, int64_t T, const float* logits, void* out,
                      void* ws, size_t ws_bytes, cudaStream_t s) {
  const MoeConfig& c = layer.config();
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(out, 0xff, T * c.hidden * 2, s));
  layer.forward(s, hidden, T, logits, out, ws, ws_bytes);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  LayerResult r;
  r.out = download<uint16_t>(out, T * c.hidden);
  const MoeIntermediates im = layer.intermediates(ws);
  r.ids = download<int32_t>(im.topk_ids, T * c.top_k);
  r.weights = download<float>(im.topk_weights, T * c.top_k);
  for (size_t i = 0; i < r.out.size(); ++i) {
    const float v = bf16_bits_to_float(r.out[i]);
    if (!std::isfinite(v)) {
      ADD_FAILURE() << c.name << ": out[" << i / c.hidden << ", " << i % c.hidden << "] is not finite";
      break;
    }
  }
  return r;
}

// Compares rows `tokens` of a GPU result with moe_reference run on the GPU's routing.
void expect_close_to_reference(const MoeConfig& cfg, const ExpertProvider& experts, const std::vector<float>& hidden,
                               const LayerResult& r, const std::vector<int64_t>& tokens) {
  const int64_t H = cfg.hidden, k = cfg.top_k, n = static_cast<int64_t>(tokens.size());
  std::vector<float> h(n * H);
  Routing rt;
  rt.tokens = n;
  rt.top_k = cfg.top_k;
  rt.ids.resize(n * k);
  rt.weights.resize(n * k);
  std::vector<float> got(n * H);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tokens[i];
    std::copy_n(hidden.begin() + t * H, H, h.begin() + i * H);
    std::copy_n(r.ids.begin() + t * k, k, rt.ids.begin() + i * k);
    std::copy_n(r.weights.begin() + t * k, k, rt.weights.begin() + i * k);
    for (int64_t c = 0; c < H; ++c) got[i * H + c] = bf16_bits_to_float(r.out[t * H + c]);
  }
  const std::vector<float> ref = moe_reference(cfg, experts, h, n, rt);
  const double err = rel_l2(got, ref);
  EXPECT_LT(err, kRelL2Bound) << cfg.name << ": relative L2 error over " << n << " tokens";
  std::printf("[ info ] %s: %lld tokens checked, relative L2 error %.3g\n", cfg.name.c_str(),
              static_cast<long long>(n), err);
}

std::vector<int64_t> all_tokens(int64_t T) {
  std::vector<int64_t> v(T);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

void check_host_layer(const MoeConfig& cfg, std::vector<int64_t> Ts, bool forced_logits = false) {
  const uint64_t seed = 1234;
  HostLayer L = build_host_layer(cfg, seed);
  VectorExperts experts(L.experts.size() > static_cast<size_t>(cfg.num_experts)
                            ? std::vector<ExpertWeights>(L.experts.begin(), L.experts.end() - 1)
                            : L.experts,
                        cfg.num_shared > 0 ? std::vector<ExpertWeights>{L.experts.back()}
                                           : std::vector<ExpertWeights>{});
  const int64_t max_T = *std::max_element(Ts.begin(), Ts.end());
  Stream st;
  MoeLayer layer(cfg, L.w, max_T, st.s);
  OwnedDeviceBuffer ws(layer.workspace_bytes()), out(max_T * cfg.hidden * 2);
  for (int64_t T : Ts) {
    SCOPED_TRACE(testing::Message() << cfg.name << " T=" << T);
    const std::vector<float> hidden = make_synthetic_hidden(cfg, seed + T, T);
    std::vector<float> logits = make_synthetic_router_logits(cfg, seed + 2 * T, T);
    if (forced_logits)  // every token picks experts 0..k-1: one expert owns all T rows, the rest are empty
      for (int64_t t = 0; t < T; ++t)
        for (int e = 0; e < cfg.top_k; ++e) logits[t * cfg.num_experts + e] = 20.0f - e;
    OwnedDeviceBuffer dh = upload(to_bf16(hidden)), dl = upload(logits);
    const LayerResult r = run_layer(layer, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes(), st.s);
    expect_routing_matches(cfg, logits, L.router_bias, T, r.ids, r.weights);
    if (forced_logits && cfg.router != RouterKind::kSigmoidGrouped)
      for (int64_t t = 0; t < T; ++t) ASSERT_EQ(r.ids[t * cfg.top_k], 0);
    expect_close_to_reference(cfg, experts, hidden, r, all_tokens(T));
    // Offsets: expert-sorted rows cover T * k exactly.
    const std::vector<int32_t> off =
        download<int32_t>(layer.intermediates(ws.get()).expert_offsets, cfg.num_experts + 1);
    EXPECT_EQ(off.front(), 0);
    EXPECT_EQ(off.back(), T * cfg.top_k);
  }
}

TEST(MoeLayerGpu, TinyPresetMatchesReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  check_host_layer(preset("tiny"), {1, 3, 64, 257});
}
TEST(MoeLayerGpu, SoftmaxRouterMatchesReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  check_host_layer(small_softmax(true, 16, 4), {1, 3, 100});
  check_host_layer(small_softmax(false, 40, 3), {1, 3, 100});
}
TEST(MoeLayerGpu, GptOssStyleMatchesReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  check_host_layer(small_gptoss(0), {1, 3, 64});
  check_host_layer(small_gptoss(1), {1, 5, 64});  // shared expert with biases
}
TEST(MoeLayerGpu, GroupedSigmoidWithWideSharedExpertMatchesReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  check_host_layer(small_grouped(), {1, 3, 200});
}
TEST(MoeLayerGpu, AllTokensOnOneExpertAndEmptyExperts) {
  FP4MOE_SKIP_WITHOUT_GPU();
  check_host_layer(small_softmax(true, 16, 4), {1, 300}, /*forced_logits=*/true);
  check_host_layer(small_gptoss(0), {300}, true);
}

TEST(MoeLayerGpu, DeviceGeneratorIsBitIdenticalToHost) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Stream st;
  struct Case {
    MoeConfig cfg;
    std::vector<int> experts;
  };
  std::vector<Case> cases = {{small_gptoss(1), {0, 3, 7, kSharedExpert}},
                             {small_grouped(), {0, 31, kSharedExpert}},
                             {preset("glm-5"), {0, 255, kSharedExpert}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.cfg.name);
    const uint64_t seed = 99;
    SyntheticDeviceLayer L = make_synthetic_layer_device(c.cfg, seed, st.s);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
    DeviceExperts dev(L);
    for (int e : c.experts) {
      SCOPED_TRACE(testing::Message() << "expert " << e);
      const ExpertWeights host = make_synthetic_expert(c.cfg, seed, e);
      const auto d = dev.expert(e);
      for (auto [a, b] : {std::pair{&host.gate, &d->gate}, {&host.up, &d->up}, {&host.down, &d->down}}) {
        EXPECT_EQ(a->codes, b->codes);
        EXPECT_EQ(a->scales, b->scales);
        EXPECT_EQ(float_bits(a->global_scale), float_bits(b->global_scale));
      }
      EXPECT_EQ(host.bias_gate, d->bias_gate);
      EXPECT_EQ(host.bias_up, d->bias_up);
      EXPECT_EQ(host.bias_down, d->bias_down);
    }
    const std::vector<float> bias = make_synthetic_router_bias(c.cfg, seed);
    if (!bias.empty()) EXPECT_EQ(download<float>(L.weights.router_bias, bias.size()), bias);
    const int64_t T = 5;
    OwnedDeviceBuffer dh(T * c.cfg.hidden * 2), dl(T * c.cfg.num_experts * 4);
    make_synthetic_hidden_device(c.cfg, seed, T, dh.get(), st.s);
    make_synthetic_router_logits_device(c.cfg, seed, T, dl.as<float>(), st.s);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
    EXPECT_EQ(download<uint16_t>(dh.get(), T * c.cfg.hidden), to_bf16(make_synthetic_hidden(c.cfg, seed, T)));
    EXPECT_EQ(download<float>(dl.get(), T * c.cfg.num_experts), make_synthetic_router_logits(c.cfg, seed, T));
  }
}

TEST(MoeLayerGpu, Glm5MatchesReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const MoeConfig& cfg = preset("glm-5");
  const uint64_t seed = 2026;
  Stream st;
  SyntheticDeviceLayer L = make_synthetic_layer_device(cfg, seed, st.s);
  const int64_t max_T = 1000;
  MoeLayer layer(cfg, L.weights, max_T, st.s);
  OwnedDeviceBuffer ws(layer.workspace_bytes()), out(max_T * cfg.hidden * 2);
  DeviceExperts experts(L);
  const std::vector<float> bias = make_synthetic_router_bias(cfg, seed);
  for (int64_t T : {1, 3, 64, 1000}) {
    SCOPED_TRACE(testing::Message() << "T=" << T);
    const std::vector<float> hidden = make_synthetic_hidden(cfg, seed + T, T);
    const std::vector<float> logits = make_synthetic_router_logits(cfg, seed + 7 * T, T);
    OwnedDeviceBuffer dh = upload(to_bf16(hidden)), dl = upload(logits);
    const LayerResult r = run_layer(layer, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes(), st.s);
    expect_routing_matches(cfg, logits, bias, T, r.ids, r.weights);
    // The CPU reference at T = 1000 (8000 expert rows) is slow; every 16th token is a fair sample.
    std::vector<int64_t> tokens;
    for (int64_t t = 0; t < T; t += (T >= 1000 ? 16 : 1)) tokens.push_back(t);
    expect_close_to_reference(cfg, experts, hidden, r, tokens);
  }
}

// Bitwise determinism (two eager runs) and CUDA-graph capture == eager, every output written (NaN
// poison), on a built layer (with whatever tile configs it was given). The graph is captured after the
// workspace was poisoned too, so it must not depend on state left by the eager runs. Returns the eager
// result.
LayerResult expect_deterministic_and_graph_equal(const MoeLayer& layer, int64_t T, uint64_t seed, int replays = 2) {
  const MoeConfig& cfg = layer.config();
  Stream st;
  OwnedDeviceBuffer ws(layer.workspace_bytes()), out(T * cfg.hidden * 2);
  OwnedDeviceBuffer dh = upload(to_bf16(make_synthetic_hidden(cfg, seed, T)));
  OwnedDeviceBuffer dl = upload(make_synthetic_router_logits(cfg, seed, T));
  const LayerResult a = run_layer(layer, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes(), st.s);
  const LayerResult b = run_layer(layer, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes(), st.s);
  EXPECT_EQ(a.out, b.out) << "two eager runs differ";

  FP4MOE_CUDA_CHECK(cudaMemsetAsync(ws.get(), 0xff, ws.bytes(), st.s));
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), st.s));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
  layer.forward(st.s, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes());
  FP4MOE_CUDA_CHECK(cudaStreamEndCapture(st.s, &graph));
  FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < replays; ++rep) {
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), st.s));
    FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, st.s));
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
    EXPECT_EQ(download<uint16_t>(out.get(), T * cfg.hidden), a.out) << "graph replay " << rep << " != eager";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return a;
}

void check_determinism_and_graph(const MoeConfig& cfg, const MoeLayerWeights& w, int64_t T, uint64_t seed) {
  Stream st;
  const MoeLayer layer(cfg, w, T, st.s);
  expect_deterministic_and_graph_equal(layer, T, seed);
}

TEST(MoeLayerGpu, DeterministicAndGraphCapturable) {
  FP4MOE_SKIP_WITHOUT_GPU();
  {
    HostLayer L = build_host_layer(preset("tiny"), 5);
    check_determinism_and_graph(preset("tiny"), L.w, 257, 5);
  }
  {
    HostLayer L = build_host_layer(small_gptoss(1), 6);
    check_determinism_and_graph(small_gptoss(1), L.w, 100, 6);
  }
  Stream st;
  const MoeConfig& glm = preset("glm-5");
  SyntheticDeviceLayer L = make_synthetic_layer_device(glm, 8, st.s);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  check_determinism_and_graph(glm, L.weights, 64, 8);
  // Large T: the multi-block permutation (17 chunks of 2048 entries).
  check_determinism_and_graph(glm, L.weights, 4100, 9);
}

// One graph replayed with new inputs in the same buffers, so the routing (and the expert offsets, the
// rows' order, every expert's row count) changes between replays: each replay must equal an eager run
// of its own inputs. Guards the reads that kernels do before their programmatic-launch wait (GEMM2
// reads the expert offsets before waiting for GEMM1) against seeing an earlier replay's values.
TEST(MoeLayerGpu, GraphReplaysWithChangingRoutingEqualEager) {
  FP4MOE_SKIP_WITHOUT_GPU();
  Stream st;
  const MoeConfig& glm = preset("glm-5");
  SyntheticDeviceLayer L = make_synthetic_layer_device(glm, 8, st.s);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  for (int64_t T : {int64_t{1}, int64_t{8}, int64_t{64}}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    MoeLayer layer(glm, L.weights, T, st.s);
    OwnedDeviceBuffer ws(layer.workspace_bytes()), out(T * glm.hidden * 2);
    OwnedDeviceBuffer ws_eager(layer.workspace_bytes()), out_eager(T * glm.hidden * 2);
    OwnedDeviceBuffer dh(T * glm.hidden * 2), dl(T * glm.num_experts * 4);
    auto set_inputs = [&](uint64_t seed) {
      const std::vector<uint16_t> h = to_bf16(make_synthetic_hidden(glm, seed, T));
      const std::vector<float> l = make_synthetic_router_logits(glm, seed, T);
      FP4MOE_CUDA_CHECK(cudaMemcpyAsync(dh.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice, st.s));
      FP4MOE_CUDA_CHECK(cudaMemcpyAsync(dl.get(), l.data(), l.size() * 4, cudaMemcpyHostToDevice, st.s));
    };
    set_inputs(100);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
    layer.forward(st.s, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes());
    FP4MOE_CUDA_CHECK(cudaStreamEndCapture(st.s, &graph));
    FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<int32_t> previous_ids;
    for (uint64_t seed : {101, 102, 103, 101}) {
      set_inputs(seed);
      const LayerResult e =
          run_layer(layer, dh.get(), T, dl.as<float>(), out_eager.get(), ws_eager.get(), ws_eager.bytes(), st.s);
      EXPECT_NE(e.ids, previous_ids) << "seed " << seed << " routes like the previous input: the test needs new routing";
      previous_ids = e.ids;
      FP4MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), st.s));
      FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, st.s));
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
      EXPECT_EQ(download<uint16_t>(out.get(), T * glm.hidden), e.out) << "graph replay with seed " << seed;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

TEST(MoeLayerGpu, RouterWeightComputesTheLogits) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const MoeConfig& cfg = preset("tiny");
  Stream st;
  SyntheticDeviceLayer L = make_synthetic_layer_device(cfg, 17, st.s, /*with_router_weight=*/true);
  const int64_t T = 37;
  MoeLayer layer(cfg, L.weights, T, st.s);
  ASSERT_TRUE(layer.has_router_weight());
  OwnedDeviceBuffer ws(layer.workspace_bytes()), out(T * cfg.hidden * 2);
  const std::vector<uint16_t> hidden = to_bf16(make_synthetic_hidden(cfg, 17, T));
  OwnedDeviceBuffer dh = upload(hidden);
  const LayerResult a = run_layer(layer, dh.get(), T, nullptr, out.get(), ws.get(), ws.bytes(), st.s);
  const std::vector<float> logits = download<float>(layer.intermediates(ws.get()).router_logits, T * cfg.num_experts);
  const std::vector<uint16_t> rw =
      download<uint16_t>(L.weights.router_weight, static_cast<size_t>(cfg.num_experts * cfg.hidden));
  double max_err = 0, max_ref = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < cfg.num_experts; ++e) {
      double acc = 0;
      for (int64_t h = 0; h < cfg.hidden; ++h)
        acc += static_cast<double>(bf16_bits_to_float(hidden[t * cfg.hidden + h])) *
               bf16_bits_to_float(rw[e * cfg.hidden + h]);
      max_err = std::max(max_err, std::fabs(acc - logits[t * cfg.num_experts + e]));
      max_ref = std::max(max_ref, std::fabs(acc));
    }
  EXPECT_LT(max_err, 1e-4 * std::max(1.0, max_ref)) << "cuBLAS router logits vs fp64";
  // The same logits given explicitly give the same output, bit for bit.
  OwnedDeviceBuffer dl = upload(logits);
  const LayerResult b = run_layer(layer, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes(), st.s);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.ids, b.ids);
}

TEST(MoeLayerGpu, StageEventsAndTileOverrides) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const MoeConfig& cfg = preset("tiny");
  HostLayer L = build_host_layer(cfg, 3);
  Stream st;
  const int64_t T = 50;
  MoeLayer layer(cfg, L.w, T, st.s);
  OwnedDeviceBuffer ws(layer.workspace_bytes()), out(T * cfg.hidden * 2);
  OwnedDeviceBuffer dh = upload(to_bf16(make_synthetic_hidden(cfg, 3, T)));
  OwnedDeviceBuffer dl = upload(make_synthetic_router_logits(cfg, 3, T));
  const LayerResult base = run_layer(layer, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes(), st.s);
  cudaEvent_t ev[kNumMoeStages + 1];
  for (auto& e : ev) FP4MOE_CUDA_CHECK(cudaEventCreate(&e));
  layer.forward(st.s, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes(), ev);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  for (int i = 0; i < kNumMoeStages; ++i) {
    float ms = -1;
    FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    EXPECT_GE(ms, 0.0f) << "stage " << i;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  EXPECT_EQ(download<uint16_t>(out.get(), T * cfg.hidden), base.out);
  // Any valid tile config computes the same values (the reduction order over K may differ, so compare
  // with the bound, not bitwise).
  MoeTileConfigs tiles;
  tiles.gemm1 = kGemmConfigs[0];
  tiles.gemm2 = kGemmConfigs[3];
  tiles.shared_gemm1 = kGemmConfigs[3];
  tiles.shared_gemm2 = kGemmConfigs[0];
  layer.set_tile_configs(tiles);
  EXPECT_EQ(layer.tile_configs(T).gemm1, kGemmConfigs[0]);
  const LayerResult other = run_layer(layer, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes(), st.s);
  EXPECT_LT(rel_l2(from_bf16(other.out), from_bf16(base.out)), kRelL2Bound);
}

// Every config of the kinds `take` accepts through the layer (all four GEMMs on it): routed GEMMs with the
// shared expert fused into the same launch or in launches of their own, experts of 0..~3x bt/4 rows,
// against the fp64 reference. Returns how many configs ran (the planner refuses the others here).
template <class Take>
static int layer_matches_reference_with_each_config(uint64_t seed, Take take, const MoeConfig& cfg = preset("tiny")) {
  EXPECT_EQ(cfg.num_shared, 1);
  HostLayer L = build_host_layer(cfg, seed);
  VectorExperts experts(std::vector<ExpertWeights>(L.experts.begin(), L.experts.end() - 1),
                        std::vector<ExpertWeights>{L.experts.back()});
  const ArchInfo arch = arch_from_device(0);
  Stream st;
  const int64_t max_T = 300;
  MoeLayer layer(cfg, L.w, max_T, st.s);
  OwnedDeviceBuffer ws(layer.workspace_bytes()), out(max_T * cfg.hidden * 2);
  int ran = 0;
  for (const TileConfig& c : kGemmConfigs) {
    if (!take(c) || !plan_sm80(c, arch).verdict.valid) continue;
    if ((cfg.hidden % c.bk != 0 || cfg.intermediate % c.bk != 0) && !tile_config_has_k_tail(c)) continue;
    MoeTileConfigs tiles;
    tiles.gemm1 = tiles.gemm2 = tiles.shared_gemm1 = tiles.shared_gemm2 = c;
    layer.set_tile_configs(tiles);
    for (int64_t T : {int64_t{37}, max_T}) {
      SCOPED_TRACE(testing::Message() << c.name() << " T=" << T);
      const std::vector<float> hidden = make_synthetic_hidden(cfg, seed + T, T);
      const std::vector<float> logits = make_synthetic_router_logits(cfg, seed + 2 * T, T);
      OwnedDeviceBuffer dh = upload(to_bf16(hidden)), dl = upload(logits);
      const LayerResult r = run_layer(layer, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes(), st.s);
      expect_close_to_reference(cfg, experts, hidden, r, all_tokens(T));
    }
    ++ran;
  }
  return ran;
}

// The tma configs (sm_90a), each tile width; GEMM2 on the bt 32 configs requests its first tile's
// weights before its programmatic-launch wait (the offsets are final at its launch).
TEST(MoeLayerGpu, TmaTilesWithFusedSharedExpertMatchReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const int ran = layer_matches_reference_with_each_config(77, [](const TileConfig& c) { return c.mma == 3; });
  if (ran == 0) GTEST_SKIP() << "no tma config is valid on this GPU (they need sm_90a)";
}

// Every tma config on a gpt-oss-style layer (biases, the clamped activation, a shared expert fused or in its
// own launches) with hidden = intermediate = 192: the 128-wide stages end on a half stage (a K tail, zero-
// filled past K by TMA), and every GEMM's last feature tile is partial (N = 384 and 192: 24 and 12 m-tile
// rows), where the tail maps copy only the expert's rows and the stage's other rows hold stale bytes.
TEST(MoeLayerGpu, TmaTilesWithKTailAndPartialFeatureTilesMatchReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  MoeConfig cfg = small_gptoss(1);
  cfg.name = "gptoss-small-odd-shapes";
  cfg.hidden = 192;
  const int ran = layer_matches_reference_with_each_config(79, [](const TileConfig& c) { return c.mma == 3; }, cfg);
  if (ran == 0) GTEST_SKIP() << "no tma config is valid on this GPU (they need sm_90a)";
}

// The pipeline configs (mma.sync, and wgmma on sm_90a): GEMM2 and the shared GEMM2 put the first stages'
// weights into the first commit group before their programmatic-launch wait, the activation rows after it.
TEST(MoeLayerGpu, PipelineTilesMatchReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const int ran =
      layer_matches_reference_with_each_config(78, [](const TileConfig& c) { return c.mma == 0 || c.mma == 1; });
  EXPECT_GT(ran, 0);
}

// The shared expert's GEMM1 on the layer's second stream (prefill: the shared expert in launches of its
// own, the routed GEMM1 a tma config that claims its tiles; MoeLayer::forward_experts): against the
// fp64 reference, bit-identical run to run, and a captured graph (workspace poisoned first, so the
// shared offsets that its own stream writes must be written inside the graph) equal to the eager run.
TEST(MoeLayerGpu, SharedExpertOnItsOwnStreamMatchesReferenceAndGraph) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const MoeConfig& cfg = preset("tiny");
  ASSERT_EQ(cfg.num_shared, 1);
  const uint64_t seed = 91;
  HostLayer L = build_host_layer(cfg, seed);
  VectorExperts experts(std::vector<ExpertWeights>(L.experts.begin(), L.experts.end() - 1),
                        std::vector<ExpertWeights>{L.experts.back()});
  const ArchInfo arch = arch_from_device(0);
  const TileConfig tma_bt32{128, 32, 64, 12, 8, 3, 2};
  if (!plan_sm80(tma_bt32, arch).verdict.valid) GTEST_SKIP() << "the tma configs need sm_90a; " << arch.name;
  ASSERT_EQ(cfg.hidden % 64, 0);
  ASSERT_EQ(cfg.intermediate % 64, 0);
  Stream st;
  const int64_t T = 300;  // > 8 token tiles of 32 rows: the shared expert is not fused
  MoeLayer layer(cfg, L.w, T, st.s);
  MoeTileConfigs tiles;
  tiles.gemm1 = tiles.gemm2 = tiles.shared_gemm1 = tiles.shared_gemm2 = tma_bt32;
  layer.set_tile_configs(tiles);
  const LayerResult a = expect_deterministic_and_graph_equal(layer, T, seed, /*replays=*/3);
  expect_close_to_reference(cfg, experts, make_synthetic_hidden(cfg, seed, T), a, all_tokens(T));
}

TEST(MoeLayerGpu, ForwardRejectsBadArguments) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const MoeConfig& cfg = preset("tiny");
  HostLayer L = build_host_layer(cfg, 3);
  Stream st;
  MoeLayer layer(cfg, L.w, 16, st.s);
  OwnedDeviceBuffer ws(layer.workspace_bytes()), out(17 * cfg.hidden * 2), dh(17 * cfg.hidden * 2),
      dl(17 * cfg.num_experts * 4);
  char* h = dh.as<char>();
  const float* l = dl.as<float>();
  EXPECT_THROW(layer.forward(st.s, h, 0, l, out.get(), ws.get(), ws.bytes()), Error);
  EXPECT_THROW(layer.forward(st.s, h, 17, l, out.get(), ws.get(), ws.bytes()), Error);
  EXPECT_THROW(layer.forward(st.s, h + 2, 4, l, out.get(), ws.get(), ws.bytes()), Error);
  EXPECT_THROW(layer.forward(st.s, nullptr, 4, l, out.get(), ws.get(), ws.bytes()), Error);
  EXPECT_THROW(layer.forward(st.s, h, 4, l, nullptr, ws.get(), ws.bytes()), Error);
  EXPECT_THROW(layer.forward(st.s, h, 4, nullptr, out.get(), ws.get(), ws.bytes()), Error);  // no router weight
  EXPECT_THROW(layer.forward(st.s, h, 4, l, out.get(), ws.get(), ws.bytes() - 1), Error);
  EXPECT_THROW(layer.forward(st.s, h, 4, l, out.get(), ws.as<char>() + 8, ws.bytes()), Error);
  EXPECT_NO_THROW(layer.forward(st.s, h, 16, l, out.get(), ws.get(), ws.bytes()));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  // Move-only ownership: the moved-to layer still runs.
  MoeLayer moved = std::move(layer);
  EXPECT_NO_THROW(moved.forward(st.s, h, 16, l, out.get(), ws.get(), ws.bytes()));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
}

}  // namespace
}  // namespace fp4moe

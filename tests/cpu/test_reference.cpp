// The CPU reference layer: routing by hand-worked examples, the synthetic recipe, and the expert compute
// against an independent naive double-precision implementation written here.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "fp4moe/config.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/synthetic.hpp"

namespace fp4moe {
namespace {

double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }

MoeConfig router_config(RouterKind kind, int e, int k, int n_group = 1, int topk_group = 1, float scaling = 1.0f) {
  MoeConfig c;
  c.name = "router-test";
  c.hidden = 64;
  c.intermediate = 64;
  c.num_experts = e;
  c.top_k = k;
  c.router = kind;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.routed_scaling = scaling;
  if (kind == RouterKind::kGptOss) c.activation = Activation::kGptOssSwiGLU;
  return c;
}

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// ------------------------------------------------------------------------------------------------
// Routing
// ------------------------------------------------------------------------------------------------

TEST(RouteReference, SoftmaxTopKRenormalized) {
  const MoeConfig c = router_config(RouterKind::kSoftmaxTopK, 4, 2);
  // token 0: logits 3 at experts 1 and 3 tie -> lower index first; equal probabilities -> 0.5 each.
  // token 1: top-2 are experts 2 (logit 2) and 1 (logit 1): w = e^2/(e^2+e^1), e^1/(e^2+e^1).
  const std::vector<float> logits = {1, 3, 2, 3, /**/ 0, 1, 2, 0.5f};
  const Routing r = route_reference(c, logits, {}, 2);
  EXPECT_EQ(r.tokens, 2);
  EXPECT_EQ(r.top_k, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3, 2, 1}));
  EXPECT_NEAR(r.weights[0], 0.5, 1e-7);
  EXPECT_NEAR(r.weights[1], 0.5, 1e-7);
  const double e = std::exp(1.0);
  EXPECT_NEAR(r.weights[2], e / (e + 1), 1e-6);
  EXPECT_NEAR(r.weights[3], 1 / (e + 1), 1e-6);
}

TEST(RouteReference, SoftmaxWithoutRenormalizeKeepsFullSoftmax) {
  MoeConfig c = router_config(RouterKind::kSoftmaxTopK, 4, 2);
  c.renormalize = false;
  const std::vector<float> logits = {0, 1, 2, 0.5f};
  const Routing r = route_reference(c, logits, {}, 1);
  const double z = 1 + std::exp(1.0) + std::exp(2.0) + std::exp(0.5);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(r.weights[0], std::exp(2.0) / z, 1e-6);
  EXPECT_NEAR(r.weights[1], std::exp(1.0) / z, 1e-6);
}

TEST(RouteReference, AllTiedPicksLowestIndices) {
  const std::vector<float> zeros(8, 0.25f);
  const Routing s = route_reference(router_config(RouterKind::kSoftmaxTopK, 8, 3), zeros, {}, 1);
  EXPECT_EQ(s.ids, (std::vector<int32_t>{0, 1, 2}));
  const Routing g = route_reference(router_config(RouterKind::kGptOss, 8, 3), zeros, {}, 1);
  EXPECT_EQ(g.ids, (std::vector<int32_t>{0, 1, 2}));
  const Routing sg = route_reference(router_config(RouterKind::kSigmoidGrouped, 8, 3), zeros, {}, 1);
  EXPECT_EQ(sg.ids, (std::vector<int32_t>{0, 1, 2}));
  for (float w : s.weights) EXPECT_NEAR(w, 1.0 / 3, 1e-7);
}

TEST(RouteReference, GroupedSelectionCanExcludeTheSingleBestExpert) {
  // 2 groups of 4, keep 1, top-2, scaling 2.5, renormalized. Group 0 holds the best expert (logit 4,
  // s = 0.982) but its runner-up is poor: group score 0.982 + 0.018 = 1.000. Group 1 has two good
  // experts: 0.731 + 0.818 = 1.549 -> group 1 is kept and expert 0 is not chosen.
  const MoeConfig c = router_config(RouterKind::kSigmoidGrouped, 8, 2, 2, 1, 2.5f);
  const std::vector<float> logits = {4, -4, -4, -4, /**/ 1, 1.5f, -4, -4};
  const Routing r = route_reference(c, logits, {}, 1);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{5, 4}));
  const double s4 = sigmoid_d(1), s5 = sigmoid_d(1.5);
  EXPECT_NEAR(r.weights[0], 2.5 * s5 / (s4 + s5), 1e-6);
  EXPECT_NEAR(r.weights[1], 2.5 * s4 / (s4 + s5), 1e-6);
  EXPECT_NEAR(r.weights[0] + r.weights[1], 2.5, 1e-6);  // renormalized, then scaled
}

TEST(RouteReference, GroupTieKeepsLowerGroup) {
  // All scores equal: both groups score 1.0 -> group 0 kept -> experts 0, 1.
  const MoeConfig c = router_config(RouterKind::kSigmoidGrouped, 8, 2, 2, 1, 2.5f);
  const Routing r = route_reference(c, std::vector<float>(8, 0.0f), {}, 1);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.weights[0], 1.25f);
  EXPECT_EQ(r.weights[1], 1.25f);
}

TEST(RouteReference, GroupScoreUsesBiasedTopTwo) {
  // The bias moves group 0's top-2 sum above group 1's: 0.5+0.5+0.3+0.3 = 1.6 vs 0.731+0.731 = 1.462.
  const MoeConfig c = router_config(RouterKind::kSigmoidGrouped, 8, 2, 2, 1, 1.0f);
  const std::vector<float> logits = {0, 0, 0, 0, /**/ 1, 1, 0, 0};
  const std::vector<float> bias = {0.3f, 0.3f, 0, 0, 0, 0, 0, 0};
  const Routing r = route_reference(c, logits, bias, 1);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r.weights[0], 0.5, 1e-7);  // unbiased scores 0.5, 0.5 renormalized
  // Without the bias group 1 wins.
  const Routing nb = route_reference(c, logits, {}, 1);
  EXPECT_EQ(nb.ids, (std::vector<int32_t>{4, 5}));
}

TEST(RouteReference, SigmoidBiasSelectsButWeightsAreUnbiased) {
  MoeConfig c = router_config(RouterKind::kSigmoidGrouped, 8, 2, 1, 1, 2.5f);
  const std::vector<float> logits = {0, 0, 0, 0, 0, 0, 0, 2};
  const std::vector<float> bias = {0, 0, 0.6f, 0, 0, 0, 0, 0};
  // biased: expert 2 = 0.5 + 0.6 = 1.1 > expert 7 = 0.881 > others 0.5.
  const double s2 = 0.5, s7 = sigmoid_d(2);
  const Routing r = route_reference(c, logits, bias, 1);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 7}));
  EXPECT_NEAR(r.weights[0], 2.5 * s2 / (s2 + s7), 1e-6);
  EXPECT_NEAR(r.weights[1], 2.5 * s7 / (s2 + s7), 1e-6);
  c.renormalize = false;
  const Routing raw = route_reference(c, logits, bias, 1);
  EXPECT_EQ(raw.ids, r.ids);
  EXPECT_NEAR(raw.weights[0], 2.5 * s2, 1e-6);
  EXPECT_NEAR(raw.weights[1], 2.5 * s7, 1e-6);
}

TEST(RouteReference, GptOssSoftmaxOverTheChosenK) {
  const MoeConfig c = router_config(RouterKind::kGptOss, 4, 2);
  const std::vector<float> logits = {1, 2, 0.5f, 3};
  const std::vector<float> bias = {0, 0, 3, -2};
  // z = logits + bias = {1, 2, 3.5, 1}: top-2 = experts 2 (3.5), 1 (2); w = softmax(3.5, 2).
  const Routing r = route_reference(c, logits, bias, 1);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(r.weights[0], 1 / (1 + std::exp(-1.5)), 1e-6);
  EXPECT_NEAR(r.weights[1], std::exp(-1.5) / (1 + std::exp(-1.5)), 1e-6);
  // Without bias: experts 3 (3), 1 (2).
  const Routing nb = route_reference(c, logits, {}, 1);
  EXPECT_EQ(nb.ids, (std::vector<int32_t>{3, 1}));
  EXPECT_NEAR(nb.weights[0], 1 / (1 + std::exp(-1.0)), 1e-6);
}

TEST(RouteReference, SyntheticRoutingIsWellFormed) {
  for (const char* name : {"tiny", "glm-5", "deepseek-v3", "qwen3-30b", "gpt-oss-120b", "mixtral-8x7b"}) {
    SCOPED_TRACE(name);
    const MoeConfig& c = preset(name);
    const int64_t t_count = 37;
    const auto logits = make_synthetic_router_logits(c, 7, t_count);
    const auto bias = make_synthetic_router_bias(c, 7);
    EXPECT_EQ(bias.size(), c.router == RouterKind::kSoftmaxTopK ? 0u : static_cast<size_t>(c.num_experts));
    const Routing r = route_reference(c, logits, bias, t_count);
    const int k = c.top_k;
    for (int64_t t = 0; t < t_count; ++t) {
      std::vector<int32_t> ids(r.ids.begin() + t * k, r.ids.begin() + (t + 1) * k);
      double wsum = 0;
      for (int s = 0; s < k; ++s) {
        ASSERT_GE(ids[s], 0);
        ASSERT_LT(ids[s], c.num_experts);
        EXPECT_GT(r.weights[t * k + s], 0.0f);
        wsum += r.weights[t * k + s];
      }
      std::sort(ids.begin(), ids.end());
      EXPECT_EQ(std::adjacent_find(ids.begin(), ids.end()), ids.end()) << "duplicate expert, token " << t;
      EXPECT_NEAR(wsum, c.routed_scaling, 1e-5 * c.routed_scaling);  // every preset normalizes
      // slot order: descending selection score (logit for softmax; + bias otherwise; sigmoid monotonic)
      for (int s = 1; s < k; ++s) {
        auto score = [&](int32_t e) {
          const float l = logits[t * c.num_experts + e];
          if (c.router == RouterKind::kSoftmaxTopK) return l;
          if (c.router == RouterKind::kGptOss) return l + bias[e];
          return 1.0f / (1.0f + std::exp(-l)) + bias[e];
        };
        EXPECT_GE(score(r.ids[t * k + s - 1]), score(r.ids[t * k + s]));
      }
    }
  }
}

TEST(RouteReference, DeepSeekChoosesWithinTopkGroups) {
  const MoeConfig& c = preset("deepseek-v3");
  const int64_t t_count = 16;
  const Routing r = route_reference(c, make_synthetic_router_logits(c, 3, t_count), make_synthetic_router_bias(c, 3),
                                    t_count);
  const int gsize = c.num_experts / c.n_group;
  for (int64_t t = 0; t < t_count; ++t) {
    std::vector<int> groups;
    for (int s = 0; s < c.top_k; ++s) groups.push_back(r.ids[t * c.top_k + s] / gsize);
    std::sort(groups.begin(), groups.end());
    groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
    EXPECT_LE(static_cast<int>(groups.size()), c.topk_group);
  }
}

TEST(RouteReference, BadInputsNameTheProblem) {
  const MoeConfig& c = preset("tiny");
  const std::vector<float> logits(16, 0.5f);
  EXPECT_NE(error_of([&] { route_reference(c, logits, {}, 3); }).find("logits has 16 values"), std::string::npos);
  EXPECT_NE(error_of([&] { route_reference(c, logits, {}, 0); }).find("tokens = 0"), std::string::npos);
  EXPECT_NE(error_of([&] { route_reference(c, logits, {}, -2); }).find("tokens = -2"), std::string::npos);
  const std::vector<float> bad_bias(5, 0.0f);
  EXPECT_NE(error_of([&] { route_reference(c, logits, bad_bias, 2); }).find("bias has 5 values"), std::string::npos);
  const MoeConfig soft = router_config(RouterKind::kSoftmaxTopK, 8, 2);
  const std::vector<float> bias(8, 0.0f);
  EXPECT_NE(error_of([&] { route_reference(soft, logits, bias, 2); }).find("takes no bias"), std::string::npos);
  std::vector<float> nan_logits = logits;
  nan_logits[11] = std::nanf("");
  EXPECT_NE(error_of([&] { route_reference(c, nan_logits, {}, 2); }).find("logits[token 1, expert 3]"),
            std::string::npos);
}

// ------------------------------------------------------------------------------------------------
// Synthetic weights and inputs
// ------------------------------------------------------------------------------------------------

void expect_same_tensor(const Nvfp4Tensor& a, const Nvfp4Tensor& b) {
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(a.cols, b.cols);
  EXPECT_EQ(a.global_scale, b.global_scale);
  EXPECT_TRUE(a.codes == b.codes);
  EXPECT_TRUE(a.scales == b.scales);
}

// The recipe of reference.hpp, written directly with synth_weight (not the hoisted row generator).
ExpertWeights recipe_expert(const MoeConfig& c, uint64_t seed, int expert) {
  const bool shared = expert == kSharedExpert;
  const int64_t h = c.hidden, ie = shared ? c.intermediate * c.num_shared : c.intermediate;
  const uint32_t eid = shared ? 0 : static_cast<uint32_t>(expert);
  const float std1 = 1.0f / std::sqrt(static_cast<float>(h)), std2 = 1.0f / std::sqrt(static_cast<float>(ie));
  std::vector<float> g(ie * h), u(ie * h), d(h * ie);
  for (int64_t j = 0; j < ie; ++j)
    for (int64_t k = 0; k < h; ++k) {
      g[j * h + k] = synth_weight(seed, shared ? SynthTensor::kSharedGate : SynthTensor::kW1Gate, eid, j, k, std1);
      u[j * h + k] = synth_weight(seed, shared ? SynthTensor::kSharedUp : SynthTensor::kW1Up, eid, j, k, std1);
    }
  for (int64_t n = 0; n < h; ++n)
    for (int64_t j = 0; j < ie; ++j)
      d[n * ie + j] = synth_weight(seed, shared ? SynthTensor::kSharedDown : SynthTensor::kW2, eid, n, j, std2);
  ExpertWeights w;
  const float gs = nvfp4_global_scale(std::max(amax(g), amax(u)));
  w.gate = quantize_nvfp4(g, ie, h, gs);
  w.up = quantize_nvfp4(u, ie, h, gs);
  w.down = quantize_nvfp4(d, h, ie);
  if (c.expert_bias) {
    const uint32_t bid = shared ? 0xffffffffu : eid;
    for (int64_t j = 0; j < ie; ++j) {
      w.bias_gate.push_back(round_to_bf16(synth_weight(seed, SynthTensor::kBias1, bid, 0, j, 0.1f)));
      w.bias_up.push_back(round_to_bf16(synth_weight(seed, SynthTensor::kBias1, bid, 0, ie + j, 0.1f)));
    }
    for (int64_t n = 0; n < h; ++n)
      w.bias_down.push_back(round_to_bf16(synth_weight(seed, SynthTensor::kBias2, bid, 0, n, 0.1f)));
  }
  return w;
}

MoeConfig small_gptoss() {
  MoeConfig c = preset("gpt-oss-120b");
  c.name = "small-gpt-oss";
  c.format = WeightFormat::kNvfp4;  // the NVFP4 recipe on gpt-oss shapes (MXFP4: test_mxfp4_layout.cpp)
  c.hidden = 128;
  c.intermediate = 192;
  c.num_experts = 6;
  c.top_k = 2;
  return c;
}

TEST(SyntheticExpert, MatchesTheDocumentedRecipeBitForBit) {
  const MoeConfig& c = preset("tiny");
  for (int e : {0, 5, kSharedExpert}) {
    SCOPED_TRACE(e);
    const ExpertWeights a = make_synthetic_expert(c, 11, e);
    const ExpertWeights b = recipe_expert(c, 11, e);
    expect_same_tensor(a.gate, b.gate);
    expect_same_tensor(a.up, b.up);
    expect_same_tensor(a.down, b.down);
    EXPECT_EQ(a.gate.global_scale, a.up.global_scale);  // one global scale for gate and up
    EXPECT_TRUE(a.bias_gate.empty());
  }
  const MoeConfig g = small_gptoss();
  const ExpertWeights a = make_synthetic_expert(g, 5, 3), b = recipe_expert(g, 5, 3);
  expect_same_tensor(a.gate, b.gate);
  expect_same_tensor(a.down, b.down);
  EXPECT_EQ(a.bias_gate, b.bias_gate);
  EXPECT_EQ(a.bias_up, b.bias_up);
  EXPECT_EQ(a.bias_down, b.bias_down);
  EXPECT_NE(a.bias_gate, a.bias_up);
}

TEST(SyntheticExpert, ShapesSeedsAndErrors) {
  MoeConfig c = preset("tiny");
  c.num_shared = 2;
  const ExpertWeights s = make_synthetic_expert(c, 1, kSharedExpert);
  EXPECT_EQ(s.gate.rows, 2 * c.intermediate);
  EXPECT_EQ(s.gate.cols, c.hidden);
  EXPECT_EQ(s.down.rows, c.hidden);
  EXPECT_EQ(s.down.cols, 2 * c.intermediate);
  const ExpertWeights a = make_synthetic_expert(c, 1, 2), b = make_synthetic_expert(c, 1, 2);
  expect_same_tensor(a.gate, b.gate);
  EXPECT_NE(make_synthetic_expert(c, 2, 2).gate.codes, a.gate.codes);   // seed matters
  EXPECT_NE(make_synthetic_expert(c, 1, 3).gate.codes, a.gate.codes);   // expert matters
  EXPECT_NE(error_of([&] { make_synthetic_expert(c, 1, 8); }).find("expert = 8"), std::string::npos);
  EXPECT_NE(error_of([&] { make_synthetic_expert(c, 1, -2); }).find("expert = -2"), std::string::npos);
  EXPECT_NE(error_of([&] { make_synthetic_expert(preset("qwen3-30b"), 1, kSharedExpert); }).find("num_shared = 0"),
            std::string::npos);
}

TEST(SyntheticInputs, Bf16ValuedAndSpread) {
  const MoeConfig& c = preset("tiny");
  const auto x = make_synthetic_hidden(c, 3, 9);
  ASSERT_EQ(x.size(), 9u * c.hidden);
  double ss = 0;
  for (float v : x) {
    EXPECT_EQ(round_to_bf16(v), v);
    ss += double(v) * v;
  }
  EXPECT_NEAR(std::sqrt(ss / x.size()), 1.0, 0.1);
  const auto l = make_synthetic_router_logits(c, 3, 9);
  ss = 0;
  for (float v : l) ss += double(v) * v;
  EXPECT_NEAR(std::sqrt(ss / l.size()), 2.0, 0.6);
  EXPECT_EQ(make_synthetic_hidden(c, 3, 9), x);
  EXPECT_NE(make_synthetic_hidden(c, 4, 9), x);
}

// ------------------------------------------------------------------------------------------------
// Activations
// ------------------------------------------------------------------------------------------------

TEST(Activation, SwiGLUByHand) {
  EXPECT_NEAR(swiglu_reference(1.0f, 2.0f), 2.0 * sigmoid_d(1.0), 1e-6);  // silu(1) * 2 = 1.4621172
  EXPECT_NEAR(swiglu_reference(-2.0f, 0.5f), 0.5 * -2.0 * sigmoid_d(-2.0), 1e-7);
  EXPECT_EQ(swiglu_reference(0.0f, 3.0f), 0.0f);
}

TEST(Activation, GptOssClampedSwiGLUByHand) {
  // no clamping: (2 + 1) * 1 * sigmoid(1.702) = 2.537387
  EXPECT_NEAR(gptoss_swiglu_reference(1.0f, 2.0f, 1.702f, 7.0f), 3.0 * sigmoid_d(1.702), 1e-6);
  EXPECT_NEAR(gptoss_swiglu_reference(1.0f, 2.0f, 1.702f, 7.0f), 2.537387, 2e-6);
  // gate 10 -> 7, up -9 -> -7: (-7 + 1) * 7 * sigmoid(11.914) = -41.99972
  EXPECT_NEAR(gptoss_swiglu_reference(10.0f, -9.0f, 1.702f, 7.0f), -42.0 * sigmoid_d(1.702 * 7), 1e-5);
  // up 12 -> 7: (7 + 1) * 2 * sigmoid(3.404)
  EXPECT_NEAR(gptoss_swiglu_reference(2.0f, 12.0f, 1.702f, 7.0f), 16.0 * sigmoid_d(3.404), 1e-5);
  // the gate is clamped only from above: gate -10 stays -10: (0.5 + 1) * -10 * sigmoid(-17.02)
  EXPECT_NEAR(gptoss_swiglu_reference(-10.0f, 0.5f, 1.702f, 7.0f), -15.0 * sigmoid_d(-17.02), 1e-9);
  // up -1 zeroes the output whatever the gate
  EXPECT_EQ(gptoss_swiglu_reference(3.0f, -1.0f, 1.702f, 7.0f), 0.0f);
}

// ------------------------------------------------------------------------------------------------
// Expert compute against a naive double implementation
// ------------------------------------------------------------------------------------------------

// Naive: weights via Nvfp4Tensor::at, everything in double, no rounding anywhere; hidden used as given.
std::vector<double> naive_expert(const MoeConfig& c, const ExpertWeights& w, const float* x) {
  const int64_t h = c.hidden, ie = w.gate.rows;
  std::vector<double> act(ie), y(h);
  for (int64_t j = 0; j < ie; ++j) {
    double g = 0, u = 0;
    for (int64_t k = 0; k < h; ++k) {
      g += double(w.gate.at(j, k)) * x[k];
      u += double(w.up.at(j, k)) * x[k];
    }
    if (c.expert_bias) {
      g += w.bias_gate[j];
      u += w.bias_up[j];
    }
    if (c.activation == Activation::kGptOssSwiGLU) {
      g = std::min<double>(g, c.swiglu_limit);
      u = std::clamp<double>(u, -c.swiglu_limit, c.swiglu_limit);
      act[j] = (u + 1) * g * sigmoid_d(double(c.swiglu_alpha) * g);
    } else {
      act[j] = g * sigmoid_d(g) * u;
    }
  }
  for (int64_t n = 0; n < h; ++n) {
    double s = 0;
    for (int64_t j = 0; j < ie; ++j) s += double(w.down.at(n, j)) * act[j];
    y[n] = s + (c.expert_bias ? w.bias_down[n] : 0.0);
  }
  return y;
}

std::vector<double> naive_layer(const MoeConfig& c, const std::vector<ExpertWeights>& experts,
                                const std::vector<float>& x, int64_t t_count, const Routing& r) {
  const int64_t h = c.hidden;
  std::vector<double> out(t_count * h, 0.0);
  for (int64_t t = 0; t < t_count; ++t) {
    for (int s = 0; s < c.top_k; ++s) {
      const auto y = naive_expert(c, experts[r.ids[t * c.top_k + s]], &x[t * h]);
      for (int64_t n = 0; n < h; ++n) out[t * h + n] += double(r.weights[t * c.top_k + s]) * y[n];
    }
    if (c.num_shared > 0) {
      const auto y = naive_expert(c, experts[c.num_experts], &x[t * h]);
      for (int64_t n = 0; n < h; ++n) out[t * h + n] += y[n];
    }
  }
  return out;
}

struct Layer {
  MoeConfig cfg;
  int64_t tokens;
  std::vector<float> x;
  Routing routing;
  std::vector<ExpertWeights> experts;  // E routed (+ shared)
};

Layer make_layer(const MoeConfig& c, uint64_t seed, int64_t t_count) {
  Layer l{c, t_count, make_synthetic_hidden(c, seed, t_count), {}, {}};
  l.routing = route_reference(c, make_synthetic_router_logits(c, seed, t_count), make_synthetic_router_bias(c, seed),
                              t_count);
  for (int e = 0; e < c.num_experts; ++e) l.experts.push_back(make_synthetic_expert(c, seed, e));
  if (c.num_shared > 0) l.experts.push_back(make_synthetic_expert(c, seed, kSharedExpert));
  return l;
}

struct ErrorStats {
  double max_abs = 0, max_ref = 0, rms_err = 0;
};
ErrorStats compare(const std::vector<float>& got, const std::vector<double>& want) {
  ErrorStats s;
  double ss = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::abs(double(got[i]) - want[i]);
    s.max_abs = std::max(s.max_abs, d);
    s.max_ref = std::max(s.max_ref, std::abs(want[i]));
    ss += d * d;
  }
  s.rms_err = std::sqrt(ss / got.size());
  return s;
}

TEST(MoeReference, TinyPureFloatMatchesNaiveDouble) {
  const Layer l = make_layer(preset("tiny"), 21, 13);
  const auto want = naive_layer(l.cfg, l.experts, l.x, l.tokens, l.routing);
  const auto got = moe_reference(l.cfg, l.experts, l.x, l.tokens, l.routing, {.round_intermediates = false});
  ASSERT_EQ(got.size(), want.size());
  const ErrorStats e = compare(got, want);
  EXPECT_GT(e.max_ref, 0.1);  // a real signal, not zeros
  // Float differences only: the activation in float (~1e-7 relative) and the final float conversions.
  EXPECT_LE(e.max_abs, 2e-6 * e.max_ref) << "max |ref| = " << e.max_ref;
}

TEST(MoeReference, TinyWithGpuRoundingIsBf16AndClose) {
  const Layer l = make_layer(preset("tiny"), 22, 13);
  const auto want = naive_layer(l.cfg, l.experts, l.x, l.tokens, l.routing);
  const auto got = moe_reference(l.cfg, l.experts, l.x, l.tokens, l.routing);
  const auto pure = moe_reference(l.cfg, l.experts, l.x, l.tokens, l.routing, {.round_intermediates = false});
  for (float v : got) ASSERT_EQ(round_to_bf16(v), v) << "output not bf16-valued";
  EXPECT_NE(got, pure);  // the rounding points are applied
  const ErrorStats e = compare(got, want);
  // bf16 has 8 significant bits: each rounding is <= 2^-9 relative. The activation rounding averages
  // out over I = 128 terms; the per-slot and final roundings each add <= 2^-9 of the value.
  EXPECT_LE(e.max_abs, 4.0 * std::ldexp(e.max_ref, -9)) << "max |ref| = " << e.max_ref;
  EXPECT_LE(e.rms_err, std::ldexp(e.max_ref, -9));
  EXPECT_GT(e.max_abs, 0.0);
}

// The rounding points emulated independently: naive double GEMMs, then bf16 exactly where the header
// says. Differences can only come from float-vs-double weight products flipping a bf16 rounding.
TEST(MoeReference, TinyRoundingPointsEmulated) {
  const Layer l = make_layer(preset("tiny"), 23, 9);
  const MoeConfig& c = l.cfg;
  const int64_t h = c.hidden;
  auto expert_rounded = [&](const ExpertWeights& w, const float* x, float scale, bool apply_scale) {
    const int64_t ie = w.gate.rows;
    std::vector<float> act(ie);
    for (int64_t j = 0; j < ie; ++j) {
      double g = 0, u = 0;
      for (int64_t k = 0; k < h; ++k) {
        g += double(w.gate.at(j, k)) * x[k];
        u += double(w.up.at(j, k)) * x[k];
      }
      const float gf = float(g), uf = float(u);
      act[j] = round_to_bf16(gf / (1.0f + std::exp(-gf)) * uf);
    }
    std::vector<float> y(h);
    for (int64_t n = 0; n < h; ++n) {
      double s = 0;
      for (int64_t j = 0; j < ie; ++j) s += double(w.down.at(n, j)) * act[j];
      y[n] = round_to_bf16(apply_scale ? float(s) * scale : float(s));
    }
    return y;
  };
  std::vector<float> want(l.tokens * h);
  for (int64_t t = 0; t < l.tokens; ++t) {
    std::vector<float> acc(h, 0.0f);
    for (int s = 0; s < c.top_k; ++s) {
      const auto y = expert_rounded(l.experts[l.routing.ids[t * c.top_k + s]], &l.x[t * h],
                                    l.routing.weights[t * c.top_k + s], true);
      for (int64_t n = 0; n < h; ++n) acc[n] += y[n];
    }
    const auto ys = expert_rounded(l.experts[c.num_experts], &l.x[t * h], 1.0f, false);
    for (int64_t n = 0; n < h; ++n) want[t * h + n] = round_to_bf16(acc[n] + ys[n]);
  }
  const auto got = moe_reference(c, l.experts, l.x, l.tokens, l.routing);
  int64_t same = 0;
  double max_ref = 0, max_abs = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    same += got[i] == want[i];
    max_ref = std::max(max_ref, double(std::abs(want[i])));
    max_abs = std::max(max_abs, double(std::abs(got[i] - want[i])));
  }
  EXPECT_GE(same, static_cast<int64_t>(0.97 * got.size())) << same << " of " << got.size() << " identical";
  EXPECT_LE(max_abs, std::ldexp(max_ref, -8));
}

TEST(MoeReference, GptOssWithBiasesMatchesNaive) {
  const Layer l = make_layer(small_gptoss(), 31, 11);
  // make sure the clamp is exercised: scale some tokens up so |gate|, |up| exceed the limit of 7
  Layer big = l;
  for (float& v : big.x) v = round_to_bf16(v * 24.0f);
  for (const Layer* p : std::vector<const Layer*>{&l, &big}) {
    const auto want = naive_layer(p->cfg, p->experts, p->x, p->tokens, p->routing);
    const auto got = moe_reference(p->cfg, p->experts, p->x, p->tokens, p->routing, {.round_intermediates = false});
    const ErrorStats e = compare(got, want);
    EXPECT_GT(e.max_ref, 0.1);
    EXPECT_LE(e.max_abs, 2e-6 * e.max_ref) << "max |ref| = " << e.max_ref;
    const auto rounded = moe_reference(p->cfg, p->experts, p->x, p->tokens, p->routing);
    EXPECT_LE(compare(rounded, want).max_abs, 4.0 * std::ldexp(e.max_ref, -9));
  }
  // the clamp changes results: without it the big inputs would give a much larger output
  const auto g1 = expert_gemm1_reference(big.cfg, big.experts[0], std::span<const float>(big.x).first(big.cfg.hidden), 1,
                                         {.round_intermediates = false});
  const float limit_bound = (7.0f + 1.0f) * 7.0f;
  for (float a : g1) EXPECT_LE(std::abs(a), limit_bound);
}

TEST(MoeReference, SharedExpertIsAddedWithWeightOne) {
  MoeConfig with = preset("tiny");
  with.num_shared = 2;  // width 2I
  Layer l = make_layer(with, 41, 6);
  MoeConfig without = with;
  without.num_shared = 0;
  std::vector<ExpertWeights> routed(l.experts.begin(), l.experts.begin() + with.num_experts);
  const ReferenceOptions pure{.round_intermediates = false};
  const auto a = moe_reference(with, l.experts, l.x, l.tokens, l.routing, pure);
  const auto b = moe_reference(without, routed, l.x, l.tokens, l.routing, pure);
  const ExpertWeights& sh = l.experts.back();
  EXPECT_EQ(sh.gate.rows, 2 * with.intermediate);
  const auto act = expert_gemm1_reference(with, sh, l.x, l.tokens, pure);
  const auto ys = expert_gemm2_reference(with, sh, act, l.tokens, {}, pure);
  double max_ref = 0;
  for (float v : ys) max_ref = std::max(max_ref, double(std::abs(v)));
  EXPECT_GT(max_ref, 0.1);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i] - b[i], ys[i], 1e-5 * (1 + std::abs(a[i]))) << i;
  // and the naive layer agrees on the whole
  const ErrorStats e = compare(a, naive_layer(with, l.experts, l.x, l.tokens, l.routing));
  EXPECT_LE(e.max_abs, 2e-6 * e.max_ref);
}

TEST(MoeReference, GemmHalvesComposeToTheLayer) {
  MoeConfig c = preset("qwen3-30b");  // softmax router, no shared expert; shrunk
  c.hidden = 192;
  c.intermediate = 128;
  c.num_experts = 4;
  c.top_k = 1;
  const Layer l = make_layer(c, 51, 5);
  // top-1 softmax renormalized: weight 1, so the layer is exactly GEMM2(GEMM1(x)) of the chosen expert.
  const auto out = moe_reference(l.cfg, l.experts, l.x, l.tokens, l.routing);
  const int64_t h = l.cfg.hidden;
  for (int64_t t = 0; t < l.tokens; ++t) {
    ASSERT_EQ(l.routing.weights[t], 1.0f);
    const ExpertWeights& w = l.experts[l.routing.ids[t]];
    const auto xt = std::span<const float>(l.x).subspan(t * h, h);
    const auto act = expert_gemm1_reference(l.cfg, w, xt, 1);
    for (float v : act) ASSERT_EQ(round_to_bf16(v), v);
    const float one = 1.0f;
    const auto y = expert_gemm2_reference(l.cfg, w, act, 1, std::span<const float>(&one, 1));
    for (int64_t n = 0; n < h; ++n) ASSERT_EQ(out[t * h + n], y[n]) << "token " << t << " feature " << n;
  }
}

TEST(MoeReference, DeterministicAcrossRunsThreadsAndProviders) {
  const MoeConfig& c = preset("tiny");
  const int64_t t_count = 17;
  const auto x = make_synthetic_hidden(c, 61, t_count);
  const Routing r =
      route_reference(c, make_synthetic_router_logits(c, 61, t_count), make_synthetic_router_bias(c, 61), t_count);
  SyntheticExperts lazy(c, 61);
  const auto a = moe_reference(c, lazy, x, t_count, r, {.threads = 1});
  const auto b = moe_reference(c, SyntheticExperts(c, 61, false), x, t_count, r, {.threads = 4});
  const Layer l = make_layer(c, 61, t_count);
  const auto v = moe_reference(c, l.experts, x, t_count, r, {.threads = 3});
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
  EXPECT_EQ(std::memcmp(a.data(), v.data(), a.size() * 4), 0);
  const auto again = moe_reference(c, lazy, x, t_count, r);  // cached experts
  EXPECT_EQ(std::memcmp(a.data(), again.data(), a.size() * 4), 0);
  // a different seed gives a different layer
  const auto other = moe_reference(c, SyntheticExperts(c, 62), x, t_count, r);
  EXPECT_NE(std::memcmp(a.data(), other.data(), a.size() * 4), 0);
}

TEST(MoeReference, ProviderBuildsOnlyRoutedExperts) {
  // One token: top_k routed experts + the shared one are built, not all 64.
  MoeConfig many = preset("tiny");
  many.num_experts = 64;
  many.n_group = 8;
  many.topk_group = 2;
  many.top_k = 4;
  const auto x = make_synthetic_hidden(many, 71, 1);
  const Routing r = route_reference(many, make_synthetic_router_logits(many, 71, 1), {}, 1);
  SyntheticExperts p(many, 71);
  moe_reference(many, p, x, 1, r);
  EXPECT_EQ(p.built(), many.top_k + 1);
  moe_reference(many, p, x, 1, r);
  EXPECT_EQ(p.built(), many.top_k + 1);  // cached
}

// A real preset's shapes (I = 768 is not a power of two), experts fetched lazily from the provider.
TEST(MoeReference, Qwen3ShapesMatchNaive) {
  const MoeConfig& c = preset("qwen3-30b");
  const int64_t t_count = 2;
  const auto x = make_synthetic_hidden(c, 101, t_count);
  const Routing r = route_reference(c, make_synthetic_router_logits(c, 101, t_count), {}, t_count);
  SyntheticExperts p(c, 101);
  const auto got = moe_reference(c, p, x, t_count, r, {.round_intermediates = false});
  EXPECT_LE(p.built(), 2 * c.top_k);
  std::vector<double> want(t_count * c.hidden, 0.0);
  for (int64_t t = 0; t < t_count; ++t)
    for (int s = 0; s < c.top_k; ++s) {
      const auto y = naive_expert(c, *p.expert(r.ids[t * c.top_k + s]), &x[t * c.hidden]);
      for (int64_t n = 0; n < c.hidden; ++n) want[t * c.hidden + n] += double(r.weights[t * c.top_k + s]) * y[n];
    }
  const ErrorStats e = compare(got, want);
  EXPECT_GT(e.max_ref, 0.1);
  EXPECT_LE(e.max_abs, 2e-6 * e.max_ref) << "max |ref| = " << e.max_ref;
}

TEST(MoeReference, UncachedProviderBuildsOnEveryRequest) {
  SyntheticExperts p(preset("tiny"), 111, /*cache=*/false);
  const auto a = p.expert(3), b = p.expert(3);
  EXPECT_EQ(p.built(), 2);
  EXPECT_NE(a.get(), b.get());
  expect_same_tensor(a->gate, b->gate);
  expect_same_tensor(a->down, b->down);
  EXPECT_THROW(p.expert(8), Error);
}

TEST(MoeReference, ConcurrentRequestsBuildOnce) {
  const MoeConfig& c = preset("tiny");
  SyntheticExperts p(c, 81);
  std::vector<std::thread> th;
  std::vector<std::shared_ptr<const ExpertWeights>> got(6);
  for (int i = 0; i < 6; ++i) th.emplace_back([&, i] { got[i] = p.expert(i % 2); });
  for (auto& t : th) t.join();
  EXPECT_EQ(p.built(), 2);
  for (int i = 2; i < 6; ++i) EXPECT_EQ(got[i].get(), got[i % 2].get());
}

TEST(MoeReference, BadInputsNameTheProblem) {
  const Layer l = make_layer(preset("tiny"), 91, 3);
  const MoeConfig& c = l.cfg;
  EXPECT_NE(error_of([&] { moe_reference(c, l.experts, std::span<const float>(l.x).first(10), 3, l.routing); })
                .find("hidden has 10 values"),
            std::string::npos);
  EXPECT_NE(error_of([&] { moe_reference(c, l.experts, l.x, 0, l.routing); }).find("tokens = 0"), std::string::npos);
  EXPECT_NE(error_of([&] { moe_reference(c, l.experts, l.x, -1, l.routing); }).find("tokens = -1"), std::string::npos);
  Routing bad = l.routing;
  bad.ids[4] = 8;
  EXPECT_NE(error_of([&] { moe_reference(c, l.experts, l.x, 3, bad); }).find("id[token 2, slot 0] = 8"),
            std::string::npos);
  bad = l.routing;
  bad.weights.pop_back();
  EXPECT_NE(error_of([&] { moe_reference(c, l.experts, l.x, 3, bad); }).find("weights"), std::string::npos);
  bad = l.routing;
  bad.tokens = 2;
  EXPECT_NE(error_of([&] { moe_reference(c, l.experts, l.x, 3, bad); }).find("routing is for 2 tokens"),
            std::string::npos);
  std::vector<ExpertWeights> short_list(l.experts.begin(), l.experts.end() - 1);
  EXPECT_NE(error_of([&] { moe_reference(c, short_list, l.x, 3, l.routing); }).find("8 experts given"),
            std::string::npos);
  // weights of another shape (a config with a different hidden size)
  std::vector<ExpertWeights> wrong = l.experts;
  MoeConfig other = c;
  other.hidden = 128;
  wrong[l.routing.ids[0]] = make_synthetic_expert(other, 1, 0);
  EXPECT_NE(error_of([&] { moe_reference(c, wrong, l.x, 3, l.routing); }).find("gate is [128, 128]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { moe_reference(c, l.experts, l.x, 3, l.routing, {.threads = -1}); }).find("threads = -1"),
            std::string::npos);
}

}  // namespace
}  // namespace fp4moe

// Intermediate sizes that are not multiples of 64 (tensor-parallel slices): the layer zero-pads the
// expert weights to MoeConfig::kernel_intermediate() with the plans of weight_padding.hpp. These tests
// apply the same plans on the host and check, through the CPU reference, that the padded layer computes
// exactly (bit for bit) what the unpadded one does, for NVFP4 and MXFP4, both activations, biases,
// quantized and bf16 shared experts. The device side of a plan is cudaMemsetAsync + cudaMemcpy2DAsync
// with the plan's fields (tests/gpu/test_moe_layer_gpu.cu runs the padded layer against the reference).
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/ep_plan.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/tuner.hpp"
#include "fp4moe/weight_padding.hpp"
#include "../host_layer_util.hpp"

namespace fp4moe {
namespace {

std::vector<uint8_t> iota_bytes(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(1 + i % 251);  // never 0: padding shows
  return v;
}

TEST(WeightPadding, RowsAndColsPlansLayBytesOutExactly) {
  // [2 groups, 3 rows, 4 bytes] -> [2, 5, 4]
  const PadCopy r = pad_rows(2, 3, 5, 4);
  EXPECT_EQ(r.width, 12u);
  EXPECT_EQ(r.height, 2u);
  EXPECT_EQ(r.spitch, 12u);
  EXPECT_EQ(r.dpitch, 20u);
  EXPECT_EQ(r.dst_bytes, 40u);
  const std::vector<uint8_t> src = iota_bytes(r.src_bytes());
  std::vector<uint8_t> dst(r.dst_bytes, 0xee);
  apply_pad_copy_host(r, src.data(), dst.data());
  for (int g = 0; g < 2; ++g)
    for (int row = 0; row < 5; ++row)
      for (int b = 0; b < 4; ++b) {
        const uint8_t want = row < 3 ? src[(g * 3 + row) * 4 + b] : 0;
        EXPECT_EQ(dst[(g * 5 + row) * 4 + b], want) << g << " " << row << " " << b;
      }
  // [3 rows, 5 bytes] -> [3, 8]
  const PadCopy c = pad_cols(3, 5, 8);
  EXPECT_EQ(c.width, 5u);
  EXPECT_EQ(c.height, 3u);
  EXPECT_EQ(c.dpitch, 8u);
  EXPECT_EQ(c.dst_bytes, 24u);
  const std::vector<uint8_t> s2 = iota_bytes(c.src_bytes());
  std::vector<uint8_t> d2(c.dst_bytes, 0xee);
  apply_pad_copy_host(c, s2.data(), d2.data());
  for (int row = 0; row < 3; ++row)
    for (int b = 0; b < 8; ++b) EXPECT_EQ(d2[row * 8 + b], b < 5 ? s2[row * 5 + b] : 0) << row << " " << b;
}

TEST(WeightPadding, GemmPlansPerOperand) {
  // GEMM1 of I = 96 -> 128, H = 256: rows per half grow, K does not.
  const GemmPadPlan g1 = gemm_pad_plan(3, 2 * 96, 256, 2 * 128, 256, /*gate_up=*/true, WeightFormat::kNvfp4);
  EXPECT_EQ(g1.codes.height, 6u);                 // 3 experts x (gate, up)
  EXPECT_EQ(g1.codes.width, 96u * 128);           // 96 rows of 128 bytes
  EXPECT_EQ(g1.codes.dpitch, 128u * 128);
  EXPECT_EQ(g1.scales.width, 96u * 16);
  EXPECT_EQ(g1.scales.dpitch, 128u * 16);
  EXPECT_EQ(g1.bias.width, 96u * 4);
  EXPECT_EQ(g1.bias.dpitch, 128u * 4);
  EXPECT_EQ(g1.bias.height, 6u);
  // GEMM2: K grows; MXFP4 has one scale byte per 32.
  const GemmPadPlan g2 = gemm_pad_plan(3, 256, 96, 256, 128, false, WeightFormat::kMxfp4);
  EXPECT_EQ(g2.codes.height, 3u * 256);
  EXPECT_EQ(g2.codes.width, 48u);
  EXPECT_EQ(g2.codes.dpitch, 64u);
  EXPECT_EQ(g2.scales.width, 3u);
  EXPECT_EQ(g2.scales.dpitch, 4u);
  EXPECT_EQ(g2.bias.width, g2.bias.dpitch);       // the down bias [E, H] is not padded
  // Refusals name the sizes.
  EXPECT_THROW(gemm_pad_plan(1, 192, 96, 256, 128, true, WeightFormat::kNvfp4), Error);  // both grow
  EXPECT_THROW(gemm_pad_plan(1, 256, 48, 256, 64, false, WeightFormat::kMxfp4), Error);   // 48 % 32
  EXPECT_THROW(gemm_pad_plan(1, 256, 128, 256, 96, false, WeightFormat::kNvfp4), Error);  // shrinks
  EXPECT_THROW(pad_rows(1, 4, 3, 8), Error);
}

TEST(WeightPadding, ConfigRulesAndKernelWidths) {
  MoeConfig c = preset("qwen3-30b");
  c.intermediate = 96;  // qwen3-30b at tp 8
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.kernel_intermediate(), 128);
  EXPECT_EQ(c.gemm1_n(), 256);
  EXPECT_EQ(c.gemm2_k(), 128);
  c.intermediate = 40;  // not a whole number of 16-wide blocks
  try {
    c.validate();
    FAIL() << "intermediate = 40 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("intermediate = 40 must be a positive multiple of 16"), std::string::npos)
        << e.what();
  }
  MoeConfig g = preset("gpt-oss-120b");  // MXFP4: 32-wide blocks
  g.intermediate = 352;
  EXPECT_NO_THROW(g.validate());
  EXPECT_EQ(g.kernel_intermediate(), 384);
  g.intermediate = 336;  // a multiple of 16, not of 32
  EXPECT_THROW(g.validate(), Error);
  // Multiples of 64 are run as they are.
  EXPECT_EQ(preset("glm-5").kernel_intermediate(), preset("glm-5").intermediate);
  // The shared expert rounds its own width: 48 * 3 = 144 -> 192 (not 3 * 64).
  MoeConfig s = preset("tiny");
  s.intermediate = 48;
  s.num_shared = 3;
  EXPECT_EQ(s.kernel_shared_intermediate(), 192);
}

TEST(WeightPadding, TensorParallelSlices) {
  const MoeConfig q = tensor_parallel_slice(preset("qwen3-30b"), 8);
  EXPECT_EQ(q.intermediate, 96);
  EXPECT_EQ(q.name, "qwen3-30b tp8");
  EXPECT_EQ(tensor_parallel_slice(preset("glm-5"), 1).name, "glm-5");
  EXPECT_EQ(tensor_parallel_slice(preset("gpt-oss-120b"), 2).intermediate, 1440);
  EXPECT_EQ(tensor_parallel_slice(preset("kimi-k2"), 4).intermediate, 512);
  // gpt-oss at tp 8: 360 per rank is not a whole number of 32-wide MXFP4 blocks.
  try {
    tensor_parallel_slice(preset("gpt-oss-120b"), 8);
    FAIL() << "gpt-oss-120b tp 8 accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("tp = 8"), std::string::npos) << m;
    EXPECT_NE(m.find("360"), std::string::npos) << m;
    EXPECT_NE(m.find("3072"), std::string::npos) << m;  // the padded size that would split
  }
  EXPECT_THROW(tensor_parallel_slice(preset("glm-5"), 0), Error);
  EXPECT_THROW(tensor_parallel_slice(preset("glm-5"), 3), Error);  // 2048 / 3
}

TEST(WeightPadding, PresetLists) {
  EXPECT_EQ(parse_preset_list("glm-5"), std::vector<std::string>{"glm-5"});
  EXPECT_EQ(parse_preset_list("glm-5,kimi-k2,gpt-oss-120b,qwen3-30b,glm-5"),
            (std::vector<std::string>{"glm-5", "kimi-k2", "gpt-oss-120b", "qwen3-30b"}));
  const std::vector<std::string> all = parse_preset_list("all");
  EXPECT_EQ(all.size(), preset_names().size() - 1);
  EXPECT_EQ(std::find(all.begin(), all.end(), "tiny"), all.end());
  EXPECT_THROW(parse_preset_list("glm-5,,kimi-k2"), Error);
  try {
    parse_preset_list("glm-5,glm-9");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("glm-9"), std::string::npos) << e.what();
  }
}

TEST(WeightPadding, WorkspaceAndTilesUseKernelWidths) {
  MoeConfig c = preset("tiny");  // H = 256, shared expert of width I
  c.intermediate = 96;
  const MoeWorkspaceLayout l = moe_workspace_layout(c, 16, false);
  const int64_t rows = 16 * c.top_k;
  EXPECT_EQ(l.gemm2_out - l.gemm1_out, align_up(static_cast<size_t>(rows * 128 * 2), 256));
  EXPECT_EQ(l.shared_gemm2_out - l.shared_gemm1_out, align_up(static_cast<size_t>(16 * 128 * 2), 256));
  // Every token bucket picks configs that are valid for the padded K (a multiple of 64).
  for (int64_t T : {1, 8, 64, 1024}) {
    const MoeResolvedTileConfigs r = moe_layer_tile_configs(c, T, arch_from_name("sm_90"));
    EXPECT_EQ(128 % r.gemm2.bk, 0) << r.gemm2.name();
    EXPECT_EQ(128 % r.shared_gemm2.bk, 0) << r.shared_gemm2.name();
  }
}

TEST(WeightPadding, EpSliceOffsetsFollowTheScaleBlock) {
  // ep_slice_weights only offsets pointers: fake, never dereferenced, bases.
  for (WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    MoeConfig c = preset("tiny");
    c.format = f;
    const int64_t H = c.hidden, I = c.intermediate, sb = f == WeightFormat::kMxfp4 ? 32 : 16;
    static uint8_t base[1];
    MoeLayerWeights all;
    all.w13_codes = base;
    all.w13_scales = base;
    all.w2_codes = base;
    all.w2_scales = base;
    const MoeLayerWeights s = ep_slice_weights(c, all, 3, 2);
    EXPECT_EQ(s.w13_codes - base, 3 * 2 * I * H / 2);
    EXPECT_EQ(s.w13_scales - base, 3 * 2 * I * H / sb);
    EXPECT_EQ(s.w2_codes - base, 3 * H * I / 2);
    EXPECT_EQ(s.w2_scales - base, 3 * H * I / sb);
  }
}

// ---- the padded layer equals the unpadded one (CPU reference over both) ----

template <class V>
V padded(const PadCopy& p, const V& src) {
  V dst(p.dst_bytes / sizeof(typename V::value_type));
  EXPECT_EQ(src.size() * sizeof(typename V::value_type), p.src_bytes());
  apply_pad_copy_host(p, src.data(), dst.data());
  return dst;
}
HostBytes padded_bytes(const PadCopy& p, const HostBytes& src) {
  EXPECT_EQ(src.size(), p.src_bytes());
  HostBytes dst(p.dst_bytes);
  apply_pad_copy_host(p, src.data(), dst.data());
  return dst;
}

// The layer's padding (MoeLayer's constructor: the same plans with the same sizes), on the host.
HostMoeLayer pad_layer(const HostMoeLayer& L) {
  const MoeConfig& c = L.cfg;
  const int E = c.num_experts;
  const int64_t H = c.hidden, I = c.intermediate, Is = I * c.num_shared;
  const int64_t Ik = c.kernel_intermediate(), Isk = c.kernel_shared_intermediate();
  HostMoeLayer P;
  P.cfg = c;
  P.cfg.intermediate = Ik;
  const GemmPadPlan g1 = gemm_pad_plan(E, 2 * I, H, 2 * Ik, H, true, c.format);
  const GemmPadPlan g2 = gemm_pad_plan(E, H, I, H, Ik, false, c.format);
  P.w13_codes = padded_bytes(g1.codes, L.w13_codes);
  P.w13_scales = padded_bytes(g1.scales, L.w13_scales);
  P.w2_codes = padded_bytes(g2.codes, L.w2_codes);
  P.w2_scales = padded_bytes(g2.scales, L.w2_scales);
  P.w13_global = L.w13_global;
  P.w2_global = L.w2_global;
  if (c.expert_bias) {
    P.b13 = padded(g1.bias, L.b13);
    P.b2 = padded(g2.bias, L.b2);
  }
  P.router_bias = L.router_bias;
  P.shared = L.shared;
  if (L.shared == SharedExpertStorage::kQuantized) {
    const GemmPadPlan s1 = gemm_pad_plan(1, 2 * Is, H, 2 * Isk, H, true, c.format);
    const GemmPadPlan s2 = gemm_pad_plan(1, H, Is, H, Isk, false, c.format);
    P.shared_w13_codes = padded(s1.codes, L.shared_w13_codes);
    P.shared_w13_scales = padded(s1.scales, L.shared_w13_scales);
    P.shared_w2_codes = padded(s2.codes, L.shared_w2_codes);
    P.shared_w2_scales = padded(s2.scales, L.shared_w2_scales);
    P.shared_w13_global = L.shared_w13_global;
    P.shared_w2_global = L.shared_w2_global;
  } else if (L.shared == SharedExpertStorage::kBf16) {
    P.shared_w13_bf16 = padded(pad_rows(2, Is, Isk, H * 2), L.shared_w13_bf16);
    P.shared_w2_bf16 = padded(pad_cols(H, Is * 2, Isk * 2), L.shared_w2_bf16);
  }
  // The reference sizes the shared expert as intermediate * num_shared: the layer's own rounding must
  // give the same width for this comparison to hold (true for the configs below).
  EXPECT_EQ(Isk, P.cfg.intermediate * c.num_shared) << "test config: pick I, num_shared with equal widths";
  return P;
}

void expect_padded_layer_equal(const MoeConfig& cfg, bool bf16_shared = false) {
  SCOPED_TRACE(testing::Message() << cfg.name << " I=" << cfg.intermediate << " shared=" << cfg.num_shared
                                  << (bf16_shared ? " (bf16)" : ""));
  ASSERT_NE(cfg.intermediate % 64, 0) << "the test needs a padded config";
  const uint64_t seed = 77;
  const HostMoeLayer L = test::stack_synthetic_layer(cfg, seed, bf16_shared);
  const HostMoeLayer P = pad_layer(L);
  const int64_t T = 37;
  const std::vector<float> hidden = make_synthetic_hidden(cfg, seed, T);
  const Routing routing = route_reference(cfg, make_synthetic_router_logits(cfg, seed, T), L.router_bias, T);
  const HostLayerExperts el(L), ep(P);
  for (bool round : {true, false}) {
    const ReferenceOptions o{.round_intermediates = round, .threads = 2};
    const std::vector<float> a = moe_reference(cfg, el, hidden, T, routing, o);
    const std::vector<float> b = moe_reference(P.cfg, ep, hidden, T, routing, o);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "round = " << round;
    double norm = 0;
    for (float v : a) norm += static_cast<double>(v) * v;
    EXPECT_GT(norm, 0.0);  // a real signal, not zeros
  }
  // The padded features of GEMM1 + activation are exact zeros, whatever the token.
  const std::shared_ptr<const ExpertWeights> x = ep.expert(routing.ids[0]);
  const std::vector<float> act = expert_gemm1_reference(P.cfg, *x, std::span<const float>(hidden).first(static_cast<size_t>(cfg.hidden * 3)), 3);
  const int64_t I = cfg.intermediate, Ik = P.cfg.intermediate;
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t j = I; j < Ik; ++j) {
      EXPECT_EQ(act[r * Ik + j], 0.0f) << r << " " << j;
    }
}

MoeConfig small(const char* base, int64_t I, int num_shared) {
  return test::small_config(base, 128, I, 8, 3, num_shared);
}

TEST(WeightPadding, PaddedLayerEqualsUnpaddedNvfp4) {
  expect_padded_layer_equal(small("qwen3-30b", 96, 0));   // softmax router, tp-8 width
  expect_padded_layer_equal(small("glm-5", 80, 1));       // sigmoid router, fused-width shared expert
  expect_padded_layer_equal(small("glm-5", 48, 2));       // wide shared expert: 96 -> 128
  expect_padded_layer_equal(small("glm-5", 112, 1), /*bf16_shared=*/true);
}

TEST(WeightPadding, PaddedLayerEqualsUnpaddedGptOss) {
  MoeConfig nv = small("gpt-oss-120b", 80, 0);  // clamped SwiGLU with biases, NVFP4
  nv.format = WeightFormat::kNvfp4;
  expect_padded_layer_equal(nv);
  expect_padded_layer_equal(small("gpt-oss-120b", 96, 0));   // MXFP4, 32-wide blocks
  expect_padded_layer_equal(small("gpt-oss-120b", 160, 0));
}

}  // namespace
}  // namespace fp4moe

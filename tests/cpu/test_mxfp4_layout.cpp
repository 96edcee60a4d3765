// MXFP4 through the NVFP4 kernel layout (nvfp4_weight_layout.hpp): the repack round-trips, the
// kernel's decode (pair * 128 + 0, the bf16 multiply, the epilogue's global * 2^8) reproduces every
// e2m1 x 2^(e-127) exactly, and malformed or out-of-range scales are refused by expert, row and block.
// Plus the CPU reference's MXFP4 experts and the gpt-oss preset.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "fp4moe/config.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/nvfp4_weight_layout.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe {
namespace {

struct Mx {
  std::vector<uint8_t> codes, scales;
};

// Random MXFP4 weights whose E8M0 exponents span [lo, hi]; every block holds a nonzero code.
Mx random_mx(int64_t n, int64_t k, int lo, int hi, uint32_t seed) {
  std::mt19937 rng(seed);
  Mx w;
  w.codes.resize(n * k / 2);
  w.scales.resize(n * k / 32);
  for (auto& c : w.codes) c = static_cast<uint8_t>(rng());
  for (int64_t b = 0; b < n * k / 32; ++b) w.codes[b * 16] |= 0x01;  // a nonzero code in every block
  for (auto& s : w.scales) s = static_cast<uint8_t>(lo + static_cast<int>(rng() % (hi - lo + 1)));
  return w;
}

TEST(Mxfp4Layout, RoundTripIsBitExactBothRowOrders) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{16, 64}, {48, 128}, {32, 2880}}) {
    for (bool inter : {false, true}) {
      const Mx w = random_mx(n, k, 100, 140, static_cast<uint32_t>(n + k + inter));
      std::vector<uint8_t> rc(repacked_codes_bytes(n, k)), rs(repacked_scales_bytes(n, k));
      float g = 0;
      repack_mxfp4_weights(w.codes.data(), w.scales.data(), n, k, inter, rc.data(), rs.data(), &g);
      const int max_e = *std::max_element(w.scales.begin(), w.scales.end());
      EXPECT_EQ(g, std::ldexp(1.0f, max_e - 136));  // 2^(max_e - 136)
      std::vector<uint8_t> c2(w.codes.size()), s2(w.scales.size());
      unpack_mxfp4_weights(rc.data(), rs.data(), g, n, k, inter, c2.data(), s2.data());
      EXPECT_EQ(c2, w.codes) << "n=" << n << " k=" << k;
      EXPECT_EQ(s2, w.scales) << "n=" << n << " k=" << k;
      // each per-32 scale fills both per-16 slots of the kernel layout
      for (int64_t mt = 0; mt < n / 16; ++mt)
        for (int64_t ch = 0; ch < k / 64; ++ch)
          for (int g8 = 0; g8 < 8; ++g8)
            for (int half = 0; half < 2; ++half)
              for (int j = 0; j < 4; j += 2)
                ASSERT_EQ(rs[layout::scale_byte_offset(mt, ch, g8, j, half, k)],
                          rs[layout::scale_byte_offset(mt, ch, g8, j + 1, half, k)]);
    }
  }
}

uint16_t emulate_mul(uint16_t a, uint16_t b) {
  return float_to_bf16_bits(bf16_bits_to_float(a) * bf16_bits_to_float(b));
}

// The kernel's arithmetic, emulated: repacked byte b -> bf16 bits b * 128 + 0 = 2^(b-127); the placed
// code (bf16 v * 2^-126) times it, rounded to bf16 (mul.bf16x2); the FP32 accumulator times
// global * kAccumulatorScale. Every code of every exponent within the accepted range is exact.
TEST(Mxfp4Layout, KernelDecodeIsExactForEveryCodeAndExponent) {
  for (int max_e : {layout::kMxfp4MinMaxExponent, 60, 127, 200, 254}) {
    const int c = layout::mxfp4_expert_offset(max_e);
    const float global = layout::mxfp4_expert_global(max_e);
    ASSERT_EQ(global, std::ldexp(1.0f, max_e - 136));
    ASSERT_TRUE(std::isnormal(global));
    for (int e = std::max(0, max_e - (254 - layout::kMxfp4MinByte)); e <= max_e; ++e) {
      const int b = e + c;
      ASSERT_GE(b, layout::kMxfp4MinByte);
      ASSERT_LE(b, 254);
      const uint16_t sbits = static_cast<uint16_t>(static_cast<uint32_t>(b) * layout::kMxfp4ScaleMul +
                                                   (layout::kMxfp4ScaleAdd & 0xffffu));
      for (uint8_t code = 0; code < 16; ++code) {
        // pair 2, low half: the magnitude lands at bf16 bits 6..8, the sign at bit 15 (v * 2^-126)
        const uint32_t placed = layout::place_code(code, 4);
        const uint16_t p = static_cast<uint16_t>(placed & 0x81C0u);
        const uint16_t w = emulate_mul(p, sbits);
        const double got = double(bf16_bits_to_float(w)) * double(global) * double(layout::kAccumulatorScale);
        const double want = double(e2m1_to_float(code)) * std::ldexp(1.0, e - 127);
        ASSERT_EQ(got, want) << "max_e " << max_e << " e " << e << " code " << int(code);
        // and the bf16 product itself is a normal number (or zero): no reliance on subnormal math
        const float wf = bf16_bits_to_float(w);
        ASSERT_TRUE(wf == 0.0f || std::isnormal(wf)) << "e " << e << " code " << int(code);
      }
    }
  }
}

TEST(Mxfp4Layout, RejectsNaNScaleAndOutOfRangeBlocks) {
  const int64_t n = 32, k = 128;
  std::vector<uint8_t> rc(repacked_codes_bytes(n, k)), rs(repacked_scales_bytes(n, k));
  float g = 0;
  {
    Mx w = random_mx(n, k, 120, 130, 1);
    w.scales[5 * 4 + 3] = 0xff;  // row 5, k-block 3
    try {
      repack_mxfp4_weights(w.codes.data(), w.scales.data(), n, k, false, rc.data(), rs.data(), &g);
      FAIL() << "NaN accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("row 5, k-block 3"), std::string::npos) << m;
      EXPECT_NE(m.find("0xFF"), std::string::npos) << m;
    }
  }
  {
    Mx w = random_mx(n, k, 120, 130, 2);
    w.scales[9 * 4 + 1] = 130 - 127;  // 127 binades below the largest: bf16 products would be subnormal
    w.scales[0] = 130;
    try {
      repack_mxfp4_weights(w.codes.data(), w.scales.data(), n, k, true, rc.data(), rs.data(), &g);
      FAIL() << "out-of-range block accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("row 9, k-block 1"), std::string::npos) << m;
      EXPECT_NE(m.find("underflow"), std::string::npos) << m;
    }
    w.scales[9 * 4 + 1] = 130 - 126;  // exactly the widest accepted range
    EXPECT_NO_THROW(repack_mxfp4_weights(w.codes.data(), w.scales.data(), n, k, true, rc.data(), rs.data(), &g));
  }
  {
    // an all-zero block may carry any scale: it dequantizes to zero whatever it is
    Mx w = random_mx(n, k, 120, 130, 3);
    for (int i = 0; i < 16; ++i) w.codes[(7 * 4 + 2) * 16 + i] = 0x88;  // -0, -0
    w.scales[7 * 4 + 2] = 0;
    EXPECT_NO_THROW(repack_mxfp4_weights(w.codes.data(), w.scales.data(), n, k, false, rc.data(), rs.data(), &g));
  }
  {
    // an expert whose largest scale is below 2^-117: its FP32 scale would not be normal
    Mx w = random_mx(n, k, 1, 9, 4);
    EXPECT_THROW(repack_mxfp4_weights(w.codes.data(), w.scales.data(), n, k, false, rc.data(), rs.data(), &g), Error);
  }
}

MoeConfig small_mx() {
  MoeConfig c = preset("gpt-oss-120b");
  c.name = "gptoss-mx-small";
  c.hidden = 128;
  c.intermediate = 64;
  c.num_experts = 4;
  c.top_k = 2;
  return c;
}

TEST(Mxfp4Reference, SyntheticExpertsAreMxfp4AndTheGemmsUseTheirExactValues) {
  const MoeConfig cfg = small_mx();
  ASSERT_EQ(cfg.format, WeightFormat::kMxfp4);
  const ExpertWeights w = make_synthetic_expert(cfg, 3, 1);
  ASSERT_EQ(w.storage, ExpertStorage::kMxfp4);
  ASSERT_EQ(w.mx_gate.rows, 64);
  ASSERT_EQ(w.mx_down.cols, 64);
  const int64_t rows = 3;
  const std::vector<float> x = make_synthetic_hidden(cfg, 4, rows);
  const ReferenceOptions no_round{.round_intermediates = false, .threads = 1};
  const std::vector<float> act = expert_gemm1_reference(cfg, w, x, rows, no_round);
  const std::vector<float> g = dequantize_mxfp4(w.mx_gate), u = dequantize_mxfp4(w.mx_up);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < 64; ++j) {
      double sg = 0, su = 0;
      for (int64_t h = 0; h < 128; ++h) {
        sg += double(g[j * 128 + h]) * x[r * 128 + h];
        su += double(u[j * 128 + h]) * x[r * 128 + h];
      }
      const float want = gptoss_swiglu_reference(float(sg) + w.bias_gate[j], float(su) + w.bias_up[j],
                                                 cfg.swiglu_alpha, cfg.swiglu_limit);
      ASSERT_NEAR(act[r * 64 + j], want, 1e-6f * std::max(1.0f, std::fabs(want)));
    }
  // The layer runs on MXFP4 experts.
  const std::vector<float> logits = make_synthetic_router_logits(cfg, 5, rows);
  const Routing r = route_reference(cfg, logits, make_synthetic_router_bias(cfg, 5), rows);
  SyntheticExperts experts(cfg, 3);
  const std::vector<float> out = moe_reference(cfg, experts, x, rows, r);
  for (float v : out) ASSERT_TRUE(std::isfinite(v));
}

TEST(Mxfp4Reference, GptOssPresetIsMxfp4) {
  EXPECT_EQ(preset("gpt-oss-120b").format, WeightFormat::kMxfp4);
  EXPECT_EQ(preset("glm-5").format, WeightFormat::kNvfp4);
}

}  // namespace
}  // namespace fp4moe

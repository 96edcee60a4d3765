// The kernel weight layout: repack/unpack round trips bit-exactly, the bit placement is a bijection,
// and the dequantization arithmetic (emulated here exactly as the GPU executes it) reproduces every
// e2m1 x E4M3 product bit for bit.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/nvfp4_weight_layout.hpp"

namespace fp4moe {
namespace {

struct DiskWeights {
  std::vector<uint8_t> codes, scales;
};

DiskWeights random_disk(int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  DiskWeights w;
  w.codes.resize(n * k / 2);
  w.scales.resize(n * k / 16);
  for (auto& c : w.codes) c = static_cast<uint8_t>(rng());
  // every positive finite E4M3 value, subnormals included
  for (auto& s : w.scales) s = static_cast<uint8_t>(1 + rng() % 0x7e);
  return w;
}

TEST(Repack, RoundTripIsBitExactBothRowOrders) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{16, 64}, {48, 128}, {128, 192}, {32, 2880}}) {
    if (k % 64) continue;
    for (bool inter : {false, true}) {
      const auto w = random_disk(n, k, static_cast<uint32_t>(n * 7 + k + inter));
      std::vector<uint8_t> rc(repacked_codes_bytes(n, k)), rs(repacked_scales_bytes(n, k));
      repack_nvfp4_weights(w.codes.data(), w.scales.data(), n, k, inter, rc.data(), rs.data());
      std::vector<uint8_t> c2(w.codes.size()), s2(w.scales.size());
      unpack_nvfp4_weights(rc.data(), rs.data(), n, k, inter, c2.data(), s2.data());
      EXPECT_EQ(c2, w.codes) << "n=" << n << " k=" << k << " interleave=" << inter;
      EXPECT_EQ(s2, w.scales) << "n=" << n << " k=" << k << " interleave=" << inter;
    }
  }
}

TEST(Repack, BitPlacementIsABijection) {
  uint32_t seen = 0;
  for (int v = 0; v < 8; ++v) {
    for (int b = 0; b < 4; ++b) {
      const uint32_t bit = 1u << layout::code_bit_pos(v, b);
      EXPECT_EQ(seen & bit, 0u) << "value " << v << " code bit " << b;
      seen |= bit;
    }
  }
  EXPECT_EQ(seen, 0xffffffffu);
  for (int v = 0; v < 8; ++v)
    for (uint8_t c = 0; c < 16; ++c) EXPECT_EQ(layout::extract_code(layout::place_code(c, v), v), c);
}

// Every word bit reaches exactly one target bit of one pair through place_pair, and that target is
// where stored_bit says it is stored: the kernels' shifts and the repack's placement agree.
TEST(Repack, PlacePairInvertsStoredBit) {
  for (int pair = 0; pair < 4; ++pair) {
    for (int t = 0; t < 32; ++t) {
      if (!((layout::kPairTargets >> t) & 1u)) continue;
      EXPECT_EQ(layout::place_pair(1u << layout::stored_bit(pair, t), pair), 1u << t) << "pair " << pair << " bit " << t;
    }
    // all other word bits are dropped by this pair
    uint32_t mine = 0;
    for (int t = 0; t < 32; ++t)
      if ((layout::kPairTargets >> t) & 1u) mine |= 1u << layout::stored_bit(pair, t);
    EXPECT_EQ(layout::place_pair(~mine, pair), 0u) << "pair " << pair;
  }
}

TEST(Repack, ScaleEncodingCoversEveryPositiveE4M3) {
  for (int b = 1; b < 0x7f; ++b) {
    const uint8_t code = layout::encode_scale(static_cast<uint8_t>(b));
    EXPECT_EQ(layout::decode_scale(code), b);
    // the kernel's decode: code * 16 + (236 << 7) is bf16(s * 2^118)
    const float m = bf16_bits_to_float(static_cast<uint16_t>(code * 16 + (236 << 7)));
    EXPECT_EQ(m, std::ldexp(e4m3_to_float(static_cast<uint8_t>(b)), 118)) << "e4m3 byte " << b;
  }
}

// Host emulation of dequant_fragment: the same integer ops, then bf16 x bf16 rounded to bf16 (the
// product of two bf16 is exact in float, so rounding it once is exactly what mul.bf16x2 does).
uint16_t emulate_pair_half(uint32_t placed, int half, uint16_t scale_bits) {
  const uint16_t w = static_cast<uint16_t>(placed >> (16 * half));
  return float_to_bf16_bits(bf16_bits_to_float(w) * bf16_bits_to_float(scale_bits));
}

TEST(Repack, DequantArithmeticIsExactForEveryCodeAndScale) {
  for (int b = 1; b < 0x7f; ++b) {
    const uint16_t sbits = static_cast<uint16_t>(layout::encode_scale(static_cast<uint8_t>(b)) * 16 + (236 << 7));
    for (uint8_t code = 0; code < 16; ++code) {
      for (int v = 0; v < 8; ++v) {
        const uint32_t word = layout::place_code(code, v);
        const uint32_t p = layout::place_pair(word, v >> 1);  // the kernels' integer ops
        const float got = bf16_bits_to_float(emulate_pair_half(p, v & 1, sbits));
        const float want = e2m1_to_float(code) * e4m3_to_float(static_cast<uint8_t>(b)) / 256.0f;
        ASSERT_EQ(got, want) << "code " << int(code) << " scale byte " << b << " value slot " << v;
      }
    }
  }
}

TEST(Repack, ZeroScaleBlockBecomesZeroCodes) {
  auto w = random_disk(16, 64, 5);
  w.scales[3] = 0;  // row 0, k-block 3
  std::vector<uint8_t> rc(repacked_codes_bytes(16, 64)), rs(repacked_scales_bytes(16, 64));
  repack_nvfp4_weights(w.codes.data(), w.scales.data(), 16, 64, false, rc.data(), rs.data());
  std::vector<uint8_t> c2(w.codes.size()), s2(w.scales.size());
  unpack_nvfp4_weights(rc.data(), rs.data(), 16, 64, false, c2.data(), s2.data());
  for (int col = 48; col < 64; ++col) EXPECT_EQ((c2[col / 2] >> ((col & 1) * 4)) & 0xf, 0) << col;
  EXPECT_EQ(s2[3], 1);  // stored as the smallest scale: the block still dequantizes to zeros
}

TEST(Repack, RejectsMalformedInput) {
  auto w = random_disk(16, 64, 6);
  std::vector<uint8_t> rc(repacked_codes_bytes(16, 64)), rs(repacked_scales_bytes(16, 64));
  w.scales[5] = 0x7f;  // NaN
  try {
    repack_nvfp4_weights(w.codes.data(), w.scales.data(), 16, 64, false, rc.data(), rs.data());
    FAIL() << "NaN scale accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NaN"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("row 1"), std::string::npos) << e.what();
  }
  w.scales[5] = 0x90;  // negative
  EXPECT_THROW(repack_nvfp4_weights(w.codes.data(), w.scales.data(), 16, 64, false, rc.data(), rs.data()), Error);
  try {
    repack_nvfp4_weights(w.codes.data(), w.scales.data(), 24, 64, false, rc.data(), rs.data());
    FAIL() << "n = 24 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n = 24"), std::string::npos) << e.what();
  }
  EXPECT_THROW(repack_nvfp4_weights(w.codes.data(), w.scales.data(), 16, 48, false, rc.data(), rs.data()), Error);
}

}  // namespace
}  // namespace fp4moe

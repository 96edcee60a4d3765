// Format arithmetic and host NVFP4/MXFP4 tensors, bit-exact against CUDA's own conversion headers
// (their host paths are plain C++) and against vectors worked by hand.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

uint8_t ref_e2m1(float x) { return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest); }
uint8_t ref_e4m3(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
float half_raw_to_float(__half_raw h) { return __half2float(__half(h)); }
uint16_t ref_bf16(float x) { return __nv_bfloat16_raw(__float2bfloat16_rn(x)).x; }

// x, its neighbours one and two ulps away, and the same for -x.
std::vector<float> around(float x) {
  std::vector<float> v;
  for (float s : {x, -x}) {
    float lo = s, hi = s;
    v.push_back(s);
    for (int i = 0; i < 2; ++i) {
      lo = std::nextafter(lo, -kInf);
      hi = std::nextafter(hi, kInf);
      v.push_back(lo);
      v.push_back(hi);
    }
  }
  return v;
}

// Log-uniform magnitudes over [2^lo, 2^hi) with random sign and all 23 mantissa bits random.
std::vector<float> random_magnitudes(std::mt19937& rng, size_t n, int lo, int hi) {
  std::uniform_int_distribution<int> e(lo, hi - 1);
  std::uniform_int_distribution<uint32_t> m(0, 0x7fffff), sgn(0, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = bits_float((sgn(rng) << 31) | (static_cast<uint32_t>(e(rng) + 127) << 23) | m(rng));
  return v;
}

std::vector<float> random_bits(std::mt19937& rng, size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = bits_float(static_cast<uint32_t>(rng()));
  return v;
}

std::vector<float> specials() {
  std::vector<float> v = {0.0f, -0.0f, kInf, -kInf, bits_float(0x7fc00000u), bits_float(0xffc00000u),
                          bits_float(0x7f800001u), bits_float(0xff812345u), FLT_MAX, -FLT_MAX,
                          FLT_MIN, -FLT_MIN, std::numeric_limits<float>::denorm_min(),
                          -std::numeric_limits<float>::denorm_min(), bits_float(0x007fffffu),
                          bits_float(0x80400000u), bits_float(0x00000123u)};
  return v;
}

// Expects fn to throw fp4moe::Error whose message contains every fragment (the argument's name,
// its value, the rule).
template <typename Fn>
void expect_error(Fn&& fn, std::initializer_list<const char*> fragments) {
  try {
    fn();
    ADD_FAILURE() << "expected fp4moe::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const char* f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "message: " << msg;
  }
}

// ---------------------------------------------------------------- E2M1

TEST(FormatE2M1, DecodeAllCodesMatchCuda) {
  const float expect[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 16; ++c) {
    const float ref = half_raw_to_float(__nv_cvt_fp4_to_halfraw(static_cast<uint8_t>(c), __NV_E2M1));
    EXPECT_EQ(float_bits(e2m1_to_float(static_cast<uint8_t>(c))), float_bits(ref)) << "code " << c;
    EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(c)), (c & 8) ? -expect[c & 7] : expect[c & 7]);
  }
}

TEST(FormatE2M1, BoundariesTiesAndGridMatchCuda) {
  std::vector<float> xs;
  // Every midpoint (the ties) and every grid value, one and two ulps either side, both signs.
  for (float t : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f,
                  4.0f, 6.0f, 6.5f, 7.0f, 8.0f, 1e6f, 1e30f})
    for (float x : around(t)) xs.push_back(x);
  for (float x : specials()) xs.push_back(x);
  for (float x : xs) EXPECT_EQ(float_to_e2m1(x), ref_e2m1(x)) << "x = " << x << " bits " << std::hex << float_bits(x);
  // The ties land on the even code; spelled out so a wrong oracle could not hide a bug.
  EXPECT_EQ(float_to_e2m1(0.25f), 0x0);
  EXPECT_EQ(float_to_e2m1(0.75f), 0x2);
  EXPECT_EQ(float_to_e2m1(1.25f), 0x2);
  EXPECT_EQ(float_to_e2m1(1.75f), 0x4);
  EXPECT_EQ(float_to_e2m1(2.5f), 0x4);
  EXPECT_EQ(float_to_e2m1(3.5f), 0x6);
  EXPECT_EQ(float_to_e2m1(5.0f), 0x6);
  EXPECT_EQ(float_to_e2m1(-5.0f), 0xe);
  EXPECT_EQ(float_to_e2m1(std::nextafter(5.0f, kInf)), 0x7);
  EXPECT_EQ(float_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(float_to_e2m1(-kInf), 0xf);
  EXPECT_EQ(float_to_e2m1(bits_float(0xffc00000u)), 0x7);  // NaN saturates to +6 whatever its sign
}

TEST(FormatE2M1, SubnormalFloatsMatchCuda) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> m(1, 0x7fffff);
  for (int i = 0; i < 20000; ++i) {
    const float x = bits_float((i & 1 ? 0x80000000u : 0u) | m(rng));
    ASSERT_EQ(float_to_e2m1(x), ref_e2m1(x)) << "bits " << std::hex << float_bits(x);
  }
}

TEST(FormatE2M1, RandomFloatsMatchCuda) {
  std::mt19937 rng(12);
  // Magnitudes 2^-6..2^5 cover every decision the grid makes; the raw-bit draw covers the rest.
  for (const auto& xs : {random_magnitudes(rng, 1 << 20, -6, 5), random_bits(rng, 1 << 18)})
    for (float x : xs) ASSERT_EQ(float_to_e2m1(x), ref_e2m1(x)) << "x = " << x << " bits " << std::hex << float_bits(x);
}

// ---------------------------------------------------------------- E4M3

TEST(FormatE4M3, DecodeAllCodesMatchCuda) {
  for (int c = 0; c < 256; ++c) {
    const float ref = half_raw_to_float(__nv_cvt_fp8_to_halfraw(static_cast<uint8_t>(c), __NV_E4M3));
    const float got = e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      EXPECT_EQ(c & 0x7f, 0x7f);
    } else {
      EXPECT_EQ(float_bits(got), float_bits(ref)) << "code " << c;
    }
  }
  EXPECT_EQ(e4m3_to_float(0x01), 1.0f / 512.0f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
}

TEST(FormatE4M3, EveryValueAndMidpointMatchCuda) {
  std::vector<float> xs;
  // Codes 0..0x7e are the finite non-negative values in increasing order; their midpoints are the
  // rounding decisions (exact in float: at most 5 significant bits).
  for (int c = 0; c < 0x7e; ++c) {
    const float v = e4m3_to_float(static_cast<uint8_t>(c)), w = e4m3_to_float(static_cast<uint8_t>(c + 1));
    for (float x : around(v)) xs.push_back(x);
    for (float x : around(0.5f * (v + w))) xs.push_back(x);
  }
  // Above 448: 464 is the tie with the missing 480 (ties to even 448), everything beyond saturates.
  for (float t : {448.0f, 456.0f, 464.0f, 480.0f, 512.0f, 1e6f, 1e38f}) for (float x : around(t)) xs.push_back(x);
  for (float x : specials()) xs.push_back(x);
  for (float x : xs) EXPECT_EQ(float_to_e4m3(x), ref_e4m3(x)) << "x = " << x << " bits " << std::hex << float_bits(x);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-kInf), 0xfe);
  EXPECT_EQ(float_to_e4m3(1.0f / 1024.0f), 0x00);  // tie between 0 and 2^-9 goes to even 0
}

TEST(FormatE4M3, RandomFloatsMatchCuda) {
  std::mt19937 rng(13);
  for (const auto& xs : {random_magnitudes(rng, 1 << 20, -12, 10), random_bits(rng, 1 << 18)})
    for (float x : xs) ASSERT_EQ(float_to_e4m3(x), ref_e4m3(x)) << "x = " << x << " bits " << std::hex << float_bits(x);
}

// ---------------------------------------------------------------- bf16

TEST(FormatBf16, MatchesCudaRounding) {
  std::mt19937 rng(14);
  std::vector<float> xs = specials();
  // Exact ties (low half 0x8000) on odd and even bf16 values, and their neighbours.
  for (uint32_t hi : {0x3f80u, 0x3f81u, 0x7f7fu, 0x0001u, 0x8080u})
    for (float x : around(bits_float((hi << 16) | 0x8000u))) xs.push_back(x);
  for (float x : random_bits(rng, 1 << 20)) xs.push_back(x);
  for (float x : xs) ASSERT_EQ(float_to_bf16_bits(x), ref_bf16(x)) << "bits " << std::hex << float_bits(x);
  // Every non-NaN bf16 survives the round trip.
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    if ((b & 0x7fffu) > 0x7f80u) continue;
    ASSERT_EQ(float_to_bf16_bits(bf16_bits_to_float(static_cast<uint16_t>(b))), b);
  }
}

// ---------------------------------------------------------------- NVFP4 scale recipe

// One 16-element row, quantized on its own.
Nvfp4Tensor quantize_block(const std::vector<float>& x, std::optional<float> g = std::nullopt) {
  return quantize_nvfp4(x, 1, static_cast<int64_t>(x.size()), g);
}

TEST(FormatNvfp4, GlobalScaleRecipe) {
  EXPECT_EQ(nvfp4_global_scale(2688.0f), 1.0f);  // 2688 = 6 * 448: the largest value at unit global
  EXPECT_EQ(nvfp4_global_scale(5376.0f), 2.0f);
  EXPECT_EQ(nvfp4_global_scale(0.0f), 1.0f);     // all-zero tensor
  EXPECT_EQ(nvfp4_global_scale(1.0f), 1.0f / 2688.0f);
}

TEST(FormatNvfp4, HandWorkedBlocks) {
  // Block amax 6 at global 1: scale = 6 / (6 * 1) = 1.0 = E4M3 0x38 (exponent 7 = bias, mantissa 0),
  // so each grid value encodes as itself.
  EXPECT_EQ(nvfp4_block_scale(6.0f, 1.0f), 0x38);
  {
    // Block 0: every grid value; block 1 holds 2688 = 6 * 448, the tensor amax, so global = 1.
    std::vector<float> row = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.5f, -1, -1.5f, -2, -3, -4, -6, 0};
    row.resize(32, 0.0f);
    row[16] = 2688.0f;
    const Nvfp4Tensor t = quantize_nvfp4(row, 1, 32);
    EXPECT_EQ(t.global_scale, 1.0f);
    ASSERT_EQ(t.scales.size(), 2u);
    EXPECT_EQ(t.scales[0], 0x38);
    EXPECT_EQ(t.scales[1], 0x7e);  // 2688 / 6 = 448, exactly the E4M3 max
    const uint8_t expect[15] = {0x0, 0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x7, 0x9, 0xa, 0xb, 0xc, 0xd, 0xe, 0xf};
    for (int i = 0; i < 15; ++i) EXPECT_EQ(packed_code(t.codes.data(), i), expect[i]) << i;
    EXPECT_EQ(packed_code(t.codes.data(), 16), 0x7);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(t.at(0, i), row[i]) << i;
  }
  // Global 1, block amax 3: scale 0.5 = 0x30; 3 / 0.5 = 6 -> code 7, 1.5 / 0.5 = 3 -> code 5.
  {
    std::vector<float> x(16, 0.0f);
    x[0] = 3.0f;
    x[1] = 1.5f;
    x[2] = -0.6f;  // 0.6 / 0.5 = 1.2 -> 1.0 (code 2), negative: 0xa
    const Nvfp4Tensor t = quantize_block(x, 1.0f);
    EXPECT_EQ(t.scales[0], 0x30);
    EXPECT_EQ(packed_code(t.codes.data(), 0), 0x7);
    EXPECT_EQ(packed_code(t.codes.data(), 1), 0x5);
    EXPECT_EQ(packed_code(t.codes.data(), 2), 0xa);
    EXPECT_EQ(t.at(0, 2), -0.5f);
  }
  // Global 1, block amax 5: ideal scale 5/6 = 0.8333 = 1.6667 * 2^-1; E4M3 keeps 3 mantissa bits,
  // 1.625 is nearer than 1.75, so scale = 0.8125 = 0x35 (exp 6, mantissa 5). Then 5 / 0.8125 = 6.15
  // saturates to 6, dequantizing to 4.875: the recipe's rounding of the scale, not a bug.
  {
    std::vector<float> x(16, 0.0f);
    x[0] = 5.0f;
    const Nvfp4Tensor t = quantize_block(x, 1.0f);
    EXPECT_EQ(t.scales[0], 0x35);
    EXPECT_EQ(e4m3_to_float(0x35), 0.8125f);
    EXPECT_EQ(t.at(0, 0), 4.875f);
  }
  // Clamp high: global 1, block amax 5376 -> ideal scale 896 > 448 -> 448 (0x7e); 5376/448 = 12
  // saturates to 6 -> 2688.
  {
    std::vector<float> x(16, 1.0f);
    x[3] = 5376.0f;
    const Nvfp4Tensor t = quantize_block(x, 1.0f);
    EXPECT_EQ(t.scales[0], 0x7e);
    EXPECT_EQ(t.at(0, 3), 2688.0f);
    EXPECT_EQ(t.at(0, 0), 0.0f);  // 1/448 rounds to 0
  }
  // Clamp low: global 1, block amax 1e-4 -> ideal scale 1.7e-5 < 2^-9 -> 2^-9 (0x01, the smallest
  // subnormal E4M3); 1e-4 * 512 = 0.0512 -> 0. At block amax 6 * 2^-9 the scale is exactly 2^-9.
  {
    std::vector<float> x(16, 0.0f);
    x[0] = 1e-4f;
    Nvfp4Tensor t = quantize_block(x, 1.0f);
    EXPECT_EQ(t.scales[0], 0x01);
    EXPECT_EQ(packed_code(t.codes.data(), 0), 0x0);
    x[0] = -6.0f / 512.0f;
    t = quantize_block(x, 1.0f);
    EXPECT_EQ(t.scales[0], 0x01);
    EXPECT_EQ(packed_code(t.codes.data(), 0), 0xf);
    EXPECT_EQ(t.at(0, 0), -6.0f / 512.0f);
  }
  // The all-zero block gets scale 1.0 (not 2^-9) and zero codes; an all-zero tensor gets global 1.
  {
    const Nvfp4Tensor t = quantize_block(std::vector<float>(16, 0.0f));
    EXPECT_EQ(t.global_scale, 1.0f);
    EXPECT_EQ(t.scales[0], 0x38);
    for (uint8_t c : t.codes) EXPECT_EQ(c, 0);
  }
  EXPECT_EQ(nvfp4_block_scale(0.0f, 1e-3f), 0x38);
}

TEST(FormatNvfp4, SharedGlobalScale) {
  // gate amax 2688, up amax 1344: alone, up would get global 0.5 and block scale 448. Shared global
  // = nvfp4_global_scale(max) = 1, so up's block scale is 1344 / 6 = 224 = 1.75 * 2^7 -> 0x76.
  std::vector<float> gate(16, 0.25f), up(16, -0.75f);
  gate[5] = 2688.0f;
  up[9] = -1344.0f;
  const float shared = nvfp4_global_scale(std::max(amax(gate), amax(up)));
  EXPECT_EQ(shared, 1.0f);
  const Nvfp4Tensor own = quantize_block(up);
  EXPECT_EQ(own.global_scale, 0.5f);
  EXPECT_EQ(own.scales[0], 0x7e);
  const Nvfp4Tensor t = quantize_block(up, shared);
  EXPECT_EQ(t.global_scale, 1.0f);
  EXPECT_EQ(t.scales[0], 0x76);
  EXPECT_EQ(t.at(0, 9), -1344.0f);
  EXPECT_EQ(t.at(0, 0), 0.0f);  // 0.75 / 224 is far below the first tie
}

// Builds a [rows, cols] tensor whose values lie on the NVFP4 grid for the given power-of-two global:
// random E4M3 scales, random codes, and a +-6 in every block so that the recipe recovers exactly that
// scale (6 * s * g / (6 * g) is exact). Returns the scales and codes it chose.
std::vector<float> grid_tensor(std::mt19937& rng, int64_t rows, int64_t cols, float g,
                               std::vector<uint8_t>& scales, std::vector<uint8_t>& codes) {
  std::uniform_int_distribution<int> sc(1, 0x7e), cd(0, 15), pos(0, 15), sgn(0, 1);
  const int64_t n = rows * cols;
  scales.resize(n / 16);
  codes.resize(n);
  std::vector<float> x(n);
  for (int64_t b = 0; b < n / 16; ++b) {
    scales[b] = static_cast<uint8_t>(sc(rng));
    for (int i = 0; i < 16; ++i) codes[b * 16 + i] = static_cast<uint8_t>(cd(rng));
    codes[b * 16 + pos(rng)] = sgn(rng) ? 0xf : 0x7;
    // Code 0x8 dequantizes to -0, which encodes back to 0x8: signed zeros round-trip too.
    for (int i = 0; i < 16; ++i) x[b * 16 + i] = nvfp4_dequantize_element(codes[b * 16 + i], scales[b], g);
  }
  return x;
}

TEST(FormatNvfp4, ExactRoundTripOnGrid) {
  std::mt19937 rng(21);
  for (float g : {1.0f, 0.03125f, 64.0f}) {
    std::vector<uint8_t> scales, codes;
    const int64_t rows = 5, cols = 96;
    const std::vector<float> x = grid_tensor(rng, rows, cols, g, scales, codes);
    const Nvfp4Tensor t = quantize_nvfp4(x, rows, cols, g);
    EXPECT_EQ(t.scales, scales);
    for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(packed_code(t.codes.data(), i), codes[i]) << i;
    const std::vector<float> d = dequantize_nvfp4(t);
    for (int64_t i = 0; i < rows * cols; ++i) {
      ASSERT_EQ(float_bits(d[i]), float_bits(x[i])) << i;
      ASSERT_EQ(float_bits(t.at(i / cols, i % cols)), float_bits(x[i]));
    }
  }
}

// Gaussian data with a few large outliers, the shape of real weights and activations.
std::vector<float> outlier_data(std::mt19937& rng, int64_t n, float sigma) {
  std::normal_distribution<float> nd(0.0f, sigma);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng) * (u(rng) < 0.01f ? 50.0f : 1.0f);
  return x;
}

TEST(FormatNvfp4, QuantizeErrorWithinHalfStep) {
  std::mt19937 rng(22);
  for (float sigma : {1.0f, 1e-3f, 300.0f}) {
    const int64_t rows = 7, cols = 128;
    const std::vector<float> x = outlier_data(rng, rows * cols, sigma);
    const Nvfp4Tensor t = quantize_nvfp4(x, rows, cols);
    EXPECT_EQ(t.global_scale, amax(x) / 2688.0f);
    const std::vector<float> d = dequantize_nvfp4(t);
    double err2 = 0, ref2 = 0;
    for (int64_t i = 0; i < rows * cols; ++i) {
      // With S = scale * global the error is half the E2M1 spacing around x / S: 0.25 S below 2,
      // 0.5 S below 4, S up to 6. The E4M3 rounding of the scale can push x / S to 6.4 at most
      // (6 / (1 - 2^-4)), which saturates with an error under S, so S bounds every element.
      const double S = double(e4m3_to_float(t.scales[i / 16])) * t.global_scale;
      const double y = std::fabs(x[i]) / S;
      const double bound = S * (y <= 2 ? 0.25 : y <= 4 ? 0.5 : 1.0) * (1 + 1e-6);
      ASSERT_LE(std::fabs(double(d[i]) - x[i]), bound) << "i " << i << " x " << x[i] << " S " << S;
      ASSERT_EQ(d[i], t.at(i / cols, i % cols));
      err2 += (double(d[i]) - x[i]) * (double(d[i]) - x[i]);
      ref2 += double(x[i]) * x[i];
    }
    // NVFP4 on Gaussian data lands near 10% relative RMS error; 15% flags a broken recipe.
    EXPECT_LT(std::sqrt(err2 / ref2), 0.15) << "sigma " << sigma;
  }
}

TEST(FormatNvfp4, Bf16MatchesFloatPath) {
  std::mt19937 rng(23);
  const int64_t rows = 3, cols = 64;
  const std::vector<float> x = outlier_data(rng, rows * cols, 2.0f);
  std::vector<uint16_t> xb(x.size());
  std::vector<float> xr(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    xb[i] = float_to_bf16_bits(x[i]);
    xr[i] = bf16_bits_to_float(xb[i]);
  }
  for (std::optional<float> g : {std::optional<float>{}, std::optional<float>{0.01f}}) {
    const Nvfp4Tensor a = quantize_nvfp4_bf16(xb, rows, cols, g), b = quantize_nvfp4(xr, rows, cols, g);
    EXPECT_EQ(float_bits(a.global_scale), float_bits(b.global_scale));
    EXPECT_EQ(a.scales, b.scales);
    EXPECT_EQ(a.codes, b.codes);
  }
}

// ---------------------------------------------------------------- packing

TEST(FormatPack, LowNibbleFirstAndRoundTrip) {
  const std::vector<uint8_t> codes = {0x1, 0x2, 0xf, 0x0, 0x7, 0x8};
  std::vector<uint8_t> packed(3), back(6);
  pack_e2m1(codes, packed);
  EXPECT_EQ(packed, (std::vector<uint8_t>{0x21, 0x0f, 0x87}));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(packed_code(packed.data(), i), codes[i]);
  unpack_e2m1(packed, back);
  EXPECT_EQ(back, codes);

  std::mt19937 rng(31);
  std::vector<uint8_t> all(4096), p(2048), u(4096);
  for (auto& c : all) c = static_cast<uint8_t>(rng() & 0xf);
  pack_e2m1(all, p);
  unpack_e2m1(p, u);
  EXPECT_EQ(u, all);
  for (int i = 0; i < 256; ++i) {  // every byte survives unpack -> pack
    const uint8_t b = static_cast<uint8_t>(i);
    uint8_t c[2], q;
    unpack_e2m1(std::span<const uint8_t>(&b, 1), c);
    pack_e2m1(c, std::span<uint8_t>(&q, 1));
    EXPECT_EQ(q, b);
  }
}

// ---------------------------------------------------------------- MXFP4

TEST(FormatMxfp4, ScaleRule) {
  // code = floor(log2(amax)) - 2 + 127: amax 6 -> 2 - 2 = 0 -> 127; amax 4 (same octave) -> 127;
  // amax 7.99 -> 127 too (7.99 / 1 saturates to 6: the OCP rule trades that for never overflowing
  // the exponent); amax 8 -> 128; amax 1 -> -2 -> 125; amax 0.5 -> 124.
  EXPECT_EQ(mxfp4_scale_code(6.0f), 127);
  EXPECT_EQ(mxfp4_scale_code(4.0f), 127);
  EXPECT_EQ(mxfp4_scale_code(7.99f), 127);
  EXPECT_EQ(mxfp4_scale_code(8.0f), 128);
  EXPECT_EQ(mxfp4_scale_code(1.0f), 125);
  EXPECT_EQ(mxfp4_scale_code(std::nextafter(1.0f, 0.0f)), 124);
  EXPECT_EQ(mxfp4_scale_code(0.5f), 124);
  EXPECT_EQ(mxfp4_scale_code(0.0f), 0);    // all-zero block: smallest scale
  EXPECT_EQ(mxfp4_scale_code(std::ldexp(1.0f, -124)), 1);  // -124 - 2 + 127
  EXPECT_EQ(mxfp4_scale_code(std::ldexp(1.0f, -125)), 0);
  EXPECT_EQ(mxfp4_scale_code(FLT_MIN), 0);  // -126 - 2 + 127 = -1, clamped
  // Subnormal amax: floor(log2) <= -127, so the code clamps to 0 as well.
  EXPECT_EQ(mxfp4_scale_code(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(mxfp4_scale_code(bits_float(0x00400000u)), 0);
  EXPECT_EQ(mxfp4_scale_code(FLT_MAX), 252);  // 127 - 2 + 127
  EXPECT_EQ(mxfp4_scale_code(bits_float(0x7fc00000u)), 0xff);
  for (int c = 0; c < 255; ++c) EXPECT_EQ(e8m0_to_float(static_cast<uint8_t>(c)), std::ldexp(1.0f, c - 127));
  EXPECT_TRUE(std::isnan(e8m0_to_float(0xff)));
  // Exhaustive over octaves: amax in [2^k, 2^(k+1)) gives code k + 125 for normal k.
  for (int k = -124; k <= 127; ++k) {
    EXPECT_EQ(mxfp4_scale_code(std::ldexp(1.0f, k)), k + 125) << k;
    EXPECT_EQ(mxfp4_scale_code(std::ldexp(1.9f, k)), k + 125) << k;
  }
}

TEST(FormatMxfp4, ExactRoundTripOnGridAndErrorBound) {
  std::mt19937 rng(41);
  const int64_t rows = 4, cols = 96;
  std::uniform_int_distribution<int> sc(100, 150), cd(0, 15), pos(0, 31), big(6, 7);
  std::vector<float> x(rows * cols);
  std::vector<uint8_t> scales(rows * cols / 32), codes(rows * cols);
  for (size_t b = 0; b < scales.size(); ++b) {
    scales[b] = static_cast<uint8_t>(sc(rng));
    for (int i = 0; i < 32; ++i) codes[b * 32 + i] = static_cast<uint8_t>(cd(rng));
    codes[b * 32 + pos(rng)] = static_cast<uint8_t>(big(rng));  // a 4 or 6 pins the octave
    for (int i = 0; i < 32; ++i) x[b * 32 + i] = mxfp4_dequantize_element(codes[b * 32 + i], scales[b]);
  }
  const Mxfp4Tensor t = quantize_mxfp4(x, rows, cols);
  EXPECT_EQ(t.scales, scales);
  const std::vector<float> d = dequantize_mxfp4(t);
  for (int64_t i = 0; i < rows * cols; ++i) {
    ASSERT_EQ(packed_code(t.codes.data(), i), codes[i]) << i;
    ASSERT_EQ(float_bits(d[i]), float_bits(x[i])) << i;
    ASSERT_EQ(t.at(i / cols, i % cols), x[i]);
  }

  const std::vector<float> y = outlier_data(rng, rows * cols, 0.7f);
  const Mxfp4Tensor q = quantize_mxfp4(y, rows, cols);
  const std::vector<float> dq = dequantize_mxfp4(q);
  for (int64_t i = 0; i < rows * cols; ++i) {
    // Half the E2M1 spacing in units of the scale, except that the block's octave puts amax / S in
    // [4, 8): values over 6 saturate with an error below 2 S.
    const double S = e8m0_to_float(q.scales[i / 32]);
    const double a = std::fabs(y[i]) / S;
    const double bound = S * (a <= 2 ? 0.25 : a <= 4 ? 0.5 : a <= 6 ? 1.0 : 2.0);
    ASSERT_LE(std::fabs(double(dq[i]) - y[i]), bound) << i;
  }
  const Mxfp4Tensor z = quantize_mxfp4(std::vector<float>(32, 0.0f), 1, 32);
  EXPECT_EQ(z.scales[0], 0);
  for (float v : dequantize_mxfp4(z)) EXPECT_EQ(v, 0.0f);
}

// ---------------------------------------------------------------- 128x4 swizzle

TEST(FormatSwizzle, OffsetFormulaAtBoundaries) {
  // Within a 512-byte atom: 16 bytes per (m % 32), then 4 per row group (m % 128) / 32, then kb % 4.
  EXPECT_EQ(swizzled_128x4_offset(0, 0, 1), 0);
  EXPECT_EQ(swizzled_128x4_offset(0, 1, 4), 1);
  EXPECT_EQ(swizzled_128x4_offset(1, 0, 4), 16);
  EXPECT_EQ(swizzled_128x4_offset(32, 0, 4), 4);
  EXPECT_EQ(swizzled_128x4_offset(127, 3, 4), 31 * 16 + 3 * 4 + 3);  // 511, the atom's last byte
  EXPECT_EQ(swizzled_128x4_offset(0, 4, 5), 512);    // second k-tile of the first row tile
  EXPECT_EQ(swizzled_128x4_offset(128, 0, 5), 1024);  // 2 k-tiles per row tile for kblocks 5
  EXPECT_EQ(swizzled_128x4_offset(129, 6, 7), 3 * 512 + 16 + 2);
  EXPECT_EQ(swizzled_128x4_offset(299, 2, 3), 2 * 512 + (299 % 32) * 16 + ((299 % 128) / 32) * 4 + 2);
  EXPECT_EQ(swizzled_128x4_size(1, 1), 512);
  EXPECT_EQ(swizzled_128x4_size(129, 5), 256 * 8);
  EXPECT_EQ(swizzled_128x4_size(300, 7), 384 * 8);
  EXPECT_EQ(swizzled_128x4_size(0, 3), 0);
}

TEST(FormatSwizzle, BijectivePaddingZeroRoundTrip) {
  std::mt19937 rng(51);
  for (int64_t rows : {1, 127, 128, 129, 300}) {
    for (int64_t kb : {1, 3, 4, 5, 7}) {
      const int64_t size = swizzled_128x4_size(rows, kb);
      ASSERT_EQ(size, (rows + 127) / 128 * 128 * ((kb + 3) / 4 * 4));
      // Every padded (row, kblock) must land on its own byte inside the buffer: the formula is a
      // bijection onto [0, size) once the padding is included.
      std::set<int64_t> seen;
      for (int64_t m = 0; m < (rows + 127) / 128 * 128; ++m)
        for (int64_t k = 0; k < (kb + 3) / 4 * 4; ++k) {
          const int64_t off = swizzled_128x4_offset(m, k, kb);
          ASSERT_GE(off, 0);
          ASSERT_LT(off, size);
          ASSERT_TRUE(seen.insert(off).second) << "rows " << rows << " kb " << kb << " m " << m << " k " << k;
        }
      ASSERT_EQ(static_cast<int64_t>(seen.size()), size);

      std::vector<uint8_t> rm(rows * kb);
      for (auto& v : rm) v = static_cast<uint8_t>(1 + rng() % 255);  // nonzero, so padding is visible
      const std::vector<uint8_t> sw = swizzle_scales_128x4(rm, rows, kb);
      ASSERT_EQ(static_cast<int64_t>(sw.size()), size);
      const int64_t nonzero = std::count_if(sw.begin(), sw.end(), [](uint8_t v) { return v != 0; });
      EXPECT_EQ(nonzero, rows * kb) << "padding must be zero";
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t k = 0; k < kb; ++k) ASSERT_EQ(sw[swizzled_128x4_offset(m, k, kb)], rm[m * kb + k]);
      EXPECT_EQ(unswizzle_scales_128x4(sw, rows, kb), rm);
    }
  }
}

// ---------------------------------------------------------------- bad input

TEST(FormatErrors, MessagesNameTheArgument) {
  const std::vector<float> x30(30, 1.0f), x32(32, 1.0f);
  expect_error([&] { quantize_nvfp4(x30, 1, 30); }, {"cols = 30", "multiple of 16"});
  expect_error([&] { quantize_nvfp4(x32, 3, 16); }, {"x.size() = 32", "rows * cols", "48"});
  expect_error([&] { quantize_nvfp4(x32, -1, 16); }, {"rows = -1"});
  expect_error([&] { quantize_nvfp4(x32, 2, 16, 0.0f); }, {"global_scale = 0", "> 0"});
  std::vector<float> bad = x32;
  bad[7] = std::nanf("");
  expect_error([&] { quantize_nvfp4(bad, 2, 16); }, {"x[7]", "finite"});
  const std::vector<uint16_t> b30(30, 0x3f80);
  expect_error([&] { quantize_nvfp4_bf16(b30, 1, 30); }, {"cols = 30", "16"});
  expect_error([&] { quantize_mxfp4(x32, 2, 16); }, {"cols = 16", "multiple of 32"});
  expect_error([&] { quantize_nvfp4(std::span<const float>(), 1, 16); }, {"x.size() = 0"});

  const Nvfp4Tensor t = quantize_nvfp4(x32, 2, 16);
  expect_error([&] { (void)t.at(2, 0); }, {"(r, c) = (2, 0)", "[2, 16]"});
  Nvfp4Tensor broken = t;
  broken.scales.pop_back();
  expect_error([&] { dequantize_nvfp4(broken); }, {"t.scales.size() = 1"});

  std::vector<uint8_t> codes3(3), p1(1), p2(2);
  expect_error([&] { pack_e2m1(codes3, p1); }, {"codes.size() = 3", "even"});
  const std::vector<uint8_t> big = {0x10, 0x1};
  expect_error([&] { pack_e2m1(big, p1); }, {"codes[0] = 16", "< 16"});
  expect_error([&] { unpack_e2m1(p2, codes3); }, {"codes.size() = 3", "2 * packed.size()"});

  const std::vector<uint8_t> rm(10);
  expect_error([&] { swizzle_scales_128x4(rm, 3, 4); }, {"row_major.size() = 10", "12"});
  expect_error([&] { unswizzle_scales_128x4(rm, 3, 4); }, {"swizzled.size() = 10", "512"});

  // The device launcher validates on the host before touching CUDA, so this runs without a GPU.
  auto fake = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  uint8_t* c8 = static_cast<uint8_t*>(fake(0x1000));
  float* g4 = static_cast<float*>(fake(0x2000));
  expect_error([&] { quantize_nvfp4_rows_device(fake(0x3000), 2, 30, c8, c8, g4, nullptr); },
               {"cols = 30", "multiple of 16"});
  expect_error([&] { quantize_nvfp4_rows_device(nullptr, 2, 32, c8, c8, g4, nullptr); },
               {"x = 0x0", "null"});
  expect_error([&] { quantize_nvfp4_rows_device(fake(0x3008), 2, 32, c8, c8, g4, nullptr); },
               {"x = 0x3008", "16-byte aligned"});
  expect_error([&] { quantize_nvfp4_rows_device(fake(0x3000), 2, 32, c8 + 4, c8, g4, nullptr); },
               {"codes = 0x1004", "8-byte aligned"});
  expect_error([&] { quantize_nvfp4_rows_device(fake(0x3000), 2, 32, c8, c8, nullptr, nullptr); },
               {"global is null"});
}

}  // namespace
}  // namespace fp4moe

// Host NVFP4 / MXFP4 reference: every number goes through format_math.hpp so that this file, the GPU
// quantizer and the synthetic-weight generator agree bit for bit.
#include "fp4moe/format.hpp"

#include <cmath>

#include "fp4moe/error.hpp"

namespace fp4moe {
namespace {

// Checks shared by every [rows, cols] entry point; `what` names the caller's data argument.
void require_shape(const char* what, size_t size, const void* data, int64_t rows, int64_t cols,
                   int block, const char* block_name) {
  FP4MOE_REQUIRE(rows >= 0, "rows = {} must be >= 0", rows);
  FP4MOE_REQUIRE(cols >= 0, "cols = {} must be >= 0", cols);
  FP4MOE_REQUIRE(cols % block == 0, "cols = {} must be a multiple of {} (the {} block)", cols, block,
                 block_name);
  FP4MOE_REQUIRE(static_cast<int64_t>(size) == rows * cols,
                 "{}.size() = {} must equal rows * cols = {} * {} = {}", what, size, rows, cols,
                 rows * cols);
  FP4MOE_REQUIRE(size == 0 || data != nullptr, "{} is null but rows * cols = {}", what, rows * cols);
}

// A non-finite weight would turn the tensor's global scale into inf/NaN and every code into garbage
// silently; refusing it here points at the broken checkpoint instead.
void require_finite(std::span<const float> x) {
  for (size_t i = 0; i < x.size(); ++i)
    FP4MOE_REQUIRE(std::isfinite(x[i]), "x[{}] = {} is not finite (quantization needs finite input)",
                   i, x[i]);
}

// max |x|. Max is exact and order-free, so the device's tree reduction finds the same float.
float amax_of(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    m = a > m ? a : m;
  }
  return m;
}

Nvfp4Tensor quantize_nvfp4_impl(std::span<const float> x, int64_t rows, int64_t cols,
                                std::optional<float> global_scale) {
  require_shape("x", x.size(), x.data(), rows, cols, kNvfp4Block, "NVFP4");
  require_finite(x);
  if (global_scale)
    FP4MOE_REQUIRE(std::isfinite(*global_scale) && *global_scale > 0.0f,
                   "global_scale = {} must be finite and > 0", *global_scale);
  Nvfp4Tensor t;
  t.rows = rows;
  t.cols = cols;
  t.global_scale = global_scale ? *global_scale : nvfp4_global_scale(amax_of(x.data(), rows * cols));
  t.codes.assign(static_cast<size_t>(rows * cols / 2), 0);
  t.scales.assign(static_cast<size_t>(rows * cols / kNvfp4Block), 0);
  // Blocks never straddle rows (cols % 16 == 0), so the tensor is a flat sequence of blocks.
  const int64_t nblocks = rows * cols / kNvfp4Block;
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* xb = x.data() + b * kNvfp4Block;
    const uint8_t s = nvfp4_block_scale(amax_of(xb, kNvfp4Block), t.global_scale);
    t.scales[b] = s;
    uint8_t* out = t.codes.data() + b * (kNvfp4Block / 2);
    for (int i = 0; i < kNvfp4Block; i += 2)
      out[i / 2] = static_cast<uint8_t>(nvfp4_quantize_element(xb[i], s, t.global_scale) |
                                        (nvfp4_quantize_element(xb[i + 1], s, t.global_scale) << 4));
  }
  return t;
}

}  // namespace

void pack_e2m1(std::span<const uint8_t> codes, std::span<uint8_t> packed) {
  FP4MOE_REQUIRE(codes.size() % 2 == 0, "codes.size() = {} must be even (two codes per byte)",
                 codes.size());
  FP4MOE_REQUIRE(packed.size() == codes.size() / 2,
                 "packed.size() = {} must equal codes.size() / 2 = {}", packed.size(),
                 codes.size() / 2);
  for (size_t i = 0; i < packed.size(); ++i) {
    const uint8_t lo = codes[2 * i], hi = codes[2 * i + 1];
    FP4MOE_REQUIRE(lo < 16 && hi < 16,
                   "codes[{}] = {} / codes[{}] = {}: an E2M1 code must be < 16 (4 bits)", 2 * i, lo,
                   2 * i + 1, hi);
    packed[i] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

void unpack_e2m1(std::span<const uint8_t> packed, std::span<uint8_t> codes) {
  FP4MOE_REQUIRE(codes.size() == 2 * packed.size(),
                 "codes.size() = {} must equal 2 * packed.size() = {}", codes.size(),
                 2 * packed.size());
  for (size_t i = 0; i < packed.size(); ++i) {
    codes[2 * i] = packed[i] & 0xf;
    codes[2 * i + 1] = packed[i] >> 4;
  }
}

float amax(std::span<const float> x) { return amax_of(x.data(), static_cast<int64_t>(x.size())); }

float Nvfp4Tensor::at(int64_t r, int64_t c) const {
  FP4MOE_REQUIRE(r >= 0 && r < rows && c >= 0 && c < cols,
                 "(r, c) = ({}, {}) is outside the [{}, {}] NVFP4 tensor", r, c, rows, cols);
  const int64_t i = r * cols + c;
  return nvfp4_dequantize_element(packed_code(codes.data(), i), scales[i / kNvfp4Block],
                                  global_scale);
}

Nvfp4Tensor quantize_nvfp4(std::span<const float> x, int64_t rows, int64_t cols,
                           std::optional<float> global_scale) {
  return quantize_nvfp4_impl(x, rows, cols, global_scale);
}

Nvfp4Tensor quantize_nvfp4_bf16(std::span<const uint16_t> x, int64_t rows, int64_t cols,
                                std::optional<float> global_scale) {
  require_shape("x", x.size(), x.data(), rows, cols, kNvfp4Block, "NVFP4");
  // bf16 -> float is exact, so this is the float path on the same values.
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = bf16_bits_to_float(x[i]);
  return quantize_nvfp4_impl(f, rows, cols, global_scale);
}

std::vector<float> dequantize_nvfp4(const Nvfp4Tensor& t) {
  FP4MOE_REQUIRE(t.rows >= 0 && t.cols >= 0 && t.cols % kNvfp4Block == 0,
                 "t is [{}, {}]: cols must be a multiple of 16 (the NVFP4 block)", t.rows, t.cols);
  const int64_t n = t.rows * t.cols;
  FP4MOE_REQUIRE(static_cast<int64_t>(t.codes.size()) == n / 2 &&
                     static_cast<int64_t>(t.scales.size()) == n / kNvfp4Block,
                 "t.codes.size() = {} and t.scales.size() = {} must be rows*cols/2 = {} and "
                 "rows*cols/16 = {}",
                 t.codes.size(), t.scales.size(), n / 2, n / kNvfp4Block);
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    out[i] = nvfp4_dequantize_element(packed_code(t.codes.data(), i), t.scales[i / kNvfp4Block],
                                      t.global_scale);
  return out;
}

float Mxfp4Tensor::at(int64_t r, int64_t c) const {
  FP4MOE_REQUIRE(r >= 0 && r < rows && c >= 0 && c < cols,
                 "(r, c) = ({}, {}) is outside the [{}, {}] MXFP4 tensor", r, c, rows, cols);
  const int64_t i = r * cols + c;
  return mxfp4_dequantize_element(packed_code(codes.data(), i), scales[i / kMxfp4Block]);
}

Mxfp4Tensor quantize_mxfp4(std::span<const float> x, int64_t rows, int64_t cols) {
  require_shape("x", x.size(), x.data(), rows, cols, kMxfp4Block, "MXFP4");
  require_finite(x);
  Mxfp4Tensor t;
  t.rows = rows;
  t.cols = cols;
  t.codes.assign(static_cast<size_t>(rows * cols / 2), 0);
  t.scales.assign(static_cast<size_t>(rows * cols / kMxfp4Block), 0);
  const int64_t nblocks = rows * cols / kMxfp4Block;
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* xb = x.data() + b * kMxfp4Block;
    const uint8_t s = mxfp4_scale_code(amax_of(xb, kMxfp4Block));
    t.scales[b] = s;
    uint8_t* out = t.codes.data() + b * (kMxfp4Block / 2);
    for (int i = 0; i < kMxfp4Block; i += 2)
      out[i / 2] = static_cast<uint8_t>(mxfp4_quantize_element(xb[i], s) |
                                        (mxfp4_quantize_element(xb[i + 1], s) << 4));
  }
  return t;
}

std::vector<float> dequantize_mxfp4(const Mxfp4Tensor& t) {
  FP4MOE_REQUIRE(t.rows >= 0 && t.cols >= 0 && t.cols % kMxfp4Block == 0,
                 "t is [{}, {}]: cols must be a multiple of 32 (the MXFP4 block)", t.rows, t.cols);
  const int64_t n = t.rows * t.cols;
  FP4MOE_REQUIRE(static_cast<int64_t>(t.codes.size()) == n / 2 &&
                     static_cast<int64_t>(t.scales.size()) == n / kMxfp4Block,
                 "t.codes.size() = {} and t.scales.size() = {} must be rows*cols/2 = {} and "
                 "rows*cols/32 = {}",
                 t.codes.size(), t.scales.size(), n / 2, n / kMxfp4Block);
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    out[i] = mxfp4_dequantize_element(packed_code(t.codes.data(), i), t.scales[i / kMxfp4Block]);
  return out;
}

std::vector<uint8_t> swizzle_scales_128x4(std::span<const uint8_t> row_major, int64_t rows,
                                          int64_t kblocks) {
  FP4MOE_REQUIRE(rows >= 0 && kblocks >= 0, "rows = {}, kblocks = {} must both be >= 0", rows,
                 kblocks);
  FP4MOE_REQUIRE(static_cast<int64_t>(row_major.size()) == rows * kblocks,
                 "row_major.size() = {} must equal rows * kblocks = {} * {} = {}", row_major.size(),
                 rows, kblocks, rows * kblocks);
  // Zero padding matters: the kernels read whole 512-byte atoms, and a zero E4M3/E8M0 scale keeps
  // whatever the padded codes hold from reaching the output.
  std::vector<uint8_t> out(static_cast<size_t>(swizzled_128x4_size(rows, kblocks)), 0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t kb = 0; kb < kblocks; ++kb)
      out[swizzled_128x4_offset(m, kb, kblocks)] = row_major[m * kblocks + kb];
  return out;
}

std::vector<uint8_t> unswizzle_scales_128x4(std::span<const uint8_t> swizzled, int64_t rows,
                                            int64_t kblocks) {
  FP4MOE_REQUIRE(rows >= 0 && kblocks >= 0, "rows = {}, kblocks = {} must both be >= 0", rows,
                 kblocks);
  const int64_t need = swizzled_128x4_size(rows, kblocks);
  FP4MOE_REQUIRE(static_cast<int64_t>(swizzled.size()) == need,
                 "swizzled.size() = {} must equal pad128(rows) * pad4(kblocks) = {} for rows = {}, "
                 "kblocks = {}",
                 swizzled.size(), need, rows, kblocks);
  std::vector<uint8_t> out(static_cast<size_t>(rows * kblocks));
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t kb = 0; kb < kblocks; ++kb)
      out[m * kblocks + kb] = swizzled[swizzled_128x4_offset(m, kb, kblocks)];
  return out;
}

}  // namespace fp4moe

// The NVFP4 / MXFP4 element and scale arithmetic, written once for host and device.
// Every quantizer in fp4moe (CPU reference, GPU kernel, synthetic-weight generator) calls these, so a
// host result and a device result are bit-identical by construction; tests check it anyway.
// Facts: docs/format.md (E2M1 {0,.5,1,1.5,2,3,4,6}; ModelOpt scale recipe; OCP MX).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FP4MOE_HD __host__ __device__ __forceinline__
#else
#define FP4MOE_HD inline
#endif

namespace fp4moe {

inline constexpr int kNvfp4Block = 16;   // elements per E4M3 scale along K
inline constexpr int kMxfp4Block = 32;   // elements per E8M0 scale along K
inline constexpr float kE2M1Max = 6.0f;
inline constexpr float kE4M3Max = 448.0f;

FP4MOE_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
FP4MOE_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// ---- bf16 (raw bits; host code has no bf16 type of its own) ----
// Round-to-nearest-even: the same result as __float2bfloat16_rn, which (host code and cvt.rn.bf16.f32
// alike) turns every NaN into the canonical 0x7fff rather than keeping its sign and payload.
FP4MOE_HD uint16_t float_to_bf16_bits(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
FP4MOE_HD float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }
FP4MOE_HD float round_to_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

// ---- E2M1 (FP4) ----
// code = sign<<3 | index, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.
FP4MOE_HD float e2m1_to_float(uint8_t code) {
  // index -> magnitude without a table (device-friendly): e = idx>>1, m = idx&1.
  const uint32_t idx = code & 7u;
  const uint32_t e = idx >> 1, m = idx & 1u;
  const float mag = (e == 0) ? 0.5f * static_cast<float>(m)
                             : static_cast<float>(1u << (e - 1)) * (1.0f + 0.5f * static_cast<float>(m));
  return (code & 8u) ? -mag : mag;
}

// Round-to-nearest-even onto the E2M1 grid, saturating at +-6. NaN -> +6 (0x7) and +-inf -> +-6,
// as __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest) does. Ties go to the even code:
// 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0.
FP4MOE_HD uint8_t float_to_e2m1(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7;  // NaN
  const uint8_t sign = static_cast<uint8_t>((u >> 28) & 8u);
  const float a = bits_float(u & 0x7fffffffu);
  // Count the thresholds a lies above (strict at ties that go down, >= at ties that go up): the same
  // index as the if/else ladder (checked on all 2^32 inputs), without branches. Weights put a
  // uniformly in [0, 6], so the ladder mispredicted ~2 times per element: the branchless count made
  // host quantization 4x faster (17 -> 4.2 ns per element).
  const uint32_t idx = static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f) +
                       static_cast<uint32_t>(a > 1.25f) + static_cast<uint32_t>(a >= 1.75f) +
                       static_cast<uint32_t>(a > 2.5f) + static_cast<uint32_t>(a >= 3.5f) +
                       static_cast<uint32_t>(a > 5.0f);
  return static_cast<uint8_t>(sign | idx);
}

// ---- E4M3 (FP8, the NVFP4 block scale) ----
FP4MOE_HD float e4m3_to_float(uint8_t b) {
  const uint32_t s = b >> 7, e = (b >> 3) & 0xfu, m = b & 7u;
  float mag;
  if (e == 0xf && m == 7) mag = bits_float(0x7fc00000u);  // NaN (E4M3 has no inf)
  else if (e == 0) mag = static_cast<float>(m) * (1.0f / 512.0f);  // subnormal: m * 2^-9
  else mag = bits_float(((e + 120u) << 23) | (m << 20));
  return s ? -mag : mag;
}

// Round-to-nearest-even, saturating to +-448 (satfinite), NaN -> NaN (0x7f), as
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3).
FP4MOE_HD uint8_t float_to_e4m3(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7f;
  const float a = bits_float(u & 0x7fffffffu);
  if (a >= 464.0f) return sign | 0x7e;  // 448 is the max finite; 464 is the tie with "480"
  const uint32_t au = u & 0x7fffffffu;
  const int exp = static_cast<int>(au >> 23) - 127;
  if (exp < -6) {
    // subnormal range: quantum 2^-9, value = round_even(a * 512) * 2^-9
    const float t = a * 512.0f;  // exact (power-of-two scaling, no underflow for these magnitudes)
    uint32_t q = static_cast<uint32_t>(t);
    const float frac = t - static_cast<float>(q);
    if (frac > 0.5f || (frac == 0.5f && (q & 1u))) ++q;
    return sign | static_cast<uint8_t>(q);  // q == 8 carries into the smallest normal (e=1,m=0)
  }
  // normal: keep 3 mantissa bits, RNE on the 20 dropped bits
  uint32_t mant = au & 0x7fffffu;
  uint32_t keep = mant >> 20;
  const uint32_t rest = mant & 0xfffffu;
  uint32_t e = static_cast<uint32_t>(exp + 7);
  if (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) {
    ++keep;
    if (keep == 8) { keep = 0; ++e; }
  }
  return sign | static_cast<uint8_t>((e << 3) | keep);
}

// ---- NVFP4 scale recipe (NVIDIA Model Optimizer) ----
// global (weight_scale_2) = amax / (6 * 448); a tensor that is all zeros gets global 1.
FP4MOE_HD float nvfp4_global_scale(float amax) {
  return amax > 0.0f ? amax / (kE2M1Max * kE4M3Max) : 1.0f;
}
// E4M3 block scale: block_amax / (6 * global), all-zero block -> 1.0, clamped to [2^-9, 448].
FP4MOE_HD uint8_t nvfp4_block_scale(float block_amax, float global) {
  float s = block_amax / (kE2M1Max * global);
  if (!(block_amax > 0.0f)) s = 1.0f;
  s = s < (1.0f / 512.0f) ? (1.0f / 512.0f) : s;
  s = s > kE4M3Max ? kE4M3Max : s;
  return float_to_e4m3(s);
}
// One element: x / (scale * global), rounded onto E2M1.
FP4MOE_HD uint8_t nvfp4_quantize_element(float x, uint8_t scale_e4m3, float global) {
  return float_to_e2m1(x / (e4m3_to_float(scale_e4m3) * global));
}
FP4MOE_HD float nvfp4_dequantize_element(uint8_t code, uint8_t scale_e4m3, float global) {
  return e2m1_to_float(code) * e4m3_to_float(scale_e4m3) * global;
}

// ---- MXFP4 (OCP Microscaling v1.0) ----
// Shared exponent = floor(log2(amax)) - emax(E2M1)=2, stored biased by 127 in E8M0 (0xFF = NaN).
// amax == 0 gives the smallest scale, code 0 (2^-127).
FP4MOE_HD uint8_t mxfp4_scale_code(float amax) {
  const uint32_t u = float_bits(amax) & 0x7fffffffu;
  if (u > 0x7f800000u) return 0xff;
  if (u == 0) return 0;
  int e = static_cast<int>(u >> 23) - 127;
  if ((u >> 23) == 0) {  // subnormal amax: floor(log2) from the leading mantissa bit
    uint32_t m = u & 0x7fffffu;
    e = -127;
    while (!(m & 0x400000u)) { m <<= 1; --e; }
  }
  int code = e - 2 + 127;
  code = code < 0 ? 0 : (code > 254 ? 254 : code);
  return static_cast<uint8_t>(code);
}
FP4MOE_HD float e8m0_to_float(uint8_t code) {
  if (code == 0xff) return bits_float(0x7fc00000u);
  if (code == 0) return bits_float(0x00400000u);  // 2^-127 is a float subnormal
  return bits_float(static_cast<uint32_t>(code) << 23);
}
FP4MOE_HD uint8_t mxfp4_quantize_element(float x, uint8_t scale_code) {
  return float_to_e2m1(x / e8m0_to_float(scale_code));
}
FP4MOE_HD float mxfp4_dequantize_element(uint8_t code, uint8_t scale_code) {
  return e2m1_to_float(code) * e8m0_to_float(scale_code);
}

// ---- Scale-factor layouts ----
// CUTLASS / TensorRT-LLM "128x4" swizzled layout for the block-scaled kernels (sm_100/sm_120):
// 128 rows x 4 k-blocks form a 512-byte atom; within it row m%32 is the outer index.
FP4MOE_HD int64_t swizzled_128x4_offset(int64_t m, int64_t kb, int64_t num_kblocks) {
  const int64_t num_k_tiles = (num_kblocks + 3) / 4;
  return ((m / 128) * num_k_tiles + kb / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + (kb % 4);
}
FP4MOE_HD int64_t swizzled_128x4_size(int64_t rows, int64_t num_kblocks) {
  return ((rows + 127) / 128) * 128 * ((num_kblocks + 3) / 4) * 4;
}

}  // namespace fp4moe

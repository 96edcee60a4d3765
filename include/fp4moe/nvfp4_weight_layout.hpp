// The kernel-side layout of NVFP4 expert weights ("repacked"), shared by the host repack, the device
// repack kernel, the inverse (tests) and the GEMM kernel's dequantization.
//
// Why this layout: the sm80-nvfp4-grouped kernel feeds weights as the A operand of
// mma.sync.m16n8k16 (features are the M dimension, tokens the N dimension: "swap AB"). Each lane's
// A fragment for one k16 step is 8 e2m1 values = one 32-bit word, so the repack stores, per 16-row
// tile and 64-wide K chunk, 32 lanes x 4 words (k16 steps) = 512 contiguous bytes: one 16-byte
// shared-memory load per lane yields four k-steps of fragments, with no bank conflicts.
//
// Within a word, the bits are permuted so that dequantization to bf16 is a few shifts and masks:
// placing an e2m1 magnitude (e1 e0 m) at bf16 bits 8..6 and its sign at bit 15 yields the value
// times 2^-126 exactly (e=0 lands in bf16's subnormal range, which mul.bf16x2 supports), for two
// values at once (one per 16-bit half). So each bf16x2 pair (a0a1, a2a3, a4a5, a6a7) must end with its
// eight bits at the targets T = {6, 7, 8, 15, 22, 23, 24, 31} and zeros elsewhere. Where a target bit is
// stored (stored_bit) is chosen so that the four pairs cost nine integer operations in all (place_pair):
//   pair 2: word & T                         (one AND)
//   pair 1: (word << 4) & T                   (a shift and an AND)
//   pair 3: rotl(word, 10) & T                (a funnel shift and an AND)
//   pair 0: ((word << 6) & T\{8, 24}) | ((word >> 2) & {8, 24})   (two shifts and two logic ops)
// Nine is the least: four single-copy pairs would need four translates of T tiling the word, and none
// exist (not mod 32 with rotations either), so a fifth copy of the word and one two-source pair are
// needed; an exhaustive search over shifts and rotations found this placement at nine (the previous
// layout, plain shifts only, took eleven: bench/NOTES.md, nineteenth session).
//
// Block scales are re-encoded in one byte as ((E + 9) << 3) | mantissa for s = 2^E * (1 + mantissa/8),
// E in [-9, 8] (every positive E4M3 value, subnormals normalized), so that byte * 16 + (236 << 7) is
// the bf16 of s * 2^118 — one integer multiply-add per two scales. Weight (v * 2^-126) * (s * 2^118)
// = v * s * 2^-8 is exact and normal in bf16 (|v*s| in [2^-10, 2688]); the kernel multiplies the FP32
// accumulator by global * 2^8.
#pragma once
#include <cstdint>

#include "fp4moe/format_math.hpp"

namespace fp4moe::layout {

inline constexpr uint32_t kPairTargets = 0x81C081C0u;  // bits 6-8, 15, 22-24, 31 of a bf16x2
inline constexpr uint32_t kPair0Shifted = 0x80C080C0u;  // pair 0's targets taken from word << 6
inline constexpr uint32_t kPair0Rest = 0x01000100u;     // pair 0's bits 8 and 24, from word >> 2
static_assert((kPair0Shifted | kPair0Rest) == kPairTargets && (kPair0Shifted & kPair0Rest) == 0);
// Word bit holding target bit t (in kPairTargets) of pair `pair`: the inverse of place_pair's shifts.
FP4MOE_HD constexpr int stored_bit(int pair, int t) {
  return pair == 0   ? ((t & 15) == 8 ? t + 2 : t - 6)
         : pair == 1 ? t - 4
         : pair == 2 ? t
                     : (t + 22) & 31;  // rotl by 10
}
// The pair's bf16x2 bits before scaling (value * 2^-126 per half): what the kernels compute, and what
// the CPU tests emulate. ptxas turns the rotate into one funnel shift (SHF.L.W).
FP4MOE_HD constexpr uint32_t place_pair(uint32_t word, int pair) {
  return pair == 0   ? ((word << 6) & kPair0Shifted) | ((word >> 2) & kPair0Rest)
         : pair == 1 ? (word << 4) & kPairTargets
         : pair == 2 ? word & kPairTargets
                     : ((word << 10) | (word >> 22)) & kPairTargets;
}
inline constexpr uint32_t kScaleBias = (236u << 7) | (236u << 23);  // bf16 exponent bias, both halves
inline constexpr float kAccumulatorScale = 256.0f;                    // 2^8, undone in the epilogue

// The kernel decodes a pair of scale bytes as pair * scale_mul + scale_add (GroupedGemmParams):
//   NVFP4: the byte above (E4M3 re-encoded); * 16 + kScaleBias = bf16 {s * 2^118} per half.
//   MXFP4: one byte per 16-wide k block like NVFP4 (each E8M0 per-32 scale fills its two slots), the
//   byte b = e + c_expert, where e is the E8M0 exponent field (scale 2^(e-127)) and
//   c_expert = 254 - (max e over the expert's blocks that hold a nonzero code), so b <= 254; * 128
//   places b in the bf16 exponent field: bf16 2^(b-127). A weight then dequantizes to
//   (v * 2^-126) * 2^(b-127) = v * 2^(e-127) * 2^(c_expert-126) = w * 2^(c_expert-126), exact and normal
//   in bf16 as long as the smallest nonzero |v| (0.5) keeps 0.5 * 2^(b-253) >= 2^-126, i.e. b >= 128
//   (kMxfp4MinByte; a block below it is refused by the repack, naming expert, row and block). The
//   epilogue multiplies by global * kAccumulatorScale = global * 2^8, so the per-expert FP32 global
//   scale is 2^(126 - c_expert - 8) = 2^(118 - c_expert) = 2^(max_e - 136): exact, and a normal float
//   for max_e >= 10 (kMxfp4MinMaxExponent; smaller would be weights below 2^-117 throughout an expert).
inline constexpr uint32_t kNvfp4ScaleMul = 16u;
inline constexpr uint32_t kNvfp4ScaleAdd = kScaleBias;
inline constexpr uint32_t kMxfp4ScaleMul = 128u;
inline constexpr uint32_t kMxfp4ScaleAdd = 0u;
inline constexpr int kMxfp4MinByte = 128;
inline constexpr int kMxfp4MinMaxExponent = 10;
FP4MOE_HD int mxfp4_expert_offset(int max_e) { return 254 - max_e; }            // c_expert
FP4MOE_HD float mxfp4_expert_global(int max_e) { return bits_float(static_cast<uint32_t>(max_e - 136 + 127) << 23); }

// Row order inside a 16-row tile. kPairs (plain epilogue): local rows g and g+8 hold features 2g and
// 2g+1, so one lane's two accumulators of a token are adjacent outputs (4-byte stores, full sectors).
// kGateUp (SwiGLU epilogue): rows 0-7 are gate rows 8t..8t+7, rows 8-15 the same up rows, so a lane
// holds gate_j and up_j together and applies SwiGLU in registers.
enum class RowOrder : int { kPairs = 0, kGateUp = 1 };

FP4MOE_HD int64_t disk_row(int64_t mtile, int local_row, int64_t n, RowOrder order) {
  if (order == RowOrder::kGateUp)
    return local_row < 8 ? mtile * 8 + local_row : n / 2 + mtile * 8 + (local_row - 8);
  return mtile * 16 + (local_row < 8 ? 2 * local_row : 2 * (local_row - 8) + 1);
}

// Value index v (0..7) of a lane's k16 fragment -> (local row, k offset within the k16 step), as
// mma.m16n8k16's A layout defines it: a0,a1 (row g, k 2t,2t+1) a2,a3 (row g+8) a4..a7 (+8 in k).
FP4MOE_HD int frag_row(int lane, int v) { return (lane >> 2) + ((v >> 1) & 1) * 8; }
FP4MOE_HD int frag_k(int lane, int v) { return (lane & 3) * 2 + (v & 1) + (v >> 2) * 8; }

// Word bit of value v's code bit b (0-2: the magnitude m, e0, e1; 3: the sign): value v is half v & 1
// of pair v >> 1, and its code bit b lands on bf16 bit 6 + b (magnitude) or 15 (sign) of that half.
FP4MOE_HD constexpr int code_bit_pos(int v, int b) { return stored_bit(v >> 1, (b < 3 ? 6 + b : 15) + (v & 1) * 16); }

FP4MOE_HD uint32_t place_code(uint8_t code, int v) {
  uint32_t word = 0;
  for (int b = 0; b < 4; ++b) word |= static_cast<uint32_t>((code >> b) & 1u) << code_bit_pos(v, b);
  return word;
}
FP4MOE_HD uint8_t extract_code(uint32_t word, int v) {
  uint32_t code = 0;
  for (int b = 0; b < 4; ++b) code |= ((word >> code_bit_pos(v, b)) & 1u) << b;
  return static_cast<uint8_t>(code);
}

// E4M3 scale byte -> kernel scale byte. Requires a finite, positive scale (checked by the callers).
FP4MOE_HD uint8_t encode_scale(uint8_t e4m3) {
  const uint32_t e = (e4m3 >> 3) & 0xfu, m = e4m3 & 7u;
  if (e != 0) return static_cast<uint8_t>(e4m3 + 16);  // ((e - 7 + 9) << 3) | m
  // subnormal m * 2^-9: normalize
  constexpr uint8_t kSub[8] = {0, 0, 8, 12, 16, 18, 20, 22};
  return kSub[m];
}
FP4MOE_HD uint8_t decode_scale(uint8_t code) {
  const uint32_t eb = code >> 3, m = code & 7u;  // eb = E + 9
  if (eb >= 3) return static_cast<uint8_t>(code - 16);  // E >= -6: an E4M3 normal
  // E in [-9, -7]: E4M3 subnormals k * 2^-9 (k = 1; 2, 3; 4..7)
  if (eb == 2) return static_cast<uint8_t>(4 + m / 2);
  if (eb == 1) return static_cast<uint8_t>(2 + m / 4);
  return 1;
}
// A valid scale for the kernel encoding: positive and finite (zero scales are rewritten by the repack).
FP4MOE_HD bool scale_encodable(uint8_t e4m3) { return e4m3 != 0 && e4m3 < 0x7f; }

// Repacked offsets (bytes) within one expert.
FP4MOE_HD int64_t codes_word_offset(int64_t mtile, int64_t chunk, int lane, int j, int64_t k) {
  return ((mtile * (k / 64) + chunk) * 32 + lane) * 16 + j * 4;
}
// Scales: per (mtile, chunk) 64 bytes ordered [g][j][half]: lane g reads 8 bytes holding rows g and g+8
// for the chunk's four k16 blocks.
FP4MOE_HD int64_t scale_byte_offset(int64_t mtile, int64_t chunk, int g, int j, int half, int64_t k) {
  return (mtile * (k / 64) + chunk) * 64 + g * 8 + j * 2 + half;
}

}  // namespace fp4moe::layout

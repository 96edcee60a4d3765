// Dequantization of one repacked word (8 e2m1 codes of a lane's mma A fragment) to four bf16x2
// registers, scaled by the block scales. Layout and exactness argument: nvfp4_weight_layout.hpp.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>

#include "fp4moe/nvfp4_weight_layout.hpp"

namespace fp4moe::kernels {

// Two re-encoded scale bytes (rows g and g+8 of a k16 block), zero-extended into the two 16-bit
// halves of `pair`, become bf16x2 scales: one IMAD. NVFP4: scale_mul 16, scale_add (236<<7)|(236<<23)
// gives {s_g * 2^118, s_g8 * 2^118}; MXFP4: 128 and 0 give {2^(b_g-127), 2^(b_g8-127)}
// (nvfp4_weight_layout.hpp). The two values come from GroupedGemmParams, read once per kernel.
__device__ __forceinline__ uint32_t decode_scale_pair(uint32_t pair, uint32_t scale_mul, uint32_t scale_add) {
  return pair * scale_mul + scale_add;
}

__device__ __forceinline__ __nv_bfloat162 as_bf162(uint32_t u) {
  return *reinterpret_cast<const __nv_bfloat162*>(&u);
}
__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) { return *reinterpret_cast<const uint32_t*>(&v); }

// word: the repacked codes; scales: decode_scale_pair() output {row g, row g+8}.
// a[0] = (a0,a1) row g, a[1] = (a2,a3) row g+8, a[2] = (a4,a5) row g, a[3] = (a6,a7) row g+8.
__device__ __forceinline__ void dequant_fragment(uint32_t word, uint32_t scales, uint32_t (&a)[4]) {
  // nine integer operations for the four pairs (layout::place_pair; nvfp4_weight_layout.hpp says why)
  const uint32_t p0 = layout::place_pair(word, 0);
  const uint32_t p1 = layout::place_pair(word, 1);
  const uint32_t p2 = layout::place_pair(word, 2);
  const uint32_t p3 = layout::place_pair(word, 3);
  const __nv_bfloat162 s = as_bf162(scales);
  const __nv_bfloat162 s_lo = __low2bfloat162(s);   // folded into HMUL2's .H0_H0 operand select
  const __nv_bfloat162 s_hi = __high2bfloat162(s);
  a[0] = as_u32(__hmul2(as_bf162(p0), s_lo));
  a[1] = as_u32(__hmul2(as_bf162(p1), s_hi));
  a[2] = as_u32(__hmul2(as_bf162(p2), s_lo));
  a[3] = as_u32(__hmul2(as_bf162(p3), s_hi));
}

}  // namespace fp4moe::kernels

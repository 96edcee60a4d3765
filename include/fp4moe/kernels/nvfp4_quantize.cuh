// Device code: NVFP4 quantization of bf16 rows (activations), one FP32 global scale per row.
// Every number comes from format_math.hpp, so the result equals quantize_nvfp4 on each row bit for bit.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "fp4moe/format_math.hpp"

// --use_fast_math flushes subnormals and approximates division: the block scale of a small row and
// x / (scale * global) would then differ from the host reference by an ulp, breaking bit-exactness.
#if defined(__USE_FAST_MATH__)
#error "nvfp4_quantize.cuh must not be compiled with --use_fast_math (bit-exact with the host reference)"
#endif

namespace fp4moe::kernels {

// One warp per row: a row is a reduction (its amax) followed by independent 16-element blocks, and
// a warp does the reduction with shuffles alone, without shared memory or __syncthreads.
// 4 warps per CTA: few rows (decode batches) still spread over many SMs, and 16 resident CTAs (of
// the 32 an SM allows) already reach the 64-warp occupancy limit.
inline constexpr int kQuantizeWarpsPerCta = 4;
inline constexpr int kQuantizeThreads = kQuantizeWarpsPerCta * 32;

// One NVFP4 block is 16 bf16 = 32 bytes: two 16-byte loads, so a warp reads 1 KiB contiguous per step.
__device__ __forceinline__ void load_bf16_block(const uint16_t* p, float (&v)[kNvfp4Block]) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
  const uint4 a = __ldg(q), b = __ldg(q + 1);
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = bf16_bits_to_float(static_cast<uint16_t>(w[i] & 0xffffu));
    v[2 * i + 1] = bf16_bits_to_float(static_cast<uint16_t>(w[i] >> 16));
  }
}

// x: bf16 bits [rows, cols]; codes [rows, cols/2]; scales [rows, cols/16]; global [rows].
// Needs cols % 16 == 0, x 16-byte and codes 8-byte aligned (checked by the host launcher).
__global__ void __launch_bounds__(kQuantizeThreads)
    nvfp4_quantize_rows_kernel(const uint16_t* __restrict__ x, int64_t rows, int64_t cols,
                               uint8_t* __restrict__ codes, uint8_t* __restrict__ scales,
                               float* __restrict__ global) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kQuantizeWarpsPerCta + threadIdx.x / 32;
  if (row >= rows) return;  // whole warps leave together: the shuffles below stay full-warp
  const int64_t nblocks = cols / kNvfp4Block;
  const uint16_t* xr = x + row * cols;

  // Pass 1: row amax. fmaxf skips NaN exactly as the host's `a > m ? a : m` does, and max is
  // order-free, so the shuffle tree yields the host's float.
  float m = 0.0f;
  for (int64_t b = lane; b < nblocks; b += 32) {
    float v[kNvfp4Block];
    load_bf16_block(xr + b * kNvfp4Block, v);
#pragma unroll
    for (int i = 0; i < kNvfp4Block; ++i) m = fmaxf(m, fabsf(v[i]));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  const float g = nvfp4_global_scale(m);
  if (lane == 0) global[row] = g;

  // Pass 2 reloads rather than caching the row in registers: a 6144-wide row would need 192 floats
  // per lane, and the second read hits L1/L2 because the warp just touched the same 12 KiB.
  uint8_t* sr = scales + row * nblocks;
  uint2* cr = reinterpret_cast<uint2*>(codes + row * (cols / 2));
  for (int64_t b = lane; b < nblocks; b += 32) {
    float v[kNvfp4Block];
    load_bf16_block(xr + b * kNvfp4Block, v);
    float bm = 0.0f;
#pragma unroll
    for (int i = 0; i < kNvfp4Block; ++i) bm = fmaxf(bm, fabsf(v[i]));
    const uint8_t s = nvfp4_block_scale(bm, g);
    sr[b] = s;
    uint32_t lo = 0, hi = 0;  // element 2i in the low nibble: little-endian words keep that order
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      lo |= static_cast<uint32_t>(nvfp4_quantize_element(v[i], s, g)) << (4 * i);
      hi |= static_cast<uint32_t>(nvfp4_quantize_element(v[i + 8], s, g)) << (4 * i);
    }
    cr[b] = make_uint2(lo, hi);
  }
}

}  // namespace fp4moe::kernels

// make_synthetic_expert's recipe (reference.hpp) on the device, for all experts at once: the values
// come from synthetic.hpp and the quantization from format_math.hpp, the same functions the host
// calls, so the results are bit-identical (tests check a few experts against the host generator).
// Two passes because ModelOpt's global scale needs the tensor amax before any block is quantized:
//   synth_amax_kernel (max |w| per expert; a max is order-independent, so atomicMax on the float bits
//   of a non-negative value is deterministic) -> synth_global_kernel -> synth_quantize_kernel.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "fp4moe/format_math.hpp"
#include "fp4moe/synthetic.hpp"

namespace fp4moe::kernels {

// synth_weight's hash with the tensor/row part hoisted (the same arithmetic as synth_weight).
struct SynthRow {
  uint64_t h_row;
  float mult;
};

__device__ __forceinline__ SynthRow synth_row(uint64_t seed, uint32_t tensor, uint32_t expert, uint64_t row,
                                              float std) {
  const uint64_t h_tensor =
      splitmix64(seed ^ (static_cast<uint64_t>(tensor) << 56) ^ (static_cast<uint64_t>(expert) << 40));
  const uint64_t h_row = splitmix64(h_tensor ^ row);
  const uint64_t hr = splitmix64(h_row ^ (0xffffffffull * 0x9e3779b97f4a7c15ull));
  const float row_scale = __fadd_rn(0.5f, __fmul_rn(static_cast<float>(hr & 0x7u), 0.25f));
  return {h_row, __fmul_rn(row_scale, std)};
}

__device__ __forceinline__ float synth_row_value(const SynthRow& r, uint64_t col) {
  const uint64_t h = splitmix64(r.h_row ^ (col * 0x9e3779b97f4a7c15ull));
  float v = synth_normal(h);
  if (((h >> 20) & 0xfffu) == 0) v = __fmul_rn(v, 4.0f + static_cast<float>((h >> 32) & 3u));
  return __fmul_rn(v, r.mult);
}

// grid: (blocks over rows, experts). amax_bits[e] must start at 0.
__global__ void synth_amax_kernel(uint64_t seed, uint32_t tensor, uint32_t expert_base, int64_t rows,
                                  int64_t cols, float std, uint32_t* amax_bits) {
  const uint32_t e = blockIdx.y;
  float m = 0.0f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const SynthRow sr = synth_row(seed, tensor, expert_base + e, static_cast<uint64_t>(r), std);
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, fabsf(synth_row_value(sr, c)));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (threadIdx.x % 32 == 0) atomicMax(amax_bits + e, __float_as_uint(m));
}

// global[e] = nvfp4_global_scale(max(amax_a[e], amax_b[e])) (amax_b may be null).
__global__ void synth_global_kernel(const uint32_t* amax_a, const uint32_t* amax_b, int num_experts,
                                    float* global) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= num_experts) return;
  float a = __uint_as_float(amax_a[e]);
  if (amax_b != nullptr) a = fmaxf(a, __uint_as_float(amax_b[e]));
  global[e] = nvfp4_global_scale(a);
}

// One thread per 16-element block of one expert's [rows, cols] tensor, written at rows
// [dst_row0, dst_row0 + rows) of a stacked [E, dst_rows, cols] tensor. grid: (blocks, experts).
__global__ void synth_quantize_kernel(uint64_t seed, uint32_t tensor, uint32_t expert_base, int64_t rows,
                                      int64_t cols, float std, const float* global, int64_t dst_row0,
                                      int64_t dst_rows, uint8_t* codes, uint8_t* scales) {
  const int64_t e = blockIdx.y;
  const int64_t kb_per_row = cols / kNvfp4Block;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= rows * kb_per_row) return;
  const int64_t r = b / kb_per_row, kb = b % kb_per_row;
  const SynthRow sr = synth_row(seed, tensor, expert_base + static_cast<uint32_t>(e), static_cast<uint64_t>(r), std);
  float x[kNvfp4Block];
  float bamax = 0.0f;
#pragma unroll
  for (int i = 0; i < kNvfp4Block; ++i) {
    x[i] = synth_row_value(sr, static_cast<uint64_t>(kb * kNvfp4Block + i));
    const float a = fabsf(x[i]);
    bamax = a > bamax ? a : bamax;  // amax_of's comparison
  }
  const float g = global[e];
  const uint8_t s = nvfp4_block_scale(bamax, g);
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) lo |= static_cast<uint32_t>(nvfp4_quantize_element(x[i], s, g)) << (4 * i);
#pragma unroll
  for (int i = 0; i < 8; ++i) hi |= static_cast<uint32_t>(nvfp4_quantize_element(x[8 + i], s, g)) << (4 * i);
  const int64_t drow = e * dst_rows + dst_row0 + r;
  *reinterpret_cast<uint2*>(codes + drow * (cols / 2) + kb * 8) = make_uint2(lo, hi);
  scales[drow * kb_per_row + kb] = s;
}

// MXFP4 (cfg.format == kMxfp4): one thread per 32-element block, quantize_mxfp4's recipe (OCP: E8M0
// scale from the block amax, no global scale). Scales [E, dst_rows, cols/32].
__global__ void synth_quantize_mxfp4_kernel(uint64_t seed, uint32_t tensor, uint32_t expert_base, int64_t rows,
                                            int64_t cols, float std, int64_t dst_row0, int64_t dst_rows,
                                            uint8_t* codes, uint8_t* scales) {
  const int64_t e = blockIdx.y;
  const int64_t kb_per_row = cols / kMxfp4Block;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= rows * kb_per_row) return;
  const int64_t r = b / kb_per_row, kb = b % kb_per_row;
  const SynthRow sr = synth_row(seed, tensor, expert_base + static_cast<uint32_t>(e), static_cast<uint64_t>(r), std);
  float x[kMxfp4Block];
  float bamax = 0.0f;
#pragma unroll
  for (int i = 0; i < kMxfp4Block; ++i) {
    x[i] = synth_row_value(sr, static_cast<uint64_t>(kb * kMxfp4Block + i));
    const float a = fabsf(x[i]);
    bamax = a > bamax ? a : bamax;  // amax_of's comparison
  }
  const uint8_t s = mxfp4_scale_code(bamax);
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < kMxfp4Block; ++i) w[i / 8] |= static_cast<uint32_t>(mxfp4_quantize_element(x[i], s)) << (4 * (i % 8));
  const int64_t drow = e * dst_rows + dst_row0 + r;
  *reinterpret_cast<uint4*>(codes + drow * (cols / 2) + kb * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  scales[drow * kb_per_row + kb] = s;
}

// out[e, c] = round_to_bf16(synth_weight(seed, tensor, expert_base + e, 0, col0 + c, 0.1f)), c < n,
// written at [e * dst_stride + dst_col0 + c] (synth_bias). grid: (blocks, experts).
__global__ void synth_bias_kernel(uint64_t seed, uint32_t tensor, uint32_t expert_base, int64_t col0, int64_t n,
                                  int64_t dst_stride, int64_t dst_col0, float* out) {
  const int64_t e = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= n) return;
  out[e * dst_stride + dst_col0 + c] = round_to_bf16(
      synth_weight(seed, static_cast<SynthTensor>(tensor), expert_base + static_cast<uint32_t>(e), 0,
                   static_cast<uint64_t>(col0 + c), 0.1f));
}

// synth_activation over [rows, cols]: fp32 (out_f32) or bf16 bits (out_bf16).
__global__ void synth_activation_kernel(uint64_t seed, uint32_t tensor, int64_t rows, int64_t cols, float std,
                                        float* out_f32, uint16_t* out_bf16) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const float v = synth_activation(seed, static_cast<SynthTensor>(tensor), static_cast<uint64_t>(i / cols),
                                   static_cast<uint64_t>(i % cols), std);
  if (out_f32 != nullptr) out_f32[i] = v;
  if (out_bf16 != nullptr) out_bf16[i] = float_to_bf16_bits(v);
}

// Router weight: bf16 bits of synth_weight(seed, kRouterWeight, 0, e, h, std), [E, H].
__global__ void synth_router_weight_kernel(uint64_t seed, int64_t rows, int64_t cols, float std, uint16_t* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  out[i] = float_to_bf16_bits(synth_weight(seed, SynthTensor::kRouterWeight, 0, static_cast<uint64_t>(i / cols),
                                           static_cast<uint64_t>(i % cols), std));
}

}  // namespace fp4moe::kernels

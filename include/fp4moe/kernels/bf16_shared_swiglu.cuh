// The activation between the two cuBLAS GEMMs of a bf16 shared expert (MoeLayer): fp32 gate/up in,
// bf16 out, with the grouped GEMM epilogue's activation (activation.cuh) so the CPU reference's
// rounding points hold for this expert too. Device code only; launched by moe_layer.cu.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>

#include "fp4moe/kernels/activation.cuh"

namespace fp4moe::kernels {

inline constexpr int kSharedSwigluThreads = 256;

// gate_up: fp32 [tokens, 2 * width] (gate columns then up columns, cuBLAS's row-major view);
// out: bf16 [tokens, width]. gpt_oss: the clamped variant (alpha, limit).
__global__ void bf16_shared_swiglu_kernel(const float* __restrict__ gate_up, int64_t tokens, int64_t width,
                                          bool gpt_oss, float alpha, float limit, __nv_bfloat16* __restrict__ out) {
  const int64_t n = tokens * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / width, j = i - t * width;
    const float gate = gate_up[t * 2 * width + j];
    const float up = gate_up[t * 2 * width + width + j];
    out[i] = __float2bfloat16_rn(gpt_oss ? gptoss_swiglu_act(gate, up, alpha, limit) : swiglu_act(gate, up));
  }
}

}  // namespace fp4moe::kernels

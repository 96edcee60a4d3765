// Finalize: out[t, :] = bf16( sum over slots s = 0..k-1, in slot order, starting from 0, of
// float(y[row(t, s), :]) + float(shared[t, :]) ). The routing weight was already applied by the GEMM2
// epilogue (row_scale), so this is a fixed-order fp32 reduction: bit-identical run to run, and the same
// order as moe_reference's step 5 (reference.hpp). A separate pass instead of atomics in the GEMM2
// epilogue is what buys the determinism.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "fp4moe/tile_config.hpp"

namespace fp4moe::kernels {

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const uint4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

// One block per token.
__global__ void moe_combine_kernel(const uint4* __restrict__ y /*[T*k, H/8]*/,
                                   const uint4* __restrict__ shared_y /*[T, H/8] or null*/,
                                   const int32_t* __restrict__ row_of /*[T, k]*/, int top_k, int64_t h8,
                                   uint4* __restrict__ out /*[T, H/8]*/) {
  __shared__ int32_t rows[kMaxTopK];
  const int64_t t = blockIdx.x;
  if (threadIdx.x < top_k) rows[threadIdx.x] = row_of[t * top_k + threadIdx.x];
  __syncthreads();
  for (int64_t v = threadIdx.x; v < h8; v += blockDim.x) {
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    for (int s = 0; s < top_k; ++s) add_bf16x8(acc, y[static_cast<int64_t>(rows[s]) * h8 + v]);
    if (shared_y != nullptr) add_bf16x8(acc, shared_y[t * h8 + v]);
    uint4 o;
    __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) oh[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    out[t * h8 + v] = o;
  }
}

}  // namespace fp4moe::kernels

// Finalize: out[t, :] = bf16( sum over slots s = 0..k-1, in slot order, starting from 0, of
// float(y[row(t, s), :]) + float(shared[t, :]) ). The routing weight was already applied by the GEMM2
// epilogue (row_scale), so this is a fixed-order fp32 reduction: bit-identical run to run, and the same
// order as moe_reference's step 5 (reference.hpp). A separate pass instead of atomics in the GEMM2
// epilogue is what buys the determinism.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "fp4moe/kernels/pdl.cuh"
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

inline constexpr int kCombineThreads = 128;

// One thread per (token, 16-byte column); grid = T * ceil(H/8 / 128) blocks.
// Why: the old one-block-per-token loop gave each thread ~3 columns x k slots of DEPENDENT-looking
// loads (a run-time k loop, so the compiler issued them one or a few at a time): at T = 1 that is ~20
// serialized L2 round trips. Here each thread first issues ALL its loads (k row ids, which are one
// broadcast address per warp, then the k slot vectors and the shared-expert vector: up to 17 16-byte
// loads in flight, held in registers by the fully unrolled kMaxK loop), then adds them in slot order.
// At T = 1, H = 6144 that is 6 blocks x 128 threads, two round trips (row ids, then data) in total.
// rows_before_wait (the layer's own launch): row_of was final before the predecessor began, so the row
// ids are loaded before griddepcontrol.wait and only the data's round trip follows it. The layer's
// permutation wrote them before GEMM1, and each launch since (GEMM1, GEMM2, a shared expert's own GEMMs)
// started only after every CTA of its predecessor passed that predecessor's wait, so their writer has
// completed by the time this grid starts.
// The arithmetic is the old loop's, in the same order: fp32 sum from 0 over s = 0..k-1, then + shared,
// then round to bf16, so the output is bit-identical.
template <int kMaxK>
__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const uint4* __restrict__ y /*[T*k, H/8]*/,
                       const uint4* __restrict__ shared_y /*[T, H/8] or null*/,
                       const int32_t* __restrict__ row_of /*[T, k]*/, int top_k, int64_t h8, int slices,
                       uint4* __restrict__ out /*[T, H/8]*/, int rows_before_wait) {
  const int64_t t = blockIdx.x / slices;
  const int64_t v = static_cast<int64_t>(blockIdx.x % slices) * kCombineThreads + threadIdx.x;
  int32_t rows[kMaxK];
  auto load_rows = [&] {
#pragma unroll
    for (int s = 0; s < kMaxK; ++s) rows[s] = s < top_k ? __ldg(row_of + t * top_k + s) : 0;
  };
  if (rows_before_wait) load_rows();
  pdl_wait();  // programmatic dependent launch: the predecessor's results are visible after this
  pdl_launch_dependents();
  if (v >= h8) return;
  if (!rows_before_wait) load_rows();
  uint4 vals[kMaxK];
#pragma unroll
  for (int s = 0; s < kMaxK; ++s)
    if (s < top_k) vals[s] = y[static_cast<int64_t>(rows[s]) * h8 + v];
  uint4 sv{};
  if (shared_y != nullptr) sv = shared_y[t * h8 + v];
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int s = 0; s < kMaxK; ++s)
    if (s < top_k) add_bf16x8(acc, vals[s]);
  if (shared_y != nullptr) add_bf16x8(acc, sv);
  uint4 o;
  __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) oh[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  out[t * h8 + v] = o;
}

}  // namespace fp4moe::kernels

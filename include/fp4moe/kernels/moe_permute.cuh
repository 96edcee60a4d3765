// Permutation of the routed (token, slot) pairs into expert-sorted rows, all on the device:
//   1. moe_count_kernel:   per chunk of kPermuteChunk flat entries i = t*k + s, a histogram over experts
//   2. moe_scan_kernel:    one block: per expert, the exclusive prefix over chunks (in place), the
//                          expert totals and their exclusive scan -> expert_offsets [E + 1]
//   3. moe_scatter_kernel: per chunk, each entry's row = offsets[e] + entries of e in earlier chunks +
//                          entries of e earlier in this chunk
//   4. moe_gather_kernel:  copies hidden rows to their k destination rows (bf16, 16-byte vectors)
// Row order within an expert is the flat order (token, then slot): a stable counting sort. Nothing
// about the order depends on scheduling: the histograms use shared atomics only to COUNT, and ranks
// come from __match_any_sync peer masks walked in a fixed order, so the result is bit-identical run to
// run. Grid sizes depend on T alone, so there is no host synchronization (CUDA-graph capturable).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "fp4moe/tile_config.hpp"

namespace fp4moe::kernels {

inline constexpr int kPermuteWarps = 8;
inline constexpr int kPermuteRounds = 8;  // 32-entry rounds per warp
inline constexpr int kPermuteChunk = kPermuteWarps * kPermuteRounds * 32;  // 2048 entries per block
inline constexpr int kScanThreads = 512;  // >= kMaxExperts: one thread per expert
static_assert(kScanThreads >= kMaxExperts, "moe_scan_kernel gives each expert one thread");

__global__ void __launch_bounds__(kPermuteWarps * 32)
    moe_count_kernel(const int32_t* __restrict__ ids, int64_t n, int num_experts,
                     int32_t* __restrict__ chunk_counts /*[chunks, E]*/) {
  __shared__ int32_t hist[kMaxExperts];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kPermuteChunk;
  const int64_t end = min(begin + kPermuteChunk, n);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < num_experts) atomicAdd(&hist[e], 1);  // out-of-range ids are dropped, never written
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    chunk_counts[static_cast<int64_t>(blockIdx.x) * num_experts + e] = hist[e];
}

// One block of kScanThreads. Also writes the shared expert's offsets {0, T}: they depend on T, which
// a captured graph may not know on the host, so a kernel writes them.
__global__ void __launch_bounds__(kScanThreads)
    moe_scan_kernel(int32_t* __restrict__ chunk_counts, int num_chunks, int num_experts,
                    int32_t* __restrict__ expert_offsets /*[E + 1]*/,
                    int32_t* __restrict__ shared_offsets /*[2] or null*/, int32_t tokens) {
  __shared__ int32_t warp_sums[kScanThreads / 32];
  const int e = threadIdx.x, lane = e % 32, warp = e / 32;
  int32_t total = 0;
  if (e < num_experts) {
    for (int c = 0; c < num_chunks; ++c) {
      int32_t* p = chunk_counts + static_cast<int64_t>(c) * num_experts + e;
      const int32_t v = *p;
      *p = total;
      total += v;
    }
  }
  // Block-wide exclusive scan of the totals (integers: the order of additions cannot matter).
  int32_t incl = total;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int32_t o = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += o;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int32_t ws = lane < kScanThreads / 32 ? warp_sums[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int32_t o = __shfl_up_sync(0xffffffffu, ws, off);
      if (lane >= off) ws += o;
    }
    if (lane < kScanThreads / 32) warp_sums[lane] = ws;  // inclusive over warps
  }
  __syncthreads();
  const int32_t excl = incl - total + (warp > 0 ? warp_sums[warp - 1] : 0);
  if (e < num_experts) expert_offsets[e] = excl;
  if (e == num_experts - 1) expert_offsets[num_experts] = excl + total;
  if (e == 0 && shared_offsets != nullptr) {
    shared_offsets[0] = 0;
    shared_offsets[1] = tokens;
  }
}

__global__ void __launch_bounds__(kPermuteWarps * 32)
    moe_scatter_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, int64_t n,
                       int num_experts, const int32_t* __restrict__ chunk_base /*[chunks, E]*/,
                       const int32_t* __restrict__ expert_offsets, int32_t* __restrict__ row_of /*[n]*/,
                       float* __restrict__ row_scale /*[n] rows*/) {
  // base[w][e]: first row of expert e for warp w's sub-chunk (16 KB for 8 warps x 512 experts).
  __shared__ int32_t base[kPermuteWarps][kMaxExperts];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t lanes_below = (1u << lane) - 1u;
  for (int i = threadIdx.x; i < kPermuteWarps * kMaxExperts; i += blockDim.x) (&base[0][0])[i] = 0;
  __syncthreads();
  const int64_t sub = static_cast<int64_t>(blockIdx.x) * kPermuteChunk +
                      static_cast<int64_t>(warp) * kPermuteRounds * 32;
  // Pass 1: per-warp histogram. Lanes with the same expert form one peer group; its lowest lane adds
  // the group size, so each address has one writer per round.
  for (int r = 0; r < kPermuteRounds; ++r) {
    const int64_t i = sub + r * 32 + lane;
    int e = i < n ? ids[i] : -1;
    if (e >= num_experts) e = -1;
    const uint32_t peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && (peers & lanes_below) == 0) base[warp][e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  // Counts -> first rows, warps in order.
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t run = expert_offsets[e] + chunk_base[static_cast<int64_t>(blockIdx.x) * num_experts + e];
#pragma unroll
    for (int w = 0; w < kPermuteWarps; ++w) {
      const int32_t c = base[w][e];
      base[w][e] = run;
      run += c;
    }
  }
  __syncthreads();
  // Pass 2: rank among the round's peers below this lane, then the group's lowest lane advances the
  // running row by the group size.
  for (int r = 0; r < kPermuteRounds; ++r) {
    const int64_t i = sub + r * 32 + lane;
    int e = i < n ? ids[i] : -1;
    if (e >= num_experts) e = -1;
    const uint32_t peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0) {
      const int32_t row = base[warp][e] + __popc(peers & lanes_below);
      row_of[i] = row;
      row_scale[row] = weights[i];
    }
    __syncwarp();
    if (e >= 0 && (peers & lanes_below) == 0) base[warp][e] += __popc(peers);
    __syncwarp();
  }
}

// One block per token: the row is read once and written to its k destination rows.
__global__ void moe_gather_kernel(const uint4* __restrict__ hidden /*[T, H/8]*/, int64_t h8,
                                  const int32_t* __restrict__ row_of /*[T, k]*/, int top_k,
                                  uint4* __restrict__ sorted /*[T*k, H/8]*/) {
  __shared__ int32_t rows[kMaxTopK];
  const int64_t t = blockIdx.x;
  if (threadIdx.x < top_k) rows[threadIdx.x] = row_of[t * top_k + threadIdx.x];
  __syncthreads();
  for (int64_t v = threadIdx.x; v < h8; v += blockDim.x) {
    const uint4 x = hidden[t * h8 + v];
    for (int s = 0; s < top_k; ++s) sorted[static_cast<int64_t>(rows[s]) * h8 + v] = x;
  }
}

}  // namespace fp4moe::kernels

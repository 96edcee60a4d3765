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
//
// Small T (T * k <= kSmallPermuteMaxEntries): moe_permute_small_kernel does all of it (and, if asked,
// the gather) in ONE launch. At these sizes the four kernels above are pure latency: each launch costs
// ~2-4 us of launch overhead plus a dependent DRAM/L2 round trip, while the work is a few KB. Every
// block recomputes the histogram of all T * k ids (<= 16 KB, an L2 hit after the first block) instead
// of waiting for another block's result: redundant work is far cheaper than a grid-wide dependency
// (which needs another launch or a grid sync). Its output is identical to the multi-kernel path:
// row(i) = offsets[e] + (entries of e before i in flat order) is a function of the ids alone.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "fp4moe/kernels/pdl.cuh"
#include "fp4moe/moe_layer.hpp"
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
  pdl_wait();  // programmatic dependent launch: the predecessor's results are visible after this
  pdl_launch_dependents();
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
  pdl_wait();  // programmatic dependent launch: the predecessor's results are visible after this
  pdl_launch_dependents();
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

// The shared expert's offsets {0, T} alone: for its GEMM1 launched on a second stream while the
// permutation runs (MoeLayer::forward_experts), which then does not write them.
__global__ void moe_shared_offsets_kernel(int32_t* __restrict__ shared_offsets, int32_t tokens) {
  if (threadIdx.x == 0) {
    shared_offsets[0] = 0;
    shared_offsets[1] = tokens;
  }
}

__global__ void __launch_bounds__(kPermuteWarps * 32)
    moe_scatter_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, int64_t n,
                       int num_experts, const int32_t* __restrict__ chunk_base /*[chunks, E]*/,
                       const int32_t* __restrict__ expert_offsets, int32_t* __restrict__ row_of /*[n]*/,
                       float* __restrict__ row_scale /*[n] rows*/) {
  pdl_wait();  // programmatic dependent launch: the predecessor's results are visible after this
  pdl_launch_dependents();
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

// ---- small T: count + scan + scatter (+ gather) in one launch ----
inline constexpr int kSmallPermuteThreads = 256;
inline constexpr int kSmallPermuteMaxEntries = kMoeSmallPermuteMaxEntries;  // T * k up to this: one launch
inline constexpr int kSmallPermuteMaxBlocks = 256;    // blocks = ceil(T / tokens_per_block) <= this
inline constexpr int kSmallPermutePrefetch = 4;       // hidden vectors per thread loaded up front
// tokens_per_block = ceil(T / kSmallPermuteMaxBlocks) <= ceil(kSmallPermuteMaxEntries / (256 k)), so a
// block owns tokens_per_block * k <= ceil(16 / k) * k <= 31 entries: one warp ranks them in one round.
static_assert(kSmallPermuteMaxEntries <= kSmallPermuteMaxBlocks * 16, "a block's entries must fit one warp");
inline constexpr int kSmallPermuteMaxOwn = 32;

__host__ __device__ constexpr int small_permute_tokens_per_block(int64_t tokens) {
  return static_cast<int>((tokens + kSmallPermuteMaxBlocks - 1) / kSmallPermuteMaxBlocks);
}
// The gather's stores per block are capped near kSmallPermuteSliceBytes by cutting the hidden columns
// into slices, one block each: a block's 16-byte stores leave its SM at ~30 ns per KB (H100 timelines:
// the one-block launch at T = 1 took 2.7 us for 32 KB of copies and 4.7 for 98 KB), so the whole copy
// in one block was most of the launch at T = 1..8 on the large models; in slices of 16 KB GLM-5's and
// Kimi-K2's launch took 3.0 us at T = 1 instead of 4.7 / 5.8 (bench/NOTES.md, twenty-fifth session).
// Every slice recomputes the histogram and the scan (a few KB of L2 reads). 32 KB: two slices of
// qwen3-30b's or gpt-oss-120b's 23-32 KB measured level with one.
inline constexpr int64_t kSmallPermuteSliceBytes = 32 * 1024;
inline constexpr int kSmallPermuteMaxSlices = 16;
__host__ __device__ constexpr int small_permute_slices(int64_t tokens_per_block, int top_k, int64_t h8) {
  const int64_t bytes = tokens_per_block * top_k * h8 * 16;
  int64_t s = (bytes + kSmallPermuteSliceBytes - 1) / kSmallPermuteSliceBytes;
  s = s < kSmallPermuteMaxSlices ? s : kSmallPermuteMaxSlices;
  s = s < h8 ? s : h8;  // at least one column per slice
  return s < 1 ? 1 : static_cast<int>(s);
}
// Columns per slice: every slice but the last has this many, the last the rest (at least one).
__host__ __device__ constexpr int small_permute_slice_cols(int slices, int64_t h8) {
  return static_cast<int>((h8 + slices - 1) / slices);
}

// Block (tb, c) = (blockIdx.x, blockIdx.y) owns tokens [tb * tpb, min(T, (tb + 1) * tpb)), i.e. flat
// entries [begin, end), and copies hidden columns [c * slice_cols, min(h8, (c + 1) * slice_cols)) of
// them (gridDim.y slices with kSliced; one slice, and no slice arithmetic, without it). No division runs
// before the trigger: the dependent's launch follows it, and a version with the slice's bounds divided
// out in the kernel delayed GEMM1's start by ~0.5 us (bench/NOTES.md, twenty-fifth session).
//   1. (gather) issue the loads of the owned hidden rows first: their DRAM latency then overlaps the
//      histogram and the scan instead of following them;
//   2. histogram of all n ids in shared memory, split into entries before `begin` and the rest (one
//      shared atomic per entry; counting only, so the order of the atomics cannot matter);
//   3. block-wide exclusive scan of the totals -> offsets; block 0 writes expert_offsets (and the
//      shared expert's {0, T});
//   4. warp 0 ranks the owned entries (<= 32) among equal experts with __match_any_sync:
//      row = offsets[e] + (entries of e before begin) + (peers in lower lanes); slice 0 writes them;
//   5. (gather) copy each owned hidden vector to its k rows (16-byte stores, fire and forget).
// hidden_before_wait (the layer's own launch): the hidden rows were final before the predecessor (the
// routing kernel, launched without programmatic launch) began, so step 1 is issued before
// griddepcontrol.wait and their DRAM latency passes under routing's tail.
template <bool kGather, bool kSliced = false>
__global__ void __launch_bounds__(kSmallPermuteThreads)
    moe_permute_small_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, int tokens,
                             int top_k, int num_experts, int tokens_per_block,
                             int32_t* __restrict__ expert_offsets, int32_t* __restrict__ row_of,
                             float* __restrict__ row_scale, int32_t* __restrict__ shared_offsets,
                             const uint4* __restrict__ hidden, int64_t h8, uint4* __restrict__ sorted,
                             int hidden_before_wait, int slice_cols) {
  constexpr int kWarps = kSmallPermuteThreads / 32;
  __shared__ int32_t before[kMaxExperts];  // entries of e before `begin`; then the first row of e here
  __shared__ int32_t rest[kMaxExperts];    // entries of e at or after `begin`
  __shared__ int32_t warp_sums[kWarps];
  __shared__ int32_t rows[kSmallPermuteMaxOwn];
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int tb = static_cast<int>(blockIdx.x), slice = kSliced ? static_cast<int>(blockIdx.y) : 0;
  const int t0 = tb * tokens_per_block;
  const int t1 = min(tokens, t0 + tokens_per_block);
  const int n = tokens * top_k, begin = t0 * top_k, end = t1 * top_k;

  // 1. prefetch of the owned hidden rows' columns [col0, col0 + cw) (vector v: token t0 + v / cw; the
  //    vectors are contiguous when the block owns one token or whole rows)
  const int col0 = kSliced ? slice * slice_cols : 0;
  const int cw = kSliced ? min(slice_cols, static_cast<int>(h8) - col0) : static_cast<int>(h8);
  const int own_vecs = kGather ? (t1 - t0) * cw : 0;
  const bool flat = !kSliced || t1 - t0 == 1 || cw == h8;
  auto src_of = [&](int v) {
    if (flat) return hidden + static_cast<int64_t>(t0) * h8 + col0 + v;
    const int tl = v / cw;
    return hidden + (static_cast<int64_t>(t0) + tl) * h8 + col0 + (v - tl * cw);
  };
  uint4 pre[kSmallPermutePrefetch] = {};
  auto prefetch = [&] {
    if constexpr (kGather) {
#pragma unroll
      for (int q = 0; q < kSmallPermutePrefetch; ++q) {
        const int v = tid + q * kSmallPermuteThreads;
        if (v < own_vecs) pre[q] = *src_of(v);
      }
    }
  };
  if (hidden_before_wait) prefetch();
  pdl_wait();  // programmatic dependent launch: the predecessor's results are visible after this
  pdl_launch_dependents();
  if (!hidden_before_wait) prefetch();
  // The owned entries' ids and weights (warp 0, one per lane), requested with the histogram's loads:
  // reloaded at step 4 they were two more L2 round trips after the scan.
  int own_e = -1;
  float own_w = 0.0f;
  if (warp == 0 && begin + lane < end) {
    own_e = ids[begin + lane];
    own_w = weights[begin + lane];
  }

  // 2. histogram
  for (int e = tid; e < num_experts; e += kSmallPermuteThreads) {
    before[e] = 0;
    rest[e] = 0;
  }
  __syncthreads();
#pragma unroll 4
  for (int i = tid; i < n; i += kSmallPermuteThreads) {
    const int e = ids[i];
    if (e >= 0 && e < num_experts) atomicAdd(i < begin ? &before[e] : &rest[e], 1);
  }
  __syncthreads();

  // 3. exclusive scan over experts: thread tid owns experts 2 tid and 2 tid + 1 (E <= 512)
  static_assert(2 * kSmallPermuteThreads >= kMaxExperts, "two experts per thread");
  const int e0 = 2 * tid, e1 = 2 * tid + 1;
  const int32_t c0 = e0 < num_experts ? before[e0] + rest[e0] : 0;
  const int32_t c1 = e1 < num_experts ? before[e1] + rest[e1] : 0;
  int32_t incl = c0 + c1;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int32_t o = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += o;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  int32_t warp_base = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) warp_base += w < warp ? warp_sums[w] : 0;
  const int32_t off0 = warp_base + incl - c0 - c1, off1 = off0 + c0;
  if (blockIdx.x == 0 && slice == 0) {
    if (e0 < num_experts) expert_offsets[e0] = off0;
    if (e1 < num_experts) expert_offsets[e1] = off1;
    if (e0 == num_experts - 1 || e1 == num_experts - 1) expert_offsets[num_experts] = off1 + c1;
    if (tid == 0 && shared_offsets != nullptr) {
      shared_offsets[0] = 0;
      shared_offsets[1] = tokens;
    }
  }
  // Each thread rewrites only its own two experts, read by no other thread in step 3.
  if (e0 < num_experts) before[e0] += off0;
  if (e1 < num_experts) before[e1] += off1;
  __syncthreads();

  // 4. rank the owned entries (flat order = token, then slot) among equal experts
  if (warp == 0) {
    const int i = begin + lane;
    int e = own_e;
    if (e >= num_experts) e = -1;
    const uint32_t peers = __match_any_sync(0xffffffffu, e);
    int32_t row = -1;
    if (e >= 0) {
      row = before[e] + __popc(peers & ((1u << lane) - 1u));
      if (slice == 0) {  // every slice ranks its tokens' entries; the first writes them
        row_of[i] = row;
        row_scale[row] = own_w;
      }
    }
    rows[lane] = row;
  }
  if constexpr (!kGather) return;
  __syncthreads();

  // 5. gather
  const int k = top_k;
  auto store = [&](int v, const uint4& x) {
    const int tl = v / cw;
    const int64_t col = col0 + (v - tl * cw);
    for (int s = 0; s < k; ++s) {
      const int32_t r = rows[tl * k + s];
      if (r >= 0) sorted[static_cast<int64_t>(r) * h8 + col] = x;
    }
  };
#pragma unroll
  for (int q = 0; q < kSmallPermutePrefetch; ++q) {
    const int v = tid + q * kSmallPermuteThreads;
    if (v < own_vecs) store(v, pre[q]);
  }
  for (int v = tid + kSmallPermutePrefetch * kSmallPermuteThreads; v < own_vecs; v += 2 * kSmallPermuteThreads) {
    // two loads in flight per iteration before their stores
    const int v2 = v + kSmallPermuteThreads;
    const uint4 a = *src_of(v);
    uint4 b{};
    if (v2 < own_vecs) b = *src_of(v2);
    store(v, a);
    if (v2 < own_vecs) store(v2, b);
  }
}

// ---- gather (the multi-kernel path, and moe_gather) ----
inline constexpr int kGatherThreads = 128;

// One thread per (token, 16-byte column): the hidden vector is read once and stored to its k rows.
// Grid = T * ceil(H/8 / 128) blocks, so even T = 1 spreads a 12 KB row over several SMs and every
// thread has its single load in flight at once (a block-per-token loop would serialize ~3 round trips
// per thread at H = 6144).
__global__ void __launch_bounds__(kGatherThreads)
    moe_gather_kernel(const uint4* __restrict__ hidden /*[T, H/8]*/, int64_t h8, int slices,
                      const int32_t* __restrict__ row_of /*[T, k]*/, int top_k, int num_rows,
                      uint4* __restrict__ sorted /*[T*k, H/8]*/) {
  pdl_wait();  // programmatic dependent launch: the predecessor's results are visible after this
  pdl_launch_dependents();
  const int64_t t = blockIdx.x / slices;
  const int64_t v = static_cast<int64_t>(blockIdx.x % slices) * kGatherThreads + threadIdx.x;
  if (v >= h8) return;
  const uint4 x = hidden[t * h8 + v];
  for (int s = 0; s < top_k; ++s) {
    const int32_t r = __ldg(row_of + t * top_k + s);  // same address across the block: one broadcast
    if (r >= 0 && r < num_rows) sorted[static_cast<int64_t>(r) * h8 + v] = x;
  }
}

}  // namespace fp4moe::kernels

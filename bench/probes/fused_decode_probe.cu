// Development probe (not part of the library or the CLI): what does the MoE layer take at T = 1..8 tokens
// when everything after routing is ONE kernel with no kernel boundary and no CTA-wide step after its
// start? bench/NOTES.md puts issue 8's decode gap in the per-launch chain: at GLM-5 T = 1 the layer takes
// ~80 us on an H200 for 42 us of weight bytes at the read ceiling. Given routing costs one copy, the
// permutation ~4 us, and each GEMM launch a ramp and a 5-11 us spread of CTA finishing times; GEMM2 starts
// only on SMs that GEMM1's last CTAs leave. qwen3-30b (small experts) is ~30 us for a 4.7-us floor.
// The fourth session's GEMM pair (both GEMMs of the stream kernel in one launch, static shares) lost to
// its finishing spread; the sixteenth session's warp-stream probe (no CTA steps, activations read through
// L1) lost to its activation misses. This probe keeps what each of those lacked:
// - Work items claimed in arrival order from one global counter (each warp's first by its index, every
//   later one claimed an item ahead), over ONE list: GEMM1 items (active expert, m16 tile, K piece) in
//   expert order, then GEMM2 items. A warp done with GEMM1 work takes GEMM2 work at once; the finishing
//   spread is at most one item, at the end of the kernel only.
// - No permutation: at T <= 8 the mma's n8 token tile holds every token, so each active expert computes
//   all T tokens (the same mma count) and only the routed (token, expert) pairs are kept.
// - Activations through a per-warp shared-memory ring filled by cp.async with each chunk's weights
//   (T rows x 128 bytes per 64-wide chunk, swizzled for conflict-free ldmatrix), issued DEPTH chunks
//   ahead like the weights: no staging step, no L1 misses in the hot loop.
// - Weights: the stream kernel's register ring in two halves, its loads and its dequantization.
// - GEMM2's activations are GEMM1's outputs: a GEMM2 item starts issuing once its expert's GEMM1 m-tiles
//   are all stored (a per-expert counter, acquire / release). Until then the warp keeps consuming what
//   its ring holds (never blocks while it holds GEMM1 work, so nothing can wait on itself).
// - Split m-tiles: fp32 partials in global memory, summed in piece order by the last piece to arrive
//   (bit-identical run to run). The combine: the last expert to store a GEMM2 m-tile (16 features) sums
//   every token's slots for those features in slot order, then the shared expert: moe_combine's order.
// Rounding points are the layer's: GEMM1 output bf16, GEMM2 output (routing weight applied) bf16 per
// (token, slot), fp32 sum from 0 in slot order, + shared expert, bf16. Only the fp32 order inside a split
// m-tile differs from the library's kernels, so the output is compared with the layer's within a bound.
//
// Variants: warps x ring depth x CTAs per SM; `_inl` with the item start and end inlined (as calls, ptxas
// drains the ring at each); `_xs` with x (GEMM1's activations) staged whole in the CTA instead of through
// the ring. Each with S1 / S2 pieces per GEMM1 / GEMM2 m-tile.
//
// Output per preset and T (graph replay, L2 flushed): the library's layer (forward_routed on the same
// routing; forward from the logits; its routing stage alone) and each probe variant: us, TB/s of weight
// bytes, ratio to the read ceiling measured in the same run, ratio to the layer; the largest difference
// to the layer's output and to its GEMM1 and GEMM2 rows (its intermediates of the same call), whether a
// rerun is bit-identical, and WRONG where either fails; with --trace, the warps' end spread. The fastest
// plausible variant is timed once more after the layer's routing stage, against the layer's forward.
// NVFP4 presets; gpt-oss-120b's shape runs as NVFP4 with plain SwiGLU and no biases (the structure is
// the question, not its MXFP4 epilogue).
//
//   fp4moe_probe_fused_decode [--reps N] [--model M[,M]] [--tokens 1,2,4,8] [--variant NAME] [--s1 N] [--s2 N]
//                             [--trace 1]   (a per-warp timeline of the first, eager launch of each variant)
//                             [--ceilings 0] [--min-chunks N]   (for compute-sanitizer: no ceiling runs, and
//                             split m-tiles with pieces down to N chunks, so that the tiny preset splits too)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "bench_common.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/kernels/activation.cuh"
#include "fp4moe/kernels/nvfp4_dequant.cuh"
#include "fp4moe/kernels/sm80_nvfp4_grouped_gemm.cuh"
#include "fp4moe/kernels/sm80_nvfp4_grouped_stream.cuh"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/nvfp4_weight_layout.hpp"

namespace {

using namespace fp4moe;
using namespace fp4moe::kernels;

constexpr int kTM = 8;                        // token rows per chunk slot and per h row block (T <= 8)
constexpr int kMaxTopKProbe = 8;              // the presets' top-k
constexpr int kMaxActive = kTM * kMaxTopKProbe + 1;  // routed experts of 8 tokens + the shared expert
constexpr int kMaxEProbe = 512;

struct FusedParams {
  // routed experts, repacked (W13 gate/up interleaved per m16 tile, W2 in pairs order)
  const uint8_t* w1c;
  const uint8_t* w1s;
  const float* g1;
  const float* g1u;  // or null: the gate's
  const uint8_t* w2c;
  const uint8_t* w2s;
  const float* g2;
  // the shared expert (expert index E), or null codes: none
  const uint8_t* sw1c;
  const uint8_t* sw1s;
  const float* sg1;
  const float* sg1u;
  const uint8_t* sw2c;
  const uint8_t* sw2s;
  const float* sg2;
  const __nv_bfloat16* x;  // [T][H]
  const int32_t* ids;      // [T][k]
  const float* wts;        // [T][k]
  __nv_bfloat16* h;        // [kMaxActive][kTM][I]: GEMM1 output per active expert and token
  __nv_bfloat16* y;        // [T][k + 1][H]: GEMM2 output per (token, slot); slot k = the shared expert
  __nv_bfloat16* out;      // [T][H]
  float* partial;          // [items][32][4]
  int32_t* cnt;            // counters (zero at launch, left zero): see the offsets below
  int E, k, T, H, I, S1, S2;
  int tp;                  // token rows per ring slot and per staged chunk: T rounded up to a power of 2
  int zero;                // 0, opaque to the compiler (the ring's load-order dependency)
  // Optional timeline (null: none): per warp of the grid, kTraceValues values: %globaltimer at entry, at
  // its first GEMM2 item opened, at exit, and the count of readiness polls that found the expert not ready.
  unsigned long long* trace;
  uint32_t scale_mul, scale_add;
};
// Counter layout (int32): [0] items claimed beyond the first W, [1] warps done, [2..2+kMaxActive) GEMM1
// m-tiles stored per active expert, then arrivals per GEMM1 m-tile (kMaxActive x MT1), per GEMM2 m-tile
// (kMaxActive x MT2), and experts stored per GEMM2 m-tile (MT2).
__host__ __device__ inline int cnt_done1(int a) { return 2 + a; }
__host__ __device__ inline int cnt_arr1(int u) { return 2 + kMaxActive + u; }
__host__ __device__ inline int cnt_arr2(int MT1, int u) { return 2 + kMaxActive + kMaxActive * MT1 + u; }
__host__ __device__ inline int cnt_comb(int MT1, int MT2, int m) {
  return 2 + kMaxActive + kMaxActive * MT1 + kMaxActive * MT2 + m;
}

constexpr int kTraceValues = 4;
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long* trace_of(const FusedParams& p, int warps) {
  return p.trace + (static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5)) * kTraceValues;
}

struct CtaState {  // shared memory, written once at the start
  uint32_t bits[(kMaxEProbe + 1 + 31) / 32];
  int32_t word_prefix[(kMaxEProbe + 1 + 31) / 32];
  int16_t act_e[kMaxActive];
  int8_t slot_of[kMaxActive][kTM];  // slot of token t for active expert a, -1: not routed there
  int A;
};

struct WarpQ {     // per warp: items opened by the issue side, consumed in order by the math side
  int q[16];
  int head, tail;
  int next_item;   // the item claimed after the issue side's current one (-1: the warp's first)
  int pending;     // an item whose expert's GEMM1 output is not complete yet (-1: none)
  int done;        // the issue side has no more items
};

struct Item {
  int gemm;  // 1 or 2
  int a, m, j;
  int u;     // m-tile index within its GEMM (a * MT + m)
};

__device__ __forceinline__ Item decode_item(int it, int A, int MT1, int MT2, int S1, int S2) {
  Item r;
  const int n1 = A * MT1 * S1;
  if (it < n1) {
    r.gemm = 1;
    r.u = it / S1;
    r.j = it - r.u * S1;
    r.a = r.u / MT1;
    r.m = r.u - r.a * MT1;
  } else {
    const int i2 = it - n1;
    r.gemm = 2;
    r.u = i2 / S2;
    r.j = i2 - r.u * S2;
    r.a = r.u / MT2;
    r.m = r.u - r.a * MT2;
  }
  return r;
}

struct Cursor {
  const uint8_t* lc;
  const uint8_t* ls;
  const uint8_t* la;  // row 0 of this lane's activation unit of the chunk
  uint32_t ast;       // activation row stride, bytes
  uint32_t sa;        // XS, GEMM1: the chunk's rows in the CTA's staged copy of x (0: rows come through the ring)
  int left;
};

template <int WARPS>
__device__ __forceinline__ CtaState& cta_state(uint8_t* smem) {
  return *reinterpret_cast<CtaState*>(smem);
}
template <int WARPS>
__device__ __forceinline__ WarpQ& warp_q(uint8_t* smem) {
  return reinterpret_cast<WarpQ*>(smem + sizeof(CtaState))[threadIdx.x >> 5];
}
// Shared memory: CtaState, the warps' queues, the warps' activation rings (DEPTH slots of kTM x 128 bytes
// each, whatever T: a slot's address is then an immediate offset, not arithmetic in the hot loop), then
// (XS) x staged whole: chunk c's tp rows at c * tp * 128, 16-byte units swizzled by row.
constexpr uint32_t kSlotBytes = kTM * 128;
template <int WARPS>
constexpr int smem_head() {
  return (sizeof(CtaState) + WARPS * sizeof(WarpQ) + 127) / 128 * 128;
}
template <int WARPS, int DEPTH>
__device__ __forceinline__ uint32_t ring_base(uint8_t* smem) {
  return smem_u32(smem + smem_head<WARPS>()) + (threadIdx.x >> 5) * (DEPTH * kSlotBytes);
}
template <int WARPS, int DEPTH>
__device__ __forceinline__ uint32_t staged_x_base(uint8_t* smem, int tp) {
  return smem_u32(smem + smem_head<WARPS>()) + WARPS * DEPTH * kSlotBytes;
}

// 16 bytes, of which src_bytes (16 or 0) are read and the rest zero-filled
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ int load_acquire(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The issue side's next item: returns a cursor with left > 0, or left == 0 when the warp has no more
// items (wq.done) or its next item's expert is not ready yet (wq.pending; the caller retries later).
template <int WARPS, int DEPTH, bool XS>
__device__ __forceinline__ Cursor open_next_body(const FusedParams& p, uint8_t* smem) {
  const CtaState& cs = cta_state<WARPS>(smem);
  WarpQ& wq = warp_q<WARPS>(smem);
  const int lane = threadIdx.x & 31;
  Cursor c{nullptr, nullptr, nullptr, 0u, 0u, 0};
  if (wq.done) return c;
  const int A = cs.A;
  const int MT1 = 2 * p.I / 16, MT2 = p.H / 16;
  const int N = A * MT1 * p.S1 + A * MT2 * p.S2;
  const int W = gridDim.x * WARPS;
  int it = wq.pending;
  if (it < 0) {
    it = wq.next_item;
    if (it < 0) it = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (it >= N) {
      __syncwarp();
      if (lane == 0) wq.done = 1;
      __syncwarp();
      return c;
    }
    // claim the item after this one now: its latency hides under this item's chunks
    int nxt = 0;
    if (lane == 0) nxt = atomicAdd(p.cnt, 1) + W;
    nxt = __shfl_sync(0xffffffffu, nxt, 0);
    __syncwarp();
    if (lane == 0) wq.next_item = nxt;
    __syncwarp();
  }
  const Item itm = decode_item(it, A, MT1, MT2, p.S1, p.S2);
  const int e = cs.act_e[itm.a];
  const bool xs = e == p.E;
  if (itm.gemm == 2) {
    int ready = 0;
    if (lane == 0) ready = load_acquire(p.cnt + cnt_done1(itm.a)) == MT1;
    ready = __shfl_sync(0xffffffffu, ready, 0);
    if (!ready) {
      __syncwarp();
      if (lane == 0) {
        wq.pending = it;
        if (p.trace != nullptr) ++trace_of(p, WARPS)[3];
      }
      __syncwarp();
      return c;
    }
    if (p.trace != nullptr && lane == 0 && trace_of(p, WARPS)[1] == 0ull) trace_of(p, WARPS)[1] = global_ns();
  }
  const int K = itm.gemm == 1 ? p.H : p.I;
  const int n = itm.gemm == 1 ? 2 * p.I : p.H;
  const int S = itm.gemm == 1 ? p.S1 : p.S2;
  const int Kc = K / 64;
  const int c0 = itm.j * Kc / S, c1 = (itm.j + 1) * Kc / S;
  const uint8_t* wc = itm.gemm == 1 ? (xs ? p.sw1c : p.w1c) : (xs ? p.sw2c : p.w2c);
  const uint8_t* ws = itm.gemm == 1 ? (xs ? p.sw1s : p.w1s) : (xs ? p.sw2s : p.w2s);
  const int64_t eo = xs ? 0 : e;
  const int64_t chunk = static_cast<int64_t>(itm.m) * Kc + c0;
  c.lc = wc + eo * (static_cast<int64_t>(n) * K / 2) + chunk * 512 + lane * 16;
  c.ls = ws + eo * (static_cast<int64_t>(n) * K / 16) + chunk * 64 + (lane >> 2) * 8;
  // activation unit of this lane: row r = lane / 8 (and r + 4 for kTM = 8), 16-byte unit lane % 8
  const int r = lane >> 3, unit = lane & 7;
  if (itm.gemm == 1) {
    c.la = reinterpret_cast<const uint8_t*>(p.x) + (static_cast<int64_t>(r) * p.H + c0 * 64) * 2 + unit * 16;
    c.ast = static_cast<uint32_t>(p.H) * 2;
    if constexpr (XS) c.sa = staged_x_base<WARPS, DEPTH>(smem, p.tp) + c0 * p.tp * 128;
  } else {
    c.la = reinterpret_cast<const uint8_t*>(p.h) +
           ((static_cast<int64_t>(itm.a) * kTM + r) * p.I + c0 * 64) * 2 + unit * 16;
    c.ast = static_cast<uint32_t>(p.I) * 2;
  }
  c.left = c1 - c0;
  __syncwarp();
  if (lane == 0) {
    wq.pending = -1;
    wq.q[wq.tail & 15] = it;
    wq.tail = wq.tail + 1;
  }
  __syncwarp();
  return c;
}

// Stores a finished GEMM1 m-tile (SwiGLU of the gate rows g and up rows g + 8, kGateUp order) for the T
// tokens, then counts it for its expert (release).
__device__ __forceinline__ void gemm1_store(const FusedParams& p, const CtaState& cs, const Item& itm,
                                            const float (&acc)[4]) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int e = cs.act_e[itm.a];
  const bool xs = e == p.E;
  const float gs = __ldg(xs ? p.sg1 : p.g1 + e) * layout::kAccumulatorScale;
  const float* gup = xs ? p.sg1u : (p.g1u != nullptr ? p.g1u + e : nullptr);
  const float gs_up = gup != nullptr ? __ldg(gup) * layout::kAccumulatorScale : gs;
  const int jn = itm.m * 8 + g;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int t = 2 * t4 + hh;
    const float gate = acc[hh] * gs + 0.f;
    const float up = acc[2 + hh] * gs_up + 0.f;
    if (t < p.T)
      p.h[(static_cast<int64_t>(itm.a) * kTM + t) * p.I + jn] = __float2bfloat16_rn(swiglu_act(gate, up));
  }
  __threadfence();
  __syncwarp();
  if (lane == 0) atomicAdd(p.cnt + cnt_done1(itm.a), 1);
}

// Stores a finished GEMM2 m-tile (features 2g, 2g + 1 in rows g, g + 8, kPairs order) for the routed
// tokens (routing weight applied, bf16 per (token, slot)); the last expert to store this m-tile sums
// every token's slots for its 16 features.
__device__ __forceinline__ void gemm2_store(const FusedParams& p, const CtaState& cs, const Item& itm,
                                            const float (&acc)[4]) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int e = cs.act_e[itm.a];
  const bool xs = e == p.E;
  const float gs = __ldg(xs ? p.sg2 : p.g2 + e) * layout::kAccumulatorScale;
  const int f = itm.m * 16 + 2 * g;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int t = 2 * t4 + hh;
    if (t < p.T) {
      const int s = cs.slot_of[itm.a][t];
      if (s >= 0) {
        const float rs = xs ? 1.0f : __ldg(p.wts + t * p.k + s);
        const float v0 = (acc[hh] * gs + 0.f) * rs;
        const float v1 = (acc[2 + hh] * gs + 0.f) * rs;
        *reinterpret_cast<__nv_bfloat162*>(p.y + (static_cast<int64_t>(t) * (p.k + 1) + s) * p.H + f) =
            __floats2bfloat162_rn(v0, v1);
      }
    }
  }
  __threadfence();
  __syncwarp();
  const int MT1 = 2 * p.I / 16, MT2 = p.H / 16;
  int old = 0;
  if (lane == 0) old = atomicAdd(p.cnt + cnt_comb(MT1, MT2, itm.m), 1);
  old = __shfl_sync(0xffffffffu, old, 0);
  if (old != cs.A - 1) return;
  __threadfence();
  // the combine of features [16 m, 16 m + 16) for every token: lane -> (token, 4 features)
  const bool shared = p.sw1c != nullptr;
  for (int o = lane; o < p.T * 4; o += 32) {
    const int t = o >> 2, f0 = itm.m * 16 + (o & 3) * 4;
    float s4[4] = {0.f, 0.f, 0.f, 0.f};
    auto add_slot = [&](int s) {  // four bf16 of (token t, slot s) into the fp32 sums
      const uint2 v = __ldcg(reinterpret_cast<const uint2*>(p.y + (static_cast<int64_t>(t) * (p.k + 1) + s) * p.H + f0));
      const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&v.x);
      const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&v.y);
      s4[0] += __low2float(a), s4[1] += __high2float(a), s4[2] += __low2float(b), s4[3] += __high2float(b);
    };
    for (int s = 0; s < p.k; ++s) {
      const int id = __ldg(p.ids + t * p.k + s);
      if (id >= 0 && id < p.E) add_slot(s);
    }
    if (shared) add_slot(p.k);  // the shared expert last, as moe_combine adds it
    __nv_bfloat162 r0 = __floats2bfloat162_rn(s4[0], s4[1]), r1 = __floats2bfloat162_rn(s4[2], s4[3]);
    uint2 w;
    w.x = *reinterpret_cast<uint32_t*>(&r0);
    w.y = *reinterpret_cast<uint32_t*>(&r1);
    *reinterpret_cast<uint2*>(p.out + static_cast<int64_t>(t) * p.H + f0) = w;
  }
  if (lane == 0) p.cnt[cnt_comb(MT1, MT2, itm.m)] = 0;
}

// The math side's item end: the item at the queue's head is done (acc holds its sum over its K piece).
template <int WARPS>
__device__ __forceinline__ void finish_item_body(const FusedParams& p, uint8_t* smem, float4 acc4) {
  const CtaState& cs = cta_state<WARPS>(smem);
  WarpQ& wq = warp_q<WARPS>(smem);
  const int lane = threadIdx.x & 31;
  const int it = wq.q[wq.head & 15];
  __syncwarp();
  if (lane == 0) wq.head = wq.head + 1;
  __syncwarp();
  const int MT1 = 2 * p.I / 16, MT2 = p.H / 16;
  const Item itm = decode_item(it, cs.A, MT1, MT2, p.S1, p.S2);
  const int S = itm.gemm == 1 ? p.S1 : p.S2;
  float acc[4] = {acc4.x, acc4.y, acc4.z, acc4.w};
  if (S > 1) {
    reinterpret_cast<float4*>(p.partial)[static_cast<int64_t>(it) * 32 + lane] = acc4;
    __threadfence();
    __syncwarp();
    const int ci = itm.gemm == 1 ? cnt_arr1(itm.u) : cnt_arr2(MT1, itm.u);
    int old = 0;
    if (lane == 0) old = atomicAdd(p.cnt + ci, 1);
    old = __shfl_sync(0xffffffffu, old, 0);
    if (old != S - 1) return;
    __threadfence();
    const int first = it - itm.j;  // the m-tile's pieces are consecutive items
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    for (int j = 0; j < S; ++j) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(p.partial) + static_cast<int64_t>(first + j) * 32 + lane);
      acc[0] += v.x, acc[1] += v.y, acc[2] += v.z, acc[3] += v.w;
    }
    if (lane == 0) p.cnt[ci] = 0;
  }
  if (itm.gemm == 1) gemm1_store(p, cs, itm, acc);
  else gemm2_store(p, cs, itm, acc);
}

// The item ends as calls (INL false: the hot loop keeps its registers, but ptxas waits for every
// outstanding ring load before a call, so each item start and end drains the ring) or inlined (INL true:
// no drain, at the price of the cold code's registers in the loop).
template <int WARPS, int DEPTH, bool XS>
__device__ __noinline__ Cursor open_next_call(const FusedParams& p, uint8_t* smem) {
  return open_next_body<WARPS, DEPTH, XS>(p, smem);
}
template <int WARPS>
__device__ __noinline__ void finish_item_call(const FusedParams& p, uint8_t* smem, float4 acc4) {
  finish_item_body<WARPS>(p, smem, acc4);
}
template <int WARPS, int DEPTH, bool XS, bool INL>
__device__ __forceinline__ Cursor open_next(const FusedParams& p, uint8_t* smem) {
  if constexpr (INL) return open_next_body<WARPS, DEPTH, XS>(p, smem);
  else return open_next_call<WARPS, DEPTH, XS>(p, smem);
}
template <int WARPS, bool INL>
__device__ __forceinline__ void finish_item(const FusedParams& p, uint8_t* smem, float4 acc4) {
  if constexpr (INL) finish_item_body<WARPS>(p, smem, acc4);
  else finish_item_call<WARPS>(p, smem, acc4);
}

// Every CTA derives the same active-expert list from the routing ids: a bitmap over experts (the shared
// expert is index E), ranks by popcount.
template <int WARPS>
__device__ void build_active(const FusedParams& p, uint8_t* smem) {
  CtaState& cs = cta_state<WARPS>(smem);
  constexpr int kWords = (kMaxEProbe + 1 + 31) / 32;
  for (int i = threadIdx.x; i < kWords; i += blockDim.x) cs.bits[i] = 0u;
  for (int i = threadIdx.x; i < kMaxActive * kTM; i += blockDim.x) (&cs.slot_of[0][0])[i] = -1;
  __syncthreads();
  const int entries = p.T * p.k;
  for (int i = threadIdx.x; i < entries; i += blockDim.x) {
    const int e = __ldg(p.ids + i);
    if (e >= 0 && e < p.E) atomicOr(&cs.bits[e >> 5], 1u << (e & 31));
  }
  if (threadIdx.x == 0 && p.sw1c != nullptr) atomicOr(&cs.bits[p.E >> 5], 1u << (p.E & 31));
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const uint32_t w = lane < kWords ? cs.bits[lane] : 0u;
    const int c = __popc(w);
    const int incl = warp_inclusive_sum(c, lane);
    if (lane < kWords) cs.word_prefix[lane] = incl - c;
    if (lane == 31) cs.A = incl;
    // list the set bits in order: each lane its word's
    int r = incl - c;
    uint32_t m = w;
    while (m != 0u) {
      const int b = __ffs(m) - 1;
      m &= m - 1u;
      cs.act_e[r++] = static_cast<int16_t>(lane * 32 + b);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < entries; i += blockDim.x) {
    const int e = __ldg(p.ids + i);
    if (e >= 0 && e < p.E) {
      const int a = cs.word_prefix[e >> 5] + __popc(cs.bits[e >> 5] & ((1u << (e & 31)) - 1u));
      cs.slot_of[a][i / p.k] = static_cast<int8_t>(i % p.k);
    }
  }
  if (p.sw1c != nullptr)
    for (int t = threadIdx.x; t < p.T; t += blockDim.x) cs.slot_of[cs.A - 1][t] = static_cast<int8_t>(p.k);
  if (threadIdx.x < WARPS) {
    WarpQ& wq = reinterpret_cast<WarpQ*>(smem + sizeof(CtaState))[threadIdx.x];
    wq.head = wq.tail = 0;
    wq.next_item = -1;
    wq.pending = -1;
    wq.done = 0;
  }
  __syncthreads();  // the only CTA-wide step
}

// XS: GEMM1's activations (x, the same for every expert) staged whole in the CTA's shared memory at the
// start (T x H x 2 bytes) instead of through the ring with each chunk, whose L2 reads grow with T
// (T x 128 bytes per 576-byte weight chunk).
template <int WARPS, int DEPTH, int CTAS, bool INL, bool XS>
__global__ void __launch_bounds__(WARPS * 32, CTAS) fused_decode_kernel(const __grid_constant__ FusedParams p) {
  constexpr int HALF = DEPTH / 2;
  extern __shared__ __align__(128) uint8_t smem[];
  if (p.trace != nullptr && (threadIdx.x & 31) == 0) {
    unsigned long long* tr = trace_of(p, WARPS);
    tr[0] = global_ns();
    tr[1] = 0ull;
    tr[3] = 0ull;
  }
  build_active<WARPS>(p, smem);
  WarpQ& wq = warp_q<WARPS>(smem);
  const int lane = threadIdx.x & 31;
  const int tp = p.tp;
  const uint32_t ring = ring_base<WARPS, DEPTH>(smem);
  [[maybe_unused]] const uint32_t xchunk_bytes = tp * 128;  // XS: a staged x chunk
  // this lane's cp.async destinations within a slot (row r = lane / 8 and r + 4, unit lane % 8, swizzled)
  // and its ldmatrix row addresses (matrix lane / 8 of a k32 half, token row lane % 8, clamped to T - 1)
  const int cr = lane >> 3, cu = lane & 7;
  // Rows past T are copied as zeros (src-size 0: nothing is read; the addresses stay inside the buffers,
  // which hold kTM rows), so the copies need no predicate; the second row only exists for T > 4.
  uint32_t cdst0 = cr * 128 + ((cu ^ cr) & 7) * 16;
  uint32_t cdst1 = (cr + 4) * 128 + ((cu ^ (cr + 4)) & 7) * 16;
  uint32_t csz0 = cr < p.T ? 16u : 0u, csz1 = cr + 4 < p.T ? 16u : 0u;
  const bool two_rows = p.T > 4;
  const int lr = min(lane & 7, p.T - 1);
  uint32_t lm0 = lr * 128 + (((lane >> 3) ^ lr) & 7) * 16;        // units 0..3: steps 0, 1
  uint32_t lm1 = lr * 128 + (((4 + (lane >> 3)) ^ lr) & 7) * 16;  // units 4..7: steps 2, 3
  // opaque to ptxas, which would otherwise recompute them from %tid at every chunk (~20 ALU instructions
  // per chunk in the first build's SASS) rather than hold six registers
  asm volatile("" : "+r"(cdst0), "+r"(cdst1), "+r"(csz0), "+r"(csz1), "+r"(lm0), "+r"(lm1));

  Cursor cur{nullptr, nullptr, nullptr, 0u, 0u, 0};
  [[maybe_unused]] uint32_t sbase[DEPTH];  // XS: each slot's rows (its ring slot, or the staged x chunk)
  uint4 ring_c[DEPTH];
  uint2 ring_s[DEPTH];
  uint32_t meta = 0;  // per slot: bit 2d valid, bit 2d + 1 the item's last chunk
  uint32_t dep = 0;
  auto issue = [&](int d) {
    if (cur.left == 0 && !wq.done) cur = open_next<WARPS, DEPTH, XS, INL>(p, smem);
    if (cur.left > 0) {
      ring_c[d] = ldg_stream_v4(cur.lc + dep);
      ring_s[d] = ldg_stream_v2(cur.ls + dep);
      const uint32_t slot = ring + d * kSlotBytes;
      if constexpr (XS) {
        if (cur.sa != 0u) {
          sbase[d] = cur.sa;
          cur.sa += xchunk_bytes;
        } else {
          sbase[d] = slot;
          cp_async16_zfill(slot + cdst0, cur.la, csz0);
          if (two_rows) cp_async16_zfill(slot + cdst1, cur.la + 4 * cur.ast, csz1);
        }
      } else {
        cp_async16_zfill(slot + cdst0, cur.la, csz0);
        if (two_rows) cp_async16_zfill(slot + cdst1, cur.la + 4 * cur.ast, csz1);
      }
      cur.lc += 512;
      cur.ls += 64;
      cur.la += 128;
      --cur.left;
      meta |= (1u | (cur.left == 0 ? 2u : 0u)) << (2 * d);
    } else {
      meta &= ~(3u << (2 * d));
    }
    cp_async_commit();
  };
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    ring_c[d] = make_uint4(0, 0, 0, 0);
    ring_s[d] = make_uint2(0, 0);
  }
  if constexpr (XS) {  // x staged whole: one commit group of its own, before the ring's first half
    const uint32_t xb = staged_x_base<WARPS, DEPTH>(smem, tp);
    const int upr = p.H / 8;  // 16-byte units per row
    for (int i = threadIdx.x; i < p.T * upr; i += blockDim.x) {
      const int t = i / upr, rem = i - t * upr, c = rem >> 3, u = rem & 7;
      cp_async16(xb + (c * tp + t) * 128 + ((u ^ t) & 7) * 16, p.x + static_cast<int64_t>(t) * p.H + rem * 8);
    }
    cp_async_commit();
  }
#pragma unroll
  for (int d = 0; d < HALF; ++d) issue(d);
  if constexpr (XS) {  // every thread's part of x landed (the HALF ring groups may still be in flight)
    cp_async_wait<HALF>();
    __syncthreads();
  }

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  auto step = [&](int d) {
    uint32_t slot;
    if constexpr (XS) slot = sbase[d];
    else slot = ring + d * kSlotBytes;
    uint32_t b[8];
    ldmatrix_x4(slot + lm0, b[0], b[1], b[2], b[3]);
    ldmatrix_x4(slot + lm1, b[4], b[5], b[6], b[7]);
    const uint4 words = ring_c[d];
    const uint2 sc = ring_s[d];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t w = s == 0 ? words.x : s == 1 ? words.y : s == 2 ? words.z : words.w;
      const uint32_t sw = s < 2 ? sc.x : sc.y;
      const uint32_t pair = __byte_perm(sw, 0u, (s & 1) ? 0x4342u : 0x4140u);
      uint32_t a[4];
      dequant_fragment(w, decode_scale_pair(pair, p.scale_mul, p.scale_add), a);
      mma_bf16_16816(acc, a, b[2 * s], b[2 * s + 1]);
    }
  };
  bool alive = true;
  while (alive) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      if (d % HALF == 0) {
        const int other = d < HALF ? HALF : 0;
        dep = ring_s[d].x & static_cast<uint32_t>(p.zero);
#pragma unroll
        for (int j = 0; j < HALF; ++j) issue(other + j);
        if (meta == 0u) {  // nothing in the ring: done, or waiting for an expert's GEMM1 output
          if (wq.done) {
            alive = false;
            break;
          }
          __nanosleep(200);
        }
      }
      // groups committed after slot d's: the rest of its half and the other half
      if ((meta >> (2 * d)) & 1u) {
        if (d % HALF == 0) cp_async_wait<DEPTH - 1>();
        else if (d % HALF == 1) cp_async_wait<(DEPTH - 2 > 0 ? DEPTH - 2 : 0)>();
        else if (d % HALF == 2) cp_async_wait<(DEPTH - 3 > 0 ? DEPTH - 3 : 0)>();
        else cp_async_wait<(DEPTH - 4 > 0 ? DEPTH - 4 : 0)>();
        __syncwarp();
        step(d);
        if ((meta >> (2 * d)) & 2u) {
          finish_item<WARPS, INL>(p, smem, make_float4(acc[0], acc[1], acc[2], acc[3]));
          acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
        }
        meta &= ~(3u << (2 * d));
      }
    }
  }
  cp_async_wait<0>();
  if (p.trace != nullptr && lane == 0) trace_of(p, WARPS)[2] = global_ns();
  // the last warp to finish resets the claim counter and the experts' GEMM1 counts for the next launch
  __syncwarp();
  if (lane == 0) {
    const int W = gridDim.x * WARPS;
    __threadfence();
    if (atomicAdd(p.cnt + 1, 1) == W - 1) {
      p.cnt[0] = 0;
      p.cnt[1] = 0;
      for (int a = 0; a < kMaxActive; ++a) p.cnt[cnt_done1(a)] = 0;
    }
  }
}

struct Variant {
  const char* name;
  void (*fn)(FusedParams);
  int warps, depth, ctas;
  bool xs;
  size_t head;
};
#define FP4MOE_PROBE_VARIANT(NAME, W, D, C, INL, XS) \
  {NAME, fused_decode_kernel<W, D, C, INL, XS>, W, D, C, XS, static_cast<size_t>(smem_head<W>())}
const Variant kVariants[] = {
    FP4MOE_PROBE_VARIANT("w16_d8_c1", 16, 8, 1, false, false),
    FP4MOE_PROBE_VARIANT("w20_d8_c1", 20, 8, 1, false, false),
    FP4MOE_PROBE_VARIANT("w12_d4_c2", 12, 4, 2, false, false),
    FP4MOE_PROBE_VARIANT("w8_d8_c2", 8, 8, 2, false, false),
    FP4MOE_PROBE_VARIANT("w16_d8_c1_inl", 16, 8, 1, true, false),
    FP4MOE_PROBE_VARIANT("w8_d8_c2_inl", 8, 8, 2, true, false),
    FP4MOE_PROBE_VARIANT("w16_d8_c1_xs", 16, 8, 1, false, true),
    FP4MOE_PROBE_VARIANT("w12_d4_c2_xs", 12, 4, 2, false, true),
    FP4MOE_PROBE_VARIANT("w8_d8_c2_xs", 8, 8, 2, false, true),
};
#undef FP4MOE_PROBE_VARIANT

int rows_per_slot(int T) { return T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8; }
size_t smem_bytes(const Variant& v, int T, int64_t H) {
  const size_t tp = rows_per_slot(T);
  return v.head + static_cast<size_t>(v.warps) * v.depth * kSlotBytes + (v.xs ? static_cast<size_t>(H) * tp * 2 : 0);
}

// "1,2,4,8" -> its fields (the token counts)
std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> r;
  size_t a = 0;
  while (a <= s.size()) {
    const size_t b = s.find(',', a);
    const std::string t = s.substr(a, b == std::string::npos ? std::string::npos : b - a);
    if (!t.empty()) r.push_back(t);
    if (b == std::string::npos) break;
    a = b + 1;
  }
  return r;
}

// Whether a cooperative launch can be captured in a CUDA graph here (the probe's timings replay graphs,
// as the bench does). If not, the stream is taken out of capture and the probe times eager launches.
bool cooperative_capture_works(cudaStream_t st, const std::function<void(cudaStream_t)>& launch) {
  try {
    const bench::CapturedGraph g(launch, st);
    g.launch(st);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st));
    return true;
  } catch (const std::exception& e) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(st, &g);
      if (g != nullptr) cudaGraphDestroy(g);
    }
    (void)cudaGetLastError();
    std::printf("  (a cooperative launch does not capture into a graph here: %s; the probe's times are of eager "
                "launches, each after an L2 flush)\n", e.what());
    return false;
  }
}

// The median of reps eager launches, each after an L2 flush, for when graphs are not available.
double time_eager_us(const std::function<void(cudaStream_t)>& launch, cudaStream_t st, int reps) {
  cudaEvent_t a, b;
  FP4MOE_CUDA_CHECK(cudaEventCreate(&a));
  FP4MOE_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps + 3; ++i) {
    bench::flush_l2(st);
    FP4MOE_CUDA_CHECK(cudaEventRecord(a, st));
    launch(st);
    FP4MOE_CUDA_CHECK(cudaEventRecord(b, st));
    FP4MOE_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) t.push_back(ms * 1000.0);
  }
  FP4MOE_CUDA_CHECK(cudaEventDestroy(a));
  FP4MOE_CUDA_CHECK(cudaEventDestroy(b));
  return bench::median(t);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20, only_s1 = -1, only_s2 = -1;
  bool want_trace = false, want_ceilings = true;
  int min_chunks = 4;  // K chunks per piece when an m-tile is split (S > 1)
  std::string models = "glm-5,kimi-k2,gpt-oss-120b,qwen3-30b", token_list = "1,2,4,8", only_variant;
  for (int i = 1; i + 1 < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps") reps = std::atoi(argv[++i]);
    else if (a == "--model") models = argv[++i];
    else if (a == "--tokens") token_list = argv[++i];
    else if (a == "--variant") only_variant = argv[++i];
    else if (a == "--s1") only_s1 = std::atoi(argv[++i]);
    else if (a == "--s2") only_s2 = std::atoi(argv[++i]);
    else if (a == "--trace") want_trace = std::atoi(argv[++i]) != 0;
    else if (a == "--ceilings") want_ceilings = std::atoi(argv[++i]) != 0;
    else if (a == "--min-chunks") min_chunks = std::max(1, std::atoi(argv[++i]));
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int graphs = -1;  // whether the probe's cooperative launches capture into graphs: tried at the first
  cudaStream_t st;
  FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  // --ceilings 0 (under compute-sanitizer): no ceiling runs; the ratios to the read ceiling print as 0
  bench::Ceilings ceil;
  if (want_ceilings) ceil = bench::measure_ceilings(st);
  else ceil.stream_read_tbps = 1e30;
  std::printf("GPU %s, %d SMs; read ceiling %.2f TB/s (same run)\n", prop.name, prop.multiProcessorCount,
              ceil.stream_read_tbps);
  for (const Variant& v : kVariants) {
    FP4MOE_CUDA_CHECK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(prop.sharedMemPerBlockOptin)));
  }
  // the library's own list rule: comma-separated preset names, or "all"; an unknown name throws naming it
  for (const std::string& model : parse_preset_list(models)) {
    MoeConfig cfg = preset(model);
    if (cfg.format != WeightFormat::kNvfp4 || cfg.expert_bias || cfg.activation != Activation::kSwiGLU) {
      cfg.format = WeightFormat::kNvfp4;  // the shape as NVFP4 with plain SwiGLU (see the top)
      cfg.expert_bias = false;
      cfg.activation = Activation::kSwiGLU;
      cfg.name = model + " (as NVFP4, SwiGLU, no biases)";
    }
    if (cfg.top_k > kMaxTopKProbe || cfg.num_experts >= kMaxEProbe || cfg.kernel_intermediate() != cfg.intermediate ||
        cfg.num_shared > 1) {
      std::printf("\n%s: outside the probe's limits, skipped\n", cfg.name.c_str());
      continue;
    }
    const int E = cfg.num_experts, K = cfg.top_k;
    const int64_t H = cfg.hidden, I = cfg.intermediate;
    const bool shared = cfg.num_shared > 0;
    SyntheticDeviceLayer L = make_synthetic_layer_device(cfg, 7, st);
    MoeLayer layer(L.cfg, L.weights, kTM, st);
    // the probe's weights: the same on-disk tensors, repacked as the layer does
    const size_t c1b = repacked_codes_bytes(2 * I, H), s1b = repacked_scales_bytes(2 * I, H);
    const size_t c2b = repacked_codes_bytes(H, I), s2b = repacked_scales_bytes(H, I);
    DeviceBuffer<uint8_t> w1c(c1b * E), w1s(s1b * E), w2c(c2b * E), w2s(s2b * E);
    DeviceBuffer<uint8_t> sw1c(shared ? c1b : 1), sw1s(shared ? s1b : 1), sw2c(shared ? c2b : 1), sw2s(shared ? s2b : 1);
    repack_nvfp4_weights_device(L.weights.w13_codes, L.weights.w13_scales, E, 2 * I, H, true, w1c.get(), w1s.get(), st);
    repack_nvfp4_weights_device(L.weights.w2_codes, L.weights.w2_scales, E, H, I, false, w2c.get(), w2s.get(), st);
    if (shared) {
      repack_nvfp4_weights_device(L.weights.shared_w13_codes, L.weights.shared_w13_scales, 1, 2 * I, H, true,
                                  sw1c.get(), sw1s.get(), st);
      repack_nvfp4_weights_device(L.weights.shared_w2_codes, L.weights.shared_w2_scales, 1, H, I, false,
                                  sw2c.get(), sw2s.get(), st);
    }
    const int MT1 = static_cast<int>(2 * I / 16), MT2 = static_cast<int>(H / 16);
    DeviceBuffer<__nv_bfloat16> x(kTM * H), out_lib(kTM * H), out(kTM * H), hbuf(kMaxActive * kTM * I),
        ybuf(kTM * (K + 1) * H);
    DeviceBuffer<float> logits(kTM * E), wts(kTM * K);
    DeviceBuffer<int32_t> ids(kTM * K);
    const size_t ncnt = static_cast<size_t>(cnt_comb(MT1, MT2, MT2));
    DeviceBuffer<int32_t> cnt(ncnt);
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(cnt.get(), 0, cnt.bytes(), st));
    const size_t max_items = static_cast<size_t>(kMaxActive) * (MT1 * 8 + MT2 * 4);  // S1 <= 8, S2 <= 4
    DeviceBuffer<float> partial(max_items * 128);
    DeviceBuffer<uint8_t> ws(layer.workspace_bytes());
    std::printf("\n%s: E = %d, top-%d, H = %lld, I = %lld, shared expert %s\n", cfg.name.c_str(), E, K,
                (long long)H, (long long)I, shared ? "yes" : "no");
    for (const std::string& ts : split_list(token_list)) {
      const int T = std::atoi(ts.c_str());
      if (T < 1 || T > kTM) continue;
      make_synthetic_hidden_device(L.cfg, 7, T, x.get(), st);
      make_synthetic_router_logits_device(L.cfg, 7, T, logits.get(), st);
      layer.route(st, logits.get(), T, ids.get(), wts.get());
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st));
      const std::vector<int32_t> hid = ids.download();
      std::vector<int> used(E + 1, 0);
      int active = shared ? 1 : 0;
      for (int i = 0; i < T * K; ++i)
        if (hid[i] >= 0 && hid[i] < E && !used[hid[i]]++) ++active;
      const double wbytes = active * (2.0 * I * H + H * I) * (0.5 + 1.0 / 16.0);
      auto lib = [&](cudaStream_t s) {
        layer.forward_routed(s, x.get(), T, ids.get(), wts.get(), out_lib.get(), ws.get(), ws.bytes());
      };
      lib(st);
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st));
      const std::vector<__nv_bfloat16> href = out_lib.download();
      float refmax = 0.f;
      for (auto v : href) refmax = std::max(refmax, std::fabs(__bfloat162float(v)));
      // The layer's own intermediates of that call, to tell which stage a wrong output comes from: its
      // GEMM1 and GEMM2 rows in expert-sorted order, row_of (token, slot) -> row, and the shared expert's
      // GEMM2 output. The probe's active expert a of expert e: e's rank among the routed ids (the shared
      // expert last), as every CTA derives it.
      const MoeIntermediates im = layer.intermediates(ws.get());
      auto fetch_bf16 = [&](const void* src, size_t n) {
        std::vector<__nv_bfloat16> v(n);
        FP4MOE_CUDA_CHECK(cudaMemcpy(v.data(), src, n * 2, cudaMemcpyDeviceToHost));
        return v;
      };
      std::vector<int32_t> row_of(static_cast<size_t>(T) * K);
      FP4MOE_CUDA_CHECK(cudaMemcpy(row_of.data(), im.row_of, row_of.size() * 4, cudaMemcpyDeviceToHost));
      const std::vector<__nv_bfloat16> lib_g1 = fetch_bf16(im.gemm1_out, static_cast<size_t>(T) * K * I);
      const std::vector<__nv_bfloat16> lib_g2 = fetch_bf16(im.gemm2_out, static_cast<size_t>(T) * K * H);
      const std::vector<__nv_bfloat16> lib_sg2 =
          shared ? fetch_bf16(im.shared_gemm2_out, static_cast<size_t>(T) * H) : std::vector<__nv_bfloat16>{};
      std::vector<int> rank(E + 1, -1);
      {
        int a = 0;
        for (int e = 0; e < E; ++e)
          if (used[e]) rank[e] = a++;
        if (shared) rank[E] = a;
      }
      // largest differences of the probe's h (GEMM1) and y (GEMM2) to the layer's, over the routed pairs
      auto stage_diffs = [&](float& d1, float& d2) {
        const std::vector<__nv_bfloat16> ph = hbuf.download(), py = ybuf.download();
        d1 = d2 = 0.f;
        auto df = [](__nv_bfloat16 a, __nv_bfloat16 b) {
          const float x = __bfloat162float(a), y = __bfloat162float(b);
          return std::isfinite(x) ? std::fabs(x - y) : INFINITY;
        };
        for (int t = 0; t < T; ++t)
          for (int sl = 0; sl < K; ++sl) {
            const int e = hid[t * K + sl];
            if (e < 0 || e >= E) continue;
            const int64_t r = row_of[t * K + sl];
            for (int64_t j = 0; j < I; ++j)
              d1 = std::max(d1, df(ph[(static_cast<int64_t>(rank[e]) * kTM + t) * I + j], lib_g1[r * I + j]));
            for (int64_t f = 0; f < H; ++f)
              d2 = std::max(d2, df(py[(static_cast<int64_t>(t) * (K + 1) + sl) * H + f], lib_g2[r * H + f]));
          }
        if (shared)
          for (int t = 0; t < T; ++t)
            for (int64_t f = 0; f < H; ++f)
              d2 = std::max(d2, df(py[(static_cast<int64_t>(t) * (K + 1) + K) * H + f], lib_sg2[t * H + f]));
      };
      const double lib_us = bench::time_graph_us(lib, st, reps);
      std::printf("  T = %d: %d active experts, %.1f MB of weights (%.1f us at the read ceiling)\n", T, active,
                  wbytes / 1e6, wbytes / ceil.stream_read_tbps / 1e6);
      auto report = [&](const std::string& what, double us) {
        std::printf("    %-30s %8.1f us  %5.2f TB/s  %.3f x read  %.3f x layer\n", what.c_str(), us,
                    wbytes / us / 1e6, wbytes / us / 1e6 / ceil.stream_read_tbps, us / lib_us);
      };
      report("library layer (forward_routed)", lib_us);
      double best_us = 1e30;
      std::string best_label;
      std::function<void(cudaStream_t)> best_launch;
      // for the end-to-end view: the layer from router logits (what `fp4moe bench` times), and its routing
      // stage alone (a fused layer would keep it: probe + routing ~ the layer's forward)
      const double fwd_us = bench::time_graph_us(
          [&](cudaStream_t s) { layer.forward(s, x.get(), T, logits.get(), out_lib.get(), ws.get(), ws.bytes()); }, st, reps);
      const double route_us = bench::time_graph_us(
          [&](cudaStream_t s) { layer.route(s, logits.get(), T, ids.get(), wts.get()); }, st, reps);
      report("library layer (forward, logits)", fwd_us);
      std::printf("    %-30s %8.1f us\n", "library routing stage alone", route_us);
      for (const Variant& v : kVariants) {
        if (!only_variant.empty() && only_variant != v.name) continue;
        const size_t smem = smem_bytes(v, T, H);
        int per_sm = 0;
        if (smem <= prop.sharedMemPerBlockOptin)
          FP4MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, v.fn, v.warps * 32, smem));
        if (per_sm < v.ctas) {
          std::printf("    %s: %d CTAs per SM resident, %d wanted; skipped\n", v.name, per_sm, v.ctas);
          continue;
        }
        const int grid = prop.multiProcessorCount * v.ctas;
        for (int S1 : {1, 2, 4, 8}) {
          if (only_s1 >= 0 && S1 != only_s1) continue;
          if (S1 > 1 && H / 64 / S1 < min_chunks) continue;
          for (int S2 : {1, 2, 4}) {
            if (only_s2 >= 0 && S2 != only_s2) continue;
            if (S2 > 1 && I / 64 / S2 < min_chunks) continue;
            FusedParams fp{};
            fp.w1c = w1c.get();
            fp.w1s = w1s.get();
            fp.g1 = L.weights.w13_global;
            fp.g1u = L.weights.w13_global_up;
            fp.w2c = w2c.get();
            fp.w2s = w2s.get();
            fp.g2 = L.weights.w2_global;
            if (shared) {
              fp.sw1c = sw1c.get();
              fp.sw1s = sw1s.get();
              fp.sg1 = L.weights.shared_w13_global;
              fp.sg1u = L.weights.shared_w13_global_up;
              fp.sw2c = sw2c.get();
              fp.sw2s = sw2s.get();
              fp.sg2 = L.weights.shared_w2_global;
            }
            fp.x = x.get();
            fp.ids = ids.get();
            fp.wts = wts.get();
            fp.h = hbuf.get();
            fp.y = ybuf.get();
            fp.out = out.get();
            fp.partial = partial.get();
            fp.cnt = cnt.get();
            fp.E = E;
            fp.k = K;
            fp.T = T;
            fp.H = static_cast<int>(H);
            fp.I = static_cast<int>(I);
            fp.S1 = S1;
            fp.S2 = S2;
            fp.zero = 0;
            fp.tp = rows_per_slot(T);
            fp.scale_mul = layout::kNvfp4ScaleMul;
            fp.scale_add = layout::kNvfp4ScaleAdd;
            // by value: the best one is launched again after the loop
            auto launch_of = [grid, fn = v.fn, threads = v.warps * 32, smem](const FusedParams& f) {
              return [grid, fn, threads, smem, f](cudaStream_t s) {
                cudaLaunchConfig_t lc{};
                lc.gridDim = dim3(grid);
                lc.blockDim = dim3(threads);
                lc.dynamicSmemBytes = smem;
                lc.stream = s;
                cudaLaunchAttribute at[1];
                at[0].id = cudaLaunchAttributeCooperative;  // every CTA resident: a GEMM2 item may wait
                at[0].val.cooperative = 1;
                lc.attrs = at;
                lc.numAttrs = 1;
                FP4MOE_CUDA_CHECK(cudaLaunchKernelEx(&lc, fn, f));
              };
            };
            FP4MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), st));  // NaN: unwritten shows
            const int warps_total = grid * v.warps;
            DeviceBuffer<unsigned long long> trace(want_trace ? static_cast<size_t>(warps_total) * kTraceValues : 1);
            fp.trace = want_trace ? trace.get() : nullptr;
            launch_of(fp)(st);
            FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st));
            fp.trace = nullptr;
            const auto launch = launch_of(fp);
            std::string tline;
            if (want_trace) {
              // one eager launch after the graph-less first run's caches: start, GEMM2 start, ends (us after
              // the first warp's entry), and polls that found an expert not ready
              const std::vector<unsigned long long> tr = trace.download();
              unsigned long long t0 = ~0ull;
              for (int w = 0; w < warps_total; ++w) t0 = std::min(t0, tr[w * kTraceValues]);
              std::vector<double> ends, g2;
              unsigned long long polls = 0;
              for (int w = 0; w < warps_total; ++w) {
                ends.push_back((tr[w * kTraceValues + 2] - t0) * 1e-3);
                if (tr[w * kTraceValues + 1] != 0ull) g2.push_back((tr[w * kTraceValues + 1] - t0) * 1e-3);
                polls += tr[w * kTraceValues + 3];
              }
              std::sort(ends.begin(), ends.end());
              std::sort(g2.begin(), g2.end());
              auto q = [](const std::vector<double>& v, double f) { return v.empty() ? 0.0 : v[static_cast<size_t>(f * (v.size() - 1))]; };
              char b[256];
              std::snprintf(b, sizeof b,
                            "      eager trace: warp ends p10 / p50 / max %.1f / %.1f / %.1f us; first GEMM2 item "
                            "p10 / p50 %.1f / %.1f us; %llu not-ready polls\n",
                            q(ends, 0.1), q(ends, 0.5), q(ends, 1.0), q(g2, 0.1), q(g2, 0.5), polls);
              tline = b;
            }
            const std::vector<__nv_bfloat16> h1 = out.download();
            float d1 = 0.f, d2 = 0.f;
            stage_diffs(d1, d2);
            float dmax = 0.f;
            bool finite = true;
            for (int i = 0; i < T * H; ++i) {
              const float a = __bfloat162float(h1[i]), b = __bfloat162float(href[i]);
              if (!std::isfinite(a)) finite = false;
              dmax = std::max(dmax, std::fabs(a - b));
            }
            if (graphs < 0) graphs = cooperative_capture_works(st, launch) ? 1 : 0;
            const double us = graphs ? bench::time_graph_us(launch, st, reps) : time_eager_us(launch, st, reps);
            launch(st);
            FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st));
            const std::vector<__nv_bfloat16> h2 = out.download();
            const bool same = std::memcmp(h1.data(), h2.data(), static_cast<size_t>(T) * H * 2) == 0;
            char label[96];
            std::snprintf(label, sizeof label, "probe %s S1=%d S2=%d", v.name, S1, S2);
            report(label, us);
            // a layout or protocol error gives differences of the output's own size; a split m-tile's
            // summation order, a few bf16 ulps
            const bool plausible = finite && same && dmax <= 0.02f * refmax;
            std::printf("      max |diff| to the layer %.3g (of max |out| %.3g; GEMM1 rows %.3g, GEMM2 rows %.3g)%s%s%s\n",
                        dmax, refmax, d1, d2, finite ? "" : "  NON-FINITE OUTPUT",
                        same ? "" : "  NOT BIT-IDENTICAL ON RERUN", plausible ? "" : "  WRONG");
            std::fputs(tline.c_str(), stdout);
            if (plausible && us < best_us) {
              best_us = us;
              best_label = label;
              best_launch = launch;
            }
          }
        }
      }
      if (best_launch) {  // what the layer's forward would be with this kernel after its routing stage
        const auto e2e_launch = [&](cudaStream_t s) {
          layer.route(s, logits.get(), T, ids.get(), wts.get());
          best_launch(s);
        };
        const double e2e = graphs == 1 ? bench::time_graph_us(e2e_launch, st, reps) : time_eager_us(e2e_launch, st, reps);
        std::printf("    best: %s; routing + it in one graph:\n", best_label.c_str());
        report("routing + best probe", e2e);
        std::printf("    %-30s %8.3f x the layer's forward\n", "", e2e / fwd_us);
      }
    }
  }
  return 0;
}

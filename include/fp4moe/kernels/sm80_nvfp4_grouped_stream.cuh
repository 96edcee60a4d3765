// sm80-nvfp4-grouped, stream configs (TileConfig::mma == 2): the decode kernel. Device code only; the
// host launcher is src/sm80_nvfp4_grouped_gemm.cu (shared with the shared-memory pipeline configs).
//
// Why a second kernel: at decode each weight byte is used by a handful of tokens, so the kernel is a
// weight stream and its speed is the bytes it keeps in flight and the warps it has to hide the
// dequantization's integer chains. The pipeline configs stage weights through shared memory behind a
// CTA barrier per K stage with ~4 warps per scheduler; a probe that streams NVFP4 straight into registers
// with the same dequantization reached 0.81-0.86 of the read ceiling at 8-16 warps per scheduler with
// four 16-byte loads in flight per thread (docs/kernel-design.md). This kernel is that stream with the
// GEMM around it:
// - Weights: each warp loads its own repacked chunks (per lane 16 B of e2m1 codes = one mma A fragment
//   for four k16 steps, and 8 B of block scales) from global memory into a ring of DEPTH register sets
//   in two halves: while the math consumes one half, the other half's DEPTH / 2 loads are in flight,
//   all issued at the start of the half (below: why halves). A warp's chunks of one m16 tile are
//   contiguous in the repacked layout (nvfp4_weight_layout.hpp), so the stream is a chunk index q: codes
//   at base + 512 q, scales at base + 64 q (one IMAD.WIDE each).
// - Activations: the rows of the current (expert, token tile), at most BT = 8 or 16, for the whole K, in
//   shared memory (loaded once per round with cp.async), read as mma B fragments with ldmatrix. No
//   barrier in the K loop.
// - Work split ("stream-K inside a CTA"): units are (expert, token tile, m16 tile) in expert order. CTA i
//   of G takes units [i*U/G, (i+1)*U/G), so every CTA streams the same number of weight bytes whatever the
//   expert sizes (at T = 1, 9 experts x 256 m-tiles spread evenly over 132 SMs). A CTA's units split into
//   rounds at (expert, token tile) boundaries; inside a round the flattened (m-tile, K chunk) list is cut
//   evenly across the warps, so a warp's range may start or end inside an m-tile. Whole m-tiles are
//   stored from registers as soon as they finish; a split m-tile's pieces meet after the round's barrier:
//   the warp holding its first chunk adds the later warps' pieces (kept in shared memory) in warp order,
//   so the sum order is fixed by the problem (shapes and every expert's row count) and the output is
//   bit-identical run to run. It is not fixed by a token's own data alone: another problem containing the
//   same rows can split the m-tile elsewhere and round differently (docs/kernel-design.md).
// - The weight ring runs across m-tiles and rounds, so the next round's weights are in flight while a
//   round ends (barrier, reduction, next activation rows).
#pragma once
#include <cstdint>

#include <cuda_bf16.h>

#include "fp4moe/kernels/pdl.cuh"
#include "fp4moe/kernels/nvfp4_dequant.cuh"
#include "fp4moe/kernels/sm80_nvfp4_grouped_gemm.cuh"
#include "fp4moe/nvfp4_weight_layout.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe::kernels {

// Weights are read once per call: keep them out of L1 (it holds nothing useful for them).
__device__ __forceinline__ uint4 ldg_stream_v4(const uint8_t* ptr) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(ptr));
  return r;
}
__device__ __forceinline__ uint2 ldg_stream_v2(const uint8_t* ptr) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "l"(ptr));
  return r;
}

// Per-warp state that only the cold paths (m-tile ends, round ends, cursor jumps) touch. It lives in shared
// memory, not registers, and the cold paths are separate (noinline) functions: the hot loop needs the
// registers for the weight ring (at 24-32 warps per SM a thread has 64-80), and with the cold code inlined
// ptxas kept its loop-invariant values live and spilled the ring. Written by lane 0.
struct StreamWarpState {
  int lru;             // load cursor: first unit of the next round it has not entered
  int cru;             // math: first unit of the next round
  int u1;              // end of the CTA's units
  int seg_e, seg_row0, seg_rows, seg_x;  // the current round's expert, first row, rows, second-set flag
  int m0, F;           // the current round's first m-tile and its chunk count (to find other warps' slices)
  int m_cur;           // the m-tile of the current piece (within the expert)
  int round_left;      // this warp's chunks in the round after the current piece
  int from_start;      // the current piece began at chunk 0 of m_cur: this warp owns m_cur
  int to_end;          // the current piece runs to the last chunk of m_cur
  int pending;         // an owned m-tile split across warps waits for the round's barrier
  int in_round;        // 1: a round is open (its barrier at the end is still due); 2: the prologue opened
                       // the first round and requested its rows (kStreamEarlyRows configs)
  int in_piece;        // a piece is open (cleft counted it down)
};
static_assert(sizeof(StreamWarpState) == kStreamWarpStateBytes, "the layout reserves kStreamWarpStateBytes per warp");

// Where a warp's weights come from next: chunk q of the cursor's range is this lane's 16 B of codes at
// lc + q * 512 and 8 B of scales at ls + q * 64 (one IMAD.WIDE each); `left` chunks remain in the
// range (-1: no more ranges).
struct StreamCursor {
  const uint8_t* lc;
  const uint8_t* ls;
  int q;
  int left;
};
// The math's next piece: chunks in it (0: the CTA is done), this lane's ldmatrix address for its first
// chunk, and whether a second n-tile of tokens is live.
struct StreamPiece {
  int cleft;
  uint32_t act_ptr;
  int two_nt;
};

struct StreamRound {
  int end, seg, m0, F;
};

// The timeline's slots (StreamTraceSlot) are in tile_config.hpp, shared with the host's summary.
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
}
// Folds to false (and every trace branch away) unless the build has FP4MOE_STREAM_TRACE.
__device__ __forceinline__ bool trace_on(const GroupedGemmParams& p) { return kStreamTraceBuilt && p.trace != nullptr; }
__device__ __forceinline__ unsigned long long* trace_slots(const GroupedGemmParams& p) {
  return p.trace + (static_cast<size_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * kStreamTraceSlots;
}
__device__ __forceinline__ void trace_event(const GroupedGemmParams& p, int slot) {  // lane 0 stores
  if (trace_on(p) && (threadIdx.x & 31) == 0) trace_slots(p)[slot] = global_timer_ns();
}
__device__ __forceinline__ void trace_set(const GroupedGemmParams& p, int slot, unsigned long long v) {
  if (trace_on(p) && (threadIdx.x & 31) == 0) trace_slots(p)[slot] = v;
}
__device__ __forceinline__ void trace_add(const GroupedGemmParams& p, int slot, unsigned long long v) {
  if (trace_on(p) && (threadIdx.x & 31) == 0) trace_slots(p)[slot] += v;
}
__device__ __forceinline__ unsigned long long trace_now(const GroupedGemmParams& p) {
  return trace_on(p) ? global_timer_ns() : 0ull;
}

// Configs whose prologue opens the first round itself and requests its activation rows right after the
// ring's first half: the first stream_advance call waits for every outstanding ring load (a CALL waits on
// the ring's scoreboard), so rows requested inside it came only after the first weights had arrived, two
// latencies in series (1-2 us at T = 1, bench/NOTES.md, twenty-fourth session). Chosen by the SASS check
// (scripts/sass_waits.py --mix, cuobjdump -res-usage): the bt 8 / 20-warp configs (at their 96-register
// cap) and the bt 16 plain ones got a stack frame and local loads in their hot loop with it, so they keep
// the rows' request inside stream_advance.
template <int BT, int WARPS>
inline constexpr bool kStreamEarlyRows = BT == 8 && WARPS != 20;

template <int BT, int WARPS>
struct StreamGeometry {
  const GroupedGemmParams& p;
  uint8_t* smem;
  StreamSmemLayout L;

  __device__ StreamGeometry(const GroupedGemmParams& params, uint8_t* s)
      : p(params), smem(s), L(stream_smem_layout(TileConfig{16 * WARPS, BT, 64, 2, WARPS, 2, 1}, params.k)) {}
  __device__ int32_t* prefix() const { return reinterpret_cast<int32_t*>(smem + L.sched_offset); }
  // Expert rows (stream_build_schedule): routed offsets 0..E clamped, then the extra set's first and end row.
  __device__ int32_t* rows() const { return prefix() + kMaxExperts + 2; }
  // Expert e's rows [a, b), exactly as expert_rows() reads them from global memory.
  __device__ void rows_of(int e, int& a, int& b) const {
    const int32_t* r = rows();
    if (e < p.num_experts) {
      a = r[e];
      b = max(r[e + 1], a);
    } else {
      a = r[kMaxExperts + 1];
      b = r[kMaxExperts + 2];
    }
  }
  __device__ float4* slots() const { return reinterpret_cast<float4*>(smem + L.slots_offset); }
  __device__ StreamWarpState& ws() const {
    return reinterpret_cast<StreamWarpState*>(smem + L.warp_state_offset)[threadIdx.x >> 5];
  }
  __device__ int experts() const { return p.num_experts + (p.x_offsets != nullptr ? 1 : 0); }
  // A round: the CTA's units from ru to the end of ru's segment (or of the CTA's range); F chunks.
  __device__ StreamRound round_at(int ru) const { return round_at(ru, ws().u1); }
  __device__ StreamRound round_at(int ru, int u1) const {
    const int MT = p.n / 16;
    StreamRound r;
    r.seg = ru / MT;
    r.m0 = ru - r.seg * MT;
    r.end = min(u1, (r.seg + 1) * MT);
    r.F = (r.end - ru) * (p.k / 64);
    return r;
  }
  // Warp w's slice of a round's F chunks starts here; F * WARPS < 2^31 (the launcher checks).
  __device__ static int slice_begin(int F, int w) { return F * w / WARPS; }
};

// Exclusive prefix of v over the CTA's threads in thread order (every thread calls it; it contains a CTA
// barrier). scratch: 32 ints of shared memory that no other thread touches until the next barrier.
template <int WARPS>
__device__ __forceinline__ int block_exclusive_sum(int v, int* scratch, int& total) {
  static_assert(WARPS <= 32, "one warp adds the warps' sums");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int incl = warp_inclusive_sum(v, lane);
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  int before = lane < warp ? scratch[lane] : 0;
  int all = lane < WARPS ? scratch[lane] : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    before += __shfl_xor_sync(0xffffffffu, before, o);
    all += __shfl_xor_sync(0xffffffffu, all, o);
  }
  total = all;
  return before + incl - v;
}

// Largest e with prefix[e] <= w (prefix non-decreasing, prefix[0] = 0 <= w), as find_expert, by the whole
// warp (every lane, converged) in two ballots instead of a binary search's chain of dependent shared-
// memory loads (~9 at 257 experts): each round's start needs it, the first one on the decode critical path.
__device__ __forceinline__ int find_expert_warp(int w, const int32_t* prefix, int experts, int lane) {
  const int step = (experts + 31) / 32;
  const int idx = min(lane * step, experts - 1);  // non-decreasing in lane: the true lanes are a prefix
  const unsigned m = __ballot_sync(0xffffffffu, prefix[idx] <= w);
  const int base = __shfl_sync(0xffffffffu, idx, 31 - __clz(m));  // the answer is in [base, base + step)
  const int j = base + lane;
  const unsigned m2 = __ballot_sync(0xffffffffu, lane < step && j < experts && prefix[j] <= w);
  return base + 31 - __clz(m2);
}

// The schedule in shared memory, built by the whole CTA (ends with a CTA barrier):
// - rows: expert e's clamped first row for e = 0..E (so e's rows are [rows[e], max(rows[e + 1], rows[e]))
//   as expert_rows() computes them from the offsets), the extra set's first and end row after them. From
//   p.offsets, or, with p.route_ids, from the routing ids themselves: the offsets are their stable
//   counting sort, so offsets[e] = ids equal to an expert below e (what the permutation kernel writes).
//   This lets GEMM1 build its schedule and start its weight stream before griddepcontrol.wait, while the
//   permutation kernel is still writing the offsets and the activation rows.
// - prefix: segments (token tiles of BT rows) per expert, exclusive prefix, total at kMaxExperts + 1.
// Each thread owns J consecutive entries and the two prefixes are CTA-wide sums: this is on the decode
// critical path, where warp 0 walking all 513 entry slots alone took 2.7 us, now 1.2 (stamps in the layer,
// bench/NOTES.md, twenty-fourth session).
template <int BT, int WARPS>
__device__ __forceinline__ void stream_build_schedule(const GroupedGemmParams& p, const StreamGeometry<BT, WARPS>& G) {
  constexpr int kThreads = WARPS * 32;
  constexpr int J = (kMaxExperts + 1 + kThreads - 1) / kThreads;  // rows 0..E and segments of E + 1 experts
  const int tid = threadIdx.x;
  const int R = p.num_experts;
  const int E = G.experts();
  int32_t* rows = G.rows();
  int* scratch = reinterpret_cast<int*>(G.slots());  // the split sums' slots, unused until the first round ends
  const bool ids = p.route_ids != nullptr;
  const bool xset = p.x_offsets != nullptr;
  int a[J], b[J];  // entry e = tid * J + j: its rows [a, b) (e < R), a = rows[e] (e <= R)
  if (ids) {  // per-expert counts into rows[0..R)
    for (int e = tid; e < R; e += kThreads) rows[e] = 0;
    __syncthreads();
    for (int i = tid; i < p.route_n; i += kThreads) {
      const int e = __ldcg(p.route_ids + i);  // L2: the ids were written by an earlier kernel
      if (e >= 0 && e < R) atomicAdd(&rows[e], 1);  // counting only: the order cannot matter
    }
    __syncthreads();
    int cnt[J], sum = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = tid * J + j;
      cnt[j] = e < R ? rows[e] : 0;
      sum += cnt[j];
    }
    int total;
    int run = block_exclusive_sum<WARPS>(sum, scratch, total);  // its barrier also ends the reads above
#pragma unroll
    for (int j = 0; j < J; ++j) {
      a[j] = min(run, p.max_rows);
      run += cnt[j];
      b[j] = min(run, p.max_rows);
    }
  } else {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = tid * J + j;
      a[j] = e <= R ? min(max(__ldg(p.offsets + e), 0), p.max_rows) : 0;
      b[j] = e < R ? max(min(max(__ldg(p.offsets + e + 1), 0), p.max_rows), a[j]) : a[j];
    }
  }
  int segs[J], sum = 0;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = tid * J + j;
    if (e <= R) rows[e] = a[j];
    segs[j] = e < R ? (b[j] - a[j] + BT - 1) / BT : 0;
    if (e == R && xset) {  // the extra set's rows
      int xa = 0, xb = p.x_max_rows;
      if (!ids) expert_rows(p, R, xa, xb);
      rows[kMaxExperts + 1] = xa;
      rows[kMaxExperts + 2] = xb;
      segs[j] = (xb - xa + BT - 1) / BT;
    }
    sum += segs[j];
  }
  int total;
  int run = block_exclusive_sum<WARPS>(sum, scratch + 32, total);
  int32_t* prefix = G.prefix();
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = tid * J + j;
    if (e < E) prefix[e] = run;
    run += segs[j];
  }
  if (tid == 0) prefix[kMaxExperts + 1] = total;
  __syncthreads();
}

// This warp's slice of round r (expert e) as a load cursor; left = 0: no chunks for it there. For the
// kStreamEarlyRows prologue. stream_cursor_next_body does the same arithmetic inline: calling this there
// moved call-site registers in every config's hot loop (scripts/sass_waits.py --mix), so it stays apart.
template <int BT, int WARPS>
__device__ __forceinline__ StreamCursor stream_cursor_in(const GroupedGemmParams& p, const StreamRound& r, int e,
                                                         int warp, int lane) {
  StreamCursor c{nullptr, nullptr, 0, 0};
  const int f0 = StreamGeometry<BT, WARPS>::slice_begin(r.F, warp);
  c.left = StreamGeometry<BT, WARPS>::slice_begin(r.F, warp + 1) - f0;
  if (c.left > 0) {
    const bool xs = e >= p.num_experts;
    const int64_t chunk = static_cast<int64_t>(r.m0) * (p.k / 64) + f0;  // within the expert
    c.lc = (xs ? p.x_codes : p.codes + e * (static_cast<int64_t>(p.n) * p.k / 2)) + chunk * 512 + lane * 16;
    c.ls = (xs ? p.x_scales : p.scales + e * (static_cast<int64_t>(p.n) * p.k / 16)) + chunk * 64 + (lane >> 2) * 8;
  }
  return c;
}

// Opens round r (expert e) for this warp: its rows and slice into the warp state (in_round = 2: open, rows
// requested) and the round's activation rows requested into shared memory (cp.async, committed, not
// waited for: stream_advance waits for them, then for the round's barrier). Every warp opens every round.
// kStreamEarlyRows configs only; the others keep their inline copy of this in stream_advance, whose
// SASS this must not move.
template <int BT, int WARPS>
__device__ __forceinline__ void stream_open_round(const GroupedGemmParams& p, const StreamGeometry<BT, WARPS>& G,
                                                  const StreamRound& r, int e) {
  StreamWarpState& ws = G.ws();
  const int tid = threadIdx.x, lane = tid & 31;
  int a, b;
  G.rows_of(e, a, b);
  const int row0 = a + (r.seg - G.prefix()[e]) * BT;
  const int rows = min(BT, b - row0);
  const bool xs = e >= p.num_experts;
  __syncwarp();
  if (lane == 0) {
    ws.cru = r.end;
    ws.seg_e = e;
    ws.seg_row0 = row0;
    ws.seg_rows = rows;
    ws.seg_x = xs;
    ws.m0 = r.m0;
    ws.F = r.F;
    ws.in_round = 2;
  }
  __syncwarp();
  const uint32_t row_bytes = static_cast<uint32_t>(p.k) * 2;
  const __nv_bfloat16* src = (xs ? p.x_act : p.act) + static_cast<int64_t>(row0) * p.k;
  const int pieces = p.k / 8;
  const uint32_t dst = smem_u32(G.smem);
  for (int rr = 0; rr < rows; ++rr)
    for (int c = tid; c < pieces; c += WARPS * 32)
      cp_async16(dst + rr * row_bytes + (((c & ~7) | ((c ^ rr) & 7)) << 4), src + static_cast<int64_t>(rr) * p.k + c * 8);
  cp_async_commit();
}

// The load cursor enters its next round that has chunks for this warp (cold: once per round).
template <int BT, int WARPS>
__device__ __forceinline__ StreamCursor stream_cursor_next_body(const GroupedGemmParams& p, uint8_t* smem) {
  const StreamGeometry<BT, WARPS> G(p, smem);
  StreamWarpState& ws = G.ws();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  StreamCursor c{nullptr, nullptr, 0, 0};
  int lru = ws.lru;
  const int u1 = ws.u1;
  while (c.left == 0 && lru < u1) {
    const StreamRound r = G.round_at(lru);
    lru = r.end;
    const int f0 = G.slice_begin(r.F, warp);
    c.left = G.slice_begin(r.F, warp + 1) - f0;
    if (c.left > 0) {
      const int e = find_expert_warp(r.seg, G.prefix(), G.experts(), lane);
      const bool xs = e >= p.num_experts;
      const int64_t chunk = static_cast<int64_t>(r.m0) * (p.k / 64) + f0;  // within the expert
      c.lc = (xs ? p.x_codes : p.codes + e * (static_cast<int64_t>(p.n) * p.k / 2)) + chunk * 512 + lane * 16;
      c.ls = (xs ? p.x_scales : p.scales + e * (static_cast<int64_t>(p.n) * p.k / 16)) + chunk * 64 + (lane >> 2) * 8;
    }
  }
  if (c.left == 0) c.left = -1;
  __syncwarp();
  if (lane == 0) ws.lru = lru;
  __syncwarp();
  return c;
}
template <int BT, int WARPS>
__device__ __noinline__ StreamCursor stream_cursor_next(const GroupedGemmParams& p, uint8_t* smem) {
  const unsigned long long t0 = trace_now(p);
  const StreamCursor c = stream_cursor_next_body<BT, WARPS>(p, smem);
  if (trace_on(p)) {
    trace_add(p, kTraceCursorCalls, 1);
    trace_add(p, kTraceCursorNs, global_timer_ns() - t0);
  }
  return c;
}

// The math's current piece ended (or none is open): store or park it, close the round if this warp's
// part of it is done (barrier; split m-tiles summed), open the next round (its activation rows loaded)
// and this warp's next piece. acc: the piece's accumulators (NT x 4 floats). Returns cleft = 0 when the
// CTA has no more work. Every warp of the CTA passes every round's two barriers.
template <int BT, int WARPS, int EPI>
__device__ __forceinline__ StreamPiece stream_advance_body(const GroupedGemmParams& p, uint8_t* smem, float4 acc0,
                                                           float4 acc1) {
  constexpr int NT = BT / 8;
  const StreamGeometry<BT, WARPS> G(p, smem);
  StreamWarpState& ws = G.ws();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int Kc = p.k / 64;
  const uint32_t row_bytes = static_cast<uint32_t>(p.k) * 2;
  float acc[NT][4];
  acc[0][0] = acc0.x, acc[0][1] = acc0.y, acc[0][2] = acc0.z, acc[0][3] = acc0.w;
  acc[NT - 1][0] = NT == 2 ? acc1.x : acc0.x;
  acc[NT - 1][1] = NT == 2 ? acc1.y : acc0.y;
  acc[NT - 1][2] = NT == 2 ? acc1.z : acc0.z;
  acc[NT - 1][3] = NT == 2 ? acc1.w : acc0.w;
  auto zero = [&]() {
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  };
  auto put = [&](auto fn) {  // a lane-0 write of the warp state, visible to the warp afterwards
    __syncwarp();
    if (lane == 0) fn();
    __syncwarp();
  };
  auto store_slot = [&]() {
#pragma unroll
    for (int j = 0; j < NT; ++j)
      G.slots()[(warp * NT + j) * 32 + lane] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
  };
  auto epilogue = [&]() {
    const unsigned long long t = trace_now(p);
    store_mtile<NT, EPI>(p, ws.seg_e, ws.seg_x != 0, ws.m_cur, ws.seg_row0, ws.seg_rows, (ws.seg_rows + 7) >> 3,
                         acc);
    if (trace_on(p)) trace_add(p, kTraceEpilogueNs, global_timer_ns() - t);
  };
  // This warp's ldmatrix row for chunk 0 of steps 0-1 (see the kernel).
  const uint32_t act_lane = smem_u32(smem) + (lane & 7) * row_bytes + (((lane >> 3) ^ (lane & 7)) << 4);
  StreamPiece out{0, 0u, 0};
  auto start_piece = [&](int m, int c_in, int avail) {
    const int len = min(Kc - c_in, avail);
    out.cleft = len;
    out.act_ptr = act_lane + static_cast<uint32_t>(c_in) * 128;
    out.two_nt = NT == 2 && ws.seg_rows > 8;
    trace_add(p, kTraceChunks, static_cast<unsigned long long>(len));
    put([&] {
      ws.m_cur = m;
      ws.round_left = avail - len;
      ws.from_start = c_in == 0;
      ws.to_end = c_in + len == Kc;
      ws.in_piece = 1;
    });
  };

  constexpr bool kEarly = kStreamEarlyRows<BT, WARPS>;
  for (;;) {
    if (ws.in_piece) {  // the piece that just ran out
      put([&] { ws.in_piece = 0; });
      if (ws.to_end) {
        if (ws.from_start) epilogue();
        else store_slot();  // this warp's first piece; the warp holding the m-tile's chunk 0 adds it
        zero();
        if (ws.round_left > 0) {
          start_piece(ws.m_cur + 1, 0, ws.round_left);
          return out;
        }
      } else if (ws.from_start) {
        put([&] { ws.pending = 1; });  // keep acc: later warps hold the rest of m_cur
      } else {
        store_slot();
        zero();
      }
    }
    if (kEarly ? ws.in_round == 1 : ws.in_round != 0) {
      // ---- end of round: split m-tiles meet. The warp holding an m-tile's chunk 0 adds the later warps'
      // pieces in warp order (a fixed order: bit-identical results run to run) and stores it.
      // Warps reach this barrier along different paths (a warp with no chunks in a round loops here
      // straight from the round's start; the others come back from the kernel's main loop or from its
      // first call before the loop), so it must be the non-aligned barrier.sync: __syncthreads() is
      // bar.sync, the aligned form, which requires the whole CTA to arrive through uniform control flow
      // (compute-sanitizer synccheck reports "divergent thread(s) in block" otherwise). The __syncwarp()
      // first lets each warp arrive once.
      __syncwarp();
      const unsigned long long t_end = trace_now(p);
      __barrier_sync(0);  // slots written; every warp is done with this round's activation rows
      if (trace_on(p)) trace_add(p, kTraceRoundEndNs, global_timer_ns() - t_end);
      if (ws.pending) {
        const int mend = (ws.m_cur - ws.m0 + 1) * Kc;  // end of m_cur in the round's flattened chunks
        for (int w = warp + 1; w < WARPS; ++w) {
          const int f0 = G.slice_begin(ws.F, w);
          if (f0 >= mend) break;
          if (G.slice_begin(ws.F, w + 1) > f0) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              const float4 v = G.slots()[(w * NT + j) * 32 + lane];
              acc[j][0] += v.x;
              acc[j][1] += v.y;
              acc[j][2] += v.z;
              acc[j][3] += v.w;
            }
          }
        }
        epilogue();
        zero();
        put([&] { ws.pending = 0; });
      }
      put([&] { ws.in_round = 0; });
    }
    // ---- next round ----
    if constexpr (kEarly) {
      if (!ws.in_round) {  // (2: the kernel's prologue opened the first round)
        const int ru = ws.cru;
        if (ru >= ws.u1) return out;  // cleft = 0: done
        const StreamRound r = G.round_at(ru);
        stream_open_round<BT, WARPS>(p, G, r, find_expert_warp(r.seg, G.prefix(), G.experts(), lane));
      }
      const unsigned long long t_rows = trace_now(p);
      cp_async_wait<0>();
      __syncwarp();
      __barrier_sync(0);  // the rows are in (non-aligned, as the round's end barrier above)
      if (trace_on(p)) {
        trace_add(p, kTraceRowsInNs, global_timer_ns() - t_rows);
        trace_add(p, kTraceRounds, 1);
      }
      put([&] { ws.in_round = 1; });
      const int F = ws.F;
      const int f0 = G.slice_begin(F, warp), f1 = G.slice_begin(F, warp + 1);
      if (f1 > f0) {
        start_piece(ws.m0 + f0 / Kc, f0 % Kc, f1 - f0);
        return out;
      }
    } else {
      const int ru = ws.cru;
      if (ru >= ws.u1) return out;  // cleft = 0: done
      const StreamRound r = G.round_at(ru);
      const int e = find_expert_warp(r.seg, G.prefix(), G.experts(), lane);
      int a, b;
      G.rows_of(e, a, b);  // from shared memory: no L2 round trip before the rows' own loads
      const int row0 = a + (r.seg - G.prefix()[e]) * BT;
      const int rows = min(BT, b - row0);
      const bool xs = e >= p.num_experts;
      put([&] {
        ws.cru = r.end;
        ws.seg_e = e;
        ws.seg_row0 = row0;
        ws.seg_rows = rows;
        ws.seg_x = xs;
        ws.m0 = r.m0;
        ws.F = r.F;
        ws.in_round = 1;
      });
      // Activation rows -> shared memory. Rows past `rows` are not loaded: they only feed accumulator
      // columns that are never stored.
      const unsigned long long t_rows = trace_now(p);
      {
        const __nv_bfloat16* src = (xs ? p.x_act : p.act) + static_cast<int64_t>(row0) * p.k;
        const int pieces = p.k / 8;
        const uint32_t dst = smem_u32(smem);
        for (int rr = 0; rr < rows; ++rr)
          for (int c = tid; c < pieces; c += WARPS * 32)
            cp_async16(dst + rr * row_bytes + (((c & ~7) | ((c ^ rr) & 7)) << 4),
                       src + static_cast<int64_t>(rr) * p.k + c * 8);
        cp_async_commit();
        cp_async_wait<0>();
      }
      __syncwarp();
      __barrier_sync(0);  // the rows are in (non-aligned, as the round's end barrier above)
      if (trace_on(p)) {
        trace_add(p, kTraceRowsInNs, global_timer_ns() - t_rows);
        trace_add(p, kTraceRounds, 1);
      }
      const int f0 = G.slice_begin(r.F, warp), f1 = G.slice_begin(r.F, warp + 1);
      if (f1 > f0) {
        start_piece(r.m0 + f0 / Kc, f0 % Kc, f1 - f0);
        return out;
      }
    }
    // no chunks for this warp in this round: straight to its end
  }
}
template <int BT, int WARPS, int EPI>
__device__ __noinline__ StreamPiece stream_advance(const GroupedGemmParams& p, uint8_t* smem, float4 acc0,
                                                   float4 acc1) {
  const unsigned long long t0 = trace_now(p);
  const StreamPiece r = stream_advance_body<BT, WARPS, EPI>(p, smem, acc0, acc1);
  if (trace_on(p)) {
    trace_add(p, kTraceAdvanceCalls, 1);
    trace_add(p, kTraceAdvanceNs, global_timer_ns() - t0);
  }
  return r;
}

template <int BT, int WARPS, int DEPTH, int CTAS, int EPI>
__global__ void __launch_bounds__(WARPS * 32, CTAS)
    sm80_nvfp4_grouped_stream_kernel(const __grid_constant__ GroupedGemmParams p) {
  // Programmatic dependent launch: the predecessor's results are visible after pdl_wait. The schedule is
  // built before it only when the host says its inputs were final before the predecessor began
  // (p.weights_before_wait): GEMM2's offsets, which GEMM1 already waited for, or GEMM1's routing ids
  // (p.route_ids), which the permutation kernel already waited for; this grid cannot start before every
  // CTA of its predecessor passed that predecessor's own wait, so their producer has completed. Weights
  // are constant.
  trace_event(p, kTraceEntry);
  if (trace_on(p)) trace_set(p, kTraceSmid, sm_id() + 1ull);  // + 1: 0 is "not written"
  if (!p.weights_before_wait) {
    pdl_wait();
    pdl_launch_dependents();
    trace_event(p, kTraceWaited);
  }
  constexpr TileConfig kCfg{16 * WARPS, BT, 64, DEPTH, WARPS, 2, CTAS};
  static_assert(tile_config_well_formed(kCfg), "stream config is malformed: see tile_config_well_formed()");
  static_assert(DEPTH % 2 == 0, "the weight ring runs in two halves");
  constexpr int NT = BT / 8;
  constexpr int HALF = DEPTH / 2;

  extern __shared__ __align__(128) uint8_t smem[];
  const StreamGeometry<BT, WARPS> G(p, smem);
  const int lane = threadIdx.x & 31;

  // ---- segments (expert, token tile) per expert, exclusive prefix; each expert's rows ----
  stream_build_schedule<BT, WARPS>(p, G);
  trace_event(p, kTraceScheduled);
  // CTA i of G owns units [stream_split(i), stream_split(i + 1)); U < 2^31 (the launcher checks).
  StreamRound r0{};
  int e0 = 0;
  StreamCursor cur{nullptr, nullptr, 0, 0};
  {
    const int segs = G.prefix()[kMaxExperts + 1];
    // Lanes 0 and 1 compute the two ends at once: one copy of the arithmetic on the critical path.
    const int cut = stream_split(segs, p.n / 16, p.k / 64, p.round_cost, blockIdx.x + (lane & 1), gridDim.x);
    const int u0 = __shfl_sync(0xffffffffu, cut, 0), u1 = __shfl_sync(0xffffffffu, cut, 1);
    if (u0 >= u1) {  // uniform over the CTA: no barrier follows
      // Exit only once the predecessor is done: this grid's completion (or trigger) then implies its
      // predecessor's, which the next kernel's early reads (GEMM2's offsets) rely on.
      if (p.weights_before_wait) pdl_wait();
      return;
    }
    StreamWarpState& ws = G.ws();
    if (lane == 0) {
      ws.lru = ws.cru = u0;
      ws.u1 = u1;
      ws.pending = ws.in_round = ws.in_piece = 0;
    }
    __syncwarp();
    if constexpr (kStreamEarlyRows<BT, WARPS>) {
      r0 = G.round_at(u0, u1);
      e0 = find_expert_warp(r0.seg, G.prefix(), G.experts(), lane);
      if (lane == 0) ws.lru = r0.end;
      __syncwarp();
      cur = stream_cursor_in<BT, WARPS>(p, r0, e0, threadIdx.x >> 5, lane);
    }
  }

  // ---- the weight ring: two halves of DEPTH / 2 chunks ----
  // Why halves: ptxas completes every ring load on one scoreboard and waits for all of them at once, at
  // the loop's head (scripts/sass_waits.py). With one ring refilled slot by slot, that wait at the top of
  // each turn also covered the load issued one chunk before it, so every turn drained the ring (22-30% of
  // the warps' stall samples, bench/NOTES.md). Here a half's loads are all issued at the start of the
  // other half, right after that half's wait, and are not waited for until a whole half of math later;
  // the wait at each half's start then finds loads DEPTH / 2 chunks old. `dep` (always 0: K is a multiple
  // of 64) makes the addresses depend on the half's first scale word, so ptxas cannot hoist the loads
  // above the wait, which would make the wait cover them too.
  if (!kStreamEarlyRows<BT, WARPS> || cur.left == 0) cur = stream_cursor_next<BT, WARPS>(p, smem);
  uint4 ring_c[DEPTH];
  uint2 ring_s[DEPTH];
  uint32_t dep = 0;
  auto issue = [&](uint4& rc, uint2& rs) {  // the next chunk into a slot; a new range is a cold call
    if (cur.left == 0) cur = stream_cursor_next<BT, WARPS>(p, smem);
    if (cur.left > 0) {
      rc = ldg_stream_v4(cur.lc + (static_cast<uint32_t>(cur.q) * 512u + dep));
      rs = ldg_stream_v2(cur.ls + (static_cast<uint32_t>(cur.q) * 64u + dep));
      ++cur.q;
      --cur.left;
    }
  };
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    ring_c[d] = make_uint4(0, 0, 0, 0);
    ring_s[d] = make_uint2(0, 0);
  }
#pragma unroll
  for (int d = 0; d < HALF; ++d) issue(ring_c[d], ring_s[d]);  // the first half; the loop requests the second
  trace_event(p, kTraceRingIssued);
  if (p.weights_before_wait) {  // the activation rows (the predecessor's output) are read after this
    pdl_wait();
    pdl_launch_dependents();
    trace_event(p, kTraceWaited);
  }
  if constexpr (kStreamEarlyRows<BT, WARPS>) stream_open_round<BT, WARPS>(p, G, r0, e0);

  // ---- math ----
  float acc[NT][4];
  auto zero_acc = [&]() {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[j][q] = 0.0f;
  };
  zero_acc();
  // Per-lane ldmatrix row address of a 64-K chunk's steps 0-1: matrix mat = lane / 8 of an x4 load is
  // the 16-byte chunk (2 * step + mat) of the 128-byte K chunk, row lane % 8; chunks are XOR-swizzled
  // with the row so the eight rows of a matrix hit eight different bank groups. Steps 2-3: + act_delta.
  const uint32_t row_bytes = static_cast<uint32_t>(p.k) * 2;
  const uint32_t act_delta = ((((lane >> 3) + 4) ^ (lane & 7)) << 4) - ((((lane >> 3)) ^ (lane & 7)) << 4);
  // The first piece is opened here, before the loop, not by the loop's first event: with the loop's
  // first turn entered with no piece, ptxas once placed a wait for every outstanding ring load at the
  // start of each slot (the ring one chunk deep; 0.59 of the read ceiling at T = 8 instead of 0.75,
  // bench/NOTES.md). The barriers in stream_advance are the non-aligned form, so two call sites are allowed.
  StreamPiece pc = stream_advance<BT, WARPS, EPI>(p, smem, make_float4(0, 0, 0, 0), make_float4(0, 0, 0, 0));
  trace_event(p, kTraceFirstPiece);

  // One K chunk (four k16 steps) of the current m-tile from a ring slot.
  auto step = [&](uint4& words, uint2& sc) {
    uint32_t b[NT][4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t addr = pc.act_ptr + (half ? act_delta : 0u);
      ldmatrix_x4(addr, b[0][0], b[0][1], b[0][2], b[0][3]);
      if (NT == 2 && pc.two_nt)
        ldmatrix_x4(addr + 8 * row_bytes, b[NT - 1][0], b[NT - 1][1], b[NT - 1][2], b[NT - 1][3]);
#pragma unroll
      for (int s2 = 0; s2 < 2; ++s2) {
        const int s = half * 2 + s2;
        const uint32_t w = s == 0 ? words.x : s == 1 ? words.y : s == 2 ? words.z : words.w;
        const uint32_t sw = half == 0 ? sc.x : sc.y;
        // bytes (row g, row g+8) of k16 block s -> the two 16-bit halves
        const uint32_t pair = __byte_perm(sw, 0u, s2 ? 0x4342u : 0x4140u);
        uint32_t a[4];
        dequant_fragment(w, pair * p.scale_mul + p.scale_add, a);
        mma_bf16_16816(acc[0], a, b[0][2 * s2], b[0][2 * s2 + 1]);
        if (NT == 2 && pc.two_nt) mma_bf16_16816(acc[NT - 1], a, b[NT - 1][2 * s2], b[NT - 1][2 * s2 + 1]);
      }
    }
    pc.act_ptr += 128;
    --pc.cleft;
  };

  // The ring is consumed in load order: slot (chunk sequence number % DEPTH), one turn per iteration.
  // Events are handled in place by the noinline cold paths: a piece or round ending before the slot that
  // would continue it, the load cursor reaching the end of its range inside a half's requests. A call
  // waits for every outstanding load (SASS), i.e. drains the ring, but events come once per m-tile or
  // round, not per chunk.
  // `alive` and a break, not a return from inside the loop: the return made ptxas put local-memory loads
  // into stream_bt8_w20_d8_c1's loop (scripts/sass_waits.py --mix), the kind of change that once cost 4%.
  bool alive = pc.cleft > 0;  // until stream_advance says the CTA has no more work
  while (alive) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      if (pc.cleft == 0) {
        pc = stream_advance<BT, WARPS, EPI>(p, smem, make_float4(acc[0][0], acc[0][1], acc[0][2], acc[0][3]),
                                            make_float4(acc[NT - 1][0], acc[NT - 1][1], acc[NT - 1][2], acc[NT - 1][3]));
        zero_acc();
        if (pc.cleft == 0) {  // the CTA has no more work
          alive = false;
          break;
        }
      }
      if (d % HALF == 0) {  // a half begins: request the other half (consumed by the previous half)
        const int other = d < HALF ? HALF : 0;
        dep = ring_s[d].x & (static_cast<uint32_t>(p.k) & 63u);
#pragma unroll
        for (int j = 0; j < HALF; ++j) issue(ring_c[other + j], ring_s[other + j]);
      }
      step(ring_c[d], ring_s[d]);
    }
  }
  trace_event(p, kTraceExit);
}

}  // namespace fp4moe::kernels

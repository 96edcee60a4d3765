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
//   for four k16 steps, and 8 B of block scales) from global memory into a ring of DEPTH register sets,
//   DEPTH chunks ahead of the math. A warp's chunks of one m16 tile are contiguous in the repacked layout
//   (nvfp4_weight_layout.hpp), so the stream is one pointer bumped by 512 B (codes) and 64 B (scales).
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
//   so the sum order is fixed by the shapes alone and the output is bit-identical run to run.
// - The weight ring runs across m-tiles and rounds, so the next round's weights are in flight while a
//   round ends (barrier, reduction, next activation rows).
#pragma once
#include <cstdint>

#include <cuda_bf16.h>

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
// memory, not registers: at 32 warps per SM a thread has 64 registers, which the hot loop needs for the
// weight ring, and a warp-uniform value costs one broadcast load where it is needed. Written by lane 0.
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
  int pad[2];
};
static_assert(sizeof(StreamWarpState) == kStreamWarpStateBytes, "the layout reserves kStreamWarpStateBytes per warp");

template <int BT, int WARPS, int DEPTH, int CTAS, int EPI>
__global__ void __launch_bounds__(WARPS * 32, CTAS) sm80_nvfp4_grouped_stream_kernel(const GroupedGemmParams p) {
  constexpr TileConfig kCfg{16 * WARPS, BT, 64, DEPTH, WARPS, 2, CTAS};
  static_assert(tile_config_well_formed(kCfg), "stream config is malformed: see tile_config_well_formed()");
  static_assert(DEPTH <= 8, "the slot dispatch below has eight cases");
  constexpr int NT = BT / 8;
  constexpr int kThreads = WARPS * 32;

  extern __shared__ __align__(128) uint8_t smem[];
  const StreamSmemLayout L = stream_smem_layout(kCfg, p.k);
  float4* s_slots = reinterpret_cast<float4*>(smem + L.slots_offset);  // [WARPS][NT][32]
  int32_t* s_prefix = reinterpret_cast<int32_t*>(smem + L.sched_offset);
  StreamWarpState& ws = reinterpret_cast<StreamWarpState*>(smem + L.warp_state_offset)[threadIdx.x >> 5];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int E = p.num_experts + (p.x_offsets != nullptr ? 1 : 0);  // + the second weight set

  // ---- segments (expert, token tile) per expert, exclusive prefix ----
  if (warp == 0) build_expert_prefix(p, E, lane, s_prefix, [](int rows) { return (rows + BT - 1) / BT; });
  __syncthreads();
  // CTA i of G owns units [i * U / G, (i + 1) * U / G); U < 2^31 (the launcher checks).
  {
    const int64_t units = static_cast<int64_t>(s_prefix[kMaxExperts + 1]) * (p.n / 16);
    const int u0 = static_cast<int>(units * blockIdx.x / gridDim.x);
    const int u1 = static_cast<int>(units * (blockIdx.x + 1) / gridDim.x);
    if (u0 >= u1) return;  // uniform over the CTA: no barrier follows
    if (lane == 0) {
      ws.lru = ws.cru = u0;
      ws.u1 = u1;
      ws.pending = 0;
    }
    __syncwarp();
  }

  // A round: the CTA's units from ru to the end of ru's segment (or of the CTA's range); F chunks.
  struct Round {
    int end, seg, m0, F;
  };
  auto round_at = [&](int ru) {
    const int MT = p.n / 16;
    Round r;
    r.seg = ru / MT;
    r.m0 = ru - r.seg * MT;
    r.end = min(ws.u1, (r.seg + 1) * MT);
    r.F = (r.end - ru) * (p.k / 64);
    return r;
  };
  // Warp w's slice of a round's F chunks starts here (the slices of warps w and w + 1 bound it).
  auto slice_begin = [](int F, int w) { return F * w / WARPS; };  // F * WARPS < 2^31 (launcher)

  // ---- load cursor: this warp's chunks over all rounds, DEPTH chunks ahead of the math ----
  const uint8_t* lc = nullptr;  // this lane's next 16 B of codes
  const uint8_t* ls = nullptr;  // this lane's next 8 B of scales
  int lleft = 0;                // chunks left in the cursor's round; -1: no more rounds
  auto load_next_round = [&]() {  // cold: once per round
    int lru = ws.lru;
    const int u1 = ws.u1;
    while (lleft == 0 && lru < u1) {
      const Round r = round_at(lru);
      lru = r.end;
      const int f0 = slice_begin(r.F, warp);
      lleft = slice_begin(r.F, warp + 1) - f0;
      if (lleft > 0) {
        const int e = find_expert(r.seg, s_prefix, E);
        const bool xs = e >= p.num_experts;
        const int64_t chunk = static_cast<int64_t>(r.m0) * (p.k / 64) + f0;  // within the expert
        lc = (xs ? p.x_codes : p.codes + e * (static_cast<int64_t>(p.n) * p.k / 2)) + chunk * 512 + lane * 16;
        ls = (xs ? p.x_scales : p.scales + e * (static_cast<int64_t>(p.n) * p.k / 16)) + chunk * 64 +
             (lane >> 2) * 8;
      }
    }
    if (lleft == 0) lleft = -1;
    __syncwarp();
    if (lane == 0) ws.lru = lru;
    __syncwarp();
  };
  auto issue = [&](uint4& rc, uint2& rs) {
    if (lleft > 0) {
      rc = ldg_stream_v4(lc);
      rs = ldg_stream_v2(ls);
      lc += 512;
      ls += 64;
      --lleft;
    }
  };

  uint4 ring_c[DEPTH];
  uint2 ring_s[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    ring_c[d] = make_uint4(0, 0, 0, 0);
    ring_s[d] = make_uint2(0, 0);
    if (lleft == 0) load_next_round();
    issue(ring_c[d], ring_s[d]);
  }

  // ---- math ----
  float acc[NT][4];
  auto zero_acc = [&]() {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[j][q] = 0.0f;
  };
  zero_acc();
  auto store_slot = [&]() {
#pragma unroll
    for (int j = 0; j < NT; ++j)
      s_slots[(warp * NT + j) * 32 + lane] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
  };
  auto epilogue = [&]() {
    store_mtile<NT, EPI>(p, ws.seg_e, ws.seg_x != 0, ws.m_cur, ws.seg_row0, ws.seg_rows, (ws.seg_rows + 7) >> 3,
                         acc);
  };
  // Per-lane ldmatrix row address of a 64-K chunk's steps 0-1: matrix mat = lane / 8 of an x4 load is
  // the 16-byte chunk (2 * step + mat) of the 128-byte K chunk, row lane % 8; chunks are XOR-swizzled
  // with the row so the eight rows of a matrix hit eight different bank groups. Steps 2-3: + act_delta.
  const uint32_t row_bytes = static_cast<uint32_t>(p.k) * 2;
  const int lrow = lane & 7, mat = lane >> 3;
  const uint32_t act_lane = smem_u32(smem) + lrow * row_bytes + ((mat ^ lrow) << 4);
  const uint32_t act_delta = (((4 + mat) ^ lrow) << 4) - ((mat ^ lrow) << 4);
  const uint32_t sadd = p.scale_add;

  int cleft = 0;         // chunks left in the current piece
  uint32_t act_ptr = 0;  // act_lane + 128 * (chunk within the m-tile)
  bool two_nt = false;   // NT == 2 and the round's segment has more than 8 rows
  bool in_round = false, in_piece = false;

  // Start this warp's piece of m-tile m at chunk c_in, with `avail` of its chunks left in the round.
  auto start_piece = [&](int m, int c_in, int avail) {
    const int len = min(p.k / 64 - c_in, avail);
    cleft = len;
    act_ptr = act_lane + static_cast<uint32_t>(c_in) * 128;
    in_piece = true;
    __syncwarp();
    if (lane == 0) {
      ws.m_cur = m;
      ws.round_left = avail - len;
      ws.from_start = c_in == 0;
      ws.to_end = c_in + len == p.k / 64;
    }
    __syncwarp();
  };
  // Next round: its segment, its activation rows into shared memory, this warp's first piece (if any).
  auto begin_round = [&]() -> bool {
    const int ru = ws.cru;
    if (ru >= ws.u1) return false;
    const Round r = round_at(ru);
    const int e = find_expert(r.seg, s_prefix, E);
    int a, b;
    expert_rows(p, e, a, b);
    const int row0 = a + (r.seg - s_prefix[e]) * BT;
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
    }
    // Activation rows -> shared memory. Rows past `rows` are not loaded: they only feed accumulator
    // columns that are never stored.
    {
      const __nv_bfloat16* src = (xs ? p.x_act : p.act) + static_cast<int64_t>(row0) * p.k;
      const int pieces = p.k / 8;
      const uint32_t dst = smem_u32(smem);
      for (int rr = 0; rr < rows; ++rr)
        for (int c = tid; c < pieces; c += kThreads)
          cp_async16(dst + rr * row_bytes + (((c & ~7) | ((c ^ rr) & 7)) << 4),
                     src + static_cast<int64_t>(rr) * p.k + c * 8);
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();  // the rows are in; also publishes ws
    two_nt = NT == 2 && rows > 8;
    in_round = true;
    const int f0 = slice_begin(r.F, warp), f1 = slice_begin(r.F, warp + 1);
    if (f1 > f0) start_piece(r.m0 + f0 / (p.k / 64), f0 % (p.k / 64), f1 - f0);
    return true;
  };
  // End of round: split m-tiles meet. The warp holding an m-tile's chunk 0 adds the later warps' pieces
  // in warp order (a fixed order: bit-identical results run to run) and stores it.
  auto end_round = [&]() {
    __syncthreads();  // slots written; every warp is done with this round's activation rows
    if (ws.pending) {
      const int mend = (ws.m_cur - ws.m0 + 1) * (p.k / 64);  // end of m_cur in the round's chunks
      for (int w = warp + 1; w < WARPS; ++w) {
        const int f0 = slice_begin(ws.F, w);
        if (f0 >= mend) break;
        if (slice_begin(ws.F, w + 1) > f0) {
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const float4 v = s_slots[(w * NT + j) * 32 + lane];
            acc[j][0] += v.x;
            acc[j][1] += v.y;
            acc[j][2] += v.z;
            acc[j][3] += v.w;
          }
        }
      }
      epilogue();
      zero_acc();
      __syncwarp();
      if (lane == 0) ws.pending = 0;
      __syncwarp();
    }
    in_round = false;
  };
  // cleft == 0: finish the piece, then move to the next piece or round; false when the CTA is done.
  // lleft == 0: the load cursor enters its next round first.
  auto advance = [&]() -> bool {
    if (lleft == 0) load_next_round();
    while (cleft == 0) {
      if (in_piece) {
        in_piece = false;
        if (ws.to_end) {
          if (ws.from_start) epilogue();
          else store_slot();  // this warp's first piece; the owner of the m-tile adds it
          zero_acc();
          if (ws.round_left > 0) {
            start_piece(ws.m_cur + 1, 0, ws.round_left);
            continue;
          }
        } else if (ws.from_start) {
          __syncwarp();
          if (lane == 0) ws.pending = 1;  // keep acc: later warps hold the rest of m_cur
          __syncwarp();
        } else {
          store_slot();
          zero_acc();
        }
      }
      if (in_round) end_round();
      if (!begin_round()) return false;
    }
    return true;
  };

  // One K chunk (four k16 steps) of the current m-tile from a ring slot, then refill the slot.
  auto step = [&](uint4& words, uint2& sc) {
    uint32_t b[NT][4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t addr = act_ptr + (half ? act_delta : 0u);
      ldmatrix_x4(addr, b[0][0], b[0][1], b[0][2], b[0][3]);
      if (NT == 2 && two_nt) ldmatrix_x4(addr + 8 * row_bytes, b[NT - 1][0], b[NT - 1][1], b[NT - 1][2], b[NT - 1][3]);
#pragma unroll
      for (int s2 = 0; s2 < 2; ++s2) {
        const int s = half * 2 + s2;
        const uint32_t w = s == 0 ? words.x : s == 1 ? words.y : s == 2 ? words.z : words.w;
        const uint32_t sw = half == 0 ? sc.x : sc.y;
        // bytes (row g, row g+8) of k16 block s -> the two 16-bit halves
        const uint32_t pair = __byte_perm(sw, 0u, s2 ? 0x4342u : 0x4140u);
        uint32_t a[4];
        dequant_fragment(w, pair * p.scale_mul + sadd, a);
        mma_bf16_16816(acc[0], a, b[0][2 * s2], b[0][2 * s2 + 1]);
        if (NT == 2 && two_nt) mma_bf16_16816(acc[NT - 1], a, b[NT - 1][2 * s2], b[NT - 1][2 * s2 + 1]);
      }
    }
    act_ptr += 128;
    --cleft;
    issue(words, sc);  // the cursor's round changes are events (lleft == 0), handled outside the ring
  };

  // The ring is consumed in load order: slot (chunk sequence number % DEPTH). Events (a piece or round
  // ending, the load cursor reaching the end of its round) leave the unrolled loop and re-enter it at the
  // slot where it stopped, so the cold code exists once.
  int ph = 0;
  bool alive = advance();
  while (alive) {
    switch (ph) {
#define FP4MOE_STREAM_SLOT(d)                                        \
  case d:                                                            \
    if constexpr (DEPTH > d) {                                       \
      if (cleft == 0 || lleft == 0) {                                \
        ph = d;                                                      \
        break;                                                       \
      }                                                              \
      step(ring_c[d < DEPTH ? d : 0], ring_s[d < DEPTH ? d : 0]);    \
    }                                                                \
    [[fallthrough]];
      FP4MOE_STREAM_SLOT(0)
      FP4MOE_STREAM_SLOT(1)
      FP4MOE_STREAM_SLOT(2)
      FP4MOE_STREAM_SLOT(3)
      FP4MOE_STREAM_SLOT(4)
      FP4MOE_STREAM_SLOT(5)
      FP4MOE_STREAM_SLOT(6)
      FP4MOE_STREAM_SLOT(7)
#undef FP4MOE_STREAM_SLOT
      default:
        ph = 0;
        continue;  // all slots consumed: next turn of the ring
    }
    alive = advance();
  }
}

}  // namespace fp4moe::kernels

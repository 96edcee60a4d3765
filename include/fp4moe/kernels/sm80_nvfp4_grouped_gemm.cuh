// sm80-nvfp4-grouped: grouped (per-expert) GEMM, bf16 activations x NVFP4 weights, FP32 accumulate.
// Device code only; the host launcher is src/sm80_nvfp4_grouped_gemm.cu.
//
// Design (docs/kernel-design.md):
// - Swap AB: weights are mma's A operand (features = M, 16 per m-tile), activations are B (tokens = N,
//   8 per n-tile), so a decode-sized expert (a few tokens) costs a few narrow n-tiles, not a padded
//   64-row tile. MMA = 0 configs use mma.sync.m16n8k16 (sm_80 and newer: the decode tiles); MMA = 1
//   configs ("_wgmma", sm_90a only) issue wgmma m64nBTk16 per warpgroup with the same per-warp A
//   fragments, reading B from the same shared-memory layout (the prefill tiles). The family keeps its
//   sm80 name because its base requirement is sm_80; the launcher refuses wgmma configs elsewhere.
// - Weights are dequantized in registers exactly to bf16 (nvfp4_dequant.cuh); the FP32 global scale is
//   applied in the epilogue.
// - Persistent CTAs walk a list of work tiles (expert, feature tile, token tile) computed on the device
//   from the expert offsets, so empty experts cost nothing and no host synchronization is needed. An
//   optional second weight set (a shared expert) is scheduled as one more expert in the same list.
//   Consecutive tiles of a CTA-wave are the token tiles, then feature tiles, of one expert: CTAs that
//   run together share weights (token tiles) or activations (feature tiles) through L2.
// - One cp.async pipeline runs across tile boundaries (iteration = (tile, k-step)), so the next tile's
//   weights stream in while the current tile's epilogue stores from registers.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>

#include "fp4moe/kernels/activation.cuh"
#include "fp4moe/kernels/pdl.cuh"
#include "fp4moe/kernels/nvfp4_dequant.cuh"
#include "fp4moe/kernels/sm90_wgmma.cuh"
#include "fp4moe/nvfp4_weight_layout.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe::kernels {

enum EpilogueKind : int { kEpiPlain = 0, kEpiSwiGLU = 1, kEpiGptOss = 2 };

// TMA tensor maps of the tma configs (TileConfig::mma == 3), encoded per launch by the host
// (src/sm90_tensor_maps.cu); unused (zero) for the other kinds. Per weight set: codes as 8-byte
// elements [experts * n/16 m-tile rows][k] (an m-tile row is k/64 chunks of 512 B), scales as 8-byte
// elements [experts * n/16][k/8], activations as bf16 [max_rows][k] with the 128-byte swizzle, one map
// per token-tile width the kernel picks (box rows bt/4, bt/2, 3bt/4, bt): a tile copies only the rows
// its wgmma width reads.
// The tma kernel's producer addresses the maps by their index from `codes`: codes, scales, act[4] in
// this order, the extra set's from 6.
// The tail maps copy the rows of an expert's last feature tile where n/16 is not a multiple of bn/16 (box
// height (n/16) % (bn/16) m-tile rows; unused, zero, otherwise): gpt-oss-120b's N = 5760 and 2880 in 256-row
// tiles end half and a quarter full, and the full box read the next expert's first rows there, which the
// epilogue then dropped. The rest of the stage keeps an earlier copy's bytes: the rows they feed are past
// N, where no m-tile is stored (an A row of the MMA reaches no other row).
struct GroupedGemmTmaMaps {
  CUtensorMap codes, scales, act[4];
  CUtensorMap x_codes, x_scales, x_act[4];
  CUtensorMap codes_tail, scales_tail, x_codes_tail, x_scales_tail;
};
static_assert(offsetof(GroupedGemmTmaMaps, x_codes) == 6 * sizeof(CUtensorMap) &&
                  offsetof(GroupedGemmTmaMaps, x_act) == 8 * sizeof(CUtensorMap),
              "the tma kernel's producer indexes the maps from `codes`");

struct GroupedGemmParams {
  const uint8_t* codes;         // repacked, expert stride n*k/2
  const uint8_t* scales;        // repacked, expert stride n*k/16
  const float* global_scale;    // [E]
  const float* global_scale_up; // [E] or null
  const float* bias;            // [E, n] (on-disk row order) or null
  const __nv_bfloat16* act;     // [max_rows, k]
  const int32_t* offsets;       // [E + 1]
  const float* row_scale;       // [max_rows] or null
  __nv_bfloat16* out;           // [max_rows, n] or [max_rows, n/2]
  int num_experts;
  // Optional second weight set of one expert run in the same launch (a shared expert: same n, k and
  // epilogue, its own activations, rows [x_offsets[0], x_offsets[1]) and output; no row scale). It is
  // scheduled as expert index num_experts, so its tiles balance with the routed experts' tiles.
  const uint8_t* x_codes;
  const uint8_t* x_scales;
  const float* x_global_scale;     // [1]
  const float* x_global_scale_up;  // [1] or null
  const float* x_bias;             // [n] or null
  const __nv_bfloat16* x_act;
  const int32_t* x_offsets;        // [2], null when there is no second set
  __nv_bfloat16* x_out;
  int x_max_rows;
  int n;
  int k;
  int max_rows;
  float alpha;
  float limit;
  // Block-scale decode: a pair of repacked scale bytes in the two 16-bit halves becomes the bf16x2 scale
  // pair * scale_mul + scale_add (NVFP4 E4M3: 16, (236 << 7) | (236 << 23); MXFP4: 128, 0; see
  // nvfp4_weight_layout.hpp). Both weight sets of a launch share the format.
  uint32_t scale_mul;
  uint32_t scale_add;
  // Stream kernel: the schedule is known before griddepcontrol.wait (offsets final at launch, or counted
  // from route_ids), so the schedule and the weight ring come before it.
  int weights_before_wait;
  // Stream kernel, GroupedGemmArgs::route_ids: the offsets are the stable counting sort of these route_n
  // ids (out-of-range ids dropped) and the extra set's rows are [0, x_max_rows); the kernel counts them
  // itself instead of reading offsets, which its predecessor is still writing. Null: read offsets.
  const int32_t* route_ids;
  int route_n;
  // Stream kernel: what entering a segment costs a CTA, in K chunks of its stream (stream_split).
  int round_cost;
  // Stream kernel timeline (GroupedGemmArgs::trace): kStreamTraceSlots values per warp, or null.
  unsigned long long* trace;
  // tma kernel: an expert's last two token tiles split their rest R at tma_cut.cut8[R - bt - 1] * 8 rows
  // (tma_cut_table, tile_config.hpp).
  TmaCutTable tma_cut;
  GroupedGemmTmaMaps tma;
  // tma kernel, GroupedGemmArgs::tile_counter: {tiles claimed, CTAs done claiming}, zero at launch and
  // left zero; a CTA's first tile is its index, every later one is claimed here. Null: tile
  // blockIdx.x + i * gridDim.x.
  int32_t* tile_counter;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
// 4 bytes, through L1 (.ca: the only mode for copies under 16 bytes)
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Row range of expert e (e == num_experts: the second weight set), clamped to the buffers.
__device__ __forceinline__ void expert_rows(const GroupedGemmParams& p, int e, int& a, int& b) {
  const bool x = e >= p.num_experts;
  const int32_t* off = x ? p.x_offsets : p.offsets + e;
  const int cap = x ? p.x_max_rows : p.max_rows;
  a = min(max(__ldg(off), 0), cap);
  b = min(max(__ldg(off + 1), a), cap);
}

// Inclusive sum of v over lanes 0..lane (every lane of the warp calls it).
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Per-expert work counts -> exclusive prefix in shared memory (warp 0 only; E <= kMaxExperts + 1, so at
// most 17 experts per lane). count(e) gives expert e's work units. prefix[kMaxExperts + 1] = total.
template <typename CountFn>
__device__ __forceinline__ void build_segment_prefix(int E, int lane, int32_t* prefix, CountFn count) {
  constexpr int kPer = (kMaxExperts + 1 + 31) / 32;  // routed experts + the second weight set
  const int per = (E + 31) / 32;
  const int e0 = lane * per;
  int cnt[kPer];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    cnt[i] = 0;
    const int e = e0 + i;
    if (i < per && e < E) cnt[i] = count(e);
    sum += cnt[i];
  }
  const int incl = warp_inclusive_sum(sum, lane);
  int run = incl - sum;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = e0 + i;
    if (i < per && e < E) prefix[e] = run;
    run += cnt[i];
  }
  if (lane == 31) prefix[kMaxExperts + 1] = incl;  // total
}

// The same from the expert offsets: count(rows_e) gives expert e's work units.
template <typename CountFn>
__device__ __forceinline__ void build_expert_prefix(const GroupedGemmParams& p, int E, int lane, int32_t* prefix,
                                                    CountFn count) {
  build_segment_prefix(E, lane, prefix, [&](int e) {
    int a, b;
    expert_rows(p, e, a, b);
    return count(b - a);
  });
}

// Largest e with prefix[e] <= w (prefix is non-decreasing, prefix[0] = 0).
__device__ __forceinline__ int find_expert(int64_t w, const int32_t* prefix, int experts) {
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (prefix[mid] <= w) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The epilogue of one m16 weight tile (global m-tile index mt of the expert's N) for NT n-tiles of 8
// tokens held in a lane's mma C fragments: acc[nt][0..1] = (row g, tokens 2t, 2t+1), acc[nt][2..3] =
// (row g + 8, same tokens). Rows are in the repack's order (nvfp4_weight_layout.hpp): kPairs for the plain
// epilogue (rows g, g+8 = features 2g, 2g+1), kGateUp for SwiGLU (row g = gate j, row g+8 = up j).
// Shared by every kernel of the family so they round identically. The plain epilogue's row scales come
// from global memory, RS_BATCH n-tiles at a time, or with RS_BATCH == 0 from rs_smem[r] for the tile's
// row r (the tma kernel stages them in shared memory: 1.0 where the launch has none).
// FLAT (the tma kernel's wide token tiles; the plain epilogue with RS_BATCH == 0): n-tiles are taken in
// fours, and every value of a live four is computed whatever its row (rows past the tile hold sums of
// other rows or of nothing, and rs_smem holds 1.0 there); only the store is predicated on the row.
// Guarding each row's whole computation made every store a branch of its own, with its row-scale load
// inside, so a warp ran its 2 x NT stores as one dependent chain after another while the tensor pipe
// idled (bench/NOTES.md, tenth session). The values and their rounding are the same either way.
// bias_smem (the tma kernel): this m-tile's 16 biases, staged in shared memory at the tile start (plain: the
// features mt*16 .. +15; SwiGLU: the 8 gate then the 8 up biases of columns mt*8 .. +7), read instead of
// global memory; null where the launch has no biases, or from global memory as before (the other kernels).
// gs_smem (the tma kernel's claimed tiles, GS_SMEM): the expert's global scale and SwiGLU's up scale (the same
// value where the launch has none), copied into shared memory by the producer; null: loaded here as before.
template <int NT, int EPI, int RS_BATCH = 4, bool FLAT = false, bool BIAS_SMEM = false, bool GS_SMEM = false>
__device__ __forceinline__ void store_mtile(const GroupedGemmParams& p, int e, bool xs, int mt, int row0, int rows,
                                            int valid_nt, const float (&acc)[NT][4],
                                            const float* rs_smem = nullptr, const float* bias_smem = nullptr,
                                            const float* gs_smem = nullptr) {
  static_assert(!FLAT || RS_BATCH == 0 || EPI != kEpiPlain, "the flat epilogue reads row scales from shared memory");
  // An m-tile past N has nothing to store. The flat SwiGLU epilogue does not return for it: its warp still
  // runs the n-tile loop, with its loads and stores predicated off. That loop holds a movmatrix (below),
  // and a warp-synchronous instruction behind this data-dependent return took the wide tma kernels' K
  // loops off the uniform datapath (their wgmma descriptors moved with 2 R2UR per step;
  // scripts/sass_wgmma_loops.py, bench/NOTES.md twenty-second session).
  constexpr bool kNoReturn = FLAT && EPI != kEpiPlain;
  const bool live_mt = mt < p.n / 16;
  if (!kNoReturn && !live_mt) return;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const float gs = (GS_SMEM && gs_smem != nullptr ? gs_smem[0] : __ldg(xs ? p.x_global_scale : p.global_scale + e)) *
                   layout::kAccumulatorScale;
  const float* bias = xs ? p.x_bias : (p.bias != nullptr ? p.bias + static_cast<int64_t>(e) * p.n : nullptr);
  const float* row_scale = xs ? nullptr : p.row_scale;
  __nv_bfloat16* out = xs ? p.x_out : p.out;
  if constexpr (EPI == kEpiPlain) {
    const int f = mt * 16 + 2 * g;  // features f, f+1 held in acc[..][0|1] and [2|3]
    float b0 = 0.f, b1 = 0.f;
    if constexpr (BIAS_SMEM) {
      if (bias_smem != nullptr) {
        b0 = bias_smem[2 * g];
        b1 = bias_smem[2 * g + 1];
      }
    } else if (bias != nullptr) {
      b0 = __ldg(bias + f);
      b1 = __ldg(bias + f + 1);
    }
    // The row scales (the layer's routing weights) of G n-tiles are loaded together, unconditionally
    // (a row past the tile's reads its last valid row's), before any is used: loaded inside each row's
    // guarded store, ptxas waited for each one in turn, 2 x NT L2 round trips per tile end while the
    // tensor pipe idled (13-16% of GLM-5's GEMMs at T = 1024..4096, bench/NOTES.md). From shared memory
    // (RS_BATCH == 0) there is no round trip to batch.
    constexpr int G = RS_BATCH == 0 ? NT : NT < RS_BATCH ? NT : RS_BATCH;
    if constexpr (FLAT) {
      __nv_bfloat16* o = out + static_cast<int64_t>(row0 + 2 * t4) * p.n + f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt % 4 == 0 && nt >= valid_nt) break;  // uniform; in fours, so that loads run ahead of use
        const float2 rs = *reinterpret_cast<const float2*>(rs_smem + nt * 8 + 2 * t4);  // rows r, r + 1
        const int r = nt * 8 + 2 * t4;
        const __nv_bfloat162 s0 = __floats2bfloat162_rn((acc[nt][0] * gs + b0) * rs.x, (acc[nt][2] * gs + b1) * rs.x);
        const __nv_bfloat162 s1 = __floats2bfloat162_rn((acc[nt][1] * gs + b0) * rs.y, (acc[nt][3] * gs + b1) * rs.y);
        if (r < rows) *reinterpret_cast<__nv_bfloat162*>(o + static_cast<int64_t>(nt * 8) * p.n) = s0;
        if (r + 1 < rows) *reinterpret_cast<__nv_bfloat162*>(o + static_cast<int64_t>(nt * 8 + 1) * p.n) = s1;
      }
    } else {
#pragma unroll
      for (int nt0 = 0; nt0 < NT; nt0 += G) {
        [[maybe_unused]] float rsv[RS_BATCH > 0 ? G : 1][2];
        if constexpr (RS_BATCH > 0) {
#pragma unroll
          for (int j = 0; j < G; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              rsv[j][h] = row_scale != nullptr && rows > 0
                              ? __ldg(row_scale + row0 + min((nt0 + j) * 8 + 2 * t4 + h, rows - 1))
                              : 1.0f;
        }
#pragma unroll
        for (int j = 0; j < G; ++j) {
          const int nt = nt0 + j;
          if (nt < valid_nt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int r = nt * 8 + 2 * t4 + h;
              if (r < rows) {
                const int row = row0 + r;
                float rs;
                if constexpr (RS_BATCH == 0) rs = rs_smem[r];
                else rs = rsv[j][h];
                const float v0 = (acc[nt][h] * gs + b0) * rs;
                const float v1 = (acc[nt][2 + h] * gs + b1) * rs;
                *reinterpret_cast<__nv_bfloat162*>(out + static_cast<int64_t>(row) * p.n + f) =
                    __floats2bfloat162_rn(v0, v1);
              }
            }
          }
        }
      }
    }
  } else {
    const float* gup = xs ? p.x_global_scale_up : (p.global_scale_up != nullptr ? p.global_scale_up + e : nullptr);
    const float gs_up = GS_SMEM && gs_smem != nullptr ? gs_smem[1] * layout::kAccumulatorScale
                        : gup != nullptr                ? __ldg(gup) * layout::kAccumulatorScale
                                                        : gs;
    const int jn = mt * 8 + g;  // output column (gate row jn, up row n/2 + jn)
    const int half = p.n / 2;
    float bg = 0.f, bu = 0.f;
    if constexpr (BIAS_SMEM) {
      if (bias_smem != nullptr && live_mt) {
        bg = bias_smem[g];
        bu = bias_smem[8 + g];
      }
    } else if (bias != nullptr && live_mt) {
      bg = __ldg(bias + jn);
      bu = __ldg(bias + half + jn);
    }
    if constexpr (FLAT) {
      // A lane's two values of an n-tile are one column (jn) of two tokens; the output is token-major, so
      // each would be its own 2-byte store. The warp's 8 columns x 8 tokens of the n-tile are one 8x8 bf16
      // matrix in the mma fragment layout: movmatrix.trans hands lane (g, t4) token g's columns 2 t4 and
      // 2 t4 + 1, one 4-byte store per n-tile instead of two 2-byte ones (the same values, rounded alike).
      __nv_bfloat16* o = out + static_cast<int64_t>(row0 + g) * half + (mt * 8 + 2 * t4);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt % 4 == 0 && nt >= valid_nt) break;  // uniform; in fours, so that loads run ahead of use
        float v[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float gate = acc[nt][h] * gs + bg;
          const float up = acc[nt][2 + h] * gs_up + bu;
          v[h] = EPI == kEpiSwiGLU ? swiglu_act(gate, up) : gptoss_swiglu_act(gate, up, p.alpha, p.limit);
        }
        const __nv_bfloat162 pk = __floats2bfloat162_rn(v[0], v[1]);  // (column g; tokens 2 t4, 2 t4 + 1)
        uint32_t tr;
        asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(tr) : "r"(*reinterpret_cast<const uint32_t*>(&pk)));
        if (live_mt && nt * 8 + g < rows) *reinterpret_cast<uint32_t*>(o + static_cast<int64_t>(nt * 8) * half) = tr;
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt < valid_nt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = nt * 8 + 2 * t4 + h;
            if (r < rows) {
              const int row = row0 + r;
              const float gate = acc[nt][h] * gs + bg;
              const float up = acc[nt][2 + h] * gs_up + bu;
              const float v = EPI == kEpiSwiGLU ? swiglu_act(gate, up) : gptoss_swiglu_act(gate, up, p.alpha, p.limit);
              out[static_cast<int64_t>(row) * half + jn] = __float2bfloat16_rn(v);
            }
          }
        }
      }
    }
  }
}

// A work tile, decoded from its linear index with the per-expert tile prefix in shared memory.
struct WorkTile {
  int expert;    // 0 .. num_experts-1, or num_experts for the second weight set
  bool extra;    // the second weight set
  int ftile;     // feature tile
  int row0;      // first activation row
  int rows;      // valid rows (1..BT)
};

// cut(n, tt): token tile tt of an expert's n rows as a TokenTile (tile_config.hpp); the tile count is
// ceil(n / BT) for every cut. The plain cut: BT rows each, the rest in the last.
template <int BT>
struct PlainTokenTiles {
  __device__ TokenTile operator()(int n, int tt) const { return {tt * BT, min(BT, n - tt * BT)}; }
};
// decode_tile_of: the same, with the tile's expert lo = find_expert(w, prefix, experts) already found (the
// tma kernel's producer loads the expert's global scales before the offsets' round trip).
template <int BT, class Cut = PlainTokenTiles<BT>>
__device__ __forceinline__ WorkTile decode_tile_of(int w, int lo, const int32_t* prefix, const GroupedGemmParams& p,
                                                   Cut cut = Cut{}) {
  WorkTile t;
  t.expert = lo;
  t.extra = lo >= p.num_experts;
  int a, b;
  expert_rows(p, lo, a, b);
  const int ttiles = (b - a + BT - 1) / BT;
  const int local = w - prefix[lo];
  t.ftile = local / ttiles;
  const int tt = local - t.ftile * ttiles;
  const TokenTile r = cut(b - a, tt);
  t.row0 = a + r.first;
  t.rows = r.rows;
  return t;
}
template <int BT, class Cut = PlainTokenTiles<BT>>
__device__ __forceinline__ WorkTile decode_tile(int w, const int32_t* prefix, const GroupedGemmParams& p, int experts,
                                                Cut cut = Cut{}) {
  return decode_tile_of<BT>(w, find_expert(w, prefix, experts), prefix, p, cut);
}

template <int BN, int BT, int BK, int STAGES, int WARPS, int MMA, int CTAS, int EPI>
__global__ void __launch_bounds__(WARPS * 32, gemm_min_ctas_per_sm(TileConfig{BN, BT, BK, STAGES, WARPS, MMA, CTAS}))
sm80_nvfp4_grouped_gemm_kernel(const GroupedGemmParams p) {
  // Programmatic dependent launch: the predecessor's results are visible after pdl_wait. With
  // p.weights_before_wait the offsets (and so every tile) were final before the predecessor began
  // (GEMM2's, which GEMM1 waited for), and the first stages' weights are requested before the wait,
  // below; the activation rows, the predecessor's output, only after it.
  if (!p.weights_before_wait) {
    pdl_wait();
    pdl_launch_dependents();
  }
  constexpr TileConfig kCfg{BN, BT, BK, STAGES, WARPS, MMA, CTAS};
  static_assert(tile_config_well_formed(kCfg), "tile config is malformed: see tile_config_well_formed()");
  constexpr GemmSmemLayout kL = gemm_smem_layout(kCfg);
  constexpr int kThreads = WARPS * 32;
  constexpr int WM = BN / (16 * WARPS);
  constexpr int MT = BN / 16;        // m-tiles per CTA tile
  constexpr int KC = BK / 64;        // 64-wide K chunks per stage
  constexpr int NT = BT / 8;         // n-tiles per CTA tile
  static_assert(NT % 2 == 0, "BT must be a multiple of 16 (ldmatrix.x4 loads n-tiles in pairs)");
  constexpr int kCodePieces = MT * KC * 32;     // 16-byte pieces per stage
  constexpr int kScalePieces = MT * KC * 4;
  constexpr int kActPieces = BT * BK / 8;

  extern __shared__ __align__(128) uint8_t smem[];
  int32_t* s_prefix = reinterpret_cast<int32_t*>(smem + kL.sched_offset);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int E = p.num_experts + (p.x_offsets != nullptr ? 1 : 0);  // + the second weight set
  const int K = p.k;
  const int m_tiles_total = p.n / 16;
  const int ftiles = (p.n + BN - 1) / BN;
  const int KT = K / BK;

  // ---- scheduler: tiles per expert, exclusive prefix ----
  if (warp == 0)
    build_expert_prefix(p, E, lane, s_prefix, [&](int rows) { return ((rows + BT - 1) / BT) * ftiles; });
  __syncthreads();
  const int total_tiles = s_prefix[kMaxExperts + 1];
  const int my_tiles = total_tiles > static_cast<int>(blockIdx.x)
                           ? (total_tiles - 1 - static_cast<int>(blockIdx.x)) / static_cast<int>(gridDim.x) + 1
                           : 0;
  const int total_iters = my_tiles * KT;
  if (total_iters == 0) {
    // Exit only once the predecessor is done: this grid's completion then implies its predecessor's,
    // which the next kernel relies on (the layer's combine reads GEMM2's rows after its own wait only).
    if (p.weights_before_wait) pdl_wait();
    return;
  }

  const int64_t codes_expert_stride = static_cast<int64_t>(p.n) * K / 2;
  const int64_t scales_expert_stride = static_cast<int64_t>(p.n) * K / 16;

  // ---- producer state. Which 16-byte pieces a thread copies is fixed by its index, so the shared
  // offsets and the global offsets within a tile are computed once; per k-step only a constant stride
  // is added (the address arithmetic would otherwise cost as much issue bandwidth as the dequant). ----
  constexpr int kCodeIters = (kCodePieces + kThreads - 1) / kThreads;
  constexpr int kScaleIters = (kScalePieces + kThreads - 1) / kThreads;
  constexpr int kActIters = (kActPieces + kThreads - 1) / kThreads;
  int code_mt[kCodeIters], code_gofs[kCodeIters];
#pragma unroll
  for (int i = 0; i < kCodeIters; ++i) {
    const int piece = tid + i * kThreads;
    code_mt[i] = piece < kCodePieces ? piece / (KC * 32) : 1 << 30;
    code_gofs[i] = (piece / (KC * 32)) * (K / 64) * 512 + (piece % (KC * 32)) * 16;
  }
  int scale_mt[kScaleIters], scale_gofs[kScaleIters];
#pragma unroll
  for (int i = 0; i < kScaleIters; ++i) {
    const int piece = tid + i * kThreads;
    scale_mt[i] = piece < kScalePieces ? piece / (KC * 4) : 1 << 30;
    scale_gofs[i] = (piece / (KC * 4)) * (K / 64) * 64 + (piece % (KC * 4)) * 16;
  }
  int act_row[kActIters], act_gofs[kActIters];
  uint32_t act_sofs[kActIters];
#pragma unroll
  for (int i = 0; i < kActIters; ++i) {
    const int piece = tid + i * kThreads;
    const int r = piece / (BK / 8), c = piece % (BK / 8);
    act_row[i] = piece < kActPieces ? r : 1 << 30;
    act_gofs[i] = r * K * 2 + c * 16;
    // activations: [KC slabs][BT rows][128 B], 16-byte chunk c of row r stored at c ^ (r & 7) so that
    // ldmatrix's eight row addresses hit eight different bank groups
    act_sofs[i] = ((c >> 3) * BT + r) * 128 + (((c & 7) ^ (r & 7)) << 4);
  }
  const uint32_t smem_base = smem_u32(smem);

  // per-tile producer bases
  const uint8_t* ld_codes = nullptr;
  const uint8_t* ld_scales = nullptr;
  const uint8_t* ld_act = nullptr;
  uint32_t ld_code_ok = 0, ld_scale_ok = 0, ld_act_ok = 0;  // bit i: piece i of this thread is loaded
  int ld_tile = 0, ld_kt = 0, ld_stage = 0;
  auto begin_load_tile = [&](int ti) {
    const WorkTile t = decode_tile<BT>(static_cast<int>(blockIdx.x) + ti * static_cast<int>(gridDim.x), s_prefix,
                                       p, E);
    const int mt0 = t.ftile * MT;
    ld_codes = (t.extra ? p.x_codes : p.codes + t.expert * codes_expert_stride) + static_cast<int64_t>(mt0) * (K / 64) * 512;
    ld_scales =
        (t.extra ? p.x_scales : p.scales + t.expert * scales_expert_stride) + static_cast<int64_t>(mt0) * (K / 64) * 64;
    ld_act = reinterpret_cast<const uint8_t*>((t.extra ? p.x_act : p.act) + static_cast<int64_t>(t.row0) * K);
    ld_code_ok = ld_scale_ok = ld_act_ok = 0;
#pragma unroll
    for (int i = 0; i < kCodeIters; ++i) ld_code_ok |= (mt0 + code_mt[i] < m_tiles_total) ? 1u << i : 0u;
#pragma unroll
    for (int i = 0; i < kScaleIters; ++i) ld_scale_ok |= (mt0 + scale_mt[i] < m_tiles_total) ? 1u << i : 0u;
    // rows past the tile's valid rows are not loaded: they only feed output columns never stored
#pragma unroll
    for (int i = 0; i < kActIters; ++i) ld_act_ok |= (act_row[i] < t.rows) ? 1u << i : 0u;
  };
  // the cp.asyncs of (the current load tile, k-step kt) into stage `sidx`: its weights and/or its
  // activation rows (both but for the weights requested before the wait)
  auto copy_stage = [&](int sidx, int kt, bool weights, bool act) {
    const uint32_t stage = smem_base + sidx * static_cast<uint32_t>(kL.stage_bytes);
    if (weights) {
      const uint32_t s_codes = stage + static_cast<uint32_t>(kL.codes_offset);
      const uint32_t s_scales = stage + static_cast<uint32_t>(kL.scales_offset);
      const uint8_t* gc = ld_codes + kt * (KC * 512);
      const uint8_t* gs = ld_scales + kt * (KC * 64);
#pragma unroll
      for (int i = 0; i < kCodeIters; ++i)
        if (ld_code_ok & (1u << i)) cp_async16(s_codes + (tid + i * kThreads) * 16, gc + code_gofs[i]);
#pragma unroll
      for (int i = 0; i < kScaleIters; ++i)
        if (ld_scale_ok & (1u << i)) cp_async16(s_scales + (tid + i * kThreads) * 16, gs + scale_gofs[i]);
    }
    if (act) {
      const uint8_t* ga = ld_act + kt * (BK * 2);
#pragma unroll
      for (int i = 0; i < kActIters; ++i)
        if (ld_act_ok & (1u << i)) cp_async16(stage + act_sofs[i], ga + act_gofs[i]);
    }
  };
  // issue the cp.asyncs of the next (tile, k-step) into the next stage, then advance; `weights`: false
  // for the stages whose weights went before the wait
  auto issue_load = [&](bool weights) {
    copy_stage(ld_stage, ld_kt, weights, true);
    if (++ld_stage == STAGES) ld_stage = 0;
    if (++ld_kt == KT) {
      ld_kt = 0;
      if (++ld_tile < my_tiles) begin_load_tile(ld_tile);
    }
  };

  float acc[WM][NT][4];
#pragma unroll
  for (int i = 0; i < WM; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

  begin_load_tile(0);
  // Loads run kAhead iterations ahead. wgmma reads shared memory asynchronously, so its configs keep one
  // more stage between the stage being loaded and the one being read: the stage overwritten at
  // iteration it was read at it - 2, whose wgmmas the wait_group<1> of iteration it - 1 has retired,
  // and no drain (wait_group<0>) is needed at the barrier.
  constexpr int kAhead = MMA == 1 ? STAGES - 2 : STAGES - 1;
  static_assert(kAhead >= 1, "wgmma configs need at least 3 stages");
  // Weights before the wait (p.weights_before_wait): the first tile's first stages' codes and scales
  // stream in under the predecessor's tail (its last CTAs, the SMs they leave), so only the activation
  // rows and the math follow the wait; a small GEMM2 (qwen3-30b at T = 1: one tile of 6 stages per CTA)
  // then has all its weights in shared memory when its input arrives. They join the first commit group
  // below, so the loop's accounting (stage s has landed once group s has) holds: group 0 carries them all.
  int early = 0;
  if (p.weights_before_wait) {
    early = min(kAhead, KT);  // within the first tile: a CTA with work has at least KT k-steps
#pragma unroll 1
    for (int s = 0; s < early; ++s) copy_stage(s, s, true, false);
    pdl_wait();
    pdl_launch_dependents();
  }
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < total_iters) issue_load(s >= early);
    cp_async_commit();
  }

  WorkTile tile = decode_tile<BT>(static_cast<int>(blockIdx.x), s_prefix, p, E);
  int stage_idx = 0;
  const int g = lane >> 2;
  // the scale decode's two operands, in registers for the whole kernel (one IMAD per scale pair)
  const uint32_t scale_mul = p.scale_mul, scale_add = p.scale_add;

  int it = 0;
  for (int tile_idx = 0; tile_idx < my_tiles; ++tile_idx) {
    if (tile_idx > 0)
      tile = decode_tile<BT>(static_cast<int>(blockIdx.x) + tile_idx * static_cast<int>(gridDim.x), s_prefix, p, E);
    const bool warp_active = (tile.ftile * MT + warp * WM) < m_tiles_total;
    const int valid_nt = (tile.rows + 7) >> 3;
    // The k-loop holds no epilogue: with a read of the accumulators inside it, ptxas drained every
    // in-flight wgmma at each stage (an injected warpgroup wait before the loop's back edge).
    for (int kt = 0; kt < KT; ++kt, ++it) {
    cp_async_wait<kAhead - 1>();
    // landed cp.async data (generic proxy) must be visible to wgmma (async proxy)
    if constexpr (MMA == 1) fence_proxy_async_smem();
    __syncthreads();
    if (it + kAhead < total_iters) issue_load(true);
    cp_async_commit();

    const uint8_t* stage = smem + stage_idx * kL.stage_bytes;
    const uint8_t* st_codes = stage + kL.codes_offset;
    const uint8_t* st_scales = stage + kL.scales_offset;
    const uint32_t st_act = smem_u32(stage);

    if constexpr (MMA == 1) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      // wgmma: all four warps of a warpgroup issue together (.sync.aligned), so warps whose m-tile lies
      // past N run too (on unloaded shared memory) and their rows are simply not stored. A fragments
      // alternate between two register sets so the dequantization of step q+1 overlaps the wgmma of
      // step q (at most one in flight while its A registers are rewritten).
      uint32_t abuf[2][4];
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        const uint4 words = *reinterpret_cast<const uint4*>(st_codes + ((warp * KC + c) * 32 + lane) * 16);
        const uint2 sc = *reinterpret_cast<const uint2*>(st_scales + (warp * KC + c) * 64 + g * 8);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int q = c * 4 + j;
          // retire the wgmma that read abuf[q & 1] two steps ago, also across stages (keeping the
          // previous one in flight); without it ptxas drains everything at the loop's back edge
          wgmma_wait<1>();
          const uint32_t w = j == 0 ? words.x : j == 1 ? words.y : j == 2 ? words.z : words.w;
          const uint32_t sw = j < 2 ? sc.x : sc.y;
          dequant_fragment(w, decode_scale_pair(__byte_perm(sw, 0u, (j & 1) ? 0x4342u : 0x4140u), scale_mul, scale_add),
                           abuf[q & 1]);
          wgmma_fence();
          wgmma_rs<BT>(acc[0], abuf[q & 1], wgmma_desc_k_major_sw128(st_act + c * BT * 128 + j * 32),
                       (kt == 0 && q == 0) ? 0 : 1);
          wgmma_commit();
        }
      }
#else
      __trap();  // wgmma exists on sm_90a only; the launcher refuses these configs elsewhere
#endif
    } else if (warp_active) {
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        uint4 words[WM];
        uint2 sc[WM];
#pragma unroll
        for (int i = 0; i < WM; ++i) {
          const int mt = warp * WM + i;
          words[i] = *reinterpret_cast<const uint4*>(st_codes + ((mt * KC + c) * 32 + lane) * 16);
          sc[i] = *reinterpret_cast<const uint2*>(st_scales + (mt * KC + c) * 64 + g * 8);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          // A fragments of this k16 step for the warp's m-tiles, dequantized once and reused by every
          // n-tile; B fragments are loaded per n-tile pair so only four B registers are live.
          uint32_t a[WM][4];
#pragma unroll
          for (int i = 0; i < WM; ++i) {
            const uint32_t w = j == 0 ? words[i].x : j == 1 ? words[i].y : j == 2 ? words[i].z : words[i].w;
            const uint32_t sw = j < 2 ? sc[i].x : sc[i].y;
            // bytes (row g, row g+8) of k16 block j -> the two 16-bit halves
            const uint32_t pair = __byte_perm(sw, 0u, (j & 1) ? 0x4342u : 0x4140u);
            dequant_fragment(w, decode_scale_pair(pair, scale_mul, scale_add), a[i]);
          }
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            if (np == 0 || 2 * np < valid_nt) {  // a valid tile has >= 1 row: pair 0 always runs
              const int mat = lane >> 3;
              const int row = (2 * np + (mat >> 1)) * 8 + (lane & 7);
              const int chunk = j * 2 + (mat & 1);
              uint32_t b0, b1, b2, b3;
              ldmatrix_x4(st_act + (c * BT + row) * 128 + ((chunk ^ (row & 7)) << 4), b0, b1, b2, b3);
#pragma unroll
              for (int i = 0; i < WM; ++i) {
                // both n-tiles of the pair: an odd last n-tile computes rows that are never stored, which
                // is cheaper than the register moves a predicated mma costs
                mma_bf16_16816(acc[i][2 * np], a[i], b0, b1);
                mma_bf16_16816(acc[i][2 * np + 1], a[i], b2, b3);
              }
            }
          }
        }
      }
    }

    if (++stage_idx == STAGES) stage_idx = 0;
    }
    // ---- epilogue: registers -> global, then reset ----
    {
      if constexpr (MMA == 1) wgmma_wait<0>();
      if (warp_active) {
#pragma unroll
        for (int i = 0; i < WM; ++i)
          store_mtile<NT, EPI>(p, tile.expert, tile.extra, tile.ftile * MT + warp * WM + i, tile.row0, tile.rows,
                               valid_nt, acc[i]);
      }
#pragma unroll
      for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
    }
  }
  cp_async_wait<0>();
}

}  // namespace fp4moe::kernels

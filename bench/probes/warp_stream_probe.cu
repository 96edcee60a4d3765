// Development probe (not part of the library or the CLI): can the decode GEMM lose its per-launch fixed
// costs if every warp streams on its own? bench/NOTES.md (fifteenth session) found the stream kernel's
// steady stream at ~0.8 of the read ceiling for small experts as for large ones, and the loss fixed per
// launch: ~9 us before a CTA's stream starts (schedule, split, the first round's activation rows behind
// a CTA barrier) and ~5 us of spread in when CTAs finish (static shares, round-end barriers). That is
// 8x heavier for qwen3-30b's 8x smaller experts.
//
// This probe runs one grouped GEMM (plain epilogue, the library's store_mtile) with a kernel that has no
// CTA-wide step after its schedule:
// - Activations are read as mma B fragments straight from global memory through L1, in a fragment
//   order written once beforehand (per row and 64-wide K chunk, lane quad t's four k16 steps in 32
//   contiguous bytes), instead of rows staged in shared memory per round behind barriers. Optionally
//   prefetched into L1 when the chunk's weights are requested (PF).
// - Weights: the stream kernel's register ring in two halves, the same loads and dequantization.
// - Work: units (segment of 8 rows, m16 tile) in expert order, each m-tile's K cut into pieces at fixed
//   chunk boundaries. mode 0 ("static"): warp w of W takes chunks [w C / W, (w + 1) C / W) of the flat
//   list (stream-K over the whole grid). mode 1 ("claimed", S pieces per m-tile): items (m-tile, piece)
//   taken in arrival order from a global counter, each warp's first item by its index, each later one
//   claimed an item ahead. A split m-tile's pieces leave fp32 partials in global memory; the last to
//   arrive (a counter per m-tile) sums them in piece order and stores: bit-identical run to run.
// Output: per shape and token count, the time and its ratio to the read ceiling measured in the same
// run, against the library's stream configs on the same weights; and the largest difference to the
// library's output (same rounding path; only the fp32 summation order of split m-tiles differs).
//
// Result on an H200 (bench/NOTES.md, sixteenth session; bench/results/h200-warp-stream-probe.txt): slower than
// the library's stream configs on every shape and token count (GLM-5 GEMM1 at T = 8: 0.65 against 0.82 of the
// read ceiling). The activation fragments miss L1 (40% hits), and the HMMAs wait for them; shared-memory rows
// staged per round are worth their barriers.
//
//   fp4moe_probe_warp_stream [--reps N] [--shape I] [--tokens T] [--kernel NAME] [--mode M] [--pieces S]
//   (the filters run one shape, token count, kernel, mode or piece count: e.g. under ncu)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <numeric>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "bench_common.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/kernels/sm80_nvfp4_grouped_stream.cuh"
#include "fp4moe/nvfp4_weight_layout.hpp"
#include "fp4moe/tile_config.hpp"

namespace {

using namespace fp4moe;
using namespace fp4moe::kernels;

constexpr int kMaxE = 257;

struct ProbeParams {
  GroupedGemmParams g;        // codes, scales, global_scale, row_scale, out, n, k, offsets, scale decode
  const uint8_t* act_frag;    // < 4 GiB; row r, chunk c: 128 bytes at (r * Kc + c) * 128; lane quad t at + 32 t
  const int32_t* seg_prefix;  // [E + 1]: segments (8 rows) per expert, exclusive prefix; [E] = total
  float* partial;             // [slot][32 lanes][4]
  int32_t* mt_count;          // [units]: pieces arrived; zero at launch, left zero
  int32_t* claim;             // [2]: items claimed beyond the first W, warps done; zero at launch, left zero
  int S;                      // pieces per m-tile (mode 1)
  int mode;                   // 0 static ranges, 1 claimed items
};

// A piece: chunks [c0, c1) of unit u, and where its fp32 partial goes when it is not the whole m-tile.
struct Piece {
  int u, c0, c1, slot, P;  // P: pieces of this m-tile (1: whole)
};

struct WarpQ {  // per warp, in shared memory: the load side's pieces, consumed in order by the math
  Piece q[16];     // the load side runs at most DEPTH (<= 8) chunks, so <= 9 pieces, ahead
  int head, tail;  // math pops head, load pushes tail (mod 16)
  int next_item;   // mode 1: the claimed item after the load side's current one
  int lw_pos;      // mode 0: next chunk of the warp's range the load side has not entered
};

struct Sched {
  int E, MT, Kc, U, W;
  long long C;  // chunks
};

__device__ __forceinline__ Sched sched_of(const ProbeParams& p, const int32_t* prefix) {
  Sched s;
  s.E = p.g.num_experts;
  s.MT = p.g.n / 16;
  s.Kc = p.g.k / 64;
  s.U = prefix[s.E] * s.MT;
  s.W = gridDim.x * (blockDim.x >> 5);
  s.C = static_cast<long long>(s.U) * s.Kc;
  return s;
}
__device__ __forceinline__ long long range_at(const Sched& s, int w) { return static_cast<long long>(w) * s.C / s.W; }

// Static mode: the pieces of unit u, in order, belong to warps w0, w0 + 1, ... (w0's range holds chunk
// u * Kc); piece start max(f(w), u Kc); slot 2 w + (start is w's range start ? 0 : 1).
__device__ int static_first_warp(const Sched& s, long long a) {
  int w = static_cast<int>(a * s.W / s.C);
  while (w + 1 < s.W && range_at(s, w + 1) <= a) ++w;
  while (w > 0 && range_at(s, w) > a) --w;
  return w;
}
__device__ __forceinline__ int static_slot(int w, bool at_range_start) { return 2 * w + (at_range_start ? 0 : 1); }
// fn(slot) for each piece of unit u in piece order: the count and the last piece's sum walk the same list.
template <typename Fn>
__device__ void for_each_static_piece(const Sched& s, int u, Fn fn) {
  const long long a = static_cast<long long>(u) * s.Kc, b = a + s.Kc;
  for (int w = static_first_warp(s, a); w < s.W && range_at(s, w) < b; ++w) {
    const long long f0 = range_at(s, w), f1 = range_at(s, w + 1);
    if (f1 > f0 && f1 > a) fn(static_slot(w, f0 >= a));
  }
}
__device__ int static_piece_count(const Sched& s, int u) {
  int P = 0;
  for_each_static_piece(s, u, [&](int) { ++P; });
  return P;
}

// The next piece of the load side (lane-uniform); returns false when the warp has no more work.
__device__ bool next_piece(const ProbeParams& p, const Sched& s, WarpQ& wq, Piece& pc) {
  const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (p.mode == 0) {
    const long long end = range_at(s, gw + 1);
    const long long pos = wq.lw_pos < 0 ? range_at(s, gw) : static_cast<long long>(wq.lw_pos);
    if (pos >= end) return false;
    const int u = static_cast<int>(pos / s.Kc);
    const long long m0 = static_cast<long long>(u) * s.Kc;
    const long long stop = min(end, m0 + s.Kc);
    pc.u = u;
    pc.c0 = static_cast<int>(pos - m0);
    pc.c1 = static_cast<int>(stop - m0);
    const bool whole = pc.c0 == 0 && pc.c1 == s.Kc;
    pc.P = whole ? 1 : static_piece_count(s, u);
    pc.slot = static_slot(gw, pos == range_at(s, gw));
    __syncwarp();
    if (lane == 0) wq.lw_pos = static_cast<int>(stop);
    __syncwarp();
    return true;
  }
  const int items = s.U * p.S;
  int it = wq.next_item;
  if (it < 0) it = gw;  // the first item by index
  if (it >= items) return false;
  // claim the item after this one now: its latency hides under this item's chunks
  int nxt = 0;
  if (lane == 0) nxt = atomicAdd(p.claim, 1) + s.W;
  nxt = __shfl_sync(0xffffffffu, nxt, 0);
  pc.u = it / p.S;
  const int j = it - pc.u * p.S;
  pc.c0 = j * s.Kc / p.S;
  pc.c1 = (j + 1) * s.Kc / p.S;
  pc.P = p.S;
  pc.slot = it;
  __syncwarp();
  if (lane == 0) wq.next_item = nxt;
  __syncwarp();
  return true;
}

struct Cursor {
  const uint8_t* lc;
  const uint8_t* ls;
  uint32_t la;  // this lane's activation bytes of the chunk, from act_frag (PF); 32-bit: fewer registers
  int left;
};

template <int WARPS>
__device__ __forceinline__ WarpQ& warp_q(uint8_t* smem) {
  return reinterpret_cast<WarpQ*>(smem + 2 * kMaxE * 4)[threadIdx.x >> 5];
}

__device__ __forceinline__ void expert_of_unit(const ProbeParams& p, const int32_t* prefix, const int32_t* rows,
                                               int u, int MT, int& e, int& m, int& row0, int& nrows) {
  const int seg = u / MT;
  m = u - seg * MT;
  e = find_expert(seg, prefix, p.g.num_experts);
  row0 = rows[e] + (seg - prefix[e]) * 8;
  nrows = min(8, rows[e + 1] - row0);
}

template <int WARPS>
__device__ __noinline__ Cursor load_next(const ProbeParams& p, uint8_t* smem) {
  const int32_t* prefix = reinterpret_cast<const int32_t*>(smem);
  const int32_t* rows = prefix + kMaxE;
  const Sched s = sched_of(p, prefix);
  WarpQ& wq = warp_q<WARPS>(smem);
  const int lane = threadIdx.x & 31;
  Cursor c{nullptr, nullptr, 0u, -1};
  Piece pc;
  if (!next_piece(p, s, wq, pc)) return c;
  int e, m, row0, nrows;
  expert_of_unit(p, prefix, rows, pc.u, s.MT, e, m, row0, nrows);
  const int64_t chunk = static_cast<int64_t>(m) * s.Kc + pc.c0;
  c.lc = p.g.codes + e * (static_cast<int64_t>(p.g.n) * p.g.k / 2) + chunk * 512 + lane * 16;
  c.ls = p.g.scales + e * (static_cast<int64_t>(p.g.n) * p.g.k / 16) + chunk * 64 + (lane >> 2) * 8;
  const int r = row0 + min(lane >> 2, nrows - 1);
  c.la = static_cast<uint32_t>((static_cast<int64_t>(r) * s.Kc + pc.c0) * 128 + (lane & 3) * 32);
  c.left = pc.c1 - pc.c0;
  __syncwarp();
  if (lane == 0) {
    wq.q[wq.tail & 15] = pc;
    wq.tail = wq.tail + 1;
  }
  __syncwarp();
  return c;
}

struct MathPiece {
  uint32_t act;  // this lane's 32 bytes of the next chunk, from act_frag
  int cleft;
};

// The piece that just ended (if any) is stored, or parked as a partial and summed by the last to arrive;
// then the next piece the load side opened begins. cleft = 0: no more work.
template <int WARPS>
__device__ __noinline__ MathPiece math_next(const ProbeParams& p, uint8_t* smem, float4 acc4, int had) {
  const int32_t* prefix = reinterpret_cast<const int32_t*>(smem);
  const int32_t* rows = prefix + kMaxE;
  const Sched s = sched_of(p, prefix);
  WarpQ& wq = warp_q<WARPS>(smem);
  const int lane = threadIdx.x & 31;
  MathPiece out{0u, 0};
  if (had) {
    const Piece pc = wq.q[wq.head & 15];
    __syncwarp();
    if (lane == 0) wq.head = wq.head + 1;
    __syncwarp();
    int e, m, row0, nrows;
    expert_of_unit(p, prefix, rows, pc.u, s.MT, e, m, row0, nrows);
    float acc[1][4] = {{acc4.x, acc4.y, acc4.z, acc4.w}};
    if (pc.P == 1) {
      store_mtile<1, kEpiPlain>(p.g, e, false, m, row0, nrows, 1, acc);
    } else {
      reinterpret_cast<float4*>(p.partial)[static_cast<int64_t>(pc.slot) * 32 + lane] = acc4;
      __threadfence();
      __syncwarp();
      int old = 0;
      if (lane == 0) old = atomicAdd(p.mt_count + pc.u, 1);
      old = __shfl_sync(0xffffffffu, old, 0);
      if (old == pc.P - 1) {  // last to arrive: sum the pieces in piece order, store, reset the counter
        __threadfence();
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        auto add = [&](int slot) {
          const float4 v = __ldcg(reinterpret_cast<const float4*>(p.partial) + static_cast<int64_t>(slot) * 32 + lane);
          sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
        };
        if (p.mode == 1) {
          for (int j = 0; j < p.S; ++j) add(pc.u * p.S + j);
        } else {
          for_each_static_piece(s, pc.u, add);
        }
        float sacc[1][4] = {{sum.x, sum.y, sum.z, sum.w}};
        store_mtile<1, kEpiPlain>(p.g, e, false, m, row0, nrows, 1, sacc);
        if (lane == 0) p.mt_count[pc.u] = 0;
      }
    }
  }
  if (wq.head == wq.tail) return out;  // the load side has opened nothing more: done
  const Piece pc = wq.q[wq.head & 15];
  int e, m, row0, nrows;
  expert_of_unit(p, prefix, rows, pc.u, s.MT, e, m, row0, nrows);
  const int r = row0 + min(lane >> 2, nrows - 1);
  out.act = static_cast<uint32_t>((static_cast<int64_t>(r) * s.Kc + pc.c0) * 128 + (lane & 3) * 32);
  out.cleft = pc.c1 - pc.c0;
  return out;
}

__device__ __forceinline__ void prefetch_l1(const void* ptr) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr));
}

template <int WARPS, int DEPTH, int CTAS, int PF>
__global__ void __launch_bounds__(WARPS * 32, CTAS) warp_stream_kernel(const __grid_constant__ ProbeParams p) {
  constexpr int HALF = DEPTH / 2;
  extern __shared__ __align__(16) uint8_t smem[];
  int32_t* prefix = reinterpret_cast<int32_t*>(smem);
  int32_t* rows = prefix + kMaxE;
  const int E = p.g.num_experts;
  for (int i = threadIdx.x; i <= E; i += blockDim.x) {
    prefix[i] = __ldg(p.seg_prefix + i);
    rows[i] = min(max(__ldg(p.g.offsets + i), 0), p.g.max_rows);
  }
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
    WarpQ& wq = warp_q<WARPS>(smem);
    wq.head = wq.tail = 0;
    wq.next_item = -1;
    wq.lw_pos = -1;
  }
  __syncthreads();  // the only CTA-wide step

  Cursor cur = load_next<WARPS>(p, smem);
  uint4 ring_c[DEPTH];
  uint2 ring_s[DEPTH];
  uint32_t dep = 0;
  auto issue = [&](uint4& rc, uint2& rs) {
    if (cur.left == 0) cur = load_next<WARPS>(p, smem);
    if (cur.left > 0) {
      rc = ldg_stream_v4(cur.lc + dep);
      rs = ldg_stream_v2(cur.ls + dep);
      if (PF) prefetch_l1(p.act_frag + cur.la);
      cur.lc += 512;
      cur.ls += 64;
      cur.la += 128;
      --cur.left;
    }
  };
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    ring_c[d] = make_uint4(0, 0, 0, 0);
    ring_s[d] = make_uint2(0, 0);
  }
#pragma unroll
  for (int d = 0; d < HALF; ++d) issue(ring_c[d], ring_s[d]);

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  MathPiece pc = math_next<WARPS>(p, smem, make_float4(0, 0, 0, 0), 0);
  auto step = [&](uint4& words, uint2& sc) {
    // B fragments of steps 2h, 2h + 1 (16 bytes): loaded half by half, as the stream kernel's
    // ldmatrix, so that only four registers of them are live at a time
    const uint4* ap = reinterpret_cast<const uint4*>(p.act_frag + pc.act);
    uint4 bh = __ldg(ap);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      if (s == 2) bh = __ldg(ap + 1);
      const uint32_t w = s == 0 ? words.x : s == 1 ? words.y : s == 2 ? words.z : words.w;
      const uint32_t sw = s < 2 ? sc.x : sc.y;
      const uint32_t pair = __byte_perm(sw, 0u, (s & 1) ? 0x4342u : 0x4140u);
      uint32_t a[4];
      dequant_fragment(w, pair * p.g.scale_mul + p.g.scale_add, a);
      const uint32_t b0 = (s & 1) ? bh.z : bh.x;
      const uint32_t b1 = (s & 1) ? bh.w : bh.y;
      mma_bf16_16816(acc, a, b0, b1);
    }
    pc.act += 128;
    --pc.cleft;
  };
  bool alive = pc.cleft > 0;
  while (alive) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      if (pc.cleft == 0) {
        pc = math_next<WARPS>(p, smem, make_float4(acc[0], acc[1], acc[2], acc[3]), 1);
        acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
        if (pc.cleft == 0) {
          alive = false;
          break;
        }
      }
      if (d % HALF == 0) {
        const int other = d < HALF ? HALF : 0;
        dep = ring_s[d].x & (static_cast<uint32_t>(p.g.k) & 63u);
#pragma unroll
        for (int j = 0; j < HALF; ++j) issue(ring_c[other + j], ring_s[other + j]);
      }
      step(ring_c[d], ring_s[d]);
    }
  }
  // mode 1: the last warp done claiming resets the claim counter for the next launch
  if (p.mode == 1) {
    __syncwarp();
    if (lane == 0) {
      const int W = gridDim.x * (blockDim.x >> 5);
      if (atomicAdd(p.claim + 1, 1) == W - 1) {
        p.claim[0] = 0;
        p.claim[1] = 0;
      }
    }
  }
}

// natural bf16 rows [rows][K] -> fragment order (see ProbeParams::act_frag)
__global__ void to_fragment_order(const uint32_t* x, uint32_t* y, int rows, int K) {
  const int Kc = K / 64;
  const int64_t total = static_cast<int64_t>(rows) * Kc * 32;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t rc = i / 32;
    const int w = static_cast<int>(i % 32), t = w / 8, s = (w % 8) / 2, h = w % 2;
    const int64_t r = rc / Kc, c = rc % Kc;
    y[i] = x[r * (K / 2) + c * 32 + s * 8 + h * 4 + t];
  }
}

struct KernelCfg {
  const char* name;
  void (*fn)(ProbeParams);
  int warps, ctas;
};
const KernelCfg kKernels[] = {
    {"w20_d8_c1", warp_stream_kernel<20, 8, 1, 0>, 20, 1},
    {"w20_d8_c1_pf", warp_stream_kernel<20, 8, 1, 1>, 20, 1},
    {"w12_d4_c2", warp_stream_kernel<12, 4, 2, 0>, 12, 2},
    {"w12_d4_c2_pf", warp_stream_kernel<12, 4, 2, 1>, 12, 2},
    {"w24_d4_c1_pf", warp_stream_kernel<24, 4, 1, 1>, 24, 1},
    {"w16_d8_c1", warp_stream_kernel<16, 8, 1, 0>, 16, 1},
    {"w16_d8_c1_pf", warp_stream_kernel<16, 8, 1, 1>, 16, 1},
};

struct Shape {
  const char* name;
  int E, top_k;
  int64_t n, k;
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 20, only_shape = -1, only_mode = -1, only_s = -1;
  int64_t only_t = -1;
  std::string only_kernel;
  for (int i = 1; i + 1 < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps") reps = std::atoi(argv[++i]);
    else if (a == "--shape") only_shape = std::atoi(argv[++i]);
    else if (a == "--tokens") only_t = std::atoll(argv[++i]);
    else if (a == "--kernel") only_kernel = argv[++i];
    else if (a == "--mode") only_mode = std::atoi(argv[++i]);
    else if (a == "--pieces") only_s = std::atoi(argv[++i]);
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  cudaStream_t st;
  FP4MOE_CUDA_CHECK(cudaStreamCreate(&st));
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const bench::Ceilings ceil = bench::measure_ceilings(st);
  std::printf("GPU %s, %d SMs; read ceiling %.2f TB/s (same run)\n", prop.name, prop.multiProcessorCount,
              ceil.stream_read_tbps);
  const Shape shapes[] = {
      {"qwen3-30b GEMM1 (as plain)", 128, 8, 1536, 2048}, {"qwen3-30b GEMM2", 128, 8, 2048, 768},
      {"gpt-oss-120b GEMM1 (as plain)", 128, 4, 5760, 2880}, {"gpt-oss-120b GEMM2", 128, 4, 2880, 2880},
      {"glm-5 GEMM1 (as plain)", 256, 8, 4096, 6144}, {"glm-5 GEMM2", 256, 8, 6144, 2048},
  };
  const int64_t tokens[] = {1, 8, 32};
  for (const KernelCfg& kc : kKernels) {
    FP4MOE_CUDA_CHECK(cudaFuncSetAttribute(kc.fn, cudaFuncAttributePreferredSharedMemoryCarveout, 10));
  }
  for (int si = 0; si < static_cast<int>(std::size(shapes)); ++si) {
    const Shape& sh = shapes[si];
    if (only_shape >= 0 && si != only_shape) continue;
    const int E = sh.E;
    const int64_t n = sh.n, k = sh.k, Kc = k / 64, MT = n / 16;
    const size_t cb = repacked_codes_bytes(n, k), sb = repacked_scales_bytes(n, k);
    DeviceBuffer<uint8_t> dc(cb * E), ds(sb * E), codes(cb * E), scales(sb * E);
    bench::fill_random_bytes(dc.get(), dc.bytes(), 11, st);
    bench::fill_random_e4m3_scales(ds.get(), ds.size(), 12, st);
    repack_nvfp4_weights_device(dc.get(), ds.get(), E, n, k, false, codes.get(), scales.get(), st);
    std::vector<float> gsc(E);
    for (int e = 0; e < E; ++e) gsc[e] = 1.0f / 64.0f * (1.0f + 0.01f * static_cast<float>(e % 7));
    DeviceBuffer<float> gs(gsc);
    GroupedWeightsView view;
    view.num_experts = E;
    view.n = n;
    view.k = k;
    view.codes = codes.get();
    view.scales = scales.get();
    view.global_scale = gs.get();
    for (int64_t T : tokens) {
      if (only_t >= 0 && T != only_t) continue;
      const auto counts = bench::random_expert_counts(T, E, sh.top_k, 1000 + static_cast<uint64_t>(T));
      std::vector<int32_t> off(E + 1, 0), segp(E + 1, 0);
      for (int e = 0; e < E; ++e) {
        off[e + 1] = off[e] + counts[e];
        segp[e + 1] = segp[e] + (counts[e] + 7) / 8;
      }
      const int rows = off[E], segs = segp[E];
      const int active = static_cast<int>(std::count_if(counts.begin(), counts.end(), [](int c) { return c > 0; }));
      const double wbytes = active * double(n * k) * (0.5 + 1.0 / 16.0);
      DeviceBuffer<int32_t> d_off(off), d_segp(segp);
      DeviceBuffer<__nv_bfloat16> act(rows * k), ref(rows * n), out(rows * n);
      DeviceBuffer<uint8_t> frag(rows * k * 2);
      DeviceBuffer<float> rs(rows);
      bench::fill_random_bf16(act.get(), act.size(), 1.0f, 21 + T, st);
      {
        std::vector<float> r(rows);
        for (int i = 0; i < rows; ++i) r[i] = 0.125f * (1.0f + 0.03f * (i % 5));
        rs.upload(r);
      }
      to_fragment_order<<<264, 256, 0, st>>>(reinterpret_cast<const uint32_t*>(act.get()),
                                             reinterpret_cast<uint32_t*>(frag.get()), rows, static_cast<int>(k));
      FP4MOE_CUDA_CHECK_LAUNCH();
      // the library's stream configs on the same problem: the reference output and the times to beat
      GroupedGemmArgs a;
      a.act = act.get();
      a.expert_offsets = d_off.get();
      a.max_rows = rows;
      a.row_scale = rs.get();
      a.out = ref.get();
      a.epilogue = GemmEpilogue::kPlain;
      std::printf("\n%s N=%lld K=%lld, T=%lld: %d active experts, %d segments, %lld units, %.1f MB of weights\n",
                  sh.name, (long long)n, (long long)k, (long long)T, active, segs, (long long)(segs * MT), wbytes / 1e6);
      auto report = [&](const std::string& what, double us) {
        std::printf("  %-34s %8.1f us  %5.2f TB/s  %.3f x read\n", what.c_str(), us, wbytes / us / 1e6,
                    wbytes / us / 1e6 / ceil.stream_read_tbps);
      };
      for (const char* cname : {"stream_bt8_w20_d8_c1", "stream_bt8_w12_d4_c2"}) {
        if (!only_kernel.empty() && only_kernel != cname) continue;
        TileConfig c{};
        for (const TileConfig& x : kGemmConfigs)
          if (x.name() == cname) c = x;
        const double us = bench::time_graph_us([&](cudaStream_t s) { grouped_gemm_nvfp4(view, a, c, s); }, st, reps);
        report(std::string("library ") + cname, us);
      }
      // the reference: a pipeline config (bk 64 where K is not a multiple of 128)
      grouped_gemm_nvfp4(view, a, k % 128 == 0 ? TileConfig{64, 16, 128, 8, 4} : TileConfig{128, 32, 64, 8, 8}, st);
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st));
      const std::vector<__nv_bfloat16> href = ref.download();
      float refmax = 0.f;
      for (auto v : href) refmax = std::max(refmax, std::fabs(__bfloat162float(v)));

      const int U = segs * static_cast<int>(MT);
      for (const KernelCfg& kc : kKernels) {
        if (!only_kernel.empty() && only_kernel != kc.name) continue;
        const int grid = prop.multiProcessorCount * kc.ctas;
        const int W = grid * kc.warps;
        const size_t smem = 2 * kMaxE * 4 + kc.warps * sizeof(WarpQ);
        for (int mode = 0; mode < 2; ++mode) {
          if (only_mode >= 0 && mode != only_mode) continue;
          for (int S : {1, 2, 4, 8}) {
            if (only_s >= 0 && S != only_s) continue;
            if (mode == 0 && S != 1) continue;
            if (mode == 1 && (Kc / S < 8 && S > 1)) continue;
            const int64_t slots = mode == 0 ? 2 * int64_t{W} : int64_t{U} * S;
            DeviceBuffer<float> part(slots * 128);
            DeviceBuffer<int32_t> cnt(U), claim(2);
            FP4MOE_CUDA_CHECK(cudaMemsetAsync(cnt.get(), 0, cnt.bytes(), st));
            FP4MOE_CUDA_CHECK(cudaMemsetAsync(claim.get(), 0, claim.bytes(), st));
            FP4MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0, out.bytes(), st));
            ProbeParams pp{};
            pp.g.codes = codes.get();
            pp.g.scales = scales.get();
            pp.g.global_scale = gs.get();
            pp.g.act = act.get();
            pp.g.offsets = d_off.get();
            pp.g.row_scale = rs.get();
            pp.g.out = out.get();
            pp.g.num_experts = E;
            pp.g.n = static_cast<int>(n);
            pp.g.k = static_cast<int>(k);
            pp.g.max_rows = rows;
            pp.g.scale_mul = layout::kNvfp4ScaleMul;
            pp.g.scale_add = layout::kNvfp4ScaleAdd;
            pp.act_frag = frag.get();
            pp.seg_prefix = d_segp.get();
            pp.partial = part.get();
            pp.mt_count = cnt.get();
            pp.claim = claim.get();
            pp.S = S;
            pp.mode = mode;
            auto launch = [&](cudaStream_t s) {
              kc.fn<<<grid, kc.warps * 32, smem, s>>>(pp);
              FP4MOE_CUDA_CHECK_LAUNCH();
            };
            launch(st);
            FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st));
            std::vector<__nv_bfloat16> h = out.download();
            float dmax = 0.f;
            for (size_t i = 0; i < h.size(); ++i)
              dmax = std::max(dmax, std::fabs(__bfloat162float(h[i]) - __bfloat162float(href[i])));
            const double us = bench::time_graph_us(launch, st, reps);
            // twice more: the claim and arrival counters must come back to zero, results bit-identical
            launch(st);
            FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st));
            const std::vector<__nv_bfloat16> h2 = out.download();
            const bool same = std::memcmp(h.data(), h2.data(), h.size() * 2) == 0;
            char label[96];
            std::snprintf(label, sizeof label, "probe %s %s%s", kc.name, mode == 0 ? "static" : "claimed S=",
                          mode == 0 ? "" : std::to_string(S).c_str());
            report(label, us);
            std::printf("      max |diff| to the library %.3g (of max |out| %.3g)%s\n", dmax, refmax,
                        same ? "" : "  NOT BIT-IDENTICAL ON RERUN");
          }
        }
      }
    }
  }
  return 0;
}

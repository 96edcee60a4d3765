// sm90-nvfp4-grouped, tma configs (TileConfig::mma == 3): the kernel for ~8 or more rows per expert and
// prefill. Device code only; the host launcher is src/sm80_nvfp4_grouped_gemm.cu (shared with the other
// kinds), the tensor maps are encoded in src/sm90_tensor_maps.cu.
//
// Why a third kernel (docs/kernel-design.md): the pipeline configs' wgmma path has every warp issue
// cp.asyncs and dequantize, a CTA barrier per stage, and at most two wgmmas in flight; at ~32 rows per
// expert it also pads its 64-token tile. Here:
// - A producer warpgroup (one elected thread) fills a ring of `stages` shared-memory stages with TMA
//   tensor copies: one copy for the stage's codes (bn/16 m-tile rows x bk/64 chunks of 512 B), one for
//   its scales, one per 64-wide slab of activation rows (128-byte swizzle: wgmma's K-major layout).
//   Each stage completes on its "full" mbarrier by transaction bytes; the consumers release it on its
//   "empty" mbarrier. The producer runs ahead across tiles, so the next tile's weights stream during
//   the current tile's epilogue. setmaxnreg hands the producer's registers to the consumers.
// - Two (or four) consumer warpgroups split the tile's bn features (wm() m64 tiles each). Per stage a warp reads
//   its codes and scales from shared memory once, dequantizes each k16 step into its own A registers and
//   issues its wgmmas; a step's A registers are rewritten only after the wgmma that read them retired
//   (wgmma.wait_group<NB - 1>, TmaConsumer::NB), so up to a stage of wgmmas is in flight under the
//   dequantization.
// - The instruction's N follows the tile's rows: the narrowest of a short list per token tile
//   (tma_widths, one branch per tile), so an expert of 33 rows in a 64-token tile costs a 40-wide
//   wgmma, not a 64-wide one. The activation copy is that width rounded up to bt/4 rows (one tensor map
//   per box height).
// - Work tiles (expert, feature tile, token tile) and the epilogue are the pipeline kernel's
//   (sm80_nvfp4_grouped_gemm.cuh): the same rounding, stores from registers. Only an expert's last two
//   token tiles are cut differently, where that narrows their widths (TmaTokenTiles below). The plain epilogue's row
//   scales are copied into shared memory by each consumer warp before the tile's K loop, so the tile
//   end waits on no global load for them.
// - Work tiles are taken in arrival order where the caller passes a counter (GroupedGemmArgs::tile_counter;
//   the layer always does): a CTA's first tile is its index, and its producer claims each later one with
//   an atomicAdd as it starts the tile before (the round trip passes under that tile's K loop). With
//   static shares the CTAs that started late or drew slow tiles finished last, and at prefill whole SMs
//   idled at the end (bench/NOTES.md, eighth session). The producer hands each index to the consumers
//   through a two-slot ring of its own (TmaTileRing, tile_config.hpp), not through the stages: when the
//   index rode in the slot of the tile's first stage, the producer's per-stage path carried the handoff
//   and the GEMMs ran 7-19% slower at T = 1024..4096 even with static shares (twelfth session). Each
//   tile is computed whole by one CTA, so results do not depend on who claimed it. The last CTA to
//   finish claiming zeroes the counter for the next launch. Without a counter every role computes its
//   static share (tile = CTA + i x grid) and the ring is unused.
#pragma once
#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>

#include "fp4moe/kernels/nvfp4_dequant.cuh"
#include "fp4moe/kernels/pdl.cuh"
#include "fp4moe/kernels/sm80_nvfp4_grouped_gemm.cuh"
#include "fp4moe/kernels/sm90_tma.cuh"
#include "fp4moe/kernels/sm90_wgmma.cuh"
#include "fp4moe/tile_config.hpp"

namespace fp4moe::kernels {

// A work tile of `rows` rows runs the wgmma width tma_width_for(cfg, rows) (tile_config.hpp: the
// narrowest of a short list per config), and copies that width rounded up to bt/4 rows: copy index w of
// the four boxes bt/4, bt/2, 3bt/4, bt (one tensor map each). Both roles go through tma_with_width: the
// producer sizes the copy and its transaction bytes by the width, the consumers run the K loop
// instantiated for it (one instantiation per listed width; ptxas serializes the wgmmas past a few of
// them: tile_config.hpp). f(integral_constant<int, N>) runs with N = the tile's width; the list is
// unrolled (a loop over it kept the list in local memory).
template <TileConfig CFG, class F, int... I>
__device__ __forceinline__ void tma_with_width_impl(int rows, F& f, std::integer_sequence<int, I...>) {
  constexpr TmaWidths kW = tma_widths(CFG);
  (void)((rows <= kW.w[I] ? (f(std::integral_constant<int, kW.w[I]>{}), true) : false) || ...);
}
template <TileConfig CFG, class F>
__device__ __forceinline__ void tma_with_width(int rows, F&& f) {
  tma_with_width_impl<CFG>(rows, f, std::make_integer_sequence<int, tma_widths(CFG).n>{});
}

// The tma configs' token tiles: the last two of an expert share its rest at the cut with the narrowest
// pair of widths (tma_token_tile, tile_config.hpp), read from the launcher's table of cuts.
template <TileConfig CFG>
struct TmaTokenTiles {
  const TmaCutTable& cuts;
  __device__ __forceinline__ TokenTile operator()(int n, int tt) const {
    constexpr int BT = CFG.bt;
    const int nt = (n + BT - 1) / BT;
    if (tt < nt - 2 || nt < 2) return {tt * BT, min(BT, n - tt * BT)};
    const int base = (nt - 2) * BT;
    const int a = cuts.cut8[n - base - BT - 1] * 8;
    return tt == nt - 2 ? TokenTile{base, a} : TokenTile{base + a, n - base - a};
  }
};

template <int BN, int BT, int BK, int STAGES, int WARPS, int CTAS, int EPI>
struct TmaConsumer {
  static constexpr TileConfig kCfg{BN, BT, BK, STAGES, WARPS, 3, CTAS};
  static constexpr GemmSmemLayout kL = gemm_smem_layout(kCfg);
  static constexpr int WM = BN / (16 * WARPS);  // m16 tiles per warp = m64 tiles per warpgroup
  static constexpr int KC = BK / 64;            // 64-wide chunks per stage
  static constexpr int KS = BK / 16;            // k16 steps per stage
  static constexpr int NT = BT / 8;
  // A-fragment register sets: a k16 step's set is rewritten NB steps later, after the wgmma that read it
  // retired (wgmma.wait_group<NB - 1>), so NB - 1 wgmma groups stay in flight under the dequantization.
  // A whole stage (KS sets) where registers allow; two m64 tiles per warpgroup double the accumulators,
  // and ptxas serializes the wgmmas (C7512) unless the sets shrink to four.
  static constexpr int NB = WM == 2 ? 4 : KS;

  // One work tile's K loop with wgmma width N; returns with the accumulators complete (all retired).
  // stage/phase: the ring position, carried across tiles.
  template <int N>
  __device__ __forceinline__ static void mainloop(const GroupedGemmParams& p, const uint8_t* smem, uint32_t smem_base,
                                                  uint32_t bar_full, uint32_t bar_empty, int KT, int cw,
                                                  float (&acc)[WM][NT][4], int& stage, uint32_t& phase) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int wg = cw >> 2, wq = cw & 3;
    const uint32_t scale_mul = p.scale_mul, scale_add = p.scale_add;
    uint32_t a[NB][WM][4];
    int prev = -1;  // the stage whose wgmmas may still be in flight
    for (int kt = 0; kt < KT; ++kt) {
      mbar_wait(bar_full + 8 * stage, phase);
      const uint32_t st = smem_base + static_cast<uint32_t>(stage) * static_cast<uint32_t>(kL.stage_bytes);
      // The stage's descriptor, once: a step's slab offset adds to its 14-bit address field (addr >> 4)
      // without a carry, as shared addresses stay below 2^18; built per step, ptxas spent five uniform
      // instructions on each (mask, shift, or, two moves) in a loop that issues ~100-200 per stage.
      const uint64_t desc0 = wgmma_desc_k_major_sw128(st);
      const uint8_t* st_codes = smem + stage * kL.stage_bytes + kL.codes_offset;
      const uint8_t* st_scales = smem + stage * kL.stage_bytes + kL.scales_offset;
      // plain loads: mbar_wait's memory clobber keeps them after the wait, and the completed
      // transaction makes the TMA's writes visible to them
      uint4 words[WM][KC];
      uint2 sc[WM][KC];
#pragma unroll
      for (int i = 0; i < WM; ++i) {
        const int mt = (wg * WM + i) * 4 + wq;  // this warp's m16 tile within the CTA tile
#pragma unroll
        for (int c = 0; c < KC; ++c) {
          words[i][c] = *reinterpret_cast<const uint4*>(st_codes + ((mt * KC + c) * 32 + lane) * 16);
          sc[i][c] = *reinterpret_cast<const uint2*>(st_scales + (mt * KC + c) * 64 + g * 8);
        }
      }
#pragma unroll
      for (int q = 0; q < KS; ++q) {
        // a[q % NB] was read by the group NB steps back: retire it (the NB - 1 later groups run on)
        wgmma_wait<NB - 1>();
        // every group of the previous stage has retired: its shared memory may be refilled. A predicated
        // arrive, not a branch: control flow between a wgmma and its wait makes ptxas serialize the
        // wgmmas (C7513)
        if (q == NB - 1) mbar_arrive_if(bar_empty + 8 * prev, prev >= 0 && lane == 0);
        const int c = q >> 2, j = q & 3;
#pragma unroll
        for (int i = 0; i < WM; ++i) {
          const uint32_t w = j == 0 ? words[i][c].x : j == 1 ? words[i][c].y : j == 2 ? words[i][c].z : words[i][c].w;
          const uint32_t sw = j < 2 ? sc[i][c].x : sc[i][c].y;
          // bytes (row g, row g+8) of k16 block j -> the two 16-bit halves
          dequant_fragment(w, decode_scale_pair(__byte_perm(sw, 0u, (j & 1) ? 0x4342u : 0x4140u), scale_mul, scale_add),
                           a[q % NB][i]);
        }
        wgmma_fence();
        const uint64_t desc = desc0 + static_cast<uint64_t>((c * BT * 128 + j * 32) >> 4);
#pragma unroll
        for (int i = 0; i < WM; ++i) wgmma_rs<N>(acc[i], a[q % NB][i], desc, (kt == 0 && q == 0) ? 0 : 1);
        wgmma_commit();
      }
      prev = stage;
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1u;
      }
    }
    wgmma_wait<0>();
    mbar_arrive_if(bar_empty + 8 * prev, prev >= 0 && lane == 0);
  }
};

template <int BN, int BT, int BK, int STAGES, int WARPS, int CTAS, int EPI>
__global__ void __launch_bounds__((WARPS + 4) * 32, CTAS > 0 ? CTAS : 1)
    sm90_nvfp4_grouped_tma_kernel(const __grid_constant__ GroupedGemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = TmaConsumer<BN, BT, BK, STAGES, WARPS, CTAS, EPI>;
  static_assert(tile_config_well_formed(C::kCfg), "tma config is malformed: see tile_config_well_formed()");
  constexpr GemmSmemLayout kL = C::kL;
  constexpr TileConfig kCfg = C::kCfg;
  constexpr int MT = BN / 16;
  constexpr int KC = BK / 64;
  static_assert(kL.stage_bytes % 1024 == 0 && (BT * 128) % 1024 == 0,
                "activation slabs must start on the 1024-byte period of the 128-byte swizzle");

  // Programmatic dependent launch: the offsets and activation rows are the predecessor's results,
  // visible after pdl_wait. Where the offsets were final before the predecessor began (GEMM2's, which
  // GEMM1 waited for: p.weights_before_wait), the bt 32 configs build their schedule before the wait,
  // and the producer requests its first tile's first stages of weights, then waits (below); the other
  // threads wait after the schedule's barrier. Nothing that reads the predecessor's output, or the tile
  // counter, runs before a wait. Only the bt 32 configs (GEMM2 at T = 96..512 on the presets) carry the
  // path: compiled into the others, it changed their code even where it did not run, and the bt 128
  // kernels ran 4-6% slower at T = 2048 (bench/NOTES.md, twenty-first session). The others' code is the
  // same as without it, instruction for instruction (checked with cuobjdump -sass).
  constexpr bool kEarly = BT <= 32;
  if (!kEarly || !p.weights_before_wait) {
    pdl_wait();
    pdl_launch_dependents();
  }

  extern __shared__ __align__(128) uint8_t smem[];  // 1024-byte alignment: checked below
  int32_t* s_prefix = reinterpret_cast<int32_t*>(smem + kL.sched_offset);
  const uint32_t smem_base = smem_u32(smem);
  const uint32_t bar_full = smem_base + static_cast<uint32_t>(kL.bar_offset);
  const uint32_t bar_empty = bar_full + 8 * STAGES;
  // Claimed tiles' handoff (TmaTileRing, tile_config.hpp): kTileRing index slots, then their full and
  // empty mbarriers, in the scheduler's reserved tail after the prefix and total.
  constexpr int kTileRing = TmaTileRing::kSlots;
  constexpr uint32_t kTileReaders = 32 * WARPS;
  const uint32_t tile_slots = smem_base + static_cast<uint32_t>(kL.sched_offset + TmaTileRing::kOffset);
  const uint32_t tile_full = tile_slots + TmaTileRing::kFullOffset;
  const uint32_t tile_empty = tile_slots + TmaTileRing::kEmptyOffset;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  // K stages per tile, the last one partial where K is not a multiple of BK (K is a multiple of 64): its
  // copies reach past K, and TMA fills what lies outside the maps' K extent with zeros and still counts
  // the whole box in the transaction bytes. Zero codes dequantize to +0 whatever the scale (a zero scale
  // byte decodes to a finite value in both formats), and the activation slabs past K are zeros too, so
  // the tail adds +0 products and the stages stay one size (docs/kernel-design.md, "K tails").
  const int KT = (p.k + BK - 1) / BK;

  if (tid == 0) {
    if ((smem_base & 1023u) != 0) __trap();  // the swizzled slabs need a 1024-byte aligned base
#pragma unroll 1
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar_full + 8 * s, 1);          // the producer's arrive (+ transaction bytes)
      mbar_init(bar_empty + 8 * s, WARPS);     // one arrive per consumer warp
    }
#pragma unroll
    for (int s = 0; s < kTileRing; ++s) {
      mbar_init(tile_full + 8 * s, 1);                // the producer's arrive after it wrote the index
      mbar_init(tile_empty + 8 * s, kTileReaders);    // every consumer lane's arrive after it read it
    }
    mbar_fence_init();
  }
  __syncthreads();
  // Register reallocation splits the roles here, each setmaxnreg in a branch that holds only its role's
  // code: ptxas allocates code before the split within the smaller budget (a schedule computed there
  // spilled) and ignores a setmaxnreg whose region reaches code that needs more (C7507). So the
  // scheduler's prefix is built after the split by the first consumer warp; named barrier 1 (the
  // producer's first warp and every consumer warp) publishes it. Registers per thread after the split:
  // tma_producer_regs / tma_consumer_regs (tile_config.hpp).

  if (warp < 4) {
    // ---- producer warpgroup ----
    setmaxnreg_dec<tma_producer_regs(WARPS)>();
    if (warp != 0) return;
    named_barrier_sync(1, 32 + WARPS * 32);  // the scheduler's prefix is written
    if (tid != 0) return;
    tma_prefetch_map(&p.tma.codes);
    tma_prefetch_map(&p.tma.scales);
    const uint64_t pol_w = l2_policy_evict_first(), pol_a = l2_policy_evict_last();
    int stage = 0;
    uint32_t phase = 0;
    // Tile w, decoded, and its expert's global scales (plain: one; SwiGLU: gate and up, the gate's where the
    // launch has no up scale): the scales' loads go out before the expert's offsets are read, so that one
    // round trip covers both. Model weights, final before any predecessor, so also before the wait.
    auto decode = [&](int w, float& g, float& g_up) {
      const int lo = find_expert(w, s_prefix, p.num_experts + (p.x_offsets != nullptr ? 1 : 0));
      const bool x = lo >= p.num_experts;
      const float* gs = x ? p.x_global_scale : p.global_scale + lo;
      g = __ldg(gs);
      g_up = g;
      if constexpr (EPI != kEpiPlain) {
        const float* gup = x ? p.x_global_scale_up : (p.global_scale_up != nullptr ? p.global_scale_up + lo : nullptr);
        if (gup != nullptr) g_up = __ldg(gup);
      }
      return decode_tile_of<BT>(w, lo, s_prefix, p, TmaTokenTiles<kCfg>{p.tma_cut});
    };
    // Tile ti (decoded) into ring slot ti % kTileRing (TmaTileSlot), once the consumers have read the tile
    // that slot held before (tile ti - kTileRing), and its global scales into scale slot ti % kScaleSlots;
    // then published on the slot's full barrier. end: expert -1. (The scales went by cp.async first,
    // completed on the full barrier with cp.async.mbarrier.arrive: compute-sanitizer's synccheck reported
    // that arrive as a missing wait.)
    auto hand_over = [&](int ti, const WorkTile& t, float g, float g_up, bool end) {
      const uint32_t slot = static_cast<uint32_t>(ti & (kTileRing - 1));
      const uint32_t at = tile_slots + TmaTileRing::kSlotBytes * slot;
      mbar_wait(tile_empty + 8 * slot, ((ti / kTileRing) & 1) ^ 1u);  // a fresh barrier passes parity 1
      if (end) {
        st_shared_s32(at, -1);
      } else {
        st_shared_v4_s32(at, t.expert, t.ftile, t.row0, t.rows);
        st_shared_v2_f32(tile_slots + TmaTileRing::kScaleOffset +
                             static_cast<uint32_t>(sizeof(TmaScaleSlot)) *
                                 static_cast<uint32_t>(ti & (TmaTileRing::kScaleSlots - 1)),
                         g, g_up);
      }
      mbar_arrive_if(tile_full + 8 * slot, true);
    };
    // w: the tile to fill; the count is reread from shared memory per tile, not held
    int w = static_cast<int>(blockIdx.x);
    int ti = 0;  // tiles filled
    if constexpr (kEarly) {
      // Weights before the wait (p.weights_before_wait, the narrow tiles only, see the kernel's top): the
      // first tile here, whole. Its first `pre` stages (fresh barriers) expect their bytes and get their
      // weights' copies before the wait, under the predecessor's tail; their activation slabs (its
      // output) after it; the tile counter is claimed after it; then the tile's other stages. The loop
      // below continues with the next tile. Written out here, its stage loop a copy of the loop's, rather
      // than as a branch in the loop or a body shared with it: with 24 registers, state of this tile held
      // into the loop spilled the claimed index, and any restructuring of the loop (a shared lambda
      // included) changed the code of the configs without this path, whose bt 128 kernels then ran 4-6%
      // slower at T = 2048 (bench/NOTES.md, twenty-first session).
      if (p.weights_before_wait) {
        if (KT > 0 && w < s_prefix[kMaxExperts + 1]) {
          float g, g_up;
          const WorkTile t = decode(w, g, g_up);
          if (p.tile_counter != nullptr) hand_over(ti, t, g, g_up, false);
          int wsel = 3;
          tma_with_width<kCfg>(t.rows, [&](auto width) { wsel = (decltype(width)::value - 1) / (BT / 4); });
          // a feature tile past N copies only its expert's rows (tail maps; tma_tail_mtiles)
          const int tail = tma_tail_mtiles(t.ftile, MT, p.n);
          const uint32_t tx = tma_stage_tx_bytes(kCfg, (wsel + 1) * (BT / 4), tail);
          const GroupedGemmTmaMaps& maps = p.tma;
          const CUtensorMap* m_codes =
              tail > 0 ? (t.extra ? &maps.x_codes_tail : &maps.codes_tail) : (t.extra ? &maps.x_codes : &maps.codes);
          const CUtensorMap* m_scales =
              tail > 0 ? (t.extra ? &maps.x_scales_tail : &maps.scales_tail) : (t.extra ? &maps.x_scales : &maps.scales);
          const CUtensorMap* m_act = (t.extra ? p.tma.x_act : p.tma.act) + wsel;
          const int mrow = (t.extra ? 0 : t.expert * (p.n / 16)) + t.ftile * MT;
          const int pre = min(STAGES, KT);
#pragma unroll 1
          for (int kt = 0; kt < pre; ++kt) {
            const uint32_t full = bar_full + 8 * kt;
            mbar_arrive_expect_tx(full, tx);
            const uint32_t st = smem_base + static_cast<uint32_t>(kt) * static_cast<uint32_t>(kL.stage_bytes);
            tma_load_2d(st + static_cast<uint32_t>(kL.codes_offset), m_codes, kt * BK, mrow, full, pol_w);
            tma_load_2d(st + static_cast<uint32_t>(kL.scales_offset), m_scales, kt * (BK / 8), mrow, full, pol_w);
          }
          pdl_wait();
          pdl_launch_dependents();
#pragma unroll 1
          for (int kt = 0; kt < pre; ++kt) {
            const uint32_t st = smem_base + static_cast<uint32_t>(kt) * static_cast<uint32_t>(kL.stage_bytes);
#pragma unroll
            for (int c = 0; c < KC; ++c)
              tma_load_2d(st + c * BT * 128, m_act, kt * BK + c * 64, t.row0, bar_full + 8 * kt, pol_a);
          }
          const int next = p.tile_counter != nullptr ? static_cast<int>(gridDim.x) + atomicAdd(p.tile_counter, 1)
                                                     : w + static_cast<int>(gridDim.x);
          stage = pre == STAGES ? 0 : pre;
          phase = pre == STAGES ? 1u : 0u;
#pragma unroll 1
          for (int kt = pre; kt < KT; ++kt) {
            mbar_wait(bar_empty + 8 * stage, phase ^ 1u);
            const uint32_t full = bar_full + 8 * stage;
            mbar_arrive_expect_tx(full, tx);
            const uint32_t st = smem_base + static_cast<uint32_t>(stage) * static_cast<uint32_t>(kL.stage_bytes);
            tma_load_2d(st + static_cast<uint32_t>(kL.codes_offset), m_codes, kt * BK, mrow, full, pol_w);
            tma_load_2d(st + static_cast<uint32_t>(kL.scales_offset), m_scales, kt * (BK / 8), mrow, full, pol_w);
#pragma unroll
            for (int c = 0; c < KC; ++c) tma_load_2d(st + c * BT * 128, m_act, kt * BK + c * 64, t.row0, full, pol_a);
            if (++stage == STAGES) {
              stage = 0;
              phase ^= 1u;
            }
          }
          w = next;
          ++ti;
        } else {
          pdl_wait();  // no tile: this grid's completion must still imply the predecessor's
          pdl_launch_dependents();
        }
      }
    }
#pragma unroll 1
    for (; KT > 0 && w < s_prefix[kMaxExperts + 1]; ++ti) {
      // Claimed tiles: claim the next one now, then hand this one over: nothing in this tile's K loop
      // waits for the atomic (`next` is first read after it), so its ~1 us round trip passes under it.
      const int next = p.tile_counter != nullptr ? static_cast<int>(gridDim.x) + atomicAdd(p.tile_counter, 1)
                                                 : w + static_cast<int>(gridDim.x);
      // the expert count formed at its use, not held: held (with `next` and ti), it spilled a register
      float g, g_up;
      const WorkTile t = decode(w, g, g_up);
      if (p.tile_counter != nullptr) hand_over(ti, t, g, g_up, false);
      // the consumers' width, and the activation map whose box has that many rows
      int wsel = 3;
      tma_with_width<kCfg>(t.rows, [&](auto width) { wsel = (decltype(width)::value - 1) / (BT / 4); });
      // a feature tile past N copies only its expert's rows (tail maps; tma_tail_mtiles)
      const int tail = tma_tail_mtiles(t.ftile, MT, p.n);
      const uint32_t tx = tma_stage_tx_bytes(kCfg, (wsel + 1) * (BT / 4), tail);
      const GroupedGemmTmaMaps& maps = p.tma;
      const CUtensorMap* m_codes =
          tail > 0 ? (t.extra ? &maps.x_codes_tail : &maps.codes_tail) : (t.extra ? &maps.x_codes : &maps.codes);
      const CUtensorMap* m_scales =
          tail > 0 ? (t.extra ? &maps.x_scales_tail : &maps.scales_tail) : (t.extra ? &maps.x_scales : &maps.scales);
      const CUtensorMap* m_act = (t.extra ? p.tma.x_act : p.tma.act) + wsel;
      const int mrow = (t.extra ? 0 : t.expert * (p.n / 16)) + t.ftile * MT;  // first m-tile row of the map
#pragma unroll 1
      for (int kt = 0; kt < KT; ++kt) {
        mbar_wait(bar_empty + 8 * stage, phase ^ 1u);  // a fresh barrier passes parity 1 at once
        const uint32_t full = bar_full + 8 * stage;
        mbar_arrive_expect_tx(full, tx);
        const uint32_t st = smem_base + static_cast<uint32_t>(stage) * static_cast<uint32_t>(kL.stage_bytes);
        tma_load_2d(st + static_cast<uint32_t>(kL.codes_offset), m_codes, kt * BK, mrow, full, pol_w);
        tma_load_2d(st + static_cast<uint32_t>(kL.scales_offset), m_scales, kt * (BK / 8), mrow, full, pol_w);
#pragma unroll
        for (int c = 0; c < KC; ++c) tma_load_2d(st + c * BT * 128, m_act, kt * BK + c * 64, t.row0, full, pol_a);
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1u;
        }
      }
      w = next;
    }
    if (p.tile_counter != nullptr) {
      // This CTA's claims are done (the last came back >= total, or it had no first tile). The last CTA
      // to get here knows no claim can follow and zeroes the counter; the grid's completion publishes
      // that to the next launch (which reads it only after its griddepcontrol.wait, or in stream order).
      // Then -1 in the next ring slot ends the consumers' loop.
      __threadfence();
      if (atomicAdd(p.tile_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        __threadfence();
        p.tile_counter[0] = 0;
        p.tile_counter[1] = 0;
      }
      hand_over(ti, WorkTile{}, 0.f, 0.f, true);
    }
    return;
  }

  // ---- consumer warpgroups ----
  setmaxnreg_inc<tma_consumer_regs(WARPS, CTAS)>();
  const int E = p.num_experts + (p.x_offsets != nullptr ? 1 : 0);
  if (warp == 4) {
    const int ftiles = (p.n + BN - 1) / BN;
    build_expert_prefix(p, E, lane, s_prefix, [&](int rows) { return ((rows + BT - 1) / BT) * ftiles; });
  }
  named_barrier_sync(1, 32 + WARPS * 32);  // the prefix is visible to the producer and every consumer
  if (kEarly && p.weights_before_wait) {  // the prefix came from final offsets; the rest reads what the predecessor wrote
    pdl_wait();
    pdl_launch_dependents();
  }
  const int cw = warp - 4;
  float acc[C::WM][C::NT][4];
  int stage = 0;
  uint32_t phase = 0;
  // The plain epilogue's row scales (GEMM2's routing weights): each consumer warp copies the tile's bt
  // of them into its own shared-memory buffer with cp.asyncs issued before the tile's K loop (no
  // register held through it) and waits for them after; its epilogue reads them from there. Loaded at
  // the tile end, even batched, they were L2 round trips with the tensor pipe idle (bench/NOTES.md). One
  // buffer per warp, not one per CTA: a shared buffer needed a barrier of all consumer warps at every
  // tile end, which cost up to 7% where the dequantization bounds the K loop (GLM-5 T = 1024). The warp
  // reads its buffer before it refills it, in program order.
  constexpr bool kStageRs = EPI == kEpiPlain;
  // The wide token tiles (prefill) end with up to 2 x bt / 8 stores per m-tile and lane while the tensor
  // pipe idles: their epilogue is the flat one (store_mtile), its scalars prefetched into L1 at the tile
  // start. Measured on the H200 against the guarded form: GEMMs at T = 4096 -1.4 to -8.7%, layer -0.7 to
  // -5.4% (bench/NOTES.md, tenth session). The narrow tiles keep the guarded form: there the flat one
  // computed n-tiles past the tile's rows and ran level to 1% slower.
  constexpr bool kFlatEpilogue = BT >= 128;
  constexpr bool kStageBias = tma_stages_bias(kCfg);  // the narrow tiles (below)
  const uint32_t rs_off = static_cast<uint32_t>(kL.rs_offset) + static_cast<uint32_t>(cw * BT * 4);
  // This warp's biases of the tile (16 per m-tile; tile_config.hpp's bias_offset), staged like the row scales:
  // loaded at the tile end they were a DRAM round trip (gpt-oss-120b's 2.9 MB of biases are cold in L2)
  // with both consumer warpgroups of a one-CTA config waiting on it: its GEMM1 ran 10% slower with them
  // than without (bench/NOTES.md, twenty-seventh session).
  const uint32_t bias_off = static_cast<uint32_t>(kL.bias_offset) + static_cast<uint32_t>(cw * C::WM * 16 * 4);
  // This warp's m-tile i of a work tile (within the expert's N): warpgroup cw / 4 holds WM m64 tiles, the
  // warp the (cw % 4)-th m16 of each.
  auto mtile_of = [&](const WorkTile& t, int i) { return t.ftile * MT + ((cw >> 2) * C::WM + i) * 4 + (cw & 3); };
#pragma unroll 1
  for (int ti = 0;; ++ti) {
    WorkTile t;
    if (p.tile_counter != nullptr) {
      // the producer's decoded tile ti (TmaTileSlot; expert -1: the end), then this lane's arrive: each
      // reading lane releases the slot itself (an arrive orders only the arriving thread's own accesses).
      // The tile's global scales stay in their own slot until the epilogue (TmaTileRing).
      const uint32_t slot = static_cast<uint32_t>(ti & (kTileRing - 1));
      mbar_wait(tile_full + 8 * slot, (ti / kTileRing) & 1);
      const int4 v = *reinterpret_cast<const int4*>(smem + kL.sched_offset + TmaTileRing::kOffset +
                                                    TmaTileRing::kSlotBytes * slot);
      mbar_arrive_if(tile_empty + 8 * slot, true);
      if (v.x < 0) break;
      t.expert = v.x;
      t.extra = v.x >= p.num_experts;
      t.ftile = v.y;
      t.row0 = v.z;
      t.rows = v.w;
    } else {
      const int w = static_cast<int>(blockIdx.x) + ti * static_cast<int>(gridDim.x);
      // the tile count reread from shared memory, not held (the bt-256 tiles' 168 registers spilled it)
      if (KT <= 0 || w >= s_prefix[kMaxExperts + 1]) break;
      t = decode_tile<BT>(w, s_prefix, p, E, TmaTokenTiles<kCfg>{p.tma_cut});
    }
    if constexpr (kStageRs) {
      __syncwarp();  // the last tile's reads of the buffer, by every lane, precede its refill
      const bool scaled = !t.extra && p.row_scale != nullptr;
#pragma unroll
      for (int r = lane; r < BT; r += 32) {
        if (scaled && r < t.rows)
          cp_async4(smem_base + rs_off + 4 * r, p.row_scale + t.row0 + r);
        else
          reinterpret_cast<float*>(smem + rs_off)[r] = 1.0f;  // rows past the tile: read, never stored
      }
      cp_async_commit();
    }
    // (the wide tiles prefetch them into L1 instead, below: staged, qwen3-30b's bt 128 GEMM1 at T = 1023 ran 3-6%
    // slower on an H100, its K loop's code moved, without biases to stage)
    const float* tile_bias = !kStageBias ? nullptr
                             : t.extra   ? p.x_bias
                                         : (p.bias != nullptr ? p.bias + static_cast<int64_t>(t.expert) * p.n : nullptr);
    if (tile_bias != nullptr) {  // uniform over the CTA (the launch's, and per set)
      if constexpr (!kStageRs) __syncwarp();  // the last tile's reads of the buffer precede its refill
      if (lane < 16 * C::WM) {
        const int mt = mtile_of(t, lane >> 4), j = lane & 15;
        const int f = EPI == kEpiPlain ? mt * 16 + j : (j < 8 ? mt * 8 + j : p.n / 2 + mt * 8 + (j - 8));
        if (mt < p.n / 16) cp_async4(smem_base + bias_off + 4 * lane, tile_bias + f);
      }
      cp_async_commit();
    }
    if (kFlatEpilogue && lane == 0) {
      // The epilogue's per-expert scalars into L1 now: loaded at the tile end, they were an L2 round trip
      // (under the K loop's TMA traffic) before its first value, with the tensor pipe idle. The pointers
      // are store_mtile's own choices, repeated here: routing store_mtile through a shared helper changed
      // the stream kernel's SASS, which no GPU has measured (bench/NOTES.md, tenth session).
      prefetch_l1(t.extra ? p.x_global_scale : p.global_scale + t.expert);
      const float* gup = t.extra ? p.x_global_scale_up
                                 : (p.global_scale_up != nullptr ? p.global_scale_up + t.expert : nullptr);
      if (gup != nullptr) prefetch_l1(gup);
      const float* bias =
          t.extra ? p.x_bias : (p.bias != nullptr ? p.bias + static_cast<int64_t>(t.expert) * p.n : nullptr);
      if (bias != nullptr) {
#pragma unroll
        for (int i = 0; i < C::WM; ++i) {
          const int mt = mtile_of(t, i);
          if (mt < p.n / 16) {  // past N there is no m-tile (the epilogue skips it)
            if (EPI == kEpiPlain) {
              prefetch_l1(bias + mt * 16);
            } else {
              prefetch_l1(bias + mt * 8);
              prefetch_l1(bias + p.n / 2 + mt * 8);
            }
          }
        }
      }
    }
    // claimed tiles: the global scales the producer copied into the tile's scale slot, read by the epilogue
    // (0, static shares: store_mtile loads them)
    const uint32_t gs_off = p.tile_counter != nullptr
                                ? static_cast<uint32_t>(kL.sched_offset + TmaTileRing::kOffset + TmaTileRing::kScaleOffset +
                                                        sizeof(TmaScaleSlot) * (ti & (TmaTileRing::kScaleSlots - 1)))
                                : 0u;
    tma_with_width<kCfg>(t.rows, [&](auto width) {  // uniform over the CTA
      C::template mainloop<decltype(width)::value>(p, smem, smem_base, bar_full, bar_empty, KT, cw, acc, stage, phase);
    });
    const float* s_rs = reinterpret_cast<const float*>(smem + rs_off);
    if (kStageRs || (kStageBias && tile_bias != nullptr)) {
      cp_async_wait<0>();
      __syncwarp();  // every lane's copies are visible to the warp
    }
    const float* s_bias = tile_bias != nullptr ? reinterpret_cast<const float*>(smem + bias_off) : nullptr;
    const int valid_nt = (t.rows + 7) >> 3;
    const float* s_gs = gs_off != 0 ? reinterpret_cast<const float*>(smem + gs_off) : nullptr;
#pragma unroll
    for (int i = 0; i < C::WM; ++i)
      store_mtile<C::NT, EPI, kStageRs ? 0 : 4, kFlatEpilogue, kStageBias, true>(
          p, t.expert, t.extra, mtile_of(t, i), t.row0, t.rows, valid_nt, acc[i], s_rs,
          s_bias != nullptr ? s_bias + i * 16 : nullptr, s_gs);
  }
#else
  __trap();  // TMA + wgmma + setmaxnreg: sm_90a only; the launcher refuses these configs elsewhere
#endif
}

}  // namespace fp4moe::kernels

// Tile configurations of the grouped NVFP4 GEMM and the one constexpr shared-memory layout that both
// the kernel (to carve its dynamic shared memory, static_assert'ed) and the host (planner, explain,
// launch checks) use. A config is a plain struct; the instantiated set is the explicit list below.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace fp4moe {

inline constexpr int kMaxExperts = 512;       // routing and the GEMM tile scheduler support up to this
inline constexpr int kMaxTopK = 16;

constexpr size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

struct TileConfig {
  int bn = 128;     // output features per CTA tile; multiple of 16 * warps
  int bt = 64;      // tokens (rows) per CTA tile; multiple of 8
  int bk = 128;     // K per pipeline stage; multiple of 64
  int stages = 4;   // cp.async pipeline depth
  int warps = 8;    // math warps; warp w owns m16 tiles [w*wm, (w+1)*wm) of the feature tile
  int mma = 0;      // 0: mma.sync.m16n8k16 per warp (sm_80+); 1: wgmma m64nBTk16 per warpgroup (sm_90a);
                    // 2: "stream" decode kernel (mma.sync, weights streamed global -> registers, see below);
                    // 3: "tma" kernel (sm_90a): a TMA producer warpgroup + `warps` wgmma consumer warps
                    //    (kernels/sm90_nvfp4_grouped_tma.cuh)
  int ctas = 0;     // CTAs per SM the kernel is compiled for (__launch_bounds__ minimum); 0: the default rule

  constexpr int wm() const { return bn / (16 * warps); }
  // mma 3 adds its producer warpgroup (four warps: setmaxnreg works per warpgroup) to the consumers
  constexpr int threads() const { return (warps + (mma == 3 ? 4 : 0)) * 32; }
  constexpr bool operator==(const TileConfig&) const = default;
  std::string name() const;  // "bn128_bt64_bk128_s4_w8" (+ "_wgmma" or "_tma", + "_c3"); stream: "stream_bt8_w32_d4_c1"
};

// Stream configs (mma = 2), the decode kernel (kernels/sm80_nvfp4_grouped_stream.cuh): each warp streams
// its own weights from global memory straight into a ring of `stages` registers sets (16 B of codes + 8 B
// of scales per lane per 64-wide K chunk), so bytes in flight grow with warps x depth and no barrier sits
// in the K loop; the activation rows of the current (expert, token tile) live in shared memory for the
// whole K. bn = 16 * warps (one m16 tile per warp at a time), bk = 64 (the chunk), bt = 8 or 16 tokens.
inline constexpr size_t kStreamWarpStateBytes = 64;  // sizeof(kernels::StreamWarpState)
// What a round change (a CTA entering its next segment) costs a stream-config CTA, in K chunks per warp:
// 4-6 us measured on an H200 (`fp4moe bench --mode gemm --trace`), at 0.34-0.45 us per chunk and warp.
// The kernel splits the units so that each CTA's chunks plus its round changes even out (stream_split).
inline constexpr int kStreamRoundCostChunks = 12;
inline constexpr int kStreamTraceSlots = 16;  // values per warp in GroupedGemmArgs::trace

// Where CTA i of G starts in the unit list (stream_split(G) = all units). The split evens out the cost
// of each CTA's range rather than its bytes: a unit is K / 64 chunks of the CTA's stream, and each
// segment (expert, token tile) costs `round_cost` chunks more at its start (kStreamRoundCostChunks x warps:
// a round change stops the whole CTA for its barriers, its activation rows and its split m-tiles' sums,
// 4-6 us on an H200). With an even split of the units, the CTAs whose range crossed into a second segment
// finished those 4-6 us after the others (bench/NOTES.md, "rounds in the split"). Every segment has MT
// units, so the cost is linear inside a segment plus a gap at its start; a cut that falls into a gap
// snaps to the segment's first unit, so no CTA pays for a round it does not run. The gap is capped at a
// quarter of a CTA's share, so that few large segments (T = 1) cannot leave CTAs without work. A function
// of the problem only (segments, shapes, grid): the results stay bit-identical run to run.
constexpr int stream_split(int segs, int MT, int Kc, int round_cost, int i, int G) {
  // 32-bit divisions only (the launcher keeps segs x G and MT x K / 64 x warps below 2^31): this runs in
  // every CTA's prologue, which is on the critical path at T = 1 (its code there measured, bench/NOTES.md).
  const int seg_chunks = MT * Kc;
  int rc = round_cost;
  const int64_t total = static_cast<int64_t>(segs) * seg_chunks;
  if (static_cast<int64_t>(rc) * 4 * G > total)  // the cap; then total < rc x 4G, far below 2^31
    rc = static_cast<int>(total) / (4 * G);
  const int per_seg = seg_chunks + rc;
  // t = segs * per_seg * i / G lands in segment j = t / per_seg = segs * i / G, at t - j * per_seg =
  // per_seg * qr / G with qr = segs * i mod G; with per_seg = a * G + b that is a * qr + b * qr / G.
  const int q = segs * i;
  const int j = q / G, qr = q - j * G;
  const int a = per_seg / G, b = per_seg - a * G;
  const int r = a * qr + b * qr / G - rc;  // chunks past the segment's round-cost gap
  return j * MT + (r <= 0 ? 0 : (r / Kc < MT ? r / Kc : MT));
}

// Timeline slots (GroupedGemmParams::trace, kStreamTraceSlots values per warp, written by lane 0): a
// measuring aid for `fp4moe bench --mode gemm --trace`, compiled only with -DFP4MOE_STREAM_TRACE=ON and
// off when trace is null. Times are %globaltimer (ns); the *Ns slots are sums over the launch, the others
// counts.
enum StreamTraceSlot : int {
  kTraceEntry = 0,        // kernel entry
  kTraceWaited = 1,       // griddepcontrol.wait returned
  kTraceScheduled = 2,    // the schedule is built (after its CTA barrier)
  kTraceRingIssued = 3,   // the ring's first half is requested
  kTraceFirstPiece = 4,   // the first piece is open (its activation rows are in shared memory)
  kTraceExit = 5,         // the math loop is done
  kTraceRoundEndNs = 6,   // waiting at the round-end barriers
  kTraceRowsInNs = 7,     // a round's activation rows: cp.async, its wait and the barrier (only the wait and the
                          // barrier for a first round the prologue opened, kStreamEarlyRows configs)
  kTraceAdvanceCalls = 8,
  kTraceCursorCalls = 9,
  kTraceChunks = 10,      // K chunks of this warp's pieces
  kTraceAdvanceNs = 11,   // inside stream_advance
  kTraceCursorNs = 12,    // inside stream_cursor_next
  kTraceRounds = 13,
  kTraceEpilogueNs = 14,  // storing m-tiles (store_mtile), split sums included
  kTraceSmid = 15,        // the SM the CTA ran on, plus one (%smid + 1: 0 is "not written")
};
static_assert(kTraceSmid < kStreamTraceSlots, "the slots must fit kStreamTraceSlots");


// The stream kernel's timeline (GroupedGemmArgs::trace) is compiled in only with
// -DFP4MOE_STREAM_TRACE=ON: a trace build runs the decode kernel 3-15% slower (bench/NOTES.md).
#ifdef FP4MOE_STREAM_TRACE
inline constexpr bool kStreamTraceBuilt = true;
#else
inline constexpr bool kStreamTraceBuilt = false;
#endif
// The stream kernel's schedule in shared memory: the segment prefix of every expert slot plus the total
// (kMaxExperts + 2 int32), then the experts' rows (kMaxExperts + 3 int32: the routed experts' clamped
// offsets 0..E and the extra set's first and end row), so a round's start reads its rows from shared
// memory instead of making a dependent L2 round trip.
inline constexpr int kStreamSchedInts = (kMaxExperts + 2) + (kMaxExperts + 3);

struct StreamSmemLayout {
  size_t act_bytes;          // bt rows x k bf16, 128-byte swizzled 16-byte chunks (ldmatrix without conflicts)
  size_t slots_offset;       // partial accumulators: warps x (bt/8) x 32 lanes x 16 B
  size_t slots_bytes;
  size_t sched_offset;       // kStreamSchedInts int32: segment prefix and total, then each expert's rows
  size_t sched_bytes;
  size_t warp_state_offset;  // warps x kStreamWarpStateBytes: the cold per-warp state
  size_t warp_state_bytes;
  size_t total_bytes;
};

constexpr StreamSmemLayout stream_smem_layout(const TileConfig& c, int64_t k) {
  StreamSmemLayout l{};
  l.act_bytes = align_up(static_cast<size_t>(c.bt) * static_cast<size_t>(k) * 2, 128);
  l.slots_offset = l.act_bytes;
  l.slots_bytes = static_cast<size_t>(c.warps) * (c.bt / 8) * 32 * 16;
  l.sched_offset = l.slots_offset + l.slots_bytes;
  l.sched_bytes = align_up(kStreamSchedInts * sizeof(int32_t), 128);
  l.warp_state_offset = l.sched_offset + l.sched_bytes;
  l.warp_state_bytes = static_cast<size_t>(c.warps) * kStreamWarpStateBytes;
  l.total_bytes = l.warp_state_offset + l.warp_state_bytes;
  return l;
}

// Shared memory of the sm80-nvfp4-grouped kernel, byte for byte as the kernel carves it:
//   [stage 0 .. stages-1] each = activations | codes | scales, padded to 1024 bytes
//   [scheduler] (kMaxExperts + 1) int32 tile prefix + 1 int32 total; tma configs: + kTmaTileSlots int32
//               reserved for the claimed tiles' ring (TmaTileRing); 128-byte aligned
//   [barriers]  tma configs only: a "full" and an "empty" mbarrier (8 B each) per stage, 128-byte aligned
//   [row scales] tma configs only: bt floats per consumer warp (the tile's routing weights, copied by
//               each warp for its own epilogue), 128-byte aligned
// Activations come first in a stage and stages are 1024-byte multiples: the 128-byte-swizzled rows
// (16-byte chunk c of row r at c ^ (r & 7)) are then exactly wgmma's K-major SWIZZLE_128B layout, whose
// pattern repeats every 1024 bytes. The epilogue stores from registers, so the next tile's loads stay
// in flight during it (no bytes; the tma configs' row scales are its only shared memory).
// The tma kernel's handoff of claimed work tiles (GroupedGemmArgs::tile_counter), in kTmaTileSlots int32
// reserved after the scheduler's prefix and total (they fit in its 128-byte padding): a ring of kSlots
// slots with a "full" and an "empty" mbarrier each, and a ring of kScaleSlots global-scale pairs. A slot
// holds a tile the producer decoded (expert, feature tile, first row, rows; expert -1 at the end); the
// scale pair of tile ti (plain: the expert's global scale; SwiGLU: gate and up) goes to scale slot
// ti % kScaleSlots, written before the tile slot's full barrier is arrived on. The producer fills slot
// ti % kSlots once the consumers freed it; every consumer lane waits on its full barrier at the tile start,
// reads the tile and arrives on the empty one (32 x warps arrivals: each lane releases its own read), and
// reads the scales in its epilogue: twice as many scale slots as tile slots, because the producer can hand
// tile ti + kSlots over once tile ti has started, i.e. while tile ti - 1 may still be in its epilogue.
// Decoded by the consumers, each tile start was a binary search of the prefix and an L2 round trip for the
// expert's offsets, and each tile end another for its global scale, with the tensor pipe idle: 8% / 15% of the
// warps' samples in qwen3-30b's GEMM1 / GEMM2 at T = 128 (K = 2048 and 768: short tiles), 4% in GLM-5's GEMM1
// (bench/NOTES.md, twenty-eighth session). The ring is apart from the stages' barriers so the producer's
// per-stage path is the static shares' (twelfth session); two slots let the producer run up to two tiles
// ahead, more than a ring of stages wherever a tile has at least `stages` K steps.
struct TmaTileSlot {
  int32_t expert, ftile, row0, rows;  // the decoded tile (WorkTile); expert < 0: no more tiles
};
struct TmaScaleSlot {
  float gs, gs_up;  // the epilogue's global scales, as stored (gs_up = gs where the launch has none)
};
struct TmaTileRing {
  static constexpr int kSlots = 2;                                      // a power of two
  static constexpr int kScaleSlots = 2 * kSlots;
  // from the scheduler's start: after the prefix and total, 16-byte aligned (one 16-byte load per tile)
  static constexpr size_t kOffset = ((kMaxExperts + 2) * sizeof(int32_t) + 15) / 16 * 16;
  static constexpr uint32_t kSlotBytes = sizeof(TmaTileSlot);
  static constexpr uint32_t kScaleOffset = kSlotBytes * kSlots;         // from the slots: scales[kScaleSlots]
  static constexpr uint32_t kFullOffset = kScaleOffset + sizeof(TmaScaleSlot) * kScaleSlots;  // full[kSlots]
  static constexpr uint32_t kEmptyOffset = kFullOffset + 8 * kSlots;    // then empty[kSlots]
  static constexpr uint32_t kBytes = kEmptyOffset + 8 * kSlots;
};
inline constexpr int kTmaTileSlots =
    static_cast<int>((TmaTileRing::kOffset + TmaTileRing::kBytes) / sizeof(int32_t)) - (kMaxExperts + 2);
static_assert(sizeof(TmaTileSlot) == 16 && sizeof(TmaScaleSlot) == 8, "a tile is one 16-byte access");
static_assert((TmaTileRing::kSlots & (TmaTileRing::kSlots - 1)) == 0, "the ring's slot is ti & (kSlots - 1)");
static_assert(TmaTileRing::kOffset % 16 == 0, "a slot's tile is one 16-byte load (the scheduler starts 1024-aligned)");
static_assert(TmaTileRing::kFullOffset % 8 == 0, "mbarriers are 8-byte aligned");
static_assert(TmaTileRing::kBytes <= kTmaTileSlots * sizeof(int32_t), "the ring fits in the reserved tile slots");

// The tma configs whose consumer warps stage their tile's biases in shared memory (bias_offset): the narrow
// token tiles. The wide ones (bt >= 128) prefetch them into L1 at the tile start, as before (bench/NOTES.md,
// twenty-seventh session).
constexpr bool tma_stages_bias(const TileConfig& c) { return c.mma == 3 && c.bt < 128; }

struct GemmSmemLayout {
  size_t act_bytes;      // per stage: bt x bk x 2 B (bf16), [bk/64 slabs][bt rows][128 B]
  size_t codes_bytes;    // per stage: (bn/16) m-tiles x (bk/64) chunks x 512 B
  size_t scales_bytes;   // per stage: (bn/16) x (bk/64) x 64 B
  size_t codes_offset;   // within a stage
  size_t scales_offset;
  size_t stage_bytes;    // act + codes + scales, rounded up to 1024
  size_t sched_offset;   // int32 prefix[kMaxExperts + 1], total; tma configs: then the tile slots
  size_t sched_bytes;
  size_t bar_offset;     // tma configs: full[stages], then empty[stages] mbarriers
  size_t bar_bytes;      // 0 for the other kinds
  size_t rs_offset;      // tma configs: float[warps][bt] row scales
  size_t rs_bytes;       // 0 for the other kinds
  size_t bias_offset;    // tma_stages_bias configs: float[warps][wm][16] the tile's biases (where the launch has them)
  size_t bias_bytes;     // 0 for the other kinds
  size_t total_bytes;    // dynamic shared memory requested at launch
};

constexpr GemmSmemLayout gemm_smem_layout(const TileConfig& c) {
  GemmSmemLayout l{};
  l.act_bytes = align_up(static_cast<size_t>(c.bt) * c.bk * 2, 128);
  l.codes_bytes = align_up(static_cast<size_t>(c.bn / 16) * (c.bk / 64) * 512, 128);
  l.scales_bytes = align_up(static_cast<size_t>(c.bn / 16) * (c.bk / 64) * 64, 128);
  l.codes_offset = l.act_bytes;
  l.scales_offset = l.codes_offset + l.codes_bytes;
  l.stage_bytes = align_up(l.scales_offset + l.scales_bytes, 1024);
  l.sched_offset = l.stage_bytes * c.stages;
  l.sched_bytes = align_up((kMaxExperts + 2 + (c.mma == 3 ? kTmaTileSlots : 0)) * sizeof(int32_t), 128);
  l.bar_offset = l.sched_offset + l.sched_bytes;
  l.bar_bytes = c.mma == 3 ? align_up(static_cast<size_t>(2 * c.stages) * 8, 128) : 0;
  l.rs_offset = l.bar_offset + l.bar_bytes;
  l.rs_bytes = c.mma == 3 ? align_up(static_cast<size_t>(c.warps) * c.bt * 4, 128) : 0;
  l.bias_offset = l.rs_offset + l.rs_bytes;
  l.bias_bytes = tma_stages_bias(c) ? align_up(static_cast<size_t>(c.warps) * c.wm() * 16 * 4, 128) : 0;
  l.total_bytes = l.bias_offset + l.bias_bytes;
  return l;
}

// The tma kernel's stage: the bytes its TMA copies complete on the stage's full barrier: codes, scales,
// and bk/64 activation slabs of `rows` rows (the copy box: bt/4, bt/2, 3bt/4 or bt rows; boxes past the
// tensor's end are zero-filled and still counted). The stage's space is sized for bt rows.
// A feature tile whose m-tile rows reach past N (its last, where n/16 is not a multiple of bn/16) copies
// only tail = (n/16) % (bn/16) of them (GroupedGemmTmaMaps' tail maps); 0 for every other tile.
constexpr int tma_tail_mtiles(int ftile, int mtiles_per_tile, int64_t n) {
  const int expert_mtiles = static_cast<int>(n / 16);
  return (ftile + 1) * mtiles_per_tile > expert_mtiles ? expert_mtiles - ftile * mtiles_per_tile : 0;
}
constexpr uint32_t tma_stage_tx_bytes(const TileConfig& c, int rows, int tail_mtiles = 0) {
  const uint32_t mts = static_cast<uint32_t>(tail_mtiles > 0 ? tail_mtiles : c.bn / 16);
  return mts * (c.bk / 64) * 512 + mts * (c.bk / 64) * 64 + static_cast<uint32_t>(rows) * c.bk * 2;
}

// The tma kernel's wgmma widths per token tile: a work tile of r rows runs the narrowest listed width
// >= r (the last is bt), and its activation copy is that width rounded up to bt/4 (one tensor map per
// box height). The lists are bounded by ptxas 13.0, not by wgmma (any multiple of 8): every width is one
// more instantiation of the K loop in the same function, and past a few of them ptxas serializes the
// wgmmas (C7512). Measured limits: two consumer warpgroups at one CTA per SM (240 registers), five
// widths at bt 64 with one m64 tile per warpgroup, four with two, eight at bt 128, five at bt 256; two
// CTAs per SM (104 registers), three at bt 32, two at bt 64; four consumer warpgroups (112 registers),
// four at bt 32, three at bt 64. Each list spends its entries where the expert sizes of its tile's range
// of T fall (bench/NOTES.md): bt 32 at ~16 rows per expert, bt 64 at ~32, bt 128 at ~64-90, bt 256 at
// ~128.
inline constexpr int kTmaMaxWidths = 8;
struct TmaWidths {
  int n;
  int w[kTmaMaxWidths];
};
constexpr TmaWidths tma_widths(const TileConfig& c) {
  const int bt = c.bt;
  if (c.ctas == 2) return bt == 32 ? TmaWidths{3, {16, 24, 32}} : bt == 64 ? TmaWidths{2, {40, 64}} : TmaWidths{0, {}};
  // four consumer warpgroups (112 registers each): at bt 64 a fourth width serializes the wgmmas, so the
  // list spends its three on ~32 rows per expert (T = 1024 on GLM-5 and gpt-oss-120b); tiles of up to
  // 16 rows run 32 wide there (bt 32 is the config for them)
  if (c.warps == 16) return bt == 32 ? TmaWidths{4, {8, 16, 24, 32}} : bt == 64 ? TmaWidths{3, {32, 40, 64}} : TmaWidths{0, {}};
  switch (bt) {
    case 32: return {4, {8, 16, 24, 32}};
    case 64: return c.wm() == 1 ? TmaWidths{5, {16, 32, 40, 48, 64}} : TmaWidths{4, {16, 32, 48, 64}};
    case 128: return {8, {16, 32, 48, 64, 72, 80, 96, 128}};
    case 256: return {5, {64, 128, 144, 192, 256}};
    default: return {0, {}};
  }
}
// The width a tile of `rows` rows (1..bt) runs (host side: planner, tests; the kernel unrolls the same).
constexpr int tma_width_for(const TileConfig& c, int rows) {
  const TmaWidths t = tma_widths(c);
  for (int i = 0; i < t.n; ++i)
    if (rows <= t.w[i]) return t.w[i];
  return c.bt;
}
// The token tiles of one expert in a tma config. n rows take ceil(n / bt) tiles however they are cut;
// the cut decides the widths, i.e. the padded columns the tensor cores compute for nothing. Every tile
// holds bt rows except the last two, which share the rest R (bt < R <= 2 bt): the second-to-last takes a
// listed width's worth of rows, the one whose pair of widths sums smallest (each counted as at least
// bt/4: narrower, a tile is bound by its dequantization, not its width); ties keep the plain cut
// (bt, R - bt). E.g. bt 256 and 534 rows (GLM-5 at T = 16384 has 512 +- 22 rows per expert): 256 + 256 +
// 22 ran 256 + 256 + 64 columns, 256 + 144 + 134 runs 256 + 144 + 144. The tile count, hence the work
// list and the planner's counts, is the plain cut's. The kernel's two roles (producer and consumers)
// decode every tile with the same cut, read from tma_cut_table below (sm90_nvfp4_grouped_tma.cuh).
struct TokenTile {
  int first;  // within the expert's rows
  int rows;   // 1..bt
};
constexpr int tma_tile_cost(const TileConfig& c, int rows) {
  const int w = tma_width_for(c, rows);
  return w > c.bt / 4 ? w : c.bt / 4;
}
// Rows of the second-to-last tile when the last two share R rows (bt < R <= 2 bt).
constexpr int tma_last_pair_cut(const TileConfig& c, int R) {
  const TmaWidths t = tma_widths(c);
  int best = c.bt;
  int best_cost = tma_tile_cost(c, c.bt) + tma_tile_cost(c, R - c.bt);
  for (int i = 0; i < t.n; ++i) {
    const int a = t.w[i];
    if (a < R && R - a <= c.bt) {
      const int cost = tma_tile_cost(c, a) + tma_tile_cost(c, R - a);
      if (cost < best_cost) {
        best = a;
        best_cost = cost;
      }
    }
  }
  return best;
}
// The kernel does not search the list per tile (a loop over it kept the list in local memory, and even
// unrolled it is ~100 instructions on the tile's critical path): the launcher passes this table of the
// cut for every rest R = bt + 1 .. 2 bt, in units of 8 rows (widths are multiples of 8), and a tile reads
// its entry from the launch parameters.
inline constexpr int kTmaCutTableSize = 256;  // the largest bt
struct TmaCutTable {
  uint8_t cut8[kTmaCutTableSize];  // [R - bt - 1]: tma_last_pair_cut(c, R) / 8
};
constexpr TmaCutTable tma_cut_table(const TileConfig& c) {
  TmaCutTable t{};
  for (int i = 0; i < kTmaCutTableSize && i < c.bt; ++i) t.cut8[i] = static_cast<uint8_t>(tma_last_pair_cut(c, c.bt + 1 + i) / 8);
  return t;
}
// Token tile tt (0 .. ceil(n / bt) - 1) of an expert with n >= 1 rows.
constexpr TokenTile tma_token_tile(const TileConfig& c, int n, int tt) {
  const int bt = c.bt;
  const int nt = (n + bt - 1) / bt;
  if (nt < 2 || tt < nt - 2) return {tt * bt, n - tt * bt < bt ? n - tt * bt : bt};
  const int base = (nt - 2) * bt;
  const int a = tma_last_pair_cut(c, n - base);
  return tt == nt - 2 ? TokenTile{base, a} : TokenTile{base + a, n - base - a};
}

// Every list ends at bt and ascends in multiples of 8. The two-warpgroup lists at one CTA per SM also hold
// the copy boxes' heights bt/4, bt/2, 3bt/4, so none of their tiles runs wider than the box it copies (as
// before the lists); the two-CTA and four-warpgroup lists are too short for that.
constexpr bool tma_widths_well_formed(const TileConfig& c) {
  const int bt = c.bt;
  const TmaWidths t = tma_widths(c);
  if (t.n < 1 || t.n > kTmaMaxWidths || t.w[t.n - 1] != bt || bt % 32 != 0) return false;
  int boxes = 0;  // the copy boxes' heights bt/4, bt/2, 3bt/4 found in the list (bt is its last entry)
  for (int i = 0; i < t.n; ++i) {
    if (t.w[i] % 8 != 0 || t.w[i] < 8 || (i > 0 && t.w[i] <= t.w[i - 1])) return false;
    if (t.w[i] < bt && t.w[i] % (bt / 4) == 0) ++boxes;
  }
  return boxes == 3 || c.ctas == 2 || c.warps == 16;
}

// tma configs: registers per thread after setmaxnreg. The CTA's pool is what the launch allocates
// (threads x the launch-bounds count, 65536 / (threads x CTAs per SM) rounded down to 8); the producer
// warpgroup keeps 24 (its one thread issues the copies; no spills at 24) and the consumers split the
// rest, rounded down to 8: one CTA per SM, 384 x 168 = 128 x 24 + 256 x 240; two, 384 x 80 >= 128 x 24 +
// 256 x 104; four consumer warpgroups, 640 x 96 >= 128 x 24 + 512 x 112. (At 40 / 232 ptxas serialized
// the wgmmas of a fifth width in the 256-token config, C7512.)
constexpr int tma_producer_regs(int /*warps*/) { return 24; }
constexpr int tma_consumer_regs(int warps, int ctas) {  // ctas: TileConfig::ctas (0: one)
  const int threads = (warps + 4) * 32;
  const int launch = 65536 / (threads * (ctas > 0 ? ctas : 1)) / 8 * 8;
  return (launch * threads - 128 * tma_producer_regs(warps)) / (warps * 32) / 8 * 8;
}
static_assert(tma_consumer_regs(8, 0) == 240 && tma_consumer_regs(8, 2) == 104 && tma_consumer_regs(16, 0) == 112,
              "two consumer warpgroups get 240 registers each at one CTA per SM, 104 at two; four get 112");

// Whether the tuner may pick config c for a bucket of `rows_per_expert` (tokens * top_k / experts).
// Below one row per expert (T = 1 and 8 on 256-expert models) only the stream kernel: the layer fuses the
// shared expert's rows into the routed launch, and the stream kernel splits all of that work evenly over
// every SM, where the tile-scheduled kernels (pipeline, tma) run the few active experts' tiles in uneven
// waves. Timed alone, without the shared expert, a tma config still won there (GLM-5 GEMM1 T = 1: 42.8
// vs 47.3 us) and a pipeline config tied, but the layer lost with them (T = 1: 106.5 and 100.3 us vs
// 87.6 with the stream kernel): the tuner times every config and picks from the stream configs.
// A model without a shared expert (shared_expert_fused = false: qwen3-30b, gpt-oss-120b) has no fused
// rows, and there the tile-scheduled configs may be picked too: qwen3-30b's layer at T = 1 ran 7-8%
// faster with the configs that won alone, a tma GEMM1 and a pipeline GEMM2 (8 active experts: one
// wave; bench/NOTES.md, twelfth session).
constexpr bool tuner_may_pick(const TileConfig& c, double rows_per_expert, bool shared_expert_fused = true) {
  return c.mma == 2 || rows_per_expert >= 1.0 || !shared_expert_fused;
}

// The kernel's __launch_bounds__ minimum CTAs per SM: two while the accumulators are small (decode: one
// CTA's pipeline bubble at a tile boundary is covered by the other's loads), else one CTA with up to
// 255 registers (prefill tiles). The planner uses the same function for its register cap.
constexpr int gemm_min_ctas_per_sm(const TileConfig& c) {
  if (c.mma == 2) return c.ctas > 0 ? c.ctas : 1;
  if (c.mma == 3) return c.ctas > 0 ? c.ctas : 1;
  return c.ctas > 0 ? c.ctas : (c.wm() * (c.bt / 8) * 4 > 48 ? 1 : 2);
}

// Static validity (what types decide). Runtime validity against a GPU (smem, registers) is the
// planner's job (planner.hpp).
constexpr bool tile_config_well_formed(const TileConfig& c) {
  if (c.mma == 2)  // stream: one m16 tile per warp, 64-wide K chunks, a register ring of 2..8 chunks in
                   // two halves
    return c.warps >= 4 && c.warps <= 32 && c.bn == 16 * c.warps && (c.bt == 8 || c.bt == 16) && c.bk == 64 &&
           c.stages >= 2 && c.stages <= 8 && c.stages % 2 == 0 && c.ctas >= 1 && c.ctas <= 2 &&
           c.warps * c.ctas <= 64;
  const bool common = c.warps > 0 && c.bn > 0 && c.bn % (16 * c.warps) == 0 && c.wm() >= 1 && c.wm() <= 2 &&
                      c.bt % 16 == 0 && c.bt >= 16 && c.bk % 64 == 0 && c.bk >= 64 && c.stages >= 2 &&
                      c.ctas >= 0 && c.ctas <= 4;
  if (c.mma == 0) return common && c.bt <= 128;
  // tma: two consumer warpgroups, each wm() m64 tiles (a warp: wm() m16 tiles); a token tile of 32..256
  // (the instruction's N: tma_widths); at most 128 accumulator registers
  // (wm * bt / 2) beside the A fragments (the planner checks them against tma_consumer_regs); one CTA
  // per SM, or two for the small tiles below. Four consumer warpgroups (16 warps, 112 registers each):
  // one m64 tile each, up to 64 tokens, 64-wide stages; more warps per scheduler without more
  // activation reads from L2 (bn 256). (Three warpgroups, and four before the producer kept 24
  // registers, compiled with setmaxnreg ignored, C7507, or serialized wgmmas, C7512: bench/NOTES.md.)
  if (c.mma == 3)
    return common && (c.warps == 8 || (c.warps == 16 && c.wm() == 1 && c.bt <= 64 && c.bk == 64 && c.ctas == 0)) &&
           (c.bt == 32 || c.bt == 64 || c.bt == 128 || c.bt == 256) &&
           (c.bk == 64 || c.bk == 128) && c.wm() * c.bt <= 256 && tma_widths_well_formed(c) &&
           // two CTAs per SM (104 registers per consumer): one m64 tile per warpgroup, up to 64 tokens,
           // 64-wide stages (four A sets)
           (c.ctas == 0 || (c.ctas == 2 && c.wm() == 1 && c.bt <= 64 && c.bk == 64));
  // wgmma: one warpgroup per 64 features (wm = 1), token tile = the instruction's N
  return c.mma == 1 && common && c.stages >= 3 && c.wm() == 1 && c.warps % 4 == 0 &&
         (c.bt == 64 || c.bt == 128 || c.bt == 256);
}

// K not a multiple of bk (but of 64, the repacked chunk): the tma kernel runs ceil(K / bk) stages, the
// last one partial, which TMA completes with zeros past K (its maps' K extent is exact), so gpt-oss's
// K = 2880 (22.5 x 128) runs the 128-wide stages too. The other kernels step K by whole stages.
constexpr bool tile_config_has_k_tail(const TileConfig& c) { return c.mma == 3; }

// The bounded instantiation list of the sm80-nvfp4-grouped kernel (mma.sync m16n8k16 bf16 with NVFP4
// weights dequantized in registers; runs on sm_80 and newer, the Hopper path today).
inline constexpr TileConfig kGemmConfigs[] = {
    // decode: few rows per expert; all warps split one feature tile (each weight dequantized once per
    // tile), deep pipelines to keep >= 24 KB per SM in flight
    {128, 16, 128, 6, 8},
    {128, 32, 128, 5, 8},
    {128, 64, 128, 4, 8},
    {64, 16, 128, 8, 4},
    {128, 32, 64, 8, 8},   // K not a multiple of 128 (gpt-oss: 2880)
    // decode with 256-wide K stages: half the barriers and loader work per weight byte
    {128, 16, 256, 4, 8},
    {128, 32, 256, 3, 8},
    // prefill: each warp owns two m16 tiles so every B fragment feeds two mma. (256x128 with two m16
    // tiles per warp needs 128 accumulator registers and spilled at 255 registers: left out.)
    {256, 64, 64, 4, 8},
    {128, 128, 64, 4, 8},
    // prefill on Hopper's wgmma: two warpgroups x 64 features, the token tile is the instruction's N
    {128, 128, 64, 4, 8, 1},
    {128, 256, 64, 4, 8, 1},
    {128, 64, 128, 4, 8, 1},
    {128, 256, 128, 3, 8, 1},
    // decode, stream kernel (bench/NOTES.md, v8-v12): bytes in flight per SM decide it. The ring runs in
    // two halves (one in flight while the math consumes the other), so a half must be several chunks
    // deep: 20 warps (96 registers) with an 8-deep ring (two halves of 4) reach 0.80-0.85 of the read
    // ceiling at T = 8..128 (GLM-5 GEMMs); 24 warps have registers (80) only for 4 (two halves of 2;
    // 6 spills); 32 warps at 64 registers spilled. bt 8 covers up to 8 rows per expert (T <= ~128 at
    // top-8 of 256), bt 16 up to 16.
    {320, 8, 64, 8, 20, 2, 1},
    {384, 8, 64, 4, 24, 2, 1},
    {192, 8, 64, 4, 12, 2, 2},   // two CTAs per SM: one CTA's round barrier overlaps the other's stream (T = 1)
    {256, 8, 64, 8, 16, 2, 1},   // 16 warps (110 registers), 8-deep ring: as many bytes, fewer warps
    {384, 16, 64, 4, 24, 2, 1},
    {256, 16, 64, 8, 16, 2, 1},  // bt 16 without spills (120 registers)
    {192, 16, 64, 4, 12, 2, 2},  // two CTAs per SM only where 16 x K x 2 B of rows allow it (GEMM2)
    // 16-256 rows per expert and prefill, tma kernel (sm_90a): a TMA producer warpgroup fills the stage
    // ring (one copy each for codes and scales, one per 64-wide activation slab), two wgmma consumer
    // warpgroups keep a stage of wgmmas in flight; the instruction width follows each tile's rows.
    {256, 32, 128, 8, 8, 3},
    {128, 64, 128, 8, 8, 3},
    {256, 64, 64, 12, 8, 3},     // (bk 128 with two m64 tiles per warpgroup spilled at 232 registers)
    {128, 128, 64, 10, 8, 3},
    {128, 256, 64, 5, 8, 3},
    // two CTAs per SM (104 registers per consumer): twice the warps per scheduler to hide the
    // dequantization's integer chains at 16-64 rows per expert, and one CTA's tile end (wgmma drain,
    // epilogue) under the other's K loop
    {128, 32, 64, 12, 8, 3, 2},
    {128, 64, 64, 8, 8, 3, 2},
    // four consumer warpgroups (112 registers each): four consumer warps per scheduler at bn 256, so
    // the activations are read from L2 once per 256 features, as with two warpgroups of two m64 tiles
    {256, 32, 64, 16, 16, 3},
    {256, 64, 64, 12, 16, 3},
};
inline constexpr int kNumGemmConfigs = sizeof(kGemmConfigs) / sizeof(kGemmConfigs[0]);

}  // namespace fp4moe

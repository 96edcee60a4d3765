// The shared-memory arithmetic of CUTLASS 4.2's sm_120 block-scaled NVFP4 ptr-array (grouped) GEMM,
// instantiated as TensorRT-LLM's MoE launcher does: the stage count its builder picks and the size of
// the kernel's SharedStorage, the byte count cudaFuncSetAttribute must accept at launch.
//
// Plain constexpr functions so that tests/cutlass/ can static_assert them against the real CUTLASS
// types (sizeof(GemmKernel::SharedStorage), the builder's PipelineStages), compiled from the pinned
// nvidia-cutlass 4.2.0.0 headers; the planner (planner.hpp) and `fp4moe explain` print the same
// numbers. docs/cutlass-sm120-stages.md walks through one tile.
//
// Where each term comes from (CUTLASS 4.2.0 headers):
//  capacity    cutlass/arch/arch.h: sm120_smem_capacity_bytes = 101,376.
//  auto stages gemm/collective/builders/sm120_blockscaled_mma_builder.inl calls
//              sm100_compute_stage_count_or_override_blockscaled (sm100_blockscaled_umma_builder.inl):
//              (capacity - carveout) / (A + B + SFA + SFB + 16-byte barrier per stage). The carveout
//              is whatever the kernel's author passes to StageCountAutoCarveout; TensorRT-LLM passes
//              sizeof(CollectiveEpilogue::SharedStorage).
//  mainloop    gemm/collective/sm120_blockscaled_mma_array_tma.hpp: alignas(1024) A[S], alignas(1024)
//              B[S], SFA[S], SFB[S]; a PipelineTmaAsync<S> (16 B per stage); 4 TMA descriptors.
//  epilogue    epilogue/collective/builders/sm120_builder.inl (tile 64 x 32 for a 16-bit D, StagesD,
//              StagesC, smem reuse) and epilogue/collective/sm90_epilogue_array_tma_warpspecialized.hpp
//              (C/D buffers aligned to their swizzle atom, the fusion callbacks' storage, a
//              PipelineTransactionAsync<StagesC>, 1 + NumEpilogueWarpGroups TMA descriptors).
//  kernel      gemm/kernel/sm90_gemm_array_tma_warpspecialized_{cooperative,pingpong}.hpp:
//              tensors {mainloop; epilogue}, pipelines {scheduler PipelineAsync<8>, mainloop, epilogue
//              load, load-order barrier (+ pingpong's math-warpgroup order barrier)}, 8 scheduler
//              responses, tensor maps {mainloop; epilogue} aligned to 128; sizeof rounds the whole to
//              its 1024-byte alignment.
#pragma once
#include <cstddef>

namespace fp4moe {

inline constexpr size_t kCutlassSm120SmemCapacity = 101376;

struct CutlassTile {
  int m = 128, n = 128, k = 128;
};

enum class CutlassSchedule { kCooperative, kPingpong };

// The epilogue as TensorRT-LLM builds it for sm_120 (its default, non-finalize epilogue): TMA
// warp-specialized, EpilogueTileAuto, ElementC = ElementD = the output type (bf16), C and D
// column-major (it computes the transposed product), LinearCombination (no shared memory of its own).
struct CutlassEpilogueSpec {
  bool has_c = true;           // ElementC non-void (TensorRT-LLM: ElementC = ElementD on sm_120)
  int c_bits = 16;             // bf16
  int d_bits = 16;             // bf16
  bool column_major = true;    // C/D layout (TensorRT-LLM: LayoutC/LayoutD = ColumnMajor)
  int tile_m = 64, tile_n = 32;  // EpilogueTileAuto on sm_120 for a 16-bit D
  size_t fusion_bytes = 1;     // FusionCallbacks::SharedStorage: an empty struct (1 byte) for LinearCombination
  int warp_groups = 2;         // NumEpilogueWarpGroups: one D descriptor each
};

struct CutlassEpilogueLayout {
  int epi_tiles = 0, stages_c = 0, stages_d = 0;
  bool reuse_smem = false;
  size_t alignment = 0;         // of its TensorStorage (the widest swizzle atom)
  size_t c_stage = 0, d_stage = 0;
  size_t collective_bytes = 0;  // the C/D buffers
  size_t tensor_bytes = 0;      // sizeof(TensorStorage): collective + fusion storage, aligned
  size_t pipeline_bytes = 0;    // sizeof(PipelineStorage): 2 barriers of 8 B per C stage
  size_t shared_storage = 0;    // sizeof(SharedStorage): what TensorRT-LLM passes as the carveout
  int tensormaps = 0;           // TMA descriptors (128 B each) in the kernel's tensor-map storage
};

struct CutlassMainloopLayout {
  size_t a_stage = 0, b_stage = 0, sfa_stage = 0, sfb_stage = 0;
  size_t barrier_stage = 16;    // sizeof(PipelineTmaUmmaAsync<1>::SharedStorage), the builder's term
  size_t auto_stage_bytes = 0;  // what StageCountAutoCarveout divides by
  size_t tensor_bytes = 0;      // sizeof(TensorStorage) for the given stages
  size_t pipeline_bytes = 0;    // sizeof(PipelineTmaAsync<S>::SharedStorage)
  int tensormaps = 4;           // A, B, SFA, SFB
};

struct CutlassKernelLayout {
  size_t tensors = 0;      // sizeof(SharedStorage::TensorStorage)
  size_t pipelines = 0;    // sizeof(SharedStorage::PipelineStorage)
  size_t responses = 0;    // scheduler_response[8]
  size_t tensormaps = 0;   // sizeof(SharedStorage::TensorMapStorage)
  size_t footprint = 0;    // sizeof(SharedStorage): the kernel's dynamic shared memory
};

namespace cutlass_sm120 {

constexpr size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
constexpr size_t max_of(size_t a, size_t b) { return a > b ? a : b; }
constexpr int min_of(int a, int b) { return a < b ? a : b; }
constexpr int max_of(int a, int b) { return a > b ? a : b; }

// CUTLASS picks the widest swizzle whose row fits the contiguous extent of the buffer; its alignment
// (alignment_for_swizzle) is the swizzle atom: 8 rows of 128, 64 or 32 bytes, else 128 bytes.
constexpr size_t swizzle_alignment(size_t contiguous_bytes) {
  return contiguous_bytes % 128 == 0 ? 1024 : contiguous_bytes % 64 == 0 ? 512 : contiguous_bytes % 32 == 0 ? 256 : 128;
}

// The tiles this model covers: the builder's scale-factor shared-memory atoms are blocks of 128 rows
// (Blk_MN) by 4 scale bytes (64 elements of K, the MMA's K permutation), so M and N are multiples of
// 128 and K a multiple of 64.
constexpr bool tile_supported(const CutlassTile& t) {
  return t.m > 0 && t.n > 0 && t.k > 0 && t.m % 128 == 0 && t.n % 128 == 0 && t.k % 64 == 0;
}

constexpr CutlassEpilogueLayout epilogue(const CutlassTile& t, const CutlassEpilogueSpec& e) {
  CutlassEpilogueLayout l;
  l.epi_tiles = (t.m / e.tile_m) * (t.n / e.tile_n);
  l.stages_d = min_of(l.epi_tiles, 2);
  l.reuse_smem = e.has_c && e.c_bits == e.d_bits && e.d_bits > 8;
  l.stages_c = l.reuse_smem ? max_of(min_of(l.epi_tiles, 2), l.stages_d + 1) : l.stages_d;
  const size_t contiguous = static_cast<size_t>(e.column_major ? e.tile_m : e.tile_n);
  const size_t align_d = swizzle_alignment(contiguous * e.d_bits / 8);
  const size_t align_c = e.has_c ? swizzle_alignment(contiguous * e.c_bits / 8) : 1;
  l.c_stage = e.has_c ? static_cast<size_t>(e.tile_m) * e.tile_n * e.c_bits / 8 : 0;
  l.d_stage = static_cast<size_t>(e.tile_m) * e.tile_n * e.d_bits / 8;
  if (!e.has_c) {  // union { C[0]; alignas(align_d) D[StagesD] }
    l.alignment = align_d;
    l.collective_bytes = round_up(l.d_stage * l.stages_d, align_d);
  } else if (l.reuse_smem) {  // union { alignas(max) C[StagesC]; alignas(max) D[StagesC] }
    l.alignment = max_of(align_c, align_d);
    l.collective_bytes = round_up(max_of(l.c_stage, l.d_stage) * l.stages_c, l.alignment);
  } else {  // struct { alignas(align_c) C[StagesC]; alignas(align_d) D[StagesD] }
    l.alignment = max_of(align_c, align_d);
    const size_t d_at = round_up(l.c_stage * l.stages_c, align_d);
    l.collective_bytes = round_up(d_at + l.d_stage * l.stages_d, l.alignment);
  }
  l.tensor_bytes = round_up(l.collective_bytes + e.fusion_bytes, l.alignment);
  l.pipeline_bytes = 16 * static_cast<size_t>(l.stages_c);
  l.shared_storage = round_up(l.tensor_bytes + l.pipeline_bytes, l.alignment);
  l.tensormaps = 1 + e.warp_groups;
  return l;
}

constexpr CutlassMainloopLayout mainloop(const CutlassTile& t, int stages) {
  CutlassMainloopLayout l;
  l.a_stage = static_cast<size_t>(t.m) * t.k / 2;          // e2m1: 4 bits
  l.b_stage = static_cast<size_t>(t.n) * t.k / 2;
  l.sfa_stage = static_cast<size_t>(t.m) * (t.k / 16);     // one E4M3 byte per 16 elements
  l.sfb_stage = static_cast<size_t>(t.n) * (t.k / 16);
  l.auto_stage_bytes = l.a_stage + l.b_stage + l.sfa_stage + l.sfb_stage + l.barrier_stage;
  const size_t S = static_cast<size_t>(stages > 0 ? stages : 0);
  size_t off = round_up(0, 1024) + S * l.a_stage;
  off = round_up(off, 1024) + S * l.b_stage;
  off += S * l.sfa_stage + S * l.sfb_stage;  // uint8 arrays: no alignment of their own
  l.tensor_bytes = round_up(off, 1024);
  l.pipeline_bytes = 16 * S;
  return l;
}

// The builder's StageCountAutoCarveout<carveout>.
constexpr int auto_stages(const CutlassTile& t, size_t carveout, size_t capacity = kCutlassSm120SmemCapacity) {
  const size_t per = mainloop(t, 1).auto_stage_bytes;
  return capacity > carveout ? static_cast<int>((capacity - carveout) / per) : 0;
}

constexpr CutlassKernelLayout kernel(const CutlassTile& t, int stages, const CutlassEpilogueLayout& epi,
                                     CutlassSchedule schedule) {
  CutlassKernelLayout l;
  const CutlassMainloopLayout ml = mainloop(t, stages);
  // struct TensorStorage : aligned_struct<128> { mainloop (alignas 1024); epilogue; }
  size_t off = ml.tensor_bytes;
  off = round_up(off, epi.alignment) + epi.tensor_bytes;
  l.tensors = round_up(off, 1024);
  // struct PipelineStorage : aligned_struct<16> { alignas(16) each member }
  size_t p = 0;
  p = round_up(p, 16) + 8 * 2 * 8;             // scheduler: PipelineAsync<8>, full + empty barrier per stage
  p = round_up(p, 16) + ml.pipeline_bytes;     // mainloop: PipelineTmaAsync<S>
  p = round_up(p, 16) + epi.pipeline_bytes;    // epilogue load: PipelineTransactionAsync<StagesC>
  p = round_up(p, 16) + 1 * 2 * 8;             // load order: OrderedSequenceBarrier<1, 2>
  if (schedule == CutlassSchedule::kPingpong)
    p = round_up(p, 16) + 2 * 2 * 8;           // math warpgroup order: OrderedSequenceBarrier<2, 2>
  l.pipelines = round_up(p, 16);
  l.responses = 8 * 16;                        // alignas(16) TileSchedulerResponse[8] (16 B each)
  // struct TensorMapStorage : aligned_struct<128> { alignas(128) mainloop; alignas(128) epilogue; }
  l.tensormaps = round_up(static_cast<size_t>(ml.tensormaps) * 128, 128) +
                 round_up(static_cast<size_t>(epi.tensormaps) * 128, 128);
  size_t f = l.tensors;
  f = round_up(f, 16) + l.pipelines;
  f = round_up(f, 16) + l.responses;
  f = round_up(f, 128) + l.tensormaps;
  l.footprint = round_up(f, 1024);
  return l;
}

// The largest stage count whose kernel fits `capacity` (0 when not even one does).
constexpr int max_stages_that_fit(const CutlassTile& t, const CutlassEpilogueLayout& epi, CutlassSchedule s,
                                  size_t capacity = kCutlassSm120SmemCapacity) {
  int best = 0;
  for (int stages = 1; stages <= 64; ++stages)
    if (kernel(t, stages, epi, s).footprint <= capacity) best = stages;
  return best;
}

}  // namespace cutlass_sm120
}  // namespace fp4moe

// Tile planner: for a kernel family, a tile configuration and an architecture, the exact shared-memory
// footprint (line by line), the stages that fit, CTAs per SM (by shared memory, registers, threads,
// the CTA cap), the work tiles and waves of a problem, the alignment rules, and a verdict whose reason
// names the resource, what is needed and what is available.
//
// Families:
//  "sm80-nvfp4-grouped"          this library's kernel (kGemmConfigs); the planner recounts every buffer
//                                of gemm_smem_layout from first principles (a test asserts equality).
//  "cutlass-sm120-nvfp4-grouped" CUTLASS's sm_120 block-scaled NVFP4 ptr-array grouped GEMM, modelled
//                                from its public sources (see src/planner.cpp), to show what its
//                                StageCountAutoCarveout picks and what the kernel really needs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/arch.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe {

inline constexpr const char* kFamilySm80Grouped = "sm80-nvfp4-grouped";
inline constexpr const char* kFamilyCutlassSm120 = "cutlass-sm120-nvfp4-grouped";

struct SmemLine {
  std::string what;     // "codes (per stage)"
  std::string formula;  // "(bn/16) * (bk/64) * 512 = 8 * 2 * 512"
  size_t bytes = 0;
};

struct Verdict {
  bool valid = true;
  std::string reason;                 // first failure as a sentence; "" when valid
  std::vector<std::string> failures;  // every failure
  void fail(std::string sentence);
};

// ---- sm80-nvfp4-grouped ----

// The shared memory of one config, recounted independently of gemm_smem_layout.
struct Sm80SmemPlan {
  size_t codes_bytes = 0, scales_bytes = 0, act_bytes = 0, stage_bytes = 0;
  size_t slots_bytes = 0;    // stream configs: partial accumulators of split m-tiles
  size_t warp_state_bytes = 0;  // stream configs: per-warp cursor state
  int64_t k = 0;             // stream configs: the K the activation rows were counted for
  size_t sched_offset = 0, sched_bytes = 0, total_bytes = 0;
  size_t padding_bytes = 0;  // 128-byte alignment padding included above
  std::vector<SmemLine> lines;
};
// Stream configs (mma == 2) hold bt activation rows of the whole K: their bytes depend on k (k = 0 counts
// the K-independent part only).
Sm80SmemPlan plan_sm80_smem(const TileConfig& cfg, int64_t k = 0);

// Register estimate per thread (the measured numRegs comes from cudaFuncGetAttributes on a GPU):
//   accumulators  wm * (bt/8) * 4       fp32 C fragments of m16n8 tiles
//   B fragments   (bt/8) * 2            bf16 activation fragments of one k16 step
//   A fragments   4                     one dequantized m16k16 bf16 fragment
//   raw weights   wm * 6                16 B of e2m1 codes + 8 B of scales per m-tile and 64-K chunk
//   addressing    40                    pointers, tile decode, loop and pipeline indices (fixed)
// rounded up to the allocation granularity of 8 per thread. launch_bounds_cap is what the kernel's
// __launch_bounds__(threads, min_blocks) allows (65536 / (min_blocks * threads), floored to 8, <= 255);
// expected = min(estimate, cap): above the cap the compiler spills instead.
struct RegisterEstimate {
  int accumulators = 0, b_fragments = 0, a_fragments = 0, raw_weights = 0, addressing = 0;
  int estimate = 0;
  int min_blocks = 1;  // the kernel's __launch_bounds__ minimum blocks per SM
  int launch_bounds_cap = 255;
  int expected = 0;
  std::string formula;
};
RegisterEstimate estimate_registers_sm80(const TileConfig& cfg);

struct Occupancy {
  int by_smem = 0, by_registers = 0, by_threads = 0, by_cta_cap = 0;
  int ctas_per_sm = 0;
  std::string limiter;  // "shared memory", "registers", "threads", "CTA cap"
};
// regs_per_thread: the estimate or a measured value. static_smem: the kernel's own static bytes.
Occupancy occupancy(const ArchInfo& arch, int threads_per_cta, int regs_per_thread, size_t dynamic_smem,
                    size_t static_smem = 0);

struct Sm80Plan {
  TileConfig cfg;
  ArchInfo arch;
  Sm80SmemPlan smem;
  int max_stages_that_fit = 0;  // with this bn/bt/bk/warps on this arch (pipeline configs)
  int64_t max_k_that_fits = 0;  // stream configs: the largest K (a multiple of 64) whose rows fit
  RegisterEstimate regs;
  Occupancy occ;                // with the estimated registers
  Verdict verdict;              // static validity on the arch (no problem shape)
};
// static_smem: the compiled kernel's static shared memory when known (0 from the planner's view).
// k: the problem's K, for stream configs (0: judged without the activation rows).
Sm80Plan plan_sm80(const TileConfig& cfg, const ArchInfo& arch, size_t static_smem = 0, int64_t k = 0);

// A problem: E experts, rows per expert (ragged), N and K of the GEMM.
struct GemmProblem {
  std::vector<int64_t> rows;  // rows of each expert (size E)
  int64_t n = 0;
  int64_t k = 0;
  static GemmProblem uniform(int experts, int64_t rows_per_expert, int64_t n, int64_t k);
};

struct WorkEstimate {
  int64_t tiles = 0;        // sum_e ceil(rows_e / bt) * ceil(n / bn)
  int64_t slots = 0;        // SMs * CTAs per SM
  double waves = 0.0;       // tiles / slots
  int64_t full_waves = 0;   // ceil(tiles / slots)
  double last_wave_fill = 0.0;  // fraction of slots busy in the last wave
};
WorkEstimate work_estimate(const GemmProblem& p, int bn, int bt, int num_sms, int ctas_per_sm);

// Shape rules of the sm80 kernel: N % 16 == 0 (m16 tiles / repack), K % 64 == 0 (repack chunk),
// K % bk == 0 (no K tail in the pipeline), E <= kMaxExperts; SwiGLU also N even.
// With arch, also the K-dependent shared memory of stream configs.
Verdict check_problem_sm80(const TileConfig& cfg, int64_t n, int64_t k, int experts,
                           const ArchInfo* arch = nullptr);

// Every config of kGemmConfigs that is valid on the arch.
std::vector<TileConfig> valid_sm80_configs(const ArchInfo& arch);

// ---- cutlass-sm120-nvfp4-grouped ----

struct CutlassTile {
  int m = 128, n = 128, k = 128;
};

// The epilogue's share (bytes), which the kernel user passes to StageCountAutoCarveout as
// sizeof(CollectiveEpilogue::SharedStorage) and which the kernel's SharedStorage also contains.
struct CutlassEpilogueModel {
  size_t tensor_bytes = 0;     // the epilogue's TensorStorage inside the kernel's tensors
  size_t carveout_bytes = 0;   // what StageCountAutoCarveout subtracts
  int tensormaps = 2;          // TMA descriptors of the epilogue (C and D)
  std::string description;
};
// TMA-store epilogue, bf16 D, no C source, EpilogueTileAuto for the cooperative schedule (128 x 32),
// 2 D stages: 2 * 128 * 32 * 2 B = 16,384 B; carveout = that + its load-pipeline barriers (16 B).
CutlassEpilogueModel cutlass_default_epilogue(const CutlassTile& t);

struct CutlassSm120Plan {
  CutlassTile tile;
  size_t capacity = 101376;     // sm120_smem_capacity_bytes
  size_t a_stage = 0, b_stage = 0, sfa_stage = 0, sfb_stage = 0, barrier_stage = 0, per_stage = 0;
  int auto_stages = 0;          // what the 4.2-era StageCountAutoCarveout picks
  int stages = 0;               // used (auto or the override)
  // the kernel's real SharedStorage with those stages:
  size_t mainloop_tensors = 0;  // A, B (1024-aligned), SFA, SFB (16-aligned), struct-aligned
  size_t tensors = 0;           // mainloop + epilogue tensors, 1024-aligned
  size_t pipelines = 0;         // scheduler, mainloop, epilogue-load pipelines + load-order barrier
  size_t scheduler_responses = 0;
  size_t tensormaps = 0;
  size_t footprint = 0;         // sizeof(SharedStorage), rounded to its 1024-byte alignment
  size_t ignored_by_auto = 0;   // footprint - (stages * per_stage + carveout)
  int64_t over_by = 0;          // footprint - capacity (> 0: launch fails)
  int max_stages_that_fit = 0;  // with the real accounting
  CutlassEpilogueModel epilogue;
  std::vector<SmemLine> lines;
  Verdict verdict;
};
// stages_override = 0: the 4.2-era automatic count. capacity: the arch's opt-in bytes.
CutlassSm120Plan plan_cutlass_sm120(const CutlassTile& t, int stages_override = 0,
                                    std::optional<CutlassEpilogueModel> epilogue = std::nullopt,
                                    size_t capacity = 101376);

// "12,345" (thousands separators, for explain's lines).
std::string with_commas(int64_t v);

}  // namespace fp4moe

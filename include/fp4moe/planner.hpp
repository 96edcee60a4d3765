// Tile planner: for a kernel family, a tile configuration and an architecture, the exact shared-memory
// footprint (line by line), the stages that fit, CTAs per SM (by shared memory, registers, threads,
// the CTA cap), the work tiles and waves of a problem, the alignment rules, and a verdict whose reason
// names the resource, what is needed and what is available.
//
// Families:
//  "sm80-nvfp4-grouped"          this library's kernel (kGemmConfigs); the planner recounts every buffer
//                                of gemm_smem_layout from first principles (a test asserts equality).
//  "cutlass-sm120-nvfp4-grouped" CUTLASS 4.2's sm_120 block-scaled NVFP4 ptr-array grouped GEMM as
//                                TensorRT-LLM instantiates it: what StageCountAutoCarveout picks and what
//                                the kernel needs (cutlass_sm120_model.hpp; tests/cutlass/ proves it
//                                against the compiled CUTLASS types).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/arch.hpp"
#include "fp4moe/cutlass_sm120_model.hpp"
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
  size_t barrier_bytes = 0;  // tma configs: full + empty mbarrier per stage
  size_t row_scale_bytes = 0;  // tma configs: bt floats per consumer warp (the epilogue's routing weights)
  size_t bias_bytes = 0;       // tma configs: 16 floats per m16 tile of a consumer warp (the epilogue's biases)
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
// K % bk == 0 unless the config has a K tail (tile_config_has_k_tail: the tma configs), E <= kMaxExperts;
// SwiGLU also N even.
// With arch, also the K-dependent shared memory of stream configs.
Verdict check_problem_sm80(const TileConfig& cfg, int64_t n, int64_t k, int experts,
                           const ArchInfo* arch = nullptr);

// Every config of kGemmConfigs that is valid on the arch.
std::vector<TileConfig> valid_sm80_configs(const ArchInfo& arch);

// ---- cutlass-sm120-nvfp4-grouped ----
// CUTLASS 4.2's kernel as TensorRT-LLM's MoE launcher instantiates it (cutlass_sm120_model.hpp); the
// arithmetic is proven equal to the compiled CUTLASS types by tests/cutlass/.

struct CutlassSm120Options {
  int stages = 0;                        // 0: StageCountAutoCarveout; else StageCount<stages>
  std::optional<size_t> carveout;        // passed to StageCountAutoCarveout; default: the epilogue's
                                         // SharedStorage, as TensorRT-LLM passes it
  CutlassSchedule schedule = CutlassSchedule::kCooperative;  // KernelScheduleAuto = cooperative
  CutlassEpilogueSpec epilogue{};
  size_t capacity = kCutlassSm120SmemCapacity;  // the arch's opt-in bytes per block
};

struct CutlassSm120Plan {
  CutlassTile tile;
  CutlassSm120Options options;
  size_t capacity = kCutlassSm120SmemCapacity;
  size_t carveout = 0;
  CutlassEpilogueLayout epilogue;
  CutlassMainloopLayout mainloop;   // for `stages`
  CutlassKernelLayout kernel;       // for `stages`
  int auto_stages = 0;              // what StageCountAutoCarveout<carveout> picks
  int stages = 0;                   // used (auto or the override)
  size_t counted_by_auto = 0;       // stages * per-stage bytes + carveout: what the auto count budgets
  int64_t ignored_by_auto = 0;      // footprint - counted_by_auto (alignment, tensor maps, scheduler)
  int64_t over_by = 0;              // footprint - capacity (> 0: cudaFuncSetAttribute fails at launch)
  int max_stages_that_fit = 0;      // with the real accounting
  // The largest auto carveout that still makes StageCountAutoCarveout pick max_stages_that_fit.
  size_t carveout_for_max_stages = 0;
  std::string fix;                  // one line: what to pass so the kernel fits (or that none is needed)
  std::vector<SmemLine> lines;
  Verdict verdict;
};
CutlassSm120Plan plan_cutlass_sm120(const CutlassTile& t, const CutlassSm120Options& options = {});

// "12,345" (thousands separators, for explain's lines).
std::string with_commas(int64_t v);

}  // namespace fp4moe

// The grouped-GEMM benchmark (issue 3): GEMM1 (gate+up, SwiGLU) + GEMM2 (down) of a preset's MoE
// experts with NVFP4 weights, against cuBLAS bf16 per-expert GEMMs on the same problem.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <memory>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "bench_common.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe::bench {

struct GemmBenchRow {
  int64_t tokens = 0;
  int active_experts = 0;
  double weight_bytes = 0;  // NVFP4 bytes (codes + E4M3 scales) of the active experts, both GEMMs
  double flops = 0;         // useful: 2 * rows * (N1*K1 + N2*K2)
  double fp4_us = 0;
  double bf16_us = 0;       // 0 when the baseline was not run
  TileConfig cfg1, cfg2;    // the configs timed as fp4_us (tuner cache, else heuristic)
  bool tuned = false;       // cfg1/cfg2 came from a tuner table
  std::string source1, source2;  // choose_config's source: "tuned table <path>" or "heuristic"
  double heuristic_us = 0;  // with heuristic_tile_config's picks (compare_heuristic), 0 otherwise
  TileConfig hcfg1, hcfg2;
  std::string trace;        // with GemmBenchOptions::trace: the stream kernels' timeline summary
};

struct GemmBenchOptions {
  std::vector<int64_t> tokens;
  bool baseline = true;
  int reps = 20;
  uint64_t seed = 1;
  std::optional<TileConfig> force1, force2;  // otherwise heuristic / tuned
  bool compare_heuristic = false;             // also time heuristic_tile_config's picks
  bool trace = false;                         // one more eager pass with the stream kernels' timeline
};

// Summary of a stream-config launch's timeline (GroupedGemmArgs::trace: kStreamTraceSlots values per
// warp, slots StreamTraceSlot in tile_config.hpp; warps that never wrote their entry are skipped).
std::string summarize_stream_trace(const std::vector<unsigned long long>& v, int warps_per_cta,
                                   const std::string& title);

std::vector<GemmBenchRow> run_gemm_bench(const MoeConfig& cfg, const GemmBenchOptions& opt, cudaStream_t stream);

// The bf16 baseline a user would otherwise run: per-expert cuBLAS GEMMs (bf16 in/out, fp32 accumulate)
// for gate+up, SwiGLU, per-expert down GEMMs, optional per-row scale (the routing weight).
struct Bf16Experts {
  int experts = 0;
  int64_t hidden = 0, inter = 0;
  void* w1 = nullptr;  // bf16 [E, 2I, H] ([gate; up] rows)
  void* w2 = nullptr;  // bf16 [E, H, I]
  ~Bf16Experts();
};
std::unique_ptr<Bf16Experts> make_bf16_experts(int experts, int64_t hidden, int64_t inter, uint64_t seed,
                                               cudaStream_t s);
// offsets: host copy of the expert offsets (the baseline needs the sizes on the host, as a user's
// per-expert loop would). x [rows, H] -> y1 [rows, 2I] -> act [rows, I] -> y2 [rows, H].
void record_bf16_expert_gemms(cublasHandle_t h, const Bf16Experts& w, const std::vector<int32_t>& offsets,
                              const void* x, void* y1, void* act, void* y2, const float* row_scale, cudaStream_t s);

}  // namespace fp4moe::bench

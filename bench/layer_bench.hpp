// The whole-layer benchmark (issue 4, the README's main job): routing + permutation + both expert
// GEMMs + combine, per token count, against the same pipeline with bf16 cuBLAS expert GEMMs.
#pragma once
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "bench_common.hpp"
#include "fp4moe/config.hpp"

namespace fp4moe::bench {

struct LayerBenchOptions {
  std::vector<int64_t> tokens;  // default {1, 8, 32, 128, 512, 1024, 4096}
  bool baseline = true;
  bool breakdown = false;
  bool timeline = false;  // one graph replay's kernels on the GPU clock (kernel_timeline.hpp)
  int reps = 20;
  uint64_t seed = 1;
};

// Prints a table and appends results to out["layer"].
void run_layer_bench(const MoeConfig& cfg, const LayerBenchOptions& opt, const Ceilings& c, cudaStream_t stream,
                     nlohmann::json& out);

}  // namespace fp4moe::bench

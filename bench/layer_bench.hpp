// The whole-layer benchmark (issue 4, the README's main job): routing + permutation + both expert
// GEMMs + combine, per token count, against the same pipeline with bf16 cuBLAS expert GEMMs.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "bench_common.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/moe_layer.hpp"

namespace fp4moe::bench {

struct LayerBenchOptions {
  std::vector<int64_t> tokens;  // default {1, 8, 32, 128, 512, 1024, 4096}
  bool baseline = true;
  bool breakdown = false;
  bool timeline = false;  // one graph replay's kernels on the GPU clock (kernel_timeline.hpp)
  int reps = 20;
  uint64_t seed = 1;
  // the routed GEMMs' configs at every T (MoeLayer::set_tile_configs); otherwise the tables' / heuristic's
  std::optional<TileConfig> force1, force2;
};

// The synthetic layer that the bench and the in-layer tuner time: weights from
// make_synthetic_layer_device, routed uniformly at random (the synthetic router bias zeroed, as the
// targets' baselines route: docs/performance-targets.md), inputs for up to max_tokens tokens.
struct SyntheticLayerRig {
  std::unique_ptr<MoeLayer> layer;
  DeviceBuffer<float> router_bias;  // the zeroed bias (E floats; empty without one), for the baseline's router
  DeviceBuffer<uint8_t> ws;
  DeviceBuffer<uint16_t> hidden, out;
  DeviceBuffer<float> logits;
  void forward(cudaStream_t s, int64_t tokens) const {
    layer->forward(s, hidden.get(), tokens, logits.get(), out.get(), ws.get(), ws.bytes());
  }
};
SyntheticLayerRig make_synthetic_layer_rig(const MoeConfig& cfg, uint64_t seed, int64_t max_tokens, cudaStream_t s);

// Prints a table and appends results to out["layer"].
void run_layer_bench(const MoeConfig& cfg, const LayerBenchOptions& opt, const Ceilings& c, cudaStream_t stream,
                     nlohmann::json& out);

}  // namespace fp4moe::bench

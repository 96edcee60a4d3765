// Synthetic MoE layers generated on the device (moe_layer.hpp): make_synthetic_expert's recipe for all
// experts at once. Device code: include/fp4moe/kernels/synthetic_weights.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/kernels/synthetic_weights.cuh"
#include "fp4moe/moe_layer.hpp"

namespace fp4moe {

namespace {

// synthetic_weight_std (reference.cpp), computed on the host and passed to the kernels as a value.
float weight_std(int64_t k) { return 1.0f / std::sqrt(static_cast<float>(k)); }

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// One GEMM1 (gate + up) or GEMM2 (down) tensor set of `experts` experts of width `width`.
struct ExpertSetTensors {
  SynthTensor gate, up, down;
  uint32_t expert_base;  // hash expert index of expert 0 (routed: 0; shared: 0)
  uint32_t bias_base;    // hash expert index for the biases (routed: 0; shared: 0xffffffff)
};

struct ExpertSetOut {
  uint8_t* w13_codes;
  uint8_t* w13_scales;
  float* w13_global;
  uint8_t* w2_codes;
  uint8_t* w2_scales;
  float* w2_global;
  float* b13;  // or null
  float* b2;   // or null
};

void quantize_set_mxfp4(uint64_t seed, SynthTensor t, uint32_t expert_base, int experts, int64_t rows, int64_t cols,
                        float std, int64_t dst_row0, int64_t dst_rows, uint8_t* codes, uint8_t* scales,
                        cudaStream_t stream) {
  const int64_t blocks32 = rows * cols / kMxfp4Block;
  const dim3 grid(blocks_for(blocks32, 256), static_cast<unsigned>(experts));
  kernels::synth_quantize_mxfp4_kernel<<<grid, 256, 0, stream>>>(seed, static_cast<uint32_t>(t), expert_base, rows,
                                                                 cols, std, dst_row0, dst_rows, codes, scales);
  FP4MOE_CUDA_CHECK_LAUNCH();
}

void quantize_set(uint64_t seed, SynthTensor t, uint32_t expert_base, int experts, int64_t rows, int64_t cols,
                  float std, const float* global, int64_t dst_row0, int64_t dst_rows, uint8_t* codes,
                  uint8_t* scales, cudaStream_t stream) {
  const int64_t blocks16 = rows * cols / kNvfp4Block;
  const dim3 grid(blocks_for(blocks16, 256), static_cast<unsigned>(experts));
  kernels::synth_quantize_kernel<<<grid, 256, 0, stream>>>(seed, static_cast<uint32_t>(t), expert_base, rows, cols,
                                                           std, global, dst_row0, dst_rows, codes, scales);
  FP4MOE_CUDA_CHECK_LAUNCH();
}

void amax_set(uint64_t seed, SynthTensor t, uint32_t expert_base, int experts, int64_t rows, int64_t cols,
              float std, uint32_t* amax_bits, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(rows, 64)), static_cast<unsigned>(experts));
  kernels::synth_amax_kernel<<<grid, 256, 0, stream>>>(seed, static_cast<uint32_t>(t), expert_base, rows, cols,
                                                       std, amax_bits);
  FP4MOE_CUDA_CHECK_LAUNCH();
}

void generate_set(const MoeConfig& cfg, uint64_t seed, const ExpertSetTensors& t, int experts, int64_t width,
                  const ExpertSetOut& o, uint32_t* amax_scratch /*3 * experts*/, cudaStream_t stream) {
  const int64_t H = cfg.hidden;
  const float std1 = weight_std(H), std2 = weight_std(width);
  if (cfg.format == WeightFormat::kMxfp4) {
    quantize_set_mxfp4(seed, t.gate, t.expert_base, experts, width, H, std1, 0, 2 * width, o.w13_codes, o.w13_scales,
                       stream);
    quantize_set_mxfp4(seed, t.up, t.expert_base, experts, width, H, std1, width, 2 * width, o.w13_codes,
                       o.w13_scales, stream);
    quantize_set_mxfp4(seed, t.down, t.expert_base, experts, H, width, std2, 0, H, o.w2_codes, o.w2_scales, stream);
  } else {
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(amax_scratch, 0, 3 * experts * sizeof(uint32_t), stream));
  uint32_t* amax_g = amax_scratch;
  uint32_t* amax_u = amax_scratch + experts;
  uint32_t* amax_d = amax_scratch + 2 * experts;
  amax_set(seed, t.gate, t.expert_base, experts, width, H, std1, amax_g, stream);
  amax_set(seed, t.up, t.expert_base, experts, width, H, std1, amax_u, stream);
  amax_set(seed, t.down, t.expert_base, experts, H, width, std2, amax_d, stream);
  kernels::synth_global_kernel<<<blocks_for(experts, 256), 256, 0, stream>>>(amax_g, amax_u, experts, o.w13_global);
  FP4MOE_CUDA_CHECK_LAUNCH();
  kernels::synth_global_kernel<<<blocks_for(experts, 256), 256, 0, stream>>>(amax_d, nullptr, experts, o.w2_global);
  FP4MOE_CUDA_CHECK_LAUNCH();
  quantize_set(seed, t.gate, t.expert_base, experts, width, H, std1, o.w13_global, 0, 2 * width, o.w13_codes,
               o.w13_scales, stream);
  quantize_set(seed, t.up, t.expert_base, experts, width, H, std1, o.w13_global, width, 2 * width, o.w13_codes,
               o.w13_scales, stream);
  quantize_set(seed, t.down, t.expert_base, experts, H, width, std2, o.w2_global, 0, H, o.w2_codes, o.w2_scales,
               stream);
  }
  if (o.b13 != nullptr) {
    // synth_bias: gate then up are columns [0, 2 * width) of one kBias1 row.
    const dim3 g1(blocks_for(2 * width, 256), static_cast<unsigned>(experts));
    kernels::synth_bias_kernel<<<g1, 256, 0, stream>>>(seed, static_cast<uint32_t>(SynthTensor::kBias1), t.bias_base,
                                                       0, 2 * width, 2 * width, 0, o.b13);
    FP4MOE_CUDA_CHECK_LAUNCH();
    const dim3 g2(blocks_for(H, 256), static_cast<unsigned>(experts));
    kernels::synth_bias_kernel<<<g2, 256, 0, stream>>>(seed, static_cast<uint32_t>(SynthTensor::kBias2), t.bias_base,
                                                       0, H, H, 0, o.b2);
    FP4MOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

SyntheticDeviceLayer make_synthetic_layer_device(const MoeConfig& cfg, uint64_t seed, cudaStream_t stream,
                                                 bool with_router_weight) {
  validate_moe_layer_config(cfg);
  SyntheticDeviceLayer L;
  L.cfg = cfg;
  L.seed = seed;
  auto alloc = [&](size_t bytes) -> void* {
    L.buffers.emplace_back(bytes);
    return L.buffers.back().get();
  };
  const int E = cfg.num_experts;
  const int64_t H = cfg.hidden, I = cfg.intermediate, Is = I * cfg.num_shared;
  // MXFP4: one E8M0 scale per 32 and no global scale (MoeLayerWeights' MXFP4 layout)
  const bool mx = cfg.format == WeightFormat::kMxfp4;
  const int64_t blk = mx ? kMxfp4Block : kNvfp4Block;
  auto* amax = static_cast<uint32_t*>(alloc(3 * static_cast<size_t>(std::max(E, 1)) * sizeof(uint32_t)));

  {
    ExpertSetOut o{};
    o.w13_codes = static_cast<uint8_t*>(alloc(static_cast<size_t>(E * 2 * I * H / 2)));
    o.w13_scales = static_cast<uint8_t*>(alloc(static_cast<size_t>(E * 2 * I * H / blk)));
    o.w13_global = mx ? nullptr : static_cast<float*>(alloc(E * sizeof(float)));
    o.w2_codes = static_cast<uint8_t*>(alloc(static_cast<size_t>(E * H * I / 2)));
    o.w2_scales = static_cast<uint8_t*>(alloc(static_cast<size_t>(E * H * I / blk)));
    o.w2_global = mx ? nullptr : static_cast<float*>(alloc(E * sizeof(float)));
    if (cfg.expert_bias) {
      o.b13 = static_cast<float*>(alloc(static_cast<size_t>(E * 2 * I) * sizeof(float)));
      o.b2 = static_cast<float*>(alloc(static_cast<size_t>(E * H) * sizeof(float)));
    }
    generate_set(cfg, seed, {SynthTensor::kW1Gate, SynthTensor::kW1Up, SynthTensor::kW2, 0u, 0u}, E, I, o, amax,
                 stream);
    MoeLayerWeights& w = L.weights;
    w.w13_codes = o.w13_codes;
    w.w13_scales = o.w13_scales;
    w.w13_global = o.w13_global;
    w.w2_codes = o.w2_codes;
    w.w2_scales = o.w2_scales;
    w.w2_global = o.w2_global;
    w.b13 = o.b13;
    w.b2 = o.b2;
  }
  if (cfg.num_shared > 0) {
    // The amax scratch is reused: stream order serializes the two sets.
    ExpertSetOut o{};
    o.w13_codes = static_cast<uint8_t*>(alloc(static_cast<size_t>(2 * Is * H / 2)));
    o.w13_scales = static_cast<uint8_t*>(alloc(static_cast<size_t>(2 * Is * H / blk)));
    o.w13_global = mx ? nullptr : static_cast<float*>(alloc(sizeof(float)));
    o.w2_codes = static_cast<uint8_t*>(alloc(static_cast<size_t>(H * Is / 2)));
    o.w2_scales = static_cast<uint8_t*>(alloc(static_cast<size_t>(H * Is / blk)));
    o.w2_global = mx ? nullptr : static_cast<float*>(alloc(sizeof(float)));
    if (cfg.expert_bias) {
      o.b13 = static_cast<float*>(alloc(static_cast<size_t>(2 * Is) * sizeof(float)));
      o.b2 = static_cast<float*>(alloc(static_cast<size_t>(H) * sizeof(float)));
    }
    generate_set(cfg, seed, {SynthTensor::kSharedGate, SynthTensor::kSharedUp, SynthTensor::kSharedDown, 0u,
                             0xffffffffu},
                 1, Is, o, amax, stream);
    MoeLayerWeights& w = L.weights;
    w.shared_w13_codes = o.w13_codes;
    w.shared_w13_scales = o.w13_scales;
    w.shared_w13_global = o.w13_global;
    w.shared_w2_codes = o.w2_codes;
    w.shared_w2_scales = o.w2_scales;
    w.shared_w2_global = o.w2_global;
    w.shared_b13 = o.b13;
    w.shared_b2 = o.b2;
  }
  if (cfg.router != RouterKind::kSoftmaxTopK) {
    // make_synthetic_router_bias: synth_activation(seed, kRouterBias, 0, e, 0.1f).
    auto* b = static_cast<float*>(alloc(E * sizeof(float)));
    kernels::synth_activation_kernel<<<blocks_for(E, 256), 256, 0, stream>>>(
        seed, static_cast<uint32_t>(SynthTensor::kRouterBias), 1, E, 0.1f, b, nullptr);
    FP4MOE_CUDA_CHECK_LAUNCH();
    L.weights.router_bias = b;
  }
  if (with_router_weight) {
    auto* rw = static_cast<uint16_t*>(alloc(static_cast<size_t>(E * H) * 2));
    kernels::synth_router_weight_kernel<<<blocks_for(E * H, 256), 256, 0, stream>>>(seed, E, H, weight_std(H), rw);
    FP4MOE_CUDA_CHECK_LAUNCH();
    L.weights.router_weight = rw;
  }
  return L;
}

void make_synthetic_hidden_device(const MoeConfig& cfg, uint64_t seed, int64_t tokens, void* hidden_bf16,
                                  cudaStream_t stream) {
  FP4MOE_REQUIRE(tokens > 0 && hidden_bf16 != nullptr,
                 "make_synthetic_hidden_device: tokens = {} must be > 0 and hidden_bf16 = {} non-null", tokens,
                 hidden_bf16);
  kernels::synth_activation_kernel<<<blocks_for(tokens * cfg.hidden, 256), 256, 0, stream>>>(
      seed, static_cast<uint32_t>(SynthTensor::kHidden), tokens, cfg.hidden, 1.0f, nullptr,
      static_cast<uint16_t*>(hidden_bf16));
  FP4MOE_CUDA_CHECK_LAUNCH();
}

void make_synthetic_router_logits_device(const MoeConfig& cfg, uint64_t seed, int64_t tokens, float* logits,
                                         cudaStream_t stream) {
  FP4MOE_REQUIRE(tokens > 0 && logits != nullptr,
                 "make_synthetic_router_logits_device: tokens = {} must be > 0 and logits = {} non-null", tokens,
                 static_cast<const void*>(logits));
  kernels::synth_activation_kernel<<<blocks_for(tokens * cfg.num_experts, 256), 256, 0, stream>>>(
      seed, static_cast<uint32_t>(SynthTensor::kRouterLogits), tokens, cfg.num_experts, 2.0f, logits, nullptr);
  FP4MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4moe

// MoE layer configuration and the model presets (docs/models.md).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fp4moe {

enum class RouterKind {
  kSoftmaxTopK,      // softmax -> top-k -> optional renormalize (Qwen3, Mixtral)
  kSigmoidGrouped,   // sigmoid + correction bias, grouped top-k, routed scaling (DeepSeek-V3, GLM, Kimi)
  kGptOss,           // router bias; top-k on logits; softmax over the k chosen
};

enum class Activation {
  kSwiGLU,           // silu(gate) * up
  kGptOssSwiGLU,     // gate=min(gate,limit); up=clamp(up,-limit,limit); (up+1)*gate*sigmoid(alpha*gate)
};

enum class WeightFormat { kNvfp4, kMxfp4 };

struct MoeConfig {
  std::string name;
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I (moe_intermediate_size)
  int num_experts = 0;       // E (routed)
  int top_k = 0;
  int num_shared = 0;        // shared experts (each of width I * num_shared ... see docs/models.md)
  RouterKind router = RouterKind::kSoftmaxTopK;
  bool renormalize = true;
  int n_group = 1;
  int topk_group = 1;
  float routed_scaling = 1.0f;
  Activation activation = Activation::kSwiGLU;
  float swiglu_alpha = 1.702f;   // gpt-oss only
  float swiglu_limit = 7.0f;     // gpt-oss only
  bool expert_bias = false;      // gpt-oss: GEMM1/GEMM2 biases
  WeightFormat format = WeightFormat::kNvfp4;

  // GEMM shapes per expert: GEMM1 (gate and up fused) N = 2I, K = H; GEMM2 (down) N = H, K = I.
  int64_t gemm1_n() const { return 2 * intermediate; }
  int64_t gemm1_k() const { return hidden; }
  int64_t gemm2_n() const { return hidden; }
  int64_t gemm2_k() const { return intermediate; }

  // Throws fp4moe::Error naming the field and the rule when the config is not runnable.
  void validate() const;
};

// Presets: glm-5, glm-4.6, deepseek-v3, kimi-k2, qwen3-235b, qwen3-30b, gpt-oss-120b, mixtral-8x7b, tiny.
const MoeConfig& preset(std::string_view name);   // throws naming the unknown preset and the known ones
std::vector<std::string> preset_names();

}  // namespace fp4moe

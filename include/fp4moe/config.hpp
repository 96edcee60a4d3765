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

  // The widths the GEMM kernels run. The repacked weight layout works in 64-wide K chunks, so an
  // intermediate size that is only a multiple of the scale block (a tensor-parallel slice: qwen3-30b at
  // tp 8 has I = 96; gpt-oss's MXFP4 at tp 2, 1440) is run as the next multiple of 64. The layer
  // zero-pads each expert's gate and up rows and its down columns once, at construction; the added
  // features compute exactly 0, so the result equals the unpadded layer's (docs/format.md, "Intermediate
  // sizes that are not multiples of 64"). Equal to intermediate when it is a multiple of 64.
  int64_t kernel_intermediate() const { return (intermediate + 63) / 64 * 64; }
  // The shared expert's kernel width: intermediate * num_shared rounded up the same way.
  int64_t kernel_shared_intermediate() const { return (intermediate * num_shared + 63) / 64 * 64; }
  // The scale block of `format` along K: 16 (NVFP4) or 32 (MXFP4).
  int scale_block() const { return format == WeightFormat::kMxfp4 ? 32 : 16; }

  // The GEMM problems per expert, as the kernels run them: GEMM1 (gate and up fused) N = 2I, K = H;
  // GEMM2 (down) N = H, K = I, with I = kernel_intermediate().
  int64_t gemm1_n() const { return 2 * kernel_intermediate(); }
  int64_t gemm1_k() const { return hidden; }
  int64_t gemm2_n() const { return hidden; }
  int64_t gemm2_k() const { return kernel_intermediate(); }

  // Throws fp4moe::Error naming the field and the rule when the config is not runnable.
  void validate() const;
};

// One rank's slice of a layer whose experts are split tensor-parallel over `tp` ranks: every expert (and
// the shared expert) keeps intermediate / tp of its features; router, hidden and experts are unchanged,
// and each rank's output is a partial sum that the engine all-reduces (the down-projection bias, when
// the model has one, is then added on one rank only: the engine's business). Throws naming tp and the
// rule when intermediate / tp is not a whole number of scale blocks. tp = 1 returns cfg unchanged.
MoeConfig tensor_parallel_slice(const MoeConfig& cfg, int tp);

// Presets: glm-5, glm-4.6, deepseek-v3, kimi-k2, qwen3-235b, qwen3-30b, gpt-oss-120b, mixtral-8x7b, tiny.
const MoeConfig& preset(std::string_view name);   // throws naming the unknown preset and the known ones
std::vector<std::string> preset_names();
// A list of presets as the command line takes it: comma-separated names ("glm-5,kimi-k2"), or "all" for
// every model preset (all but "tiny", the test preset). Duplicates are dropped, order kept; an unknown
// or empty name throws naming it and the known presets.
std::vector<std::string> parse_preset_list(std::string_view spec);

}  // namespace fp4moe

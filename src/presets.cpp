// Model presets (values and sources: docs/models.md) and MoeConfig::validate().
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <fmt/ranges.h>

#include "fp4moe/config.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe {

namespace {

MoeConfig sigmoid_grouped(std::string name, int64_t h, int64_t i, int e, int k, int shared, int n_group,
                          int topk_group, float scaling) {
  MoeConfig c;
  c.name = std::move(name);
  c.hidden = h;
  c.intermediate = i;
  c.num_experts = e;
  c.top_k = k;
  c.num_shared = shared;
  c.router = RouterKind::kSigmoidGrouped;
  c.renormalize = true;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.routed_scaling = scaling;
  return c;
}

MoeConfig softmax_topk(std::string name, int64_t h, int64_t i, int e, int k) {
  MoeConfig c;
  c.name = std::move(name);
  c.hidden = h;
  c.intermediate = i;
  c.num_experts = e;
  c.top_k = k;
  c.router = RouterKind::kSoftmaxTopK;
  c.renormalize = true;
  return c;
}

std::vector<MoeConfig> make_presets() {
  std::vector<MoeConfig> p;
  p.push_back(sigmoid_grouped("glm-5", 6144, 2048, 256, 8, 1, 1, 1, 2.5f));
  p.push_back(sigmoid_grouped("glm-4.6", 5120, 1536, 160, 8, 1, 1, 1, 2.5f));
  p.push_back(sigmoid_grouped("deepseek-v3", 7168, 2048, 256, 8, 1, 8, 4, 2.5f));
  p.push_back(sigmoid_grouped("kimi-k2", 7168, 2048, 384, 8, 1, 1, 1, 2.827f));
  p.push_back(softmax_topk("qwen3-235b", 4096, 1536, 128, 8));
  p.push_back(softmax_topk("qwen3-30b", 2048, 768, 128, 8));
  {
    MoeConfig c;
    c.name = "gpt-oss-120b";
    c.hidden = 2880;
    c.intermediate = 2880;
    c.num_experts = 128;
    c.top_k = 4;
    c.router = RouterKind::kGptOss;
    c.renormalize = false;  // the softmax over the k chosen already sums to 1
    c.activation = Activation::kGptOssSwiGLU;
    c.swiglu_alpha = 1.702f;
    c.swiglu_limit = 7.0f;
    c.expert_bias = true;
    // The released checkpoint is MXFP4 (32-element blocks, E8M0 scales), and so is the preset: the
    // GEMM runs it through the same kernel layout (nvfp4_weight_layout.hpp, MXFP4 scale decode).
    c.format = WeightFormat::kMxfp4;
    p.push_back(c);
  }
  p.push_back(softmax_topk("mixtral-8x7b", 4096, 14336, 8, 2));
  // tiny: small enough for exhaustive CPU tests, but it exercises every feature of the largest
  // router: grouped selection (2 groups of 4, 1 kept), correction bias, scaling, a shared expert.
  p.push_back(sigmoid_grouped("tiny", 256, 128, 8, 2, 1, 2, 1, 2.5f));
  return p;
}

const std::vector<MoeConfig>& presets() {
  static const std::vector<MoeConfig> p = make_presets();
  return p;
}

}  // namespace

void MoeConfig::validate() const {
  const std::string& n = name;
  FP4MOE_REQUIRE(hidden > 0 && hidden % 64 == 0,
                 "config '{}': hidden = {} must be a positive multiple of 64 (GEMM1's K runs in 64-wide "
                 "chunks; hidden is not padded)", n, hidden);
  // intermediate only needs whole scale blocks: the layer pads it to the kernels' 64 (kernel_intermediate).
  FP4MOE_REQUIRE(intermediate > 0 && intermediate % scale_block() == 0,
                 "config '{}': intermediate = {} must be a positive multiple of {} (the {} scale block along "
                 "GEMM2's K; a tensor-parallel slice of the experts must cut at a block boundary)",
                 n, intermediate, scale_block(), format == WeightFormat::kMxfp4 ? "MXFP4" : "NVFP4");
  FP4MOE_REQUIRE(num_experts >= 1 && num_experts <= kMaxExperts,
                 "config '{}': num_experts = {} must be in [1, {}] (the routing and tile scheduler limit)",
                 n, num_experts, kMaxExperts);
  FP4MOE_REQUIRE(top_k >= 1 && top_k <= kMaxTopK,
                 "config '{}': top_k = {} must be in [1, {}]", n, top_k, kMaxTopK);
  FP4MOE_REQUIRE(top_k <= num_experts, "config '{}': top_k = {} must be <= num_experts = {}", n, top_k,
                 num_experts);
  FP4MOE_REQUIRE(num_shared >= 0 && num_shared <= 16,
                 "config '{}': num_shared = {} must be in [0, 16]", n, num_shared);
  FP4MOE_REQUIRE(n_group >= 1, "config '{}': n_group = {} must be >= 1", n, n_group);
  FP4MOE_REQUIRE(num_experts % n_group == 0,
                 "config '{}': n_group = {} must divide num_experts = {}", n, n_group, num_experts);
  FP4MOE_REQUIRE(topk_group >= 1 && topk_group <= n_group,
                 "config '{}': topk_group = {} must be in [1, n_group = {}]", n, topk_group, n_group);
  if (router == RouterKind::kSigmoidGrouped) {
    const int group_size = num_experts / n_group;
    // The group score is the sum of the group's top-2 biased scores, so a group needs two experts.
    FP4MOE_REQUIRE(n_group == 1 || group_size >= 2,
                   "config '{}': num_experts / n_group = {} / {} = {} experts per group; grouped routing "
                   "needs >= 2 (the group score sums the top 2)", n, num_experts, n_group, group_size);
    FP4MOE_REQUIRE(top_k <= topk_group * group_size,
                   "config '{}': top_k = {} must be <= topk_group * experts per group = {} * {} = {} "
                   "(the experts that survive group selection)", n, top_k, topk_group, group_size,
                   topk_group * group_size);
  } else {
    FP4MOE_REQUIRE(n_group == 1 && topk_group == 1,
                   "config '{}': n_group = {}, topk_group = {}: group selection applies only to the "
                   "sigmoid grouped router; set both to 1", n, n_group, topk_group);
  }
  FP4MOE_REQUIRE(std::isfinite(routed_scaling) && routed_scaling > 0.0f,
                 "config '{}': routed_scaling = {} must be finite and > 0", n, routed_scaling);
  if (activation == Activation::kGptOssSwiGLU) {
    FP4MOE_REQUIRE(std::isfinite(swiglu_alpha) && swiglu_alpha > 0.0f,
                   "config '{}': swiglu_alpha = {} must be finite and > 0", n, swiglu_alpha);
    FP4MOE_REQUIRE(std::isfinite(swiglu_limit) && swiglu_limit > 0.0f,
                   "config '{}': swiglu_limit = {} must be finite and > 0", n, swiglu_limit);
  }
}

MoeConfig tensor_parallel_slice(const MoeConfig& cfg, int tp) {
  FP4MOE_REQUIRE(tp >= 1, "tensor parallel: tp = {} must be >= 1", tp);
  if (tp == 1) return cfg;
  FP4MOE_REQUIRE(cfg.intermediate % tp == 0 && (cfg.intermediate / tp) % cfg.scale_block() == 0,
                 "tensor parallel: tp = {} splits intermediate = {} of config '{}' into {} per rank; the slice must "
                 "be a whole number of {}-wide {} scale blocks (an engine pads the experts first, e.g. to {})",
                 tp, cfg.intermediate, cfg.name, static_cast<double>(cfg.intermediate) / tp, cfg.scale_block(),
                 cfg.format == WeightFormat::kMxfp4 ? "MXFP4" : "NVFP4",
                 (cfg.intermediate + int64_t{tp} * cfg.scale_block() - 1) / (int64_t{tp} * cfg.scale_block()) * tp *
                     cfg.scale_block());
  MoeConfig c = cfg;
  c.intermediate = cfg.intermediate / tp;
  c.name = fmt::format("{} tp{}", cfg.name, tp);
  c.validate();
  return c;
}

const MoeConfig& preset(std::string_view name) {
  for (const MoeConfig& c : presets())
    if (c.name == name) return c;
  FP4MOE_FAIL("unknown preset '{}'; known presets: {}", name, fmt::join(preset_names(), ", "));
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const MoeConfig& c : presets()) names.push_back(c.name);
  return names;
}

std::vector<std::string> parse_preset_list(std::string_view spec) {
  std::vector<std::string> out;
  if (spec == "all") {
    for (const MoeConfig& c : presets())
      if (c.name != "tiny") out.push_back(c.name);
    return out;
  }
  size_t at = 0;
  for (;;) {
    const size_t comma = spec.find(',', at);
    const std::string_view name = spec.substr(at, comma == std::string_view::npos ? std::string_view::npos : comma - at);
    FP4MOE_REQUIRE(!name.empty(), "model list '{}': empty name at position {} (write names separated by commas, or "
                   "'all'); known presets: {}", spec, at, fmt::join(preset_names(), ", "));
    const std::string n(preset(name).name);  // throws for an unknown name, listing the known ones
    if (std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
    if (comma == std::string_view::npos) break;
    at = comma + 1;
  }
  return out;
}

}  // namespace fp4moe

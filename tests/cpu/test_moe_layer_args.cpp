// The MoE layer's host-only checks: config limits, weight pointers, workspace layout (no GPU needed).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"

namespace fp4moe {
namespace {

// Fake, 16-byte aligned, never dereferenced addresses: the checks only look at the pointer values.
template <class T>
const T* fake(uintptr_t slot) {
  return reinterpret_cast<const T*>(0x10000 + slot * 0x100);
}

MoeLayerWeights complete_weights(const MoeConfig& cfg) {
  MoeLayerWeights w;
  w.w13_codes = fake<uint8_t>(1);
  w.w13_scales = fake<uint8_t>(2);
  const bool mx = cfg.format == WeightFormat::kMxfp4;  // MXFP4 has no global scales
  w.w13_global = mx ? nullptr : fake<float>(3);
  w.w2_codes = fake<uint8_t>(4);
  w.w2_scales = fake<uint8_t>(5);
  w.w2_global = mx ? nullptr : fake<float>(6);
  if (cfg.expert_bias) {
    w.b13 = fake<float>(7);
    w.b2 = fake<float>(8);
  }
  if (cfg.router != RouterKind::kSoftmaxTopK) w.router_bias = fake<float>(9);
  if (cfg.num_shared > 0) {
    w.shared_w13_codes = fake<uint8_t>(10);
    w.shared_w13_scales = fake<uint8_t>(11);
    w.shared_w13_global = mx ? nullptr : fake<float>(12);
    w.shared_w2_codes = fake<uint8_t>(13);
    w.shared_w2_scales = fake<uint8_t>(14);
    w.shared_w2_global = mx ? nullptr : fake<float>(15);
    if (cfg.expert_bias) {
      w.shared_b13 = fake<float>(16);
      w.shared_b2 = fake<float>(17);
    }
  }
  return w;
}

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MoeLayerArgs, EveryPresetIsAValidLayerConfig) {
  for (const std::string& name : preset_names()) {
    EXPECT_NO_THROW(validate_moe_layer_config(preset(name))) << name;
    EXPECT_NO_THROW(validate_moe_layer_weights(preset(name), complete_weights(preset(name)))) << name;
  }
}

TEST(MoeLayerArgs, RejectsUnsupportedConfigs) {
  MoeConfig g = preset("deepseek-v3");
  g.num_experts = 512;
  g.n_group = 64;
  g.topk_group = 4;
  EXPECT_NE(error_of([&] { validate_moe_layer_config(g); }).find("n_group = 64"), std::string::npos);
  MoeConfig k = preset("glm-5");
  k.top_k = 17;
  EXPECT_THROW(validate_moe_layer_config(k), Error);
}

TEST(MoeLayerArgs, RejectsMissingOrMisplacedWeights) {
  const MoeConfig& glm = preset("glm-5");
  MoeLayerWeights w = complete_weights(glm);
  w.w2_scales = nullptr;
  EXPECT_NE(error_of([&] { validate_moe_layer_weights(glm, w); }).find("w2_scales"), std::string::npos);
  w = complete_weights(glm);
  w.shared_w13_codes = nullptr;  // GLM-5 has a shared expert
  EXPECT_NE(error_of([&] { validate_moe_layer_weights(glm, w); }).find("shared_w13_codes"), std::string::npos);
  w = complete_weights(glm);
  w.w13_codes = reinterpret_cast<const uint8_t*>(0x10008);  // not 16-byte aligned
  EXPECT_NE(error_of([&] { validate_moe_layer_weights(glm, w); }).find("aligned"), std::string::npos);
  w = complete_weights(glm);
  w.b13 = fake<float>(20);  // biases without expert_bias
  EXPECT_NE(error_of([&] { validate_moe_layer_weights(glm, w); }).find("expert_bias"), std::string::npos);

  const MoeConfig& gptoss = preset("gpt-oss-120b");
  w = complete_weights(gptoss);
  w.b2 = nullptr;
  EXPECT_NE(error_of([&] { validate_moe_layer_weights(gptoss, w); }).find("b2"), std::string::npos);

  const MoeConfig& qwen = preset("qwen3-30b");
  w = complete_weights(qwen);
  w.router_bias = fake<float>(21);
  EXPECT_NE(error_of([&] { validate_moe_layer_weights(qwen, w); }).find("softmax"), std::string::npos);
}

TEST(MoeLayerArgs, Mxfp4WeightsCarryNoGlobalScale) {
  const MoeConfig& gptoss = preset("gpt-oss-120b");
  ASSERT_EQ(gptoss.format, WeightFormat::kMxfp4);
  EXPECT_NO_THROW(validate_moe_layer_config(gptoss));
  MoeLayerWeights w = complete_weights(gptoss);
  w.w13_global = fake<float>(3);
  EXPECT_NE(error_of([&] { validate_moe_layer_weights(gptoss, w); }).find("MXFP4"), std::string::npos);
}

TEST(MoeLayerArgs, Bf16SharedExpertAndRoutedOnly) {
  const MoeConfig& glm = preset("glm-5");
  MoeLayerWeights w = complete_weights(glm);
  // bf16 shared expert instead of the quantized one
  w.shared_w13_codes = w.shared_w13_scales = w.shared_w2_codes = w.shared_w2_scales = nullptr;
  w.shared_w13_global = w.shared_w2_global = nullptr;
  w.shared_w13_bf16 = fake<uint8_t>(30);
  w.shared_w2_bf16 = fake<uint8_t>(31);
  EXPECT_NO_THROW(validate_moe_layer_weights(glm, w));
  w.shared_w2_bf16 = nullptr;
  EXPECT_NE(error_of([&] { validate_moe_layer_weights(glm, w); }).find("shared_w2_bf16"), std::string::npos);
  w.shared_w2_bf16 = fake<uint8_t>(31);
  w.shared_w13_codes = fake<uint8_t>(10);  // both kinds at once
  EXPECT_NE(error_of([&] { validate_moe_layer_weights(glm, w); }).find("one of the two"), std::string::npos);
  // routed-only: no shared-expert pointers at all
  EXPECT_NO_THROW(validate_moe_layer_weights(glm, [&] {
    MoeLayerWeights x = complete_weights(glm);
    x.shared_w13_codes = x.shared_w13_scales = x.shared_w2_codes = x.shared_w2_scales = nullptr;
    x.shared_w13_global = x.shared_w2_global = nullptr;
    x.routed_only = true;
    return x;
  }()));
  MoeLayerWeights y = complete_weights(glm);
  y.routed_only = true;
  EXPECT_NE(error_of([&] { validate_moe_layer_weights(glm, y); }).find("routed_only"), std::string::npos);
  // the bf16 shared expert's fp32 gate/up scratch is in the workspace
  const MoeWorkspaceLayout l = moe_workspace_layout(glm, 64, false, /*bf16_shared=*/true);
  EXPECT_GE(l.total - l.shared_gate_up, size_t(64) * 2 * glm.intermediate * 4);
  EXPECT_EQ(l.shared_gate_up % 256, 0u);
}

TEST(MoeLayerArgs, WorkspaceLayoutIsAlignedAndSized) {
  const MoeConfig& glm = preset("glm-5");
  for (int64_t max_t : {1, 3, 1000, 16384}) {
    for (bool router_gemm : {false, true}) {
      const MoeWorkspaceLayout l = moe_workspace_layout(glm, max_t, router_gemm);
      const size_t offs[] = {l.router_logits, l.topk_ids,  l.topk_weights,  l.chunk_counts,  l.expert_offsets,
                             l.shared_offsets, l.row_of, l.row_scale,     l.sorted_hidden, l.gemm1_out,
                             l.gemm2_out,     l.shared_gemm1_out, l.shared_gemm2_out};
      for (size_t i = 1; i < sizeof(offs) / sizeof(offs[0]); ++i) {
        EXPECT_EQ(offs[i] % 256, 0u);
        EXPECT_GE(offs[i], offs[i - 1]);
      }
      const size_t rows = static_cast<size_t>(max_t) * glm.top_k;
      EXPECT_GE(l.gemm1_out - l.sorted_hidden, rows * glm.hidden * 2);
      EXPECT_GE(l.gemm2_out - l.gemm1_out, rows * glm.intermediate * 2);
      EXPECT_GE(l.total - l.shared_gemm2_out, static_cast<size_t>(max_t) * glm.hidden * 2);
      EXPECT_GE(l.expert_offsets - l.chunk_counts,
                static_cast<size_t>(moe_permute_chunks(static_cast<int64_t>(rows)) * glm.num_experts) * 4);
    }
  }
  EXPECT_EQ(moe_permute_chunks(1), 1);
  EXPECT_EQ(moe_permute_chunks(kMoePermuteChunk), 1);
  EXPECT_EQ(moe_permute_chunks(kMoePermuteChunk + 1), 2);
  EXPECT_EQ(moe_permute_chunks(131072), 131072 / kMoePermuteChunk);
  EXPECT_THROW(moe_workspace_layout(glm, 0, false), Error);
}

}  // namespace
}  // namespace fp4moe

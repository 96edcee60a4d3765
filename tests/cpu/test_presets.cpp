// Presets against docs/models.md, and MoeConfig::validate()'s rules.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp4moe/config.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe {
namespace {

struct Row {
  const char* name;
  int64_t h, i;
  int e, k, shared;
  RouterKind router;
  int n_group, topk_group;
  float scaling;
  Activation act;
};

// Transcribed from the docs/models.md table.
const Row kTable[] = {
    {"glm-5", 6144, 2048, 256, 8, 1, RouterKind::kSigmoidGrouped, 1, 1, 2.5f, Activation::kSwiGLU},
    {"glm-4.6", 5120, 1536, 160, 8, 1, RouterKind::kSigmoidGrouped, 1, 1, 2.5f, Activation::kSwiGLU},
    {"deepseek-v3", 7168, 2048, 256, 8, 1, RouterKind::kSigmoidGrouped, 8, 4, 2.5f, Activation::kSwiGLU},
    {"kimi-k2", 7168, 2048, 384, 8, 1, RouterKind::kSigmoidGrouped, 1, 1, 2.827f, Activation::kSwiGLU},
    {"qwen3-235b", 4096, 1536, 128, 8, 0, RouterKind::kSoftmaxTopK, 1, 1, 1.0f, Activation::kSwiGLU},
    {"qwen3-30b", 2048, 768, 128, 8, 0, RouterKind::kSoftmaxTopK, 1, 1, 1.0f, Activation::kSwiGLU},
    {"gpt-oss-120b", 2880, 2880, 128, 4, 0, RouterKind::kGptOss, 1, 1, 1.0f, Activation::kGptOssSwiGLU},
    {"mixtral-8x7b", 4096, 14336, 8, 2, 0, RouterKind::kSoftmaxTopK, 1, 1, 1.0f, Activation::kSwiGLU},
};

TEST(Presets, MatchModelsTable) {
  for (const Row& r : kTable) {
    SCOPED_TRACE(r.name);
    const MoeConfig& c = preset(r.name);
    EXPECT_EQ(c.name, r.name);
    EXPECT_EQ(c.hidden, r.h);
    EXPECT_EQ(c.intermediate, r.i);
    EXPECT_EQ(c.num_experts, r.e);
    EXPECT_EQ(c.top_k, r.k);
    EXPECT_EQ(c.num_shared, r.shared);
    EXPECT_EQ(c.router, r.router);
    EXPECT_EQ(c.n_group, r.n_group);
    EXPECT_EQ(c.topk_group, r.topk_group);
    EXPECT_EQ(c.routed_scaling, r.scaling);
    EXPECT_EQ(c.activation, r.act);
    EXPECT_EQ(c.format, c.name == "gpt-oss-120b" ? WeightFormat::kMxfp4 : WeightFormat::kNvfp4);  // gpt-oss ships MXFP4
    EXPECT_EQ(c.gemm1_n(), 2 * r.i);
    EXPECT_EQ(c.gemm1_k(), r.h);
    EXPECT_EQ(c.gemm2_n(), r.h);
    EXPECT_EQ(c.gemm2_k(), r.i);
    EXPECT_NO_THROW(c.validate());
  }
}

TEST(Presets, RenormalizeAndGptOssDetails) {
  for (const char* n : {"glm-5", "glm-4.6", "deepseek-v3", "kimi-k2", "qwen3-235b", "qwen3-30b", "mixtral-8x7b"})
    EXPECT_TRUE(preset(n).renormalize) << n;
  const MoeConfig& g = preset("gpt-oss-120b");
  EXPECT_TRUE(g.expert_bias);
  EXPECT_EQ(g.swiglu_alpha, 1.702f);
  EXPECT_EQ(g.swiglu_limit, 7.0f);
  for (const char* n : {"glm-5", "qwen3-30b", "mixtral-8x7b"}) EXPECT_FALSE(preset(n).expert_bias) << n;
}

TEST(Presets, TinyExercisesGroupedRoutingAndSharedExpert) {
  const MoeConfig& t = preset("tiny");
  EXPECT_EQ(t.router, RouterKind::kSigmoidGrouped);
  EXPECT_EQ(t.n_group, 2);
  EXPECT_EQ(t.topk_group, 1);
  EXPECT_EQ(t.num_shared, 1);
  EXPECT_NE(t.routed_scaling, 1.0f);
  EXPECT_LT(t.top_k, t.num_experts / t.n_group + 1);
  EXPECT_LE(t.hidden * t.intermediate, 256 * 256);  // small enough for exhaustive tests
  EXPECT_NO_THROW(t.validate());
}

TEST(Presets, NamesListsAllInOrder) {
  const std::vector<std::string> want = {"glm-5",     "glm-4.6",      "deepseek-v3",  "kimi-k2", "qwen3-235b",
                                         "qwen3-30b", "gpt-oss-120b", "mixtral-8x7b", "tiny"};
  EXPECT_EQ(preset_names(), want);
  for (const auto& n : want) EXPECT_EQ(preset(n).name, n);
}

TEST(Presets, UnknownNameListsKnownOnes) {
  try {
    preset("glm-6");
    FAIL() << "preset(\"glm-6\") did not throw";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'glm-6'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("glm-5"), std::string::npos) << msg;
    EXPECT_NE(msg.find("tiny"), std::string::npos) << msg;
    EXPECT_NE(msg.find("mixtral-8x7b"), std::string::npos) << msg;
  }
  EXPECT_THROW(preset(""), Error);
}

// Expects validate() to throw and the message to contain every fragment.
void expect_invalid(const MoeConfig& c, std::vector<std::string> fragments) {
  try {
    c.validate();
    ADD_FAILURE() << "validate() accepted an invalid config";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  }
}

TEST(Presets, ValidateRejectsWithTheRule) {
  const MoeConfig base = preset("tiny");
  MoeConfig c = base;
  c.hidden = 100;
  expect_invalid(c, {"hidden = 100", "multiple of 64"});
  c = base;
  c.hidden = 0;
  expect_invalid(c, {"hidden = 0"});
  c = base;
  c.intermediate = 88;  // whole blocks only: 96 (6 NVFP4 blocks) is valid and padded to 128 by the layer
  expect_invalid(c, {"intermediate = 88", "multiple of 16", "NVFP4 scale block"});
  c.intermediate = 96;
  EXPECT_NO_THROW(c.validate());
  c.format = WeightFormat::kMxfp4;
  c.intermediate = 80;
  expect_invalid(c, {"intermediate = 80", "multiple of 32", "MXFP4 scale block"});
  c = base;
  c.top_k = 9;
  expect_invalid(c, {"top_k = 9", "num_experts = 8"});
  c = base;
  c.num_experts = 64;
  c.top_k = 17;
  c.n_group = 1;
  expect_invalid(c, {"top_k = 17", "16"});
  c = base;
  c.top_k = 0;
  expect_invalid(c, {"top_k = 0"});
  c = base;
  c.num_experts = 514;
  expect_invalid(c, {"num_experts = 514", "512"});
  c = base;
  c.n_group = 3;
  expect_invalid(c, {"n_group = 3", "divide", "num_experts = 8"});
  c = base;
  c.topk_group = 3;
  expect_invalid(c, {"topk_group = 3", "n_group = 2"});
  c = base;
  c.n_group = 8;
  expect_invalid(c, {"1 experts per group", ">= 2"});
  c = base;
  c.top_k = 5;  // one kept group of 4 experts cannot supply 5
  expect_invalid(c, {"top_k = 5", "topk_group"});
  c = base;
  c.router = RouterKind::kSoftmaxTopK;
  expect_invalid(c, {"n_group = 2", "sigmoid grouped"});
  c = base;
  c.routed_scaling = 0.0f;
  expect_invalid(c, {"routed_scaling = 0"});
  c = base;
  c.num_shared = -1;
  expect_invalid(c, {"num_shared = -1"});
  c = preset("gpt-oss-120b");
  c.swiglu_limit = -1.0f;
  expect_invalid(c, {"swiglu_limit = -1"});
  // the config name is part of every message
  c = base;
  c.hidden = 65;
  expect_invalid(c, {"'tiny'"});
}

}  // namespace
}  // namespace fp4moe

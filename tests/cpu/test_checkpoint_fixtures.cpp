// The exporter-written fixtures (tests/fixtures, written by nvidia-modelopt, llm-compressor and the
// gpt-oss MXFP4 script): each one is recognized, its MoE layers load, and the CPU reference runs on
// them. One fixture keeps its bf16 source: the loaded, dequantized experts must match it to NVFP4's
// quantization error, a bound that a nibble, row or scale mistake cannot meet.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "checkpoint_test_util.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe {
namespace {

using test::rel_l2;

struct Expect {
  const char* name;
  CheckpointFormat format;
  const char* arch;
  std::vector<int> moe_layers;
  SharedExpertStorage shared;
  RouterKind router;
  int n_group, topk_group;
  float scaling;
};

const std::vector<Expect>& fixtures() {
  using F = CheckpointFormat;
  using S = SharedExpertStorage;
  using R = RouterKind;
  static const std::vector<Expect> v = {
      {"modelopt-qwen3-moe-nvfp4", F::kModelOptNvfp4, "Qwen3MoeForCausalLM", {1}, S::kNone, R::kSoftmaxTopK, 1, 1, 1.0f},
      {"modelopt-qwen3-moe-nvfp4-sharded", F::kModelOptNvfp4, "Qwen3MoeForCausalLM", {1}, S::kNone, R::kSoftmaxTopK, 1, 1,
       1.0f},
      {"modelopt-deepseek-v3-nvfp4", F::kModelOptNvfp4, "DeepseekV3ForCausalLM", {1}, S::kQuantized, R::kSigmoidGrouped, 4,
       2, 2.5f},
      {"modelopt-deepseek-v3-nvfp4-experts-only", F::kModelOptNvfp4, "DeepseekV3ForCausalLM", {1}, S::kBf16,
       R::kSigmoidGrouped, 4, 2, 2.5f},
      {"modelopt-glm4-moe-nvfp4", F::kModelOptNvfp4, "Glm4MoeForCausalLM", {1}, S::kQuantized, R::kSigmoidGrouped, 1, 1,
       2.5f},
      {"modelopt-glm5-nvfp4", F::kModelOptNvfp4, "GlmMoeDsaForCausalLM", {1}, S::kQuantized, R::kSigmoidGrouped, 1, 1,
       2.5f},
      {"modelopt-mixtral-nvfp4", F::kModelOptNvfp4, "MixtralForCausalLM", {0, 1}, S::kNone, R::kSoftmaxTopK, 1, 1, 1.0f},
      {"llmcompressor-qwen3-moe-nvfp4", F::kCompressedTensorsNvfp4, "Qwen3MoeForCausalLM", {1}, S::kNone,
       R::kSoftmaxTopK, 1, 1, 1.0f},
      {"llmcompressor-deepseek-v3-nvfp4a16", F::kCompressedTensorsNvfp4, "DeepseekV3ForCausalLM", {1}, S::kQuantized,
       R::kSigmoidGrouped, 4, 2, 2.5f},
      {"llmcompressor-glm4-moe-nvfp4", F::kCompressedTensorsNvfp4, "Glm4MoeForCausalLM", {1}, S::kQuantized,
       R::kSigmoidGrouped, 1, 1, 2.5f},
      {"gptoss-mxfp4", F::kGptOssMxfp4, "GptOssForCausalLM", {0, 1}, S::kNone, R::kGptOss, 1, 1, 1.0f},
  };
  return v;
}

// transformers keeps the DeepSeek-V3 / GLM router weight in fp32, and the exporters write it so: the
// one warning these fixtures should give.
LoadOptions quiet(bool routed_only = false) {
  LoadOptions o;
  o.routed_only = routed_only;
  o.warn = [](const std::string& w) {
    if (w.find("router weight is stored in F32") == std::string::npos) ADD_FAILURE() << "unexpected warning: " << w;
  };
  return o;
}

TEST(CheckpointFixtures, EachIsRecognizedLoadsAndRunsOnTheReference) {
  for (const Expect& x : fixtures()) {
    SCOPED_TRACE(x.name);
    SafetensorsCheckpoint ck(test::fixture(x.name));
    const CheckpointInfo info = inspect_checkpoint(ck);
    EXPECT_EQ(info.format, x.format);
    EXPECT_EQ(info.architecture, x.arch);
    EXPECT_EQ(info.moe_layers, x.moe_layers);
    EXPECT_EQ(info.shared, x.shared);
    const MoeConfig& m = info.moe;
    EXPECT_EQ(m.hidden, 128);
    EXPECT_EQ(m.intermediate, 64);
    EXPECT_EQ(m.num_experts, 8);
    EXPECT_EQ(m.top_k, 2);
    EXPECT_EQ(m.num_shared, x.shared == SharedExpertStorage::kNone ? 0 : 1);
    EXPECT_EQ(m.router, x.router);
    EXPECT_EQ(m.n_group, x.n_group);
    EXPECT_EQ(m.topk_group, x.topk_group);
    EXPECT_EQ(m.routed_scaling, x.scaling);
    EXPECT_EQ(m.format, x.format == CheckpointFormat::kGptOssMxfp4 ? WeightFormat::kMxfp4 : WeightFormat::kNvfp4);
    EXPECT_TRUE(m.renormalize || x.router == RouterKind::kGptOss);
    for (int layer : x.moe_layers) {
      SCOPED_TRACE(testing::Message() << "layer " << layer);
      const HostMoeLayer l = load_moe_layer(ck, info, layer, quiet());
      const int64_t E = 8, H = 128, I = 64;
      const int blk = m.format == WeightFormat::kMxfp4 ? 32 : 16;
      EXPECT_EQ(l.w13_codes.size(), size_t(E * 2 * I * H / 2));
      EXPECT_EQ(l.w13_scales.size(), size_t(E * 2 * I * H / blk));
      EXPECT_EQ(l.w2_codes.size(), size_t(E * H * I / 2));
      EXPECT_EQ(l.router_weight.size(), size_t(E * H));
      for (float g : l.w13_global) EXPECT_TRUE(std::isfinite(g) && g > 0);
      if (x.router != RouterKind::kSoftmaxTopK) {
        ASSERT_EQ(l.router_bias.size(), size_t(E));
        EXPECT_TRUE(std::any_of(l.router_bias.begin(), l.router_bias.end(), [](float b) { return b != 0.0f; }));
      }
      const int64_t T = 6;
      const std::vector<float> hidden = make_synthetic_hidden(l.cfg, 5, T);
      const std::vector<float> logits = host_router_logits(l, hidden, T);
      const Routing r = route_reference(l.cfg, logits, l.router_bias, T);
      HostLayerExperts experts(l);
      const std::vector<float> out = moe_reference(l.cfg, experts, hidden, T, r);
      double norm = 0;
      for (float v : out) {
        ASSERT_TRUE(std::isfinite(v));
        norm += double(v) * v;
      }
      EXPECT_GT(norm, 0.0);
      if (l.cfg.num_shared > 0) {
        // routed-only: the same layer without its shared expert gives a different output
        const HostMoeLayer ro = load_moe_layer(ck, info, layer, quiet(true));
        EXPECT_EQ(ro.cfg.num_shared, 0);
        EXPECT_EQ(ro.shared, SharedExpertStorage::kNone);
        HostLayerExperts ro_experts(ro);
        const std::vector<float> out_ro = moe_reference(ro.cfg, ro_experts, hidden, T, r);
        EXPECT_GT(rel_l2(out_ro, out), 1e-3);
      }
    }
  }
}

// The loaded, dequantized experts against the bf16 weights the exporter quantized. NVFP4 on these
// Gaussian weights measures 0.093-0.096 relative L2 (every projection of every expert); a swapped
// nibble pair or an off-by-one row gives ~1.4, scales shifted by one block ~0.33 (neighbouring blocks
// have similar scales), so the 0.12 bound passes the correct load and fails each mistake.
TEST(CheckpointFixtures, DequantizedExpertsMatchTheBf16Source) {
  SafetensorsCheckpoint ck(test::fixture("modelopt-qwen3-moe-nvfp4"));
  const CheckpointInfo info = inspect_checkpoint(ck);
  const HostMoeLayer l = load_moe_layer(ck, info, 1, quiet());
  SafetensorsCheckpoint src(test::fixture("bf16-source-qwen3-moe"));
  HostLayerExperts experts(l);
  double worst = 0, best_wrong = 1e30;
  for (int e = 0; e < 8; ++e) {
    const auto w = experts.expert(e);
    for (auto [t, proj] : {std::pair{&w->gate, "gate_proj"}, {&w->up, "up_proj"}, {&w->down, "down_proj"}}) {
      const TensorRef s = src.tensor(fmt::format("model.layers.1.mlp.experts.{}.{}.weight", e, proj));
      ASSERT_EQ(s.info->shape, (std::vector<int64_t>{t->rows, t->cols}));
      std::vector<float> ref(static_cast<size_t>(t->rows * t->cols));
      for (size_t i = 0; i < ref.size(); ++i) {
        uint16_t b;
        std::memcpy(&b, s.data + 2 * i, 2);
        ref[i] = bf16_bits_to_float(b);
      }
      const std::vector<float> got = dequantize_nvfp4(*t);
      const double err = rel_l2(got, ref);
      worst = std::max(worst, err);
      // the same comparison after each kind of layout mistake
      Nvfp4Tensor swapped = *t;
      for (auto& c : swapped.codes) c = static_cast<uint8_t>((c >> 4) | (c << 4));
      std::vector<float> shifted_rows(got.size());
      for (int64_t r = 0; r < t->rows; ++r)
        std::copy_n(got.begin() + ((r + 1) % t->rows) * t->cols, t->cols, shifted_rows.begin() + r * t->cols);
      Nvfp4Tensor shifted_scales = *t;
      std::rotate(shifted_scales.scales.begin(), shifted_scales.scales.begin() + 1, shifted_scales.scales.end());
      const double e_nib = rel_l2(dequantize_nvfp4(swapped), ref), e_row = rel_l2(shifted_rows, ref),
                   e_scale = rel_l2(dequantize_nvfp4(shifted_scales), ref);
      best_wrong = std::min({best_wrong, e_nib, e_row, e_scale});
    }
  }
  EXPECT_LT(worst, 0.12) << "loaded experts differ from the bf16 source by more than NVFP4's error";
  EXPECT_GT(best_wrong, 0.3) << "a layout mistake would pass the bound";
  RecordProperty("worst_rel_l2", std::to_string(worst));
}

// One checkpoint written as one file and as nine shards (experts 4 and 7 straddle two shards) loads
// to the same bytes.
TEST(CheckpointFixtures, ShardedEqualsSingleFile) {
  SafetensorsCheckpoint a(test::fixture("modelopt-qwen3-moe-nvfp4"));
  SafetensorsCheckpoint b(test::fixture("modelopt-qwen3-moe-nvfp4-sharded"));
  ASSERT_TRUE(b.sharded());
  EXPECT_EQ(b.files().size(), 9u);
  std::set<std::string> expert4_files;
  for (const auto& n : b.names())
    if (n.find("layers.1.mlp.experts.4.") != std::string::npos) expert4_files.insert(std::string(b.tensor(n).file));
  EXPECT_GE(expert4_files.size(), 2u) << "the fixture should split expert 4 across shards";
  const HostMoeLayer la = load_moe_layer(a, inspect_checkpoint(a), 1, quiet());
  const HostMoeLayer lb = load_moe_layer(b, inspect_checkpoint(b), 1, quiet());
  auto same = [](const HostBytes& x, const HostBytes& y) {
    return x.size() == y.size() && std::equal(x.data(), x.data() + x.size(), y.data());
  };
  EXPECT_TRUE(same(la.w13_codes, lb.w13_codes));
  EXPECT_TRUE(same(la.w13_scales, lb.w13_scales));
  EXPECT_TRUE(same(la.w2_codes, lb.w2_codes));
  EXPECT_TRUE(same(la.w2_scales, lb.w2_scales));
  EXPECT_EQ(la.w13_global, lb.w13_global);
  EXPECT_EQ(la.w2_global, lb.w2_global);
  EXPECT_EQ(la.router_weight, lb.router_weight);
}

// compressed-tensors' weight_global_scale is the reciprocal of the dequantization scale.
TEST(CheckpointFixtures, CompressedTensorsGlobalScaleIsInverted) {
  SafetensorsCheckpoint ck(test::fixture("llmcompressor-qwen3-moe-nvfp4"));
  const HostMoeLayer l = load_moe_layer(ck, inspect_checkpoint(ck), 1, quiet());
  for (int e = 0; e < 8; ++e) {
    float raw;
    std::memcpy(&raw, ck.tensor(fmt::format("model.layers.1.mlp.experts.{}.down_proj.weight_global_scale", e)).data, 4);
    EXPECT_EQ(l.w2_global[e], 1.0f / raw) << e;
    // a plausible dequantization scale: amax / (6 * 448) for weights of magnitude ~0.02 .. 0.2
    EXPECT_GT(l.w2_global[e], 1e-7f);
    EXPECT_LT(l.w2_global[e], 1e-3f);
  }
}

// e_score_correction_bias is F32 in some exports and BF16 in others: both load.
TEST(CheckpointFixtures, CorrectionBiasInBf16Loads) {
  test::ScratchDir d;
  const std::string dir = test::copy_fixture(d, "modelopt-glm4-moe-nvfp4");
  const std::string name = "model.layers.1.mlp.gate.e_score_correction_bias";
  std::vector<float> f32;
  {
    SafetensorsCheckpoint ck(dir);
    const TensorRef t = ck.tensor(name);
    ASSERT_EQ(t.info->dtype, SafetensorsDtype::kF32);
    f32.resize(8);
    std::memcpy(f32.data(), t.data, 32);
  }
  // rewrite the tensor as BF16 [8] in the first 16 of its 32 bytes (the rest becomes an unused gap)
  std::string f = test::read_file(dir + "/model.safetensors");
  const SafetensorsHeader h = parse_safetensors_header({reinterpret_cast<const uint8_t*>(f.data()), f.size()}, "x");
  auto j = nlohmann::ordered_json::parse(f.substr(8, h.header_bytes));
  const uint64_t begin = j[name]["data_offsets"][0].get<uint64_t>();
  j[name]["dtype"] = "BF16";
  j[name]["data_offsets"] = {begin, begin + 16};
  std::string data = f.substr(h.data_offset);
  for (int e = 0; e < 8; ++e) {
    const uint16_t b = float_to_bf16_bits(f32[e]);
    std::memcpy(data.data() + begin + 2 * e, &b, 2);
  }
  test::write_file(dir + "/model.safetensors", test::safetensors_bytes({}, j.dump()) + data);
  SafetensorsCheckpoint ck(dir);
  const HostMoeLayer l = load_moe_layer(ck, inspect_checkpoint(ck), 1, quiet());
  for (int e = 0; e < 8; ++e) EXPECT_EQ(l.router_bias[e], round_to_bf16(f32[e])) << e;
}

// gpt-oss: disk rows 2j / 2j+1 (gate / up, interleaved) land at rows j / I + j; biases likewise.
TEST(CheckpointFixtures, GptOssRowsAreDeinterleaved) {
  SafetensorsCheckpoint ck(test::fixture("gptoss-mxfp4"));
  const CheckpointInfo info = inspect_checkpoint(ck);
  EXPECT_EQ(info.moe.activation, Activation::kGptOssSwiGLU);
  EXPECT_TRUE(info.moe.expert_bias);
  EXPECT_EQ(info.moe.swiglu_limit, 7.0f);
  const HostMoeLayer l = load_moe_layer(ck, info, 1, quiet());
  const int64_t E = 8, H = 128, I = 64;
  const TensorRef blocks = ck.tensor("model.layers.1.mlp.experts.gate_up_proj_blocks");
  const TensorRef scales = ck.tensor("model.layers.1.mlp.experts.gate_up_proj_scales");
  const TensorRef bias = ck.tensor("model.layers.1.mlp.experts.gate_up_proj_bias");
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < I; ++j)
      for (int half = 0; half < 2; ++half) {
        const int64_t disk = e * 2 * I + 2 * j + half, mine = e * 2 * I + half * I + j;
        ASSERT_EQ(0, std::memcmp(blocks.data + disk * H / 2, l.w13_codes.data() + mine * H / 2, H / 2)) << e << " " << j;
        ASSERT_EQ(0, std::memcmp(scales.data + disk * H / 32, l.w13_scales.data() + mine * H / 32, H / 32));
        uint16_t b;
        std::memcpy(&b, bias.data + 2 * disk, 2);
        ASSERT_EQ(l.b13[mine], bf16_bits_to_float(b));
      }
  // the reference's MXFP4 expert decodes the OCP values: e2m1 * 2^(e - 127)
  HostLayerExperts experts(l);
  const auto w = experts.expert(3);
  ASSERT_EQ(w->storage, ExpertStorage::kMxfp4);
  const int64_t disk_row = 3 * 2 * I + 2 * 5 + 1;  // expert 3, up row 5
  const uint8_t byte = blocks.data[disk_row * H / 2 + 7], sc = scales.data[disk_row * H / 32 + 0];
  EXPECT_EQ(w->mx_up.at(5, 14), e2m1_to_float(byte & 0xf) * std::ldexp(1.0f, sc - 127));
  EXPECT_EQ(w->mx_up.at(5, 15), e2m1_to_float(byte >> 4) * std::ldexp(1.0f, sc - 127));
}

// Gate and up with different global scales: the smaller-scaled half is requantized to the larger
// scale, with a warning that says so; the other half is untouched.
TEST(CheckpointFixtures, MismatchedGateUpScalesAreRequantizedWithAWarning) {
  test::ScratchDir d;
  const std::string dir = test::copy_fixture(d, "modelopt-qwen3-moe-nvfp4");
  const std::string name = "model.layers.1.mlp.experts.3.up_proj.weight_scale_2";
  const HostMoeLayer before = [&] {
    SafetensorsCheckpoint ck(dir);
    return load_moe_layer(ck, inspect_checkpoint(ck), 1, quiet());
  }();
  float g_gate = before.w13_global[3];
  {
    // halve up's global scale in the file: its values become half of what they were
    std::string f = test::read_file(dir + "/model.safetensors");
    const SafetensorsHeader h =
        parse_safetensors_header({reinterpret_cast<const uint8_t*>(f.data()), f.size()}, "x");
    const float half = g_gate * 0.5f;
    std::memcpy(f.data() + h.data_offset + h.find(name)->begin, &half, 4);
    test::write_file(dir + "/model.safetensors", f);
  }
  SafetensorsCheckpoint ck(dir);
  LoadOptions o;
  std::vector<std::string> warnings;
  o.warn = [&](const std::string& w) { warnings.push_back(w); };
  const HostMoeLayer after = load_moe_layer(ck, inspect_checkpoint(ck), 1, o);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("requantized"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("expert 3"), std::string::npos) << warnings[0];
  EXPECT_EQ(after.w13_global[3], g_gate);
  HostLayerExperts eb(before), ea(after);
  const auto wb = eb.expert(3), wa = ea.expert(3);
  EXPECT_EQ(wa->gate.codes, wb->gate.codes);  // the larger-scaled half is untouched
  EXPECT_EQ(wa->gate.scales, wb->gate.scales);
  std::vector<float> want = dequantize_nvfp4(wb->up);
  for (float& v : want) v *= 0.5f;
  const std::vector<float> got = dequantize_nvfp4(wa->up);
  // requantization error: at most half an E2M1 step of the new block scale, ~4% relative overall
  EXPECT_LT(rel_l2(got, want), 0.06);
  EXPECT_GT(rel_l2(dequantize_nvfp4(wb->up), want), 0.5);  // and the change is real
}

}  // namespace
}  // namespace fp4moe

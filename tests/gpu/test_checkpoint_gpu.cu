// Real checkpoints on the GPU: every exporter-written fixture's MoE layer (tests/fixtures) through
// MoeLayer against the CPU reference on the same loaded weights; MXFP4 through the repack, the GEMM and
// the layer; the bf16 shared expert and routed-only mode; CUDA-graph capture with a bf16 shared expert.
//
// Bound: relative L2 < 5e-3 against moe_reference (the layer tests' bound, test_moe_layer_gpu.cu:
// only bf16 rounding-boundary flips between fp32 and double accumulation remain). Routing is given as
// the same fp32 logits to both, so both route identically.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <vector>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/kernels/nvfp4_dequant.cuh"
#include "fp4moe/nvfp4_weight_layout.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "../host_layer_util.hpp"
#include "../test_common.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe {
namespace {

using test::download;
using test::fixture;
using test::rel_l2;
using test::Stream;
using test::upload;

constexpr double kRelL2Bound = 5e-3;

const char* kFixtures[] = {
    "modelopt-qwen3-moe-nvfp4",      "modelopt-qwen3-moe-nvfp4-sharded", "modelopt-deepseek-v3-nvfp4",
    "modelopt-deepseek-v3-nvfp4-experts-only", "modelopt-glm4-moe-nvfp4", "modelopt-glm5-nvfp4", "modelopt-mixtral-nvfp4",
    "llmcompressor-qwen3-moe-nvfp4", "llmcompressor-deepseek-v3-nvfp4a16", "llmcompressor-glm4-moe-nvfp4",
    "gptoss-mxfp4",
};

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = float_to_bf16_bits(x[i]);
  return b;
}

// Hidden states with a per-token scale (x0.25 .. x4) so that logits and activations vary in size.
std::vector<float> hidden_for(const MoeConfig& cfg, int64_t T, uint64_t seed) {
  std::vector<float> h = make_synthetic_hidden(cfg, seed, T);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < cfg.hidden; ++i) h[t * cfg.hidden + i] = round_to_bf16(h[t * cfg.hidden + i] * std::ldexp(1.0f, int(t % 5) - 2));
  return h;
}

// The layer on the GPU vs the reference, for several T (ragged expert sizes, empty experts at T = 1).
void check_layer(const HostMoeLayer& l, const char* what) {
  SCOPED_TRACE(what);
  Stream st;
  const int64_t max_T = 67;
  DeviceMoeLayer d = upload_moe_layer(l, st.s);
  MoeLayer layer(d.cfg, d.weights, max_T, st.s);
  d.buffers.clear();  // the layer keeps its own copies
  OwnedDeviceBuffer ws(layer.workspace_bytes()), out(max_T * l.cfg.hidden * 2);
  HostLayerExperts experts(l);
  for (int64_t T : {1, 5, 67}) {
    SCOPED_TRACE(testing::Message() << "T=" << T);
    const std::vector<float> hidden = hidden_for(l.cfg, T, 100 + T);
    const std::vector<float> logits = host_router_logits(l, hidden, T);
    OwnedDeviceBuffer dh = upload(to_bf16(hidden)), dl = upload(logits);
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, T * l.cfg.hidden * 2, st.s));  // NaN poison
    layer.forward(st.s, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes());
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
    const std::vector<uint16_t> bits = download<uint16_t>(out.get(), T * l.cfg.hidden);
    std::vector<float> got(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) {
      got[i] = bf16_bits_to_float(bits[i]);
      ASSERT_TRUE(std::isfinite(got[i])) << "element " << i;
    }
    const Routing r = route_reference(l.cfg, logits, l.router_bias, T);
    const std::vector<int32_t> ids = download<int32_t>(layer.intermediates(ws.get()).topk_ids, T * l.cfg.top_k);
    EXPECT_EQ(ids, r.ids);
    const std::vector<float> ref = moe_reference(l.cfg, experts, hidden, T, r);
    const double err = rel_l2(got, ref);
    EXPECT_LT(err, kRelL2Bound);
    // the layer's own router GEMM (bf16 weight, fp32 accumulation) routes the same tokens
    if (T == 67) {
      layer.forward(st.s, dh.get(), T, nullptr, out.get(), ws.get(), ws.bytes());
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
      const std::vector<int32_t> ids2 = download<int32_t>(layer.intermediates(ws.get()).topk_ids, T * l.cfg.top_k);
      int same = 0;
      for (int64_t t = 0; t < T; ++t)
        same += std::equal(ids2.begin() + t * l.cfg.top_k, ids2.begin() + (t + 1) * l.cfg.top_k,
                           ids.begin() + t * l.cfg.top_k);
      EXPECT_GE(same, T - 2) << "router GEMM vs host logits: near-ties may flip a token or two";
    }
  }
}

// Intermediate sizes that are not multiples of 64 (tensor-parallel slices): MoeLayer zero-pads the
// weights on the device (weight_padding.hpp; tests/cpu/test_padding.cpp proves the padded layer equals
// the unpadded one on the CPU). Here the padded GPU layer against the reference over the unpadded
// weights: NVFP4 and MXFP4, both activations with biases, a fused and a wide shared expert, a bf16 one.
TEST(CheckpointGpu, PaddedIntermediateLayersMatchTheReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  auto small = [](const char* base, int64_t I, int num_shared) {
    return test::small_config(base, 256, I, 16, 4, num_shared);
  };
  MoeConfig nv_gptoss = small("gpt-oss-120b", 80, 0);
  nv_gptoss.format = WeightFormat::kNvfp4;
  const struct {
    MoeConfig cfg;
    bool bf16_shared;
  } cases[] = {
      {small("qwen3-30b", 96, 0), false},     // qwen3-30b's tp-8 slice width
      {small("glm-5", 80, 1), false},         // shared expert fused into the routed launches
      {small("glm-5", 48, 2), false},         // wide shared expert: 96 -> 128, own launches
      {small("glm-5", 720, 1), false},        // gpt-oss-like tp-4 width with NVFP4 blocks
      {small("glm-5", 112, 1), true},         // bf16 shared expert (cuBLAS on the padded width)
      {nv_gptoss, false},                     // clamped SwiGLU + biases, NVFP4
      {small("gpt-oss-120b", 96, 0), false},  // MXFP4 (32-wide blocks)
      {small("gpt-oss-120b", 352, 0), false},
  };
  for (const auto& c : cases) {
    const HostMoeLayer l = test::stack_synthetic_layer(c.cfg, 11, c.bf16_shared);
    check_layer(l, fmt::format("{} I={} shared={}{}", c.cfg.name, c.cfg.intermediate, c.cfg.num_shared,
                               c.bf16_shared ? " bf16" : "").c_str());
  }
}

// A malformed scale in a layer whose experts are padded: refused, in the padded copy's coordinates with
// the mapping back to the caller's rows.
TEST(CheckpointGpu, PaddedLayerReportsABadScaleWithTheMapping) {
  FP4MOE_SKIP_WITHOUT_GPU();
  MoeConfig c = preset("qwen3-30b");
  c.hidden = 256;
  c.intermediate = 96;  // padded to 128
  c.num_experts = 4;
  c.top_k = 2;
  HostMoeLayer l = test::stack_synthetic_layer(c, 3, false);
  // expert 1, up-projection row 5 (stacked row 96 + 5), k-block 2: E4M3 0x7f is NaN
  l.w13_scales.data()[(1 * 2 * 96 + 96 + 5) * (256 / 16) + 2] = 0x7f;
  Stream st;
  DeviceMoeLayer d = upload_moe_layer(l, st.s);
  try {
    MoeLayer layer(d.cfg, d.weights, 8, st.s);
    FAIL() << "a NaN scale was accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("expert 1, row 133, k-block 2"), std::string::npos) << m;  // padded row 128 + 5
    EXPECT_NE(m.find("192 x 256 padded to 256 x 256"), std::string::npos) << m;
    EXPECT_NE(m.find("up-projection row r is padded row 128 + r"), std::string::npos) << m;
  }
}

TEST(CheckpointGpu, EveryFixtureLayerMatchesTheReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  for (const char* name : kFixtures) {
    SafetensorsCheckpoint ck(fixture(name));
    const CheckpointInfo info = inspect_checkpoint(ck);
    for (int layer : info.moe_layers) {
      const HostMoeLayer l = load_moe_layer(ck, info, layer);
      check_layer(l, (std::string(name) + " layer " + std::to_string(layer)).c_str());
      if (l.cfg.num_shared > 0) {
        LoadOptions o;
        o.routed_only = true;
        const HostMoeLayer ro = load_moe_layer(ck, info, layer, o);
        check_layer(ro, (std::string(name) + " routed-only").c_str());
      }
    }
  }
}

// routed_only on MoeLayerWeights: the same layer without its shared expert, whatever pointers the
// config would want; out = the routed sum alone.
TEST(CheckpointGpu, RoutedOnlyFlagSkipsTheSharedExpert) {
  FP4MOE_SKIP_WITHOUT_GPU();
  SafetensorsCheckpoint ck(fixture("modelopt-glm4-moe-nvfp4"));
  const CheckpointInfo info = inspect_checkpoint(ck);
  LoadOptions o;
  o.routed_only = true;
  HostMoeLayer l = load_moe_layer(ck, info, 1, o);
  Stream st;
  DeviceMoeLayer d = upload_moe_layer(l, st.s);
  MoeConfig full = info.moe;  // num_shared = 1
  d.weights.routed_only = true;
  MoeLayer layer(full, d.weights, 8, st.s);
  EXPECT_EQ(layer.config().num_shared, 0);
  OwnedDeviceBuffer ws(layer.workspace_bytes()), out(8 * l.cfg.hidden * 2);
  const std::vector<float> hidden = hidden_for(l.cfg, 8, 3);
  const std::vector<float> logits = host_router_logits(l, hidden, 8);
  OwnedDeviceBuffer dh = upload(to_bf16(hidden)), dl = upload(logits);
  layer.forward(st.s, dh.get(), 8, dl.as<float>(), out.get(), ws.get(), ws.bytes());
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  const std::vector<uint16_t> bits = download<uint16_t>(out.get(), 8 * l.cfg.hidden);
  std::vector<float> got(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) got[i] = bf16_bits_to_float(bits[i]);
  HostLayerExperts experts(l);
  const std::vector<float> ref =
      moe_reference(l.cfg, experts, hidden, 8, route_reference(l.cfg, logits, l.router_bias, 8));
  EXPECT_LT(rel_l2(got, ref), kRelL2Bound);
}

// The bf16 shared expert (cuBLAS) inside a captured CUDA graph: replay == eager, bit for bit.
TEST(CheckpointGpu, Bf16SharedExpertIsGraphCapturable) {
  FP4MOE_SKIP_WITHOUT_GPU();
  SafetensorsCheckpoint ck(fixture("modelopt-deepseek-v3-nvfp4-experts-only"));
  const CheckpointInfo info = inspect_checkpoint(ck);
  ASSERT_EQ(info.shared, SharedExpertStorage::kBf16);
  const HostMoeLayer l = load_moe_layer(ck, info, 1);
  Stream st;
  DeviceMoeLayer d = upload_moe_layer(l, st.s);
  const int64_t T = 19;
  MoeLayer layer(d.cfg, d.weights, T, st.s);
  OwnedDeviceBuffer ws(layer.workspace_bytes()), out1(T * l.cfg.hidden * 2), out2(T * l.cfg.hidden * 2);
  OwnedDeviceBuffer dh = upload(to_bf16(hidden_for(l.cfg, T, 9)));
  layer.forward(st.s, dh.get(), T, nullptr, out1.get(), ws.get(), ws.bytes());
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal));
  layer.forward(st.s, dh.get(), T, nullptr, out2.get(), ws.get(), ws.bytes());
  FP4MOE_CUDA_CHECK(cudaStreamEndCapture(st.s, &g));
  FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(out2.get(), 0xff, T * l.cfg.hidden * 2, st.s));
  FP4MOE_CUDA_CHECK(cudaGraphLaunch(ge, st.s));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  EXPECT_EQ(download<uint16_t>(out1.get(), T * l.cfg.hidden), download<uint16_t>(out2.get(), T * l.cfg.hidden));
  FP4MOE_CUDA_CHECK(cudaGraphExecDestroy(ge));
  FP4MOE_CUDA_CHECK(cudaGraphDestroy(g));
}

// ---- MXFP4 ----

// The kernel's own decode and dequantization on the hardware (mul.bf16x2 included): every code in
// every value slot, every accepted scale byte b in [kMxfp4MinByte, 254], both halves of the pair.
__global__ void mx_dequant_kernel(const uint32_t* words, const uint32_t* pairs, uint32_t* out, int count) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  uint32_t a[4];
  kernels::dequant_fragment(words[i], kernels::decode_scale_pair(pairs[i], layout::kMxfp4ScaleMul,
                                                                 layout::kMxfp4ScaleAdd), a);
  for (int q = 0; q < 4; ++q) out[4 * i + q] = a[q];
}

TEST(Mxfp4Gpu, DequantFragmentIsExactOnTheHardware) {
  FP4MOE_SKIP_WITHOUT_GPU();
  std::vector<uint32_t> words, pairs;
  std::vector<std::array<int, 10>> meta;  // 8 codes, b_g, b_g8
  std::mt19937 rng(5);
  for (int b = layout::kMxfp4MinByte; b <= 254; ++b)
    for (int rep = 0; rep < 8; ++rep) {
      std::array<int, 10> m{};
      uint32_t w = 0;
      for (int v = 0; v < 8; ++v) {
        m[v] = static_cast<int>((rep * 8 + v + rng()) % 16);
        w |= layout::place_code(static_cast<uint8_t>(m[v]), v);
      }
      m[8] = b;
      m[9] = layout::kMxfp4MinByte + static_cast<int>(rng() % (255 - layout::kMxfp4MinByte));
      words.push_back(w);
      pairs.push_back(static_cast<uint32_t>(m[8]) | (static_cast<uint32_t>(m[9]) << 16));
      meta.push_back(m);
    }
  const int n = static_cast<int>(words.size());
  OwnedDeviceBuffer dw = upload(words), dp = upload(pairs), dout(4 * n * 4);
  mx_dequant_kernel<<<(n + 127) / 128, 128>>>(dw.as<uint32_t>(), dp.as<uint32_t>(), dout.as<uint32_t>(), n);
  FP4MOE_CUDA_CHECK_LAUNCH();
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint32_t> out = download<uint32_t>(dout.get(), 4 * n);
  for (int i = 0; i < n; ++i)
    for (int v = 0; v < 8; ++v) {
      // a[0] = (a0,a1) row g, a[1] = (a2,a3) row g+8, a[2] = (a4,a5) row g, a[3] = (a6,a7) row g+8
      const int reg = v >> 1, half = v & 1;
      const int b = (reg & 1) ? meta[i][9] : meta[i][8];
      const uint16_t bits = static_cast<uint16_t>(out[4 * i + reg] >> (16 * half));
      // v * 2^-126 * 2^(b-127): the weight times 2^(c-126) for an expert whose b = e + c
      const double want = double(e2m1_to_float(static_cast<uint8_t>(meta[i][v]))) * std::ldexp(1.0, b - 253);
      ASSERT_EQ(double(bf16_bits_to_float(bits)), want) << "b " << b << " code " << meta[i][v] << " slot " << v;
    }
}

TEST(Mxfp4Gpu, DeviceRepackIsBitIdenticalToHost) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const int E = 3;
  const int64_t n = 96, k = 192;
  std::mt19937 rng(7);
  std::vector<uint8_t> codes(E * n * k / 2), scales(E * n * k / 32);
  for (auto& c : codes) c = static_cast<uint8_t>(rng());
  for (int e = 0; e < E; ++e)  // a different exponent range per expert
    for (int64_t i = 0; i < n * k / 32; ++i) scales[e * n * k / 32 + i] = static_cast<uint8_t>(90 + 20 * e + rng() % 30);
  for (int i = 0; i < 16; ++i) codes[(1 * n * k / 32 + 5) * 16 + i] = 0;  // an all-zero block with any scale
  scales[1 * n * k / 32 + 5] = 3;
  for (bool inter : {false, true}) {
    Stream st;
    OwnedDeviceBuffer dc = upload(codes), ds = upload(scales);
    OwnedDeviceBuffer rc(E * repacked_codes_bytes(n, k)), rs(E * repacked_scales_bytes(n, k)), g(E * 4);
    repack_mxfp4_weights_device(dc.as<uint8_t>(), ds.as<uint8_t>(), E, n, k, inter, rc.as<uint8_t>(), rs.as<uint8_t>(),
                                g.as<float>(), st.s);
    const auto got_c = download<uint8_t>(rc.get(), E * repacked_codes_bytes(n, k));
    const auto got_s = download<uint8_t>(rs.get(), E * repacked_scales_bytes(n, k));
    const auto got_g = download<float>(g.get(), E);
    for (int e = 0; e < E; ++e) {
      std::vector<uint8_t> hc(repacked_codes_bytes(n, k)), hs(repacked_scales_bytes(n, k));
      float hg = 0;
      repack_mxfp4_weights(codes.data() + e * n * k / 2, scales.data() + e * n * k / 32, n, k, inter, hc.data(),
                           hs.data(), &hg);
      EXPECT_TRUE(std::equal(hc.begin(), hc.end(), got_c.begin() + e * hc.size())) << "expert " << e;
      EXPECT_TRUE(std::equal(hs.begin(), hs.end(), got_s.begin() + e * hs.size())) << "expert " << e;
      EXPECT_EQ(float_bits(hg), float_bits(got_g[e])) << "expert " << e;
    }
  }
  // A NaN scale is reported by expert, row and block.
  scales[2 * n * k / 32 + 7 * (k / 32) + 4] = 0xff;
  Stream st;
  OwnedDeviceBuffer dc = upload(codes), ds = upload(scales);
  OwnedDeviceBuffer rc(E * repacked_codes_bytes(n, k)), rs(E * repacked_scales_bytes(n, k)), g(E * 4);
  try {
    repack_mxfp4_weights_device(dc.as<uint8_t>(), ds.as<uint8_t>(), E, n, k, false, rc.as<uint8_t>(),
                                rs.as<uint8_t>(), g.as<float>(), st.s);
    FAIL() << "NaN accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert 2, row 7, k-block 4"), std::string::npos) << e.what();
  }
}

MoeConfig small_gptoss_mx(int E, int64_t H, int64_t I) {
  MoeConfig c = preset("gpt-oss-120b");
  c.name = "gpt-oss-mx-small";
  c.num_experts = E;
  c.hidden = H;
  c.intermediate = I;
  return c;
}

// The synthetic MXFP4 generator on the device equals the host one, and the layer on it matches the
// reference: MXFP4 through repack, scale decode (pair * 128 + 0), epilogue scale, biases, gpt-oss SwiGLU.
TEST(Mxfp4Gpu, SyntheticLayerMatchesReference) {
  FP4MOE_SKIP_WITHOUT_GPU();
  for (const MoeConfig& cfg : {small_gptoss_mx(16, 256, 192), small_gptoss_mx(8, 2880 / 5 / 64 * 64, 320)}) {
    SCOPED_TRACE(cfg.name + " H=" + std::to_string(cfg.hidden));
    Stream st;
    const uint64_t seed = 11;
    SyntheticDeviceLayer L = make_synthetic_layer_device(cfg, seed, st.s);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
    const int64_t H = cfg.hidden, I = cfg.intermediate;
    for (int e : {0, cfg.num_experts - 1}) {
      const ExpertWeights host = make_synthetic_expert(cfg, seed, e);
      const auto c13 = download<uint8_t>(L.weights.w13_codes + e * 2 * I * H / 2, 2 * I * H / 2);
      const auto s13 = download<uint8_t>(L.weights.w13_scales + e * 2 * I * H / 32, 2 * I * H / 32);
      EXPECT_TRUE(std::equal(host.mx_gate.codes.begin(), host.mx_gate.codes.end(), c13.begin()));
      EXPECT_TRUE(std::equal(host.mx_up.codes.begin(), host.mx_up.codes.end(), c13.begin() + I * H / 2));
      EXPECT_TRUE(std::equal(host.mx_gate.scales.begin(), host.mx_gate.scales.end(), s13.begin()));
      EXPECT_TRUE(std::equal(host.mx_up.scales.begin(), host.mx_up.scales.end(), s13.begin() + I * H / 32));
      EXPECT_EQ(download<uint8_t>(L.weights.w2_scales + e * H * I / 32, H * I / 32), host.mx_down.scales);
    }
    const int64_t max_T = 40;
    MoeLayer layer(cfg, L.weights, max_T, st.s);
    OwnedDeviceBuffer ws(layer.workspace_bytes()), out(max_T * H * 2);
    SyntheticExperts experts(cfg, seed);
    const std::vector<float> bias = make_synthetic_router_bias(cfg, seed);
    for (int64_t T : {1, 3, 40}) {
      const std::vector<float> hidden = make_synthetic_hidden(cfg, seed + T, T);
      const std::vector<float> logits = make_synthetic_router_logits(cfg, seed + 3 * T, T);
      OwnedDeviceBuffer dh = upload(to_bf16(hidden)), dl = upload(logits);
      layer.forward(st.s, dh.get(), T, dl.as<float>(), out.get(), ws.get(), ws.bytes());
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
      const auto bits = download<uint16_t>(out.get(), T * H);
      std::vector<float> got(bits.size());
      for (size_t i = 0; i < bits.size(); ++i) got[i] = bf16_bits_to_float(bits[i]);
      const std::vector<float> ref = moe_reference(cfg, experts, hidden, T, route_reference(cfg, logits, bias, T));
      EXPECT_LT(rel_l2(got, ref), kRelL2Bound) << "T=" << T;
    }
  }
}

}  // namespace
}  // namespace fp4moe

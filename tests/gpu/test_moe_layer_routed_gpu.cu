// MoeLayer::forward_routed (routing given by the caller) on the GPU: bit-identical to forward() for the
// same ids and weights, bad ids contribute nothing and are reported, graph capture == eager.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/planner.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe {
namespace {

using test::download;
using test::Stream;
using test::upload;

struct Bufs {
  OwnedDeviceBuffer hidden, logits, out, ws, ids, weights;
};

Bufs make_bufs(const MoeConfig& cfg, const MoeLayer& layer, int64_t T, uint64_t seed, cudaStream_t s) {
  Bufs b;
  b.hidden = OwnedDeviceBuffer(T * cfg.hidden * 2);
  b.logits = OwnedDeviceBuffer(T * cfg.num_experts * 4);
  b.out = OwnedDeviceBuffer(T * cfg.hidden * 2);
  b.ws = OwnedDeviceBuffer(layer.workspace_bytes());
  b.ids = OwnedDeviceBuffer(T * cfg.top_k * 4);
  b.weights = OwnedDeviceBuffer(T * cfg.top_k * 4);
  make_synthetic_hidden_device(cfg, seed, T, b.hidden.get(), s);
  make_synthetic_router_logits_device(cfg, seed, T, b.logits.as<float>(), s);
  return b;
}

std::vector<uint16_t> run_logits(const MoeLayer& l, Bufs& b, int64_t T, cudaStream_t s) {
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(b.out.get(), 0xff, b.out.bytes(), s));  // NaN poison
  l.forward(s, b.hidden.get(), T, b.logits.as<float>(), b.out.get(), b.ws.get(), b.ws.bytes());
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return download<uint16_t>(b.out.get(), T * l.config().hidden);
}

std::vector<uint16_t> run_routed(const MoeLayer& l, Bufs& b, int64_t T, const int32_t* ids, const float* w,
                                 cudaStream_t s) {
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(b.out.get(), 0xff, b.out.bytes(), s));
  l.forward_routed(s, b.hidden.get(), T, ids, w, b.out.get(), b.ws.get(), b.ws.bytes());
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return download<uint16_t>(b.out.get(), T * l.config().hidden);
}

TEST(MoeLayerRoutedGpu, RoutingGivenEqualsTheLogitsPathBitForBit) {
  FP4MOE_SKIP_WITHOUT_GPU();
  struct Case {
    const char* preset;
    std::vector<int64_t> tokens;
  };
  // tiny: grouped sigmoid + shared expert, T * k up to 4200 (the chunked permutation);
  // qwen3-30b: softmax, no shared expert; gpt-oss-120b: router bias, expert biases, clamped SwiGLU.
  for (const Case& c : {Case{"tiny", {1, 7, 300, 2100}}, Case{"qwen3-30b", {1, 33}}, Case{"gpt-oss-120b", {1, 5}}}) {
    const MoeConfig& cfg = preset(c.preset);
    Stream st;
    SyntheticDeviceLayer L = make_synthetic_layer_device(cfg, 41, st.s);
    const int64_t max_T = c.tokens.back();
    MoeLayer layer(cfg, L.weights, max_T, st.s);
    for (int64_t T : c.tokens) {
      SCOPED_TRACE(testing::Message() << c.preset << " T=" << T);
      Bufs b = make_bufs(cfg, layer, T, 100 + T, st.s);
      const std::vector<uint16_t> a = run_logits(layer, b, T, st.s);
      const MoeIntermediates im = layer.intermediates(b.ws.get());
      const size_t n = static_cast<size_t>(T * cfg.top_k);
      const std::vector<int32_t> ids = download<int32_t>(im.topk_ids, n);
      const std::vector<float> w = download<float>(im.topk_weights, n);
      // route() alone gives the same ids and weights.
      layer.route(st.s, b.logits.as<float>(), T, b.ids.as<int32_t>(), b.weights.as<float>());
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
      EXPECT_EQ(download<int32_t>(b.ids.get(), n), ids);
      EXPECT_EQ(download<float>(b.weights.get(), n), w);
      const std::vector<uint16_t> r = run_routed(layer, b, T, b.ids.as<int32_t>(), b.weights.as<float>(), st.s);
      EXPECT_EQ(r, a) << "forward_routed(route(logits)) != forward(logits)";
      EXPECT_EQ(layer.take_routing_error(), "");
    }
  }
}

TEST(MoeLayerRoutedGpu, BadIdsContributeNothingAndAreReportedByTheNextCall) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const MoeConfig& cfg = preset("tiny");  // E = 8, k = 2
  Stream st;
  SyntheticDeviceLayer L = make_synthetic_layer_device(cfg, 5, st.s);
  const int64_t T = 6;
  MoeLayer layer(cfg, L.weights, T, st.s);
  Bufs b = make_bufs(cfg, layer, T, 9, st.s);
  layer.route(st.s, b.logits.as<float>(), T, b.ids.as<int32_t>(), b.weights.as<float>());
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  const size_t n = static_cast<size_t>(T * cfg.top_k);
  std::vector<int32_t> ids = download<int32_t>(b.ids.get(), n);
  std::vector<float> w = download<float>(b.weights.get(), n);

  // -1 (not on this rank) is skipped silently: the same as weight 0 on a valid expert.
  std::vector<int32_t> skip = ids, zero = ids;
  std::vector<float> zero_w = w;
  skip[1 * 2 + 0] = -1;
  zero[1 * 2 + 0] = 0;
  zero_w[1 * 2 + 0] = 0.0f;
  OwnedDeviceBuffer d_skip = upload(skip), d_zero = upload(zero), d_w = upload(w), d_zw = upload(zero_w);
  const std::vector<uint16_t> expect = run_routed(layer, b, T, d_zero.as<int32_t>(), d_zw.as<float>(), st.s);
  EXPECT_EQ(run_routed(layer, b, T, d_skip.as<int32_t>(), d_w.as<float>(), st.s), expect);
  EXPECT_EQ(layer.take_routing_error(), "") << "-1 is not an error";

  // Any other out-of-range id: no crash, the slot contributes nothing, the next call reports it.
  std::vector<int32_t> bad = skip;
  bad[3 * 2 + 1] = cfg.num_experts;  // one past the last expert
  std::vector<int32_t> bad_zero = zero;
  std::vector<float> bad_zero_w = zero_w;
  bad_zero[3 * 2 + 1] = 0;
  bad_zero_w[3 * 2 + 1] = 0.0f;
  OwnedDeviceBuffer d_bad = upload(bad), d_bz = upload(bad_zero), d_bzw = upload(bad_zero_w);
  const std::vector<uint16_t> got = run_routed(layer, b, T, d_bad.as<int32_t>(), d_w.as<float>(), st.s);
  const std::string rec = layer.take_routing_error();  // taken here, so the next call runs
  EXPECT_NE(rec.find("topk_ids[3, 1] = 8"), std::string::npos) << rec;
  const std::vector<uint16_t> want = run_routed(layer, b, T, d_bz.as<int32_t>(), d_bzw.as<float>(), st.s);
  EXPECT_EQ(got, want);

  // Left pending, the record makes the next call (either entry) throw before it launches anything.
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(b.out.get(), 0, b.out.bytes(), st.s));
  layer.forward_routed(st.s, b.hidden.get(), T, d_bad.as<int32_t>(), d_w.as<float>(), b.out.get(), b.ws.get(),
                       b.ws.bytes());
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  std::string msg;
  try {
    layer.forward(st.s, b.hidden.get(), T, b.logits.as<float>(), b.out.get(), b.ws.get(), b.ws.bytes());
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("topk_ids[3, 1] = 8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("MoeLayer::forward"), std::string::npos) << msg;
  // Reported once: the next call runs.
  EXPECT_NO_THROW(layer.forward(st.s, b.hidden.get(), T, b.logits.as<float>(), b.out.get(), b.ws.get(),
                                b.ws.bytes()));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
  // take_routing_error() polls without a call; very negative ids are bad ids too.
  bad[0] = -1000;
  bad[3 * 2 + 1] = ids[3 * 2 + 1];
  OwnedDeviceBuffer d_neg = upload(bad);
  run_routed(layer, b, T, d_neg.as<int32_t>(), d_w.as<float>(), st.s);
  const std::string polled = layer.take_routing_error();
  EXPECT_NE(polled.find("topk_ids[0, 0] = -1000"), std::string::npos) << polled;
  EXPECT_EQ(layer.take_routing_error(), "");

  // The same with GEMM1 on each config that counts the ids itself before its programmatic-launch wait
  // (the stream configs; GroupedGemmArgs::route_ids): a skipped or bad id is dropped from the count
  // exactly as from the offsets the permutation writes.
  const ArchInfo arch = arch_from_device(0);
  for (const TileConfig& c : kGemmConfigs) {
    if (c.mma != 2 || !plan_sm80(c, arch).verdict.valid) continue;
    if (cfg.hidden % c.bk != 0 || cfg.intermediate % c.bk != 0) continue;
    SCOPED_TRACE(c.name());
    MoeTileConfigs tiles;
    tiles.gemm1 = tiles.gemm2 = tiles.shared_gemm1 = tiles.shared_gemm2 = c;
    layer.set_tile_configs(tiles);
    const std::vector<uint16_t> z = run_routed(layer, b, T, d_zero.as<int32_t>(), d_zw.as<float>(), st.s);
    EXPECT_EQ(run_routed(layer, b, T, d_skip.as<int32_t>(), d_w.as<float>(), st.s), z);
    const std::vector<uint16_t> g = run_routed(layer, b, T, d_bad.as<int32_t>(), d_w.as<float>(), st.s);
    EXPECT_NE(layer.take_routing_error(), "");
    EXPECT_EQ(g, run_routed(layer, b, T, d_bz.as<int32_t>(), d_bzw.as<float>(), st.s));
  }
}

TEST(MoeLayerRoutedGpu, GraphCaptureEqualsEager) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const MoeConfig& cfg = preset("glm-5");
  Stream st;
  SyntheticDeviceLayer L = make_synthetic_layer_device(cfg, 3, st.s);
  const int64_t T = 64;
  MoeLayer layer(cfg, L.weights, T, st.s);
  Bufs b = make_bufs(cfg, layer, T, 4, st.s);
  layer.route(st.s, b.logits.as<float>(), T, b.ids.as<int32_t>(), b.weights.as<float>());
  const std::vector<uint16_t> eager = run_routed(layer, b, T, b.ids.as<int32_t>(), b.weights.as<float>(), st.s);
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(b.ws.get(), 0xff, b.ws.bytes(), st.s));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal));
  layer.forward_routed(st.s, b.hidden.get(), T, b.ids.as<int32_t>(), b.weights.as<float>(), b.out.get(), b.ws.get(),
                       b.ws.bytes());
  FP4MOE_CUDA_CHECK(cudaStreamEndCapture(st.s, &graph));
  FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(b.out.get(), 0xff, b.out.bytes(), st.s));
    FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, st.s));
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
    EXPECT_EQ(download<uint16_t>(b.out.get(), T * cfg.hidden), eager) << "replay " << rep;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(MoeLayerRoutedGpu, RejectsBadArguments) {
  FP4MOE_SKIP_WITHOUT_GPU();
  const MoeConfig& cfg = preset("tiny");
  Stream st;
  SyntheticDeviceLayer L = make_synthetic_layer_device(cfg, 2, st.s);
  MoeLayer layer(cfg, L.weights, 8, st.s);
  Bufs b = make_bufs(cfg, layer, 8, 1, st.s);
  const int32_t* ids = b.ids.as<int32_t>();
  const float* w = b.weights.as<float>();
  auto call = [&](int64_t T, const int32_t* i, const float* ww, size_t ws) {
    layer.forward_routed(st.s, b.hidden.get(), T, i, ww, b.out.get(), b.ws.get(), ws);
  };
  EXPECT_THROW(call(9, ids, w, b.ws.bytes()), Error);
  EXPECT_THROW(call(0, ids, w, b.ws.bytes()), Error);
  EXPECT_THROW(call(4, nullptr, w, b.ws.bytes()), Error);
  EXPECT_THROW(call(4, ids, nullptr, b.ws.bytes()), Error);
  EXPECT_THROW(call(4, ids, w, b.ws.bytes() - 1), Error);
  EXPECT_THROW(layer.route(st.s, nullptr, 4, b.ids.as<int32_t>(), b.weights.as<float>()), Error);
  EXPECT_THROW(layer.route(st.s, b.logits.as<float>(), 9, b.ids.as<int32_t>(), b.weights.as<float>()), Error);
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
}

}  // namespace
}  // namespace fp4moe

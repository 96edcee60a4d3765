#include "layer_bench.hpp"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <set>

#include <cublas_v2.h>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/moe_layer.hpp"
#include "gemm_bench.hpp"
#include "kernel_timeline.hpp"

namespace fp4moe::bench {

SyntheticLayerRig make_synthetic_layer_rig(const MoeConfig& cfg, uint64_t seed, int64_t max_tokens, cudaStream_t s) {
  const int E = cfg.num_experts;
  std::fprintf(stderr, "building the synthetic %s layer on the GPU...\n", cfg.name.c_str());
  SyntheticDeviceLayer syn = make_synthetic_layer_device(cfg, seed, s);
  // Route uniformly at random, like the targets' baseline measurements (docs/performance-targets.md: random top-k):
  // the synthetic correction bias would otherwise concentrate tokens on a few experts.
  if (syn.weights.router_bias != nullptr)
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(const_cast<float*>(syn.weights.router_bias), 0, E * sizeof(float), s));
  SyntheticLayerRig r;
  r.layer = std::make_unique<MoeLayer>(cfg, syn.weights, max_tokens, s);
  // the baseline routes with the same bias; keep a copy before the synthetic buffers go
  r.router_bias = DeviceBuffer<float>(syn.weights.router_bias ? E : 0);
  if (syn.weights.router_bias)
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(r.router_bias.get(), syn.weights.router_bias, E * sizeof(float),
                                      cudaMemcpyDeviceToDevice, s));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  syn.buffers.clear();  // the layer holds its own repacked copy
  r.ws = DeviceBuffer<uint8_t>(r.layer->workspace_bytes());
  r.hidden = DeviceBuffer<uint16_t>(max_tokens * cfg.hidden);
  r.out = DeviceBuffer<uint16_t>(max_tokens * cfg.hidden);
  r.logits = DeviceBuffer<float>(max_tokens * E);
  make_synthetic_hidden_device(cfg, seed, max_tokens, r.hidden.get(), s);
  make_synthetic_router_logits_device(cfg, seed, max_tokens, r.logits.get(), s);
  return r;
}

void run_layer_bench(const MoeConfig& cfg, const LayerBenchOptions& opt, const Ceilings& c, cudaStream_t s,
                     nlohmann::json& out) {
  const std::vector<int64_t> tokens =
      opt.tokens.empty() ? std::vector<int64_t>{1, 8, 32, 128, 512, 1024, 4096} : opt.tokens;
  const int64_t max_t = *std::max_element(tokens.begin(), tokens.end());
  const int E = cfg.num_experts, k = cfg.top_k;
  const int64_t H = cfg.hidden, I = cfg.intermediate, Is = cfg.intermediate * cfg.num_shared;

  SyntheticLayerRig rig = make_synthetic_layer_rig(cfg, opt.seed, max_t, s);
  if (opt.force1 || opt.force2) {
    MoeTileConfigs forced;
    forced.gemm1 = opt.force1;
    forced.gemm2 = opt.force2;
    rig.layer->set_tile_configs(forced);
  }
  const MoeLayer& layer = *rig.layer;
  DeviceBuffer<float>& router_bias = rig.router_bias;
  DeviceBuffer<uint8_t>& ws = rig.ws;
  DeviceBuffer<uint16_t>& hidden = rig.hidden;
  DeviceBuffer<uint16_t>& outb = rig.out;
  DeviceBuffer<float>& logits = rig.logits;
  const MoeIntermediates im = layer.intermediates(ws.get());
  const double expert_bytes = double(3 * H * I) * (0.5 + 1.0 / 16.0);
  const double shared_bytes = double(3 * H * Is) * (0.5 + 1.0 / 16.0);

  std::unique_ptr<Bf16Experts> bw, bshared;
  DeviceBuffer<uint16_t> y1, act, y2, sy1, sact, sy2;
  cublasHandle_t h = nullptr;
  if (opt.baseline) {
    bw = make_bf16_experts(E, H, I, opt.seed + 100, s);
    if (Is > 0) bshared = make_bf16_experts(1, H, Is, opt.seed + 200, s);
    y1 = DeviceBuffer<uint16_t>(max_t * k * 2 * I);
    act = DeviceBuffer<uint16_t>(max_t * k * I);
    y2 = DeviceBuffer<uint16_t>(max_t * k * H);
    if (Is > 0) {
      sy1 = DeviceBuffer<uint16_t>(max_t * 2 * Is);
      sact = DeviceBuffer<uint16_t>(max_t * Is);
      sy2 = DeviceBuffer<uint16_t>(max_t * H);
    }
    FP4MOE_CUBLAS_CHECK(cublasCreate(&h));
  }

  std::printf("\n%s MoE layer (routing + permutation + GEMM1/SwiGLU + GEMM2 + combine%s), graph replay, cold L2\n",
              cfg.name.c_str(), Is > 0 ? " + shared expert" : "");
  std::printf("%7s %6s %10s %8s %7s %8s %7s %10s %7s %8s\n", "tokens", "active", "layer us", "TB/s", "xread", "TFLOP/s",
              "xbf16", "bf16 us", "speedup", "x floor");
  std::vector<std::vector<double>> stage_rows;
  for (int64_t T : tokens) {
    auto fwd = [&](cudaStream_t st) {
      layer.forward(st, hidden.get(), T, logits.get(), outb.get(), ws.get(), ws.bytes());
    };
    fwd(s);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    // the routing this input produced: active experts (bytes the layer must stream) and host offsets
    std::vector<int32_t> off(E + 1);
    FP4MOE_CUDA_CHECK(cudaMemcpy(off.data(), im.expert_offsets, (E + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost));
    int active = 0;
    for (int e = 0; e < E; ++e) active += off[e + 1] > off[e];
    const double bytes = active * expert_bytes + shared_bytes;
    const double flops = 2.0 * double(T) * (k * 3.0 * H * I + 3.0 * H * Is);
    const double us = time_graph_us(fwd, s, opt.reps);

    std::vector<double> stages(kNumMoeStages, 0.0);
    if (opt.breakdown) {
      std::vector<cudaEvent_t> ev(kNumMoeStages + 1);
      for (auto& e : ev) FP4MOE_CUDA_CHECK(cudaEventCreate(&e));
      std::vector<std::vector<double>> samples(kNumMoeStages);
      for (int r = 0; r < 10; ++r) {
        layer.forward(s, hidden.get(), T, logits.get(), outb.get(), ws.get(), ws.bytes(), ev.data());
        FP4MOE_CUDA_CHECK(cudaEventSynchronize(ev.back()));
        for (int st = 0; st < kNumMoeStages; ++st) {
          float ms = 0;
          FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[st], ev[st + 1]));
          samples[st].push_back(ms * 1e3);
        }
      }
      for (int st = 0; st < kNumMoeStages; ++st) stages[st] = median(samples[st]);
      for (auto& e : ev) FP4MOE_CUDA_CHECK(cudaEventDestroy(e));
    }

    double bf16_us = 0;
    if (opt.baseline) {
      // The same pipeline with bf16 experts: fp4moe's routing, permutation, gather and combine around
      // per-expert cuBLAS GEMMs (sizes from this routing, as a per-expert loop would have them).
      auto pipeline = [&](cudaStream_t st) {
        const MoeWorkspaceLayout L = layer.workspace_layout();
        auto* wsb = static_cast<uint8_t*>(ws.get());
        moe_route(cfg, logits.get(), router_bias.get(), T, im.topk_ids, im.topk_weights, st);
        moe_permute(E, k, T, im.topk_ids, im.topk_weights, reinterpret_cast<int32_t*>(wsb + L.chunk_counts),
                    im.expert_offsets, im.row_of, im.row_scale, nullptr, st);
        moe_gather(hidden.get(), T, H, im.row_of, k, im.sorted_hidden, st);
        record_bf16_expert_gemms(h, *bw, off, im.sorted_hidden, y1.get(), act.get(), y2.get(), im.row_scale, st);
        if (bshared) {
          const std::vector<int32_t> soff{0, static_cast<int32_t>(T)};
          record_bf16_expert_gemms(h, *bshared, soff, hidden.get(), sy1.get(), sact.get(), sy2.get(), nullptr, st);
        }
        moe_combine(y2.get(), bshared ? sy2.get() : nullptr, im.row_of, k, T, H, outb.get(), st);
      };
      pipeline(s);
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      bf16_us = time_graph_us(pipeline, s, std::max(5, opt.reps / 2));
    }
    const double tbps = bytes / (us * 1e-6) / 1e12;
    const double tflops = flops / (us * 1e-6) / 1e12;
    const double floor_us = bytes / (c.stream_read_tbps * 1e12) * 1e6;
    std::printf("%7lld %6d %10.1f %8.2f %7.3f %8.1f %7.3f %10.1f %7.2f %8.2f\n", (long long)T, active, us, tbps,
                tbps / c.stream_read_tbps, tflops, tflops / c.bf16_tflops, bf16_us, bf16_us > 0 ? bf16_us / us : 0.0,
                us / floor_us);
    std::fflush(stdout);
    if (opt.timeline) {
      // The routing this input produced, per active expert: what decides the GEMMs' token tiles.
      int lo = INT32_MAX, hi = 0;
      for (int e = 0; e < E; ++e)
        if (off[e + 1] > off[e]) lo = std::min(lo, off[e + 1] - off[e]), hi = std::max(hi, off[e + 1] - off[e]);
      std::printf("    rows per active expert: min %d, mean %.1f, max %d\n", active > 0 ? lo : 0,
                  active > 0 ? double(off[E] - off[0]) / active : 0.0, hi);
      print_kernel_timeline(graph_kernel_timeline(fwd, s, 5), us);
    }
    const auto tc = layer.tile_configs(T);
    nlohmann::json row = {{"tokens", T},
                          {"active_experts", active},
                          {"weight_bytes", bytes},
                          {"flops", flops},
                          {"layer_us", us},
                          {"weight_tbps", tbps},
                          {"ratio_stream_read", tbps / c.stream_read_tbps},
                          {"tflops", tflops},
                          {"ratio_bf16_gemm", tflops / c.bf16_tflops},
                          {"bf16_pipeline_us", bf16_us},
                          {"speedup_vs_bf16", bf16_us > 0 ? bf16_us / us : 0.0},
                          {"time_over_weight_floor", us / floor_us},
                          {"config_gemm1", tc.gemm1.name()},
                          {"config_gemm2", tc.gemm2.name()}};
    if (opt.breakdown) {
      row["stages_us"] = {{"routing", stages[0]}, {"permute_gather", stages[1]}, {"gemm1", stages[2]},
                          {"gemm2", stages[3]}, {"combine", stages[4]}};
      stage_rows.push_back(stages);
    }
    out["layer"].push_back(row);
  }
  if (opt.breakdown) {
    std::printf("\nper-stage breakdown (eager launches with events, median of 10; us)\n");
    std::printf("%7s %9s %9s %9s %9s %9s %10s\n", "tokens", "routing", "permute", "gemm1", "gemm2", "combine",
                "non-GEMM %");
    for (size_t i = 0; i < tokens.size() && i < stage_rows.size(); ++i) {
      const auto& st = stage_rows[i];
      const double tot = st[0] + st[1] + st[2] + st[3] + st[4];
      std::printf("%7lld %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f%%\n", (long long)tokens[i], st[0], st[1], st[2], st[3],
                  st[4], 100.0 * (st[0] + st[1] + st[4]) / std::max(tot, 1e-9));
    }
  }
  if (h) FP4MOE_CUBLAS_CHECK(cublasDestroy(h));
}

}  // namespace fp4moe::bench

// `fp4moe info|run|bench --checkpoint DIR`: a real checkpoint's MoE layer, loaded by checkpoint.hpp.
#include "checkpoint_cli.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "bench_common.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::cli {

namespace {

const char* router_str(const MoeConfig& c) {
  switch (c.router) {
    case RouterKind::kSoftmaxTopK: return c.renormalize ? "softmax top-k, renormalized" : "softmax top-k";
    case RouterKind::kSigmoidGrouped: return "sigmoid + correction bias, grouped top-k";
    case RouterKind::kGptOss: return "gpt-oss (router bias, top-k on logits, softmax over k)";
  }
  return "?";
}

const char* shared_str(SharedExpertStorage s) {
  switch (s) {
    case SharedExpertStorage::kNone: return "none";
    case SharedExpertStorage::kQuantized: return "quantized like the routed experts";
    case SharedExpertStorage::kBf16: return "bf16 (unquantized)";
  }
  return "?";
}

std::string layers_str(const std::vector<int>& v) {
  // ranges: 1-3, 5
  std::string s;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    s += (s.empty() ? "" : ", ") + (j > i ? fmt::format("{}-{}", v[i], v[j]) : fmt::format("{}", v[i]));
    i = j + 1;
  }
  return s;
}

int resolve_layer(const CheckpointInfo& info, int layer) { return layer < 0 ? info.moe_layers.front() : layer; }

void print_checksum(const std::vector<float>& out, int64_t t, int64_t h) {
  double sum = 0, sumsq = 0;
  for (float v : out) {
    sum += v;
    sumsq += static_cast<double>(v) * v;
  }
  fmt::print("output [{}, {}] bf16: sum = {:.9e}, sum of squares = {:.9e}, hash = {:016x}\n", t, h, sum, sumsq,
             bf16_hash(out));
}

struct Loaded {
  CheckpointInfo info;
  HostMoeLayer layer;
  double load_s = 0;
};

Loaded load(const std::string& dir, int layer, bool routed_only) {
  SafetensorsCheckpoint ck(dir);
  Loaded r;
  r.info = inspect_checkpoint(ck);
  LoadOptions o;
  o.routed_only = routed_only;
  const auto t0 = std::chrono::steady_clock::now();
  r.layer = load_moe_layer(ck, r.info, resolve_layer(r.info, layer), o);
  r.load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace

uint64_t bf16_hash(const std::vector<float>& v) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (float x : v) {
    const uint16_t b = float_to_bf16_bits(x);
    for (int i = 0; i < 2; ++i) {
      h ^= (b >> (8 * i)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

void print_checkpoint_info(const std::string& dir) {
  SafetensorsCheckpoint ck(dir);
  const CheckpointInfo info = inspect_checkpoint(ck);
  const MoeConfig& m = info.moe;
  fmt::print("checkpoint: {}\n", dir);
  fmt::print("  architecture     {} (model_type {})\n", info.architecture, info.model_type);
  fmt::print("  format           {} ({})\n", checkpoint_format_name(info.format), info.format_detail);
  fmt::print("  files            {}{}\n", ck.files().size() == 1 ? ck.files()[0] : fmt::format("{} shards", ck.files().size()),
             ck.sharded() ? " via model.safetensors.index.json" : "");
  fmt::print("  decoder layers   {}; MoE layers: {} ({} of them)\n", info.num_layers, layers_str(info.moe_layers),
             info.moe_layers.size());
  fmt::print("  MoE shape        hidden {}, moe_intermediate {}, {} routed experts, top-{}, {} shared\n", m.hidden,
             m.intermediate, m.num_experts, m.top_k, m.num_shared);
  fmt::print("  routing          {}{}{}\n", router_str(m),
             m.router == RouterKind::kSigmoidGrouped
                 ? fmt::format(" (n_group {}, topk_group {}, renormalize {})", m.n_group, m.topk_group, m.renormalize)
                 : std::string(),
             m.routed_scaling != 1.0f ? fmt::format(", routed scaling {}", m.routed_scaling) : std::string());
  fmt::print("  activation       {}{}\n", m.activation == Activation::kGptOssSwiGLU ? "clamped SwiGLU (gpt-oss)" : "SwiGLU",
             m.expert_bias ? fmt::format(", expert biases, limit {}", m.swiglu_limit) : std::string());
  fmt::print("  expert weights   {}\n", m.format == WeightFormat::kMxfp4
                                             ? "MXFP4: E2M1 codes, E8M0 scale per 32"
                                             : "NVFP4: E2M1 codes, E4M3 scale per 16, FP32 scale per expert projection");
  fmt::print("  shared expert    {}\n", shared_str(info.shared));
  fmt::print("  activations      bf16 in fp4moe{}\n",
             info.activation_scales ? " (the checkpoint's activation scales, a W4A4 recipe, are not used)" : "");
  if (!info.unquantized.empty()) {
    fmt::print("  kept in bf16     {}\n", fmt::join(info.unquantized, ", "));
  }
  const double per_layer = static_cast<double>(3 * m.hidden * m.intermediate) *
                           (0.5 + (m.format == WeightFormat::kMxfp4 ? 1.0 / 32 : 1.0 / 16)) * m.num_experts;
  fmt::print("  routed expert bytes per MoE layer: {:.3f} MB\n", per_layer / 1e6);
}

void run_checkpoint(const CheckpointRunArgs& a) {
  FP4MOE_REQUIRE(a.tokens > 0, "--tokens = {} must be > 0", a.tokens);
  const Loaded L = load(a.dir, a.layer, a.routed_only);
  const MoeConfig& cfg = L.layer.cfg;
  fmt::print("checkpoint {}: {} ({}), layer {}: H = {}, I = {}, {} experts, top-{}, shared: {}\n", a.dir,
             L.info.architecture, checkpoint_format_name(L.info.format), L.layer.layer, cfg.hidden, cfg.intermediate,
             cfg.num_experts, cfg.top_k, a.routed_only ? "not run (--routed-only)" : shared_str(L.layer.shared));
  fmt::print("loaded {:.3f} MB of expert weights in {:.3f} s\n", static_cast<double>(L.layer.bytes()) / 1e6, L.load_s);
  const int64_t T = a.tokens;
  const std::vector<float> hidden = make_synthetic_hidden(cfg, a.seed, T);
  const std::vector<float> logits = host_router_logits(L.layer, hidden, T);
  fmt::print("tokens: {} (synthetic hidden states, seed {}); router logits from the checkpoint's router weight\n", T,
             a.seed);
  std::vector<float> gpu_out;
  if (!a.cpu && gpu_available()) {
    cudaStream_t s;
    FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    {
      DeviceMoeLayer d = upload_moe_layer(L.layer, s);
      MoeLayer layer(d.cfg, d.weights, T, s);
      d.buffers.clear();
      DeviceBuffer<uint8_t> ws(layer.workspace_bytes());
      std::vector<uint16_t> hb(hidden.size());
      for (size_t i = 0; i < hb.size(); ++i) hb[i] = float_to_bf16_bits(hidden[i]);
      DeviceBuffer<uint16_t> dh(hb), out(static_cast<size_t>(T * cfg.hidden));
      DeviceBuffer<float> dl(logits);
      layer.forward(s, dh.get(), T, dl.get(), out.get(), ws.get(), ws.bytes());
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      const std::vector<uint16_t> bits = out.download();
      gpu_out.resize(bits.size());
      for (size_t i = 0; i < bits.size(); ++i) gpu_out[i] = bf16_bits_to_float(bits[i]);
      cudaDeviceProp prop{};
      FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
      fmt::print("device: GPU {} (sm_{}{}), fp4moe::MoeLayer\n", prop.name, prop.major, prop.minor);
      print_checksum(gpu_out, T, cfg.hidden);
    }
    FP4MOE_CUDA_CHECK(cudaStreamDestroy(s));
    if (!a.check) return;
    fmt::print("--check: running the CPU reference on the same weights and inputs\n");
  } else if (!a.cpu) {
    fmt::print("no CUDA GPU found: ");
  }
  const Routing routing = route_reference(cfg, logits, L.layer.router_bias, T);
  HostLayerExperts experts(L.layer);
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<float> ref =
      moe_reference(cfg, experts, hidden, T, routing, ReferenceOptions{.round_intermediates = true, .threads = a.threads});
  fmt::print("device: CPU reference ({:.3f} s)\n",
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  print_checksum(ref, T, cfg.hidden);
  if (gpu_out.empty()) return;
  double err2 = 0, ref2 = 0;
  size_t equal = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(gpu_out[i]) - ref[i];
    err2 += d * d;
    ref2 += static_cast<double>(ref[i]) * ref[i];
    equal += gpu_out[i] == ref[i];
  }
  const double rel = std::sqrt(err2 / std::max(ref2, 1e-300));
  fmt::print("GPU vs CPU reference: relative L2 error {:.3e}, {:.2f}% of elements bit-identical\n", rel,
             100.0 * static_cast<double>(equal) / static_cast<double>(ref.size()));
  // The bound of the GPU layer tests (tests/gpu/test_moe_layer_gpu.cu): bf16 rounding-boundary flips only.
  FP4MOE_REQUIRE(rel < 5e-3, "--check: GPU output differs from the CPU reference (relative L2 error {:.3e} >= 5e-3)",
                 rel);
  fmt::print("--check passed (bound 5e-3)\n");
}

void bench_checkpoint(const CheckpointBenchArgs& a) {
  FP4MOE_REQUIRE(gpu_available(), "bench needs a CUDA GPU and none was found");
  const std::vector<int64_t> tokens =
      a.tokens.empty() ? std::vector<int64_t>{1, 8, 32, 128, 512, 2048} : a.tokens;
  const int64_t max_t = *std::max_element(tokens.begin(), tokens.end());
  const Loaded L = load(a.dir, a.layer, a.routed_only);
  const MoeConfig& cfg = L.layer.cfg;
  cudaStream_t s;
  FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::fprintf(stderr, "measuring ceilings...\n");
  const bench::Ceilings c = bench::measure_ceilings(s);
  DeviceMoeLayer d = upload_moe_layer(L.layer, s);
  MoeLayer layer(d.cfg, d.weights, max_t, s);
  d.buffers.clear();
  DeviceBuffer<uint8_t> ws(layer.workspace_bytes());
  const std::vector<float> hidden = make_synthetic_hidden(cfg, 1, max_t);
  std::vector<uint16_t> hb(hidden.size());
  for (size_t i = 0; i < hb.size(); ++i) hb[i] = float_to_bf16_bits(hidden[i]);
  DeviceBuffer<uint16_t> dh(hb), out(static_cast<size_t>(max_t * cfg.hidden));
  const MoeIntermediates im = layer.intermediates(ws.get());
  const double blk = cfg.format == WeightFormat::kMxfp4 ? 1.0 / 32 : 1.0 / 16;
  const double expert_bytes = static_cast<double>(3 * cfg.hidden * cfg.intermediate) * (0.5 + blk);
  const double shared_bytes =
      L.layer.shared == SharedExpertStorage::kBf16
          ? static_cast<double>(3 * cfg.hidden * cfg.intermediate * cfg.num_shared) * 2.0
          : static_cast<double>(3 * cfg.hidden * cfg.intermediate * cfg.num_shared) * (0.5 + blk);
  fmt::print("GPU: {}; streaming-read ceiling measured in this run: {:.2f} TB/s\n", c.gpu, c.stream_read_tbps);
  fmt::print("{} layer {} ({}), router GEMM included, CUDA graph replay, cold L2, hidden states synthetic\n",
             L.info.moe.name, L.layer.layer, checkpoint_format_name(L.info.format));
  fmt::print("{:>7} {:>7} {:>10} {:>8} {:>7}\n", "tokens", "active", "layer us", "TB/s", "xread");
  nlohmann::json j = {{"gpu", c.gpu}, {"checkpoint", a.dir}, {"layer", L.layer.layer},
                      {"stream_read_tbps", c.stream_read_tbps}};
  for (int64_t T : tokens) {
    auto fwd = [&](cudaStream_t st) {
      layer.forward(st, dh.get(), T, nullptr, out.get(), ws.get(), ws.bytes());
    };
    fwd(s);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<int32_t> ids(static_cast<size_t>(T * cfg.top_k));
    FP4MOE_CUDA_CHECK(cudaMemcpy(ids.data(), im.topk_ids, ids.size() * 4, cudaMemcpyDeviceToHost));
    const int active = static_cast<int>(std::set<int32_t>(ids.begin(), ids.end()).size());
    const double us = bench::time_graph_us(fwd, s, a.reps);
    const double bytes = active * expert_bytes + shared_bytes;
    const double tbps = bytes / (us * 1e-6) / 1e12;
    fmt::print("{:>7} {:>7} {:>10.1f} {:>8.2f} {:>7.3f}\n", T, active, us, tbps, tbps / c.stream_read_tbps);
    j["rows"].push_back({{"tokens", T}, {"active_experts", active}, {"layer_us", us}, {"weight_tbps", tbps},
                         {"ratio_stream_read", tbps / c.stream_read_tbps}});
  }
  if (!a.json.empty()) {
    std::ofstream f(a.json);
    FP4MOE_REQUIRE(f.good(), "--json {}: cannot open for writing", a.json);
    f << j.dump(2) << "\n";
  }
  FP4MOE_CUDA_CHECK(cudaStreamDestroy(s));
}

}  // namespace fp4moe::cli

#include "gemm_bench.hpp"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/tuner.hpp"

namespace fp4moe::bench {
namespace {

// NVFP4 weights of all experts of one GEMM, repacked, random but valid.
struct Fp4Weights {
  DeviceBuffer<uint8_t> codes, scales;
  DeviceBuffer<float> global;
  GroupedWeightsView view;
};

Fp4Weights make_fp4_weights(int E, int64_t n, int64_t k, bool interleave, uint64_t seed, cudaStream_t s) {
  Fp4Weights w;
  const size_t cb = repacked_codes_bytes(n, k), sb = repacked_scales_bytes(n, k);
  DeviceBuffer<uint8_t> disk_codes(cb * E), disk_scales(sb * E);
  fill_random_bytes(disk_codes.get(), disk_codes.bytes(), seed, s);
  fill_random_e4m3_scales(disk_scales.get(), disk_scales.size(), seed + 1, s);
  w.codes = DeviceBuffer<uint8_t>(cb * E);
  w.scales = DeviceBuffer<uint8_t>(sb * E);
  repack_nvfp4_weights_device(disk_codes.get(), disk_scales.get(), E, n, k, interleave, w.codes.get(), w.scales.get(), s);
  std::vector<float> g(E);
  for (int e = 0; e < E; ++e) g[e] = 1.0f / 64.0f * (1.0f + 0.01f * static_cast<float>(e % 7));
  w.global = DeviceBuffer<float>(g);
  w.view.num_experts = E;
  w.view.n = n;
  w.view.k = k;
  w.view.gate_up_interleaved = interleave;
  w.view.codes = w.codes.get();
  w.view.scales = w.scales.get();
  w.view.global_scale = w.global.get();
  return w;
}

__global__ void swiglu_rows_kernel(const __nv_bfloat16* y, __nv_bfloat16* act, int64_t rows, int64_t inter) {
  const int64_t total = rows * inter;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / inter, j = i - r * inter;
    const float g = __bfloat162float(y[r * 2 * inter + j]), u = __bfloat162float(y[r * 2 * inter + inter + j]);
    act[i] = __float2bfloat16_rn(g / (1.0f + __expf(-g)) * u);
  }
}

__global__ void scale_rows_kernel(__nv_bfloat16* y, const float* row_scale, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x)
    y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) * row_scale[i / cols]);
}

std::vector<int32_t> offsets_of(const std::vector<int32_t>& counts) {
  std::vector<int32_t> off(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), off.begin() + 1);
  return off;
}

}  // namespace

Bf16Experts::~Bf16Experts() {
  cudaFree(w1);
  cudaFree(w2);
}

std::unique_ptr<Bf16Experts> make_bf16_experts(int experts, int64_t hidden, int64_t inter, uint64_t seed,
                                               cudaStream_t s) {
  auto w = std::make_unique<Bf16Experts>();
  w->experts = experts;
  w->hidden = hidden;
  w->inter = inter;
  const size_t n1 = size_t(experts) * 2 * inter * hidden, n2 = size_t(experts) * hidden * inter;
  FP4MOE_CUDA_CHECK(cudaMalloc(&w->w1, n1 * 2));
  FP4MOE_CUDA_CHECK(cudaMalloc(&w->w2, n2 * 2));
  fill_random_bf16(w->w1, n1, 0.02f, seed, s);
  fill_random_bf16(w->w2, n2, 0.02f, seed + 1, s);
  return w;
}

void record_bf16_expert_gemms(cublasHandle_t h, const Bf16Experts& w, const std::vector<int32_t>& off,
                              const void* x, void* y1, void* act, void* y2, const float* row_scale, cudaStream_t s) {
  const float one = 1.f, zero = 0.f;
  const int64_t H = w.hidden, I = w.inter;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  auto* y1b = static_cast<__nv_bfloat16*>(y1);
  auto* ab = static_cast<__nv_bfloat16*>(act);
  auto* y2b = static_cast<__nv_bfloat16*>(y2);
  const auto* w1 = static_cast<const __nv_bfloat16*>(w.w1);
  const auto* w2 = static_cast<const __nv_bfloat16*>(w.w2);
  FP4MOE_CUBLAS_CHECK(cublasSetStream(h, s));
  for (int e = 0; e < w.experts; ++e) {
    const int m = off[e + 1] - off[e];
    if (m == 0) continue;
    // row-major Y[m, 2I] = X[m, H] W1_e^T, i.e. column-major Y^T = op_T(W1_e) X^T
    FP4MOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, m, H, &one, w1 + size_t(e) * 2 * I * H,
                                     CUDA_R_16BF, H, xb + size_t(off[e]) * H, CUDA_R_16BF, H, &zero,
                                     y1b + size_t(off[e]) * 2 * I, CUDA_R_16BF, 2 * I, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
  }
  const int64_t rows = off[w.experts];
  if (rows == 0) return;
  swiglu_rows_kernel<<<1024, 256, 0, s>>>(y1b, ab, rows, I);
  FP4MOE_CUDA_CHECK_LAUNCH();
  for (int e = 0; e < w.experts; ++e) {
    const int m = off[e + 1] - off[e];
    if (m == 0) continue;
    FP4MOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, H, m, I, &one, w2 + size_t(e) * H * I, CUDA_R_16BF,
                                     I, ab + size_t(off[e]) * I, CUDA_R_16BF, I, &zero, y2b + size_t(off[e]) * H,
                                     CUDA_R_16BF, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  if (row_scale != nullptr) {
    scale_rows_kernel<<<1024, 256, 0, s>>>(y2b, row_scale, rows, H);
    FP4MOE_CUDA_CHECK_LAUNCH();
  }
}

std::vector<GemmBenchRow> run_gemm_bench(const MoeConfig& cfg, const GemmBenchOptions& opt, cudaStream_t stream) {
  const int E = cfg.num_experts;
  // The GEMMs as the kernels run them (an intermediate size that is not a multiple of 64 is zero-padded).
  const int64_t H = cfg.hidden, I = cfg.kernel_intermediate();
  const int64_t max_t = *std::max_element(opt.tokens.begin(), opt.tokens.end());
  const int64_t max_rows = max_t * cfg.top_k;
  int dev = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&dev));
  const ArchInfo arch = arch_from_device(dev);

  const GemmEpilogue epi1 =
      cfg.activation == Activation::kGptOssSwiGLU ? GemmEpilogue::kGptOssSwiGLU : GemmEpilogue::kSwiGLU;
  Fp4Weights w1 = make_fp4_weights(E, 2 * I, H, true, opt.seed, stream);
  Fp4Weights w2 = make_fp4_weights(E, H, I, false, opt.seed + 7, stream);
  // The model's per-row biases (gpt-oss-120b): the layer's tile ends load them, so these GEMMs do too.
  DeviceBuffer<float> bias1, bias2;
  if (cfg.expert_bias) {
    auto random_bias = [&](int64_t count, uint64_t seed) {
      std::vector<float> b(static_cast<size_t>(count));
      uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
      for (auto& v : b) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        v = static_cast<float>(static_cast<int64_t>(x % 2001) - 1000) * 1e-4f;
      }
      return DeviceBuffer<float>(b);
    };
    bias1 = random_bias(E * 2 * I, opt.seed + 31);
    bias2 = random_bias(E * H, opt.seed + 37);
    w1.view.bias = bias1.get();
    w2.view.bias = bias2.get();
  }
  DeviceBuffer<__nv_bfloat16> x1(max_rows * H), act(max_rows * I), y2(max_rows * H);
  DeviceBuffer<float> row_scale(max_rows);
  fill_random_bf16(x1.get(), x1.size(), 1.0f, opt.seed + 11, stream);
  {
    std::vector<float> rs(max_rows, 0.125f);
    row_scale.upload(rs);
  }
  DeviceBuffer<int32_t> d_off(E + 1);
  // GEMM1's and GEMM2's tile counters, as the layer gives them (GroupedGemmArgs::tile_counter)
  DeviceBuffer<int32_t> counters(2 * kTileCounterStride);
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(counters.get(), 0, counters.bytes(), stream));

  // bf16 baseline weights: the same shapes, bf16, [gate; up] rows for GEMM1
  std::unique_ptr<Bf16Experts> bw;
  DeviceBuffer<__nv_bfloat16> y1;
  cublasHandle_t h = nullptr;
  if (opt.baseline) {
    bw = make_bf16_experts(E, H, I, opt.seed + 21, stream);
    y1 = DeviceBuffer<__nv_bfloat16>(max_rows * 2 * I);
    FP4MOE_CUBLAS_CHECK(cublasCreate(&h));
    FP4MOE_CUBLAS_CHECK(cublasSetStream(h, stream));
  }

  std::vector<GemmBenchRow> rows_out;
  for (int64_t T : opt.tokens) {
    const auto counts = random_expert_counts(T, E, cfg.top_k, opt.seed * 1000 + static_cast<uint64_t>(T));
    const auto off = offsets_of(counts);
    d_off.upload(off);
    GemmBenchRow r;
    r.tokens = T;
    r.active_experts = static_cast<int>(std::count_if(counts.begin(), counts.end(), [](int c) { return c > 0; }));
    const double rows = static_cast<double>(T * cfg.top_k);
    r.weight_bytes = r.active_experts * double(3 * H * I) * (0.5 + 1.0 / 16.0);
    r.flops = 2.0 * rows * double(3 * H * I);
    const TuneProblem p1{E, cfg.top_k, 2 * I, H, epi1}, p2{E, cfg.top_k, H, I, GemmEpilogue::kPlain};
    const TuneLookup l1 = choose_config(p1, T, arch), l2 = choose_config(p2, T, arch);
    r.tuned = !l1.table.empty() && !l2.table.empty();
    r.source1 = l1.source;
    r.source2 = l2.source;
    r.cfg1 = opt.force1 ? *opt.force1 : *l1.config;
    r.cfg2 = opt.force2 ? *opt.force2 : *l2.config;

    GroupedGemmArgs a1, a2;
    a1.act = x1.get(); a1.expert_offsets = d_off.get(); a1.max_rows = T * cfg.top_k; a1.out = act.get();
    a1.epilogue = epi1;
    a2.act = act.get(); a2.expert_offsets = d_off.get(); a2.max_rows = T * cfg.top_k; a2.out = y2.get();
    a2.row_scale = row_scale.get(); a2.epilogue = GemmEpilogue::kPlain;
    a1.tile_counter = counters.get();
    a2.tile_counter = counters.get() + kTileCounterStride;
    auto time_pair = [&](const TileConfig& c1, const TileConfig& c2) {
      auto fp4 = [&](cudaStream_t s) {
        grouped_gemm_nvfp4(w1.view, a1, c1, s);
        grouped_gemm_nvfp4(w2.view, a2, c2, s);
      };
      fp4(stream);
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      return time_graph_us(fp4, stream, opt.reps);
    };
    r.fp4_us = time_pair(r.cfg1, r.cfg2);
    if (opt.compare_heuristic) {
      // the pick without a tuner table: rows per expert as the heuristic sees them (T * k / E)
      const double rpe_h = rows / E;
      r.hcfg1 = heuristic_tile_config(2 * I, H, rpe_h, arch);
      r.hcfg2 = heuristic_tile_config(H, I, rpe_h, arch);
      r.heuristic_us = (r.hcfg1 == r.cfg1 && r.hcfg2 == r.cfg2) ? r.fp4_us : time_pair(r.hcfg1, r.hcfg2);
    }

    if (opt.trace && (r.cfg1.mma == 2 || r.cfg2.mma == 2)) {
      // One eager pass with the timeline on, L2 flushed first as before each timed replay; only stream
      // configs write it.
      const size_t n1 = grouped_gemm_trace_values(r.cfg1, epi1, H);
      const size_t n2 = grouped_gemm_trace_values(r.cfg2, GemmEpilogue::kPlain, I);
      DeviceBuffer<unsigned long long> t1(std::max<size_t>(n1, 1)), t2(std::max<size_t>(n2, 1));
      FP4MOE_CUDA_CHECK(cudaMemsetAsync(t1.get(), 0, t1.size() * 8, stream));
      FP4MOE_CUDA_CHECK(cudaMemsetAsync(t2.get(), 0, t2.size() * 8, stream));
      GroupedGemmArgs b1 = a1, b2 = a2;
      if (n1) b1.trace = t1.get(), b1.trace_capacity = n1;
      if (n2) b2.trace = t2.get(), b2.trace_capacity = n2;
      flush_l2(stream);
      grouped_gemm_nvfp4(w1.view, b1, r.cfg1, stream);
      grouped_gemm_nvfp4(w2.view, b2, r.cfg2, stream);
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      if (n1) r.trace += summarize_stream_trace(t1.download(), r.cfg1.warps, "T=" + std::to_string(T) + " GEMM1 " + r.cfg1.name());
      if (n2) r.trace += summarize_stream_trace(t2.download(), r.cfg2.warps, "T=" + std::to_string(T) + " GEMM2 " + r.cfg2.name());
    }

    if (opt.baseline) {
      auto bf16 = [&](cudaStream_t s) {
        record_bf16_expert_gemms(h, *bw, off, x1.get(), y1.get(), act.get(), y2.get(), row_scale.get(), s);
      };
      bf16(stream);
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      r.bf16_us = time_graph_us(bf16, stream, std::max(5, opt.reps / 2));
    }
    std::fprintf(stderr, "  T=%lld done (fp4 %.1f us, bf16 %.1f us)\n", static_cast<long long>(T), r.fp4_us, r.bf16_us);
    rows_out.push_back(r);
  }
  if (h) FP4MOE_CUBLAS_CHECK(cublasDestroy(h));
  return rows_out;
}

}  // namespace fp4moe::bench

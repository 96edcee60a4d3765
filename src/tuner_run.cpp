// The tuner's timing loop (tuner.hpp: run_tuner). Needs a GPU. Per (problem, bucket): random valid
// NVFP4 weights (codes random bytes, E4M3 scales random in [0x08, 0x70], on-disk layout, repacked on
// the device), random bf16 activations, per-expert row offsets from random top-k routing of T tokens.
// Several input sets, together larger than 2x L2, are rotated so that weights are not L2-resident
// (decode is weight-streaming). Each config: warm-up launches apart, then `reps` launches each timed
// with CUDA events; the median is kept.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <cstring>
#include <memory>
#include <random>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include "fp4moe/arch.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/planner.hpp"
#include "fp4moe/tuner.hpp"

namespace fp4moe {

namespace {

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { p = device_malloc(std::max<size_t>(bytes, 16), "a tuner input set"); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T> T* as() const { return static_cast<T*>(p); }
};

struct InputSet {
  std::unique_ptr<DeviceBuffer> codes, scales, gscale, bias, act, offsets, out;
};

class Progress {
 public:
  Progress(int64_t total, bool on) : total_(total), on_(on), t0_(std::chrono::steady_clock::now()) {}
  void step(const std::string& what) {
    ++done_;
    if (!on_) return;
    const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    const double eta = done_ > 0 ? el / done_ * (total_ - done_) : 0.0;
    const int width = 30, filled = total_ > 0 ? static_cast<int>(width * done_ / total_) : width;
    std::fprintf(stderr, "\r[%s%s] %lld/%lld  %5.0fs elapsed, ~%4.0fs left  %-40.40s", std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), static_cast<long long>(done_),
                 static_cast<long long>(total_), el, eta, what.c_str());
    if (done_ == total_) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  }

 private:
  int64_t total_, done_ = 0;
  bool on_;
  std::chrono::steady_clock::time_point t0_;
};

uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

std::vector<TileConfig> candidates(const TuneProblem& pr, const ArchInfo& arch) {
  std::vector<TileConfig> out;
  for (const TileConfig& c : valid_sm80_configs(arch))
    if (check_problem_sm80(c, pr.n, pr.k, pr.experts, &arch).valid) out.push_back(c);
  return out;
}

}  // namespace

nlohmann::json run_tuner(const std::vector<TuneProblem>& problems, const TuneOptions& opt, int device) {
  FP4MOE_CUDA_CHECK(cudaSetDevice(device));
  const ArchInfo arch = arch_from_device(device);
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  FP4MOE_REQUIRE(!opt.buckets.empty(), "buckets: at least one token count is needed");
  FP4MOE_REQUIRE(opt.reps >= 1 && opt.warmup >= 0, "reps = {} must be >= 1 and warmup = {} >= 0", opt.reps,
                 opt.warmup);
  for (int64_t t : opt.buckets) FP4MOE_REQUIRE(t >= 1, "bucket {} must be >= 1 token", t);

  int64_t total = 0;
  for (const auto& pr : problems) {
    const auto c = candidates(pr, arch);
    FP4MOE_REQUIRE(!c.empty(), "problem {}: no config of kGemmConfigs is valid on {} for it (see fp4moe explain)",
                   pr.key(), arch.name);
    total += static_cast<int64_t>(c.size()) * static_cast<int64_t>(opt.buckets.size());
  }
  Progress progress(total, opt.progress);
  std::mt19937_64 rng(opt.seed);

  nlohmann::json doc;
  doc["format"] = "fp4moe-tune/2";
  const TuneKey key = current_tune_key(device);
  doc["key"] = key.key_json();
  doc["provenance"] = key.provenance_json();
  doc["entries"] = nlohmann::json::array();

  cudaStream_t stream;
  FP4MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaEvent_t ev0, ev1;
  FP4MOE_CUDA_CHECK(cudaEventCreate(&ev0));
  FP4MOE_CUDA_CHECK(cudaEventCreate(&ev1));
  // The tile counter the layer's launches use (GroupedGemmArgs::tile_counter): the tma configs are timed
  // taking work tiles in arrival order, as the layer runs them. Each launch leaves it zero.
  DeviceBuffer tile_counter(8);
  FP4MOE_CUDA_CHECK(cudaMemset(tile_counter.p, 0, 8));

  for (const TuneProblem& pr : problems) {
    FP4MOE_REQUIRE(pr.experts >= 1 && pr.top_k >= 1 && pr.top_k <= pr.experts,
                   "problem {}: experts = {} and top_k = {} must satisfy 1 <= top_k <= experts", pr.key(),
                   pr.experts, pr.top_k);
    const auto configs = candidates(pr, arch);
    const bool swiglu = pr.epilogue != GemmEpilogue::kPlain;
    const int64_t E = pr.experts, n = pr.n, k = pr.k;
    const size_t codes_bytes = static_cast<size_t>(E) * repacked_codes_bytes(n, k);
    const size_t scales_bytes = static_cast<size_t>(E) * repacked_scales_bytes(n, k);
    const int64_t max_tokens = *std::max_element(opt.buckets.begin(), opt.buckets.end());
    const int64_t max_rows = max_tokens * pr.top_k;
    const size_t set_bytes = codes_bytes + scales_bytes;
    int sets = static_cast<int>(std::min<int64_t>(8, (2 * static_cast<int64_t>(prop.l2CacheSize)) / set_bytes + 1));
    size_t free_b = 0, total_b = 0;
    FP4MOE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const size_t act_bytes = static_cast<size_t>(max_rows) * k * 2;
    const size_t out_bytes = static_cast<size_t>(max_rows) * (swiglu ? n / 2 : n) * 2;
    const size_t per_set = set_bytes + act_bytes + out_bytes;
    sets = static_cast<int>(std::max<size_t>(1, std::min<size_t>(sets, free_b / 2 / std::max<size_t>(per_set, 1))));

    // Weights: random on-disk bytes, repacked on the device, one set after another.
    std::vector<InputSet> in(static_cast<size_t>(sets));
    {
      DeviceBuffer raw_codes(codes_bytes), raw_scales(scales_bytes);
      std::vector<uint8_t> h_codes(codes_bytes), h_scales(scales_bytes);
      std::vector<float> h_gs(static_cast<size_t>(E));
      uint64_t sbits = 0;
      for (auto& s : in) {
        // Eight bytes per draw: a GLM-5 problem is ~5 GB of codes, and a byte-wise distribution took
        // most of the tuner's wall time. Scales stay in [0x08, 0x70] (finite, positive E4M3).
        for (size_t i = 0; i < h_codes.size(); i += 8) {
          const uint64_t r = rng();
          std::memcpy(h_codes.data() + i, &r, std::min<size_t>(8, h_codes.size() - i));
        }
        for (size_t i = 0; i < h_scales.size(); ++i) {
          if (i % 8 == 0) sbits = rng();
          h_scales[i] = static_cast<uint8_t>(0x08 + ((sbits >> (8 * (i % 8))) & 0xff) % (0x70 - 0x08 + 1));
        }
        for (auto& g : h_gs) g = 1.0f / 64.0f;
        copy_to_device(raw_codes.p, h_codes.data(), codes_bytes);
        copy_to_device(raw_scales.p, h_scales.data(), scales_bytes);
        s.codes = std::make_unique<DeviceBuffer>(codes_bytes);
        s.scales = std::make_unique<DeviceBuffer>(scales_bytes);
        repack_nvfp4_weights_device(raw_codes.as<uint8_t>(), raw_scales.as<uint8_t>(), static_cast<int>(E), n, k,
                                    swiglu, s.codes->as<uint8_t>(), s.scales->as<uint8_t>(), stream);
        s.gscale = std::make_unique<DeviceBuffer>(static_cast<size_t>(E) * 4);
        copy_to_device(s.gscale->p, h_gs.data(), static_cast<size_t>(E) * 4);
        if (pr.bias) {  // the model's per-row biases, small values (their time is the loads, not the values)
          std::vector<float> h_bias(static_cast<size_t>(E * n));
          std::normal_distribution<float> bd(0.0f, 0.1f);
          for (auto& b : h_bias) b = bd(rng);
          s.bias = std::make_unique<DeviceBuffer>(h_bias.size() * 4);
          copy_to_device(s.bias->p, h_bias.data(), h_bias.size() * 4);
        }
        std::vector<uint16_t> h_act(static_cast<size_t>(max_rows) * k);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (auto& a : h_act) a = bf16_bits(nd(rng));
        s.act = std::make_unique<DeviceBuffer>(act_bytes);
        copy_to_device(s.act->p, h_act.data(), act_bytes);
        s.offsets = std::make_unique<DeviceBuffer>(static_cast<size_t>(E + 1) * 4);
        s.out = std::make_unique<DeviceBuffer>(out_bytes);
      }
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    }

    nlohmann::json entry;
    entry["problem_key"] = pr.key();
    entry["problem"] = {{"experts", E}, {"top_k", pr.top_k}, {"n", n}, {"k", k},
                        {"weight_format", pr.weight_format}, {"act_format", pr.act_format},
                        {"epilogue", epilogue_name(pr.epilogue)}};
    if (pr.bias) entry["problem"]["bias"] = true;
    entry["input_sets"] = sets;
    entry["buckets"] = nlohmann::json::array();

    for (int64_t T : opt.buckets) {
      // Random top-k routing of T tokens (distinct experts per token), per set; offsets on the host.
      for (auto& s : in) {
        std::vector<int32_t> counts(static_cast<size_t>(E), 0);
        std::vector<int> perm(static_cast<size_t>(E));
        std::iota(perm.begin(), perm.end(), 0);
        for (int64_t t = 0; t < T; ++t)
          for (int j = 0; j < pr.top_k; ++j) {
            std::uniform_int_distribution<int> pick(j, static_cast<int>(E) - 1);
            std::swap(perm[j], perm[pick(rng)]);
            ++counts[perm[j]];
          }
        std::vector<int32_t> offs(static_cast<size_t>(E + 1), 0);
        for (int64_t e = 0; e < E; ++e) offs[e + 1] = offs[e] + counts[e];
        copy_to_device(s.offsets->p, offs.data(), offs.size() * 4);
      }
      const int64_t rows = T * pr.top_k;
      nlohmann::json bucket;
      bucket["tokens"] = T;
      bucket["rows_per_expert"] = static_cast<double>(rows) / E;
      bucket["timings"] = nlohmann::json::array();
      double best_us = 1e30;
      TileConfig best{};
      for (const TileConfig& cfg : configs) {
        auto launch = [&](const InputSet& s) {
          GroupedWeightsView w;
          w.num_experts = static_cast<int>(E);
          w.n = n;
          w.k = k;
          w.gate_up_interleaved = swiglu;
          w.codes = s.codes->as<uint8_t>();
          w.scales = s.scales->as<uint8_t>();
          w.global_scale = s.gscale->as<float>();
          w.bias = s.bias ? s.bias->as<float>() : nullptr;
          GroupedGemmArgs a;
          a.act = s.act->p;
          a.expert_offsets = s.offsets->as<int32_t>();
          a.max_rows = std::max<int64_t>(rows, 1);
          a.out = s.out->p;
          a.epilogue = pr.epilogue;
          a.tile_counter = static_cast<int32_t*>(tile_counter.p);
          grouped_gemm_nvfp4(w, a, cfg, stream);
        };
        for (int i = 0; i < opt.warmup; ++i) launch(in[static_cast<size_t>(i % sets)]);
        FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        std::vector<double> us;
        for (int r = 0; r < opt.reps; ++r) {
          const InputSet& s = in[static_cast<size_t>((r + opt.warmup) % sets)];
          FP4MOE_CUDA_CHECK(cudaEventRecord(ev0, stream));
          launch(s);
          FP4MOE_CUDA_CHECK(cudaEventRecord(ev1, stream));
          FP4MOE_CUDA_CHECK(cudaEventSynchronize(ev1));
          float ms = 0.f;
          FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, ev0, ev1));
          us.push_back(ms * 1000.0);
        }
        std::sort(us.begin(), us.end());
        const double med = us[us.size() / 2];
        bucket["timings"].push_back({{"config", cfg.name()}, {"cfg", tile_config_to_json(cfg)},
                                     {"median_us", med}, {"min_us", us.front()}, {"max_us", us.back()},
                                     {"reps", opt.reps}});
        if (med < best_us && tuner_may_pick(cfg, static_cast<double>(rows) / E, pr.shared_expert_fused))
          best_us = med, best = cfg;
        progress.step(fmt::format("{} T={} {}", pr.key(), T, cfg.name()));
      }
      bucket["shared_expert_fused"] = pr.shared_expert_fused;  // the rule the pick obeys (tuner_may_pick)
      bucket["best"] = tile_config_to_json(best);
      bucket["best_name"] = best.name();
      bucket["best_us"] = best_us;
      bucket["all_experts_weight_bytes_per_us"] = static_cast<double>(set_bytes) / best_us;
      entry["buckets"].push_back(bucket);
    }
    doc["entries"].push_back(entry);
  }
  cudaEventDestroy(ev0);
  cudaEventDestroy(ev1);
  cudaStreamDestroy(stream);
  return doc;
}

}  // namespace fp4moe

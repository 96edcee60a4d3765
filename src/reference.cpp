// CPU reference MoE layer (see include/fp4moe/reference.hpp for the arithmetic contract).
#include "fp4moe/reference.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <thread>

#include "fp4moe/error.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/synthetic.hpp"

namespace fp4moe {

namespace {

// ---------------------------------------------------------------------------------------------------
// Threads
// ---------------------------------------------------------------------------------------------------

int resolve_threads(int requested) {
  FP4MOE_REQUIRE(requested >= 0, "ReferenceOptions::threads = {} must be >= 0 (0 = all cores)", requested);
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// Runs fn(i) for i in [0, n) on up to `threads` threads, items handed out one at a time (the items
// are uneven: an expert with 8 tokens vs 1). The first exception is rethrown after all threads join.
template <class Fn>
void parallel_for(int64_t n, int threads, Fn&& fn) {
  if (n <= 0) return;
  const int64_t nt = std::min<int64_t>(threads, n);
  if (nt <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mu;
  auto worker = [&] {
    for (;;) {
      if (failed.load()) return;
      const int64_t i = next.fetch_add(1);
      if (i >= n) return;
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < nt; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

// ---------------------------------------------------------------------------------------------------
// Synthetic weights
// ---------------------------------------------------------------------------------------------------

std::vector<float> synth_weight_matrix(uint64_t seed, SynthTensor t, uint32_t expert, int64_t rows, int64_t cols,
                                       float std) {
  std::vector<float> w(static_cast<size_t>(rows * cols));
  // synth_weight itself, not a re-derivation: hoisting the per-row hash by hand measured no faster
  // (2.4 ns per weight either way; quantization is the cost).
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      w[r * cols + c] = synth_weight(seed, t, expert, static_cast<uint64_t>(r), static_cast<uint64_t>(c), std);
  return w;
}

std::vector<float> synth_bias(uint64_t seed, SynthTensor t, uint32_t expert, int64_t offset, int64_t n) {
  std::vector<float> b(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    b[i] = round_to_bf16(synth_weight(seed, t, expert, 0, static_cast<uint64_t>(offset + i), 0.1f));
  return b;
}

int64_t expert_width(const MoeConfig& cfg, int expert) {
  return expert == kSharedExpert ? cfg.intermediate * cfg.num_shared : cfg.intermediate;
}

// ---------------------------------------------------------------------------------------------------
// GEMMs over NVFP4 weights
// ---------------------------------------------------------------------------------------------------

// e2m1 * e4m3 of one row, exact in float (<= 6 significant bits); the global scale is applied to the
// double dot product afterwards.
void decode_row(const Nvfp4Tensor& w, int64_t r, float* out) {
  static const auto lut = [] {
    std::array<float, 16> l{};
    for (int i = 0; i < 16; ++i) l[i] = e2m1_to_float(static_cast<uint8_t>(i));
    return l;
  }();
  const int64_t k = w.cols;
  const uint8_t* codes = w.codes.data() + r * k / 2;
  const uint8_t* scales = w.scales.data() + r * k / kNvfp4Block;
  for (int64_t b = 0; b < k / kNvfp4Block; ++b) {
    const float s = e4m3_to_float(scales[b]);
    for (int i = 0; i < kNvfp4Block / 2; ++i) {
      const uint8_t byte = codes[b * kNvfp4Block / 2 + i];
      out[b * kNvfp4Block + 2 * i] = lut[byte & 0xf] * s;
      out[b * kNvfp4Block + 2 * i + 1] = lut[byte >> 4] * s;
    }
  }
}

// e2m1 * 2^(e-127) of one MXFP4 row, exact in float.
void decode_row(const Mxfp4Tensor& w, int64_t r, float* out) {
  const int64_t k = w.cols;
  const uint8_t* codes = w.codes.data() + r * k / 2;
  const uint8_t* scales = w.scales.data() + r * k / kMxfp4Block;
  for (int64_t b = 0; b < k / kMxfp4Block; ++b) {
    const float s = e8m0_to_float(scales[b]);
    for (int i = 0; i < kMxfp4Block / 2; ++i) {
      const uint8_t byte = codes[b * kMxfp4Block / 2 + i];
      out[b * kMxfp4Block + 2 * i] = e2m1_to_float(byte & 0xf) * s;
      out[b * kMxfp4Block + 2 * i + 1] = e2m1_to_float(byte >> 4) * s;
    }
  }
}

// One of an expert's three matrices, whatever its storage: shape, exact row decode, global scale.
struct Mat {
  const Nvfp4Tensor* nv = nullptr;
  const Mxfp4Tensor* mx = nullptr;
  const DenseMatrix* dn = nullptr;
  int64_t rows() const { return nv ? nv->rows : mx ? mx->rows : dn->rows; }
  int64_t cols() const { return nv ? nv->cols : mx ? mx->cols : dn->cols; }
  double global() const { return nv ? nv->global_scale : 1.0; }
  void decode(int64_t r, float* out) const {
    if (nv) decode_row(*nv, r, out);
    else if (mx) decode_row(*mx, r, out);
    else std::copy_n(dn->values.data() + r * dn->cols, dn->cols, out);
  }
  // Byte counts match the shape (dense: value count).
  bool consistent() const {
    if (nv) return nv->codes.size() == static_cast<size_t>(rows() * cols() / 2) &&
                   nv->scales.size() == static_cast<size_t>(rows() * cols() / kNvfp4Block);
    if (mx) return mx->cols % kMxfp4Block == 0 && mx->codes.size() == static_cast<size_t>(rows() * cols() / 2) &&
                   mx->scales.size() == static_cast<size_t>(rows() * cols() / kMxfp4Block);
    return dn->values.size() == static_cast<size_t>(rows() * cols());
  }
};
enum class Which { kGate, kUp, kDown };
Mat mat(const ExpertWeights& w, Which which) {
  Mat m;
  switch (w.storage) {
    case ExpertStorage::kNvfp4: m.nv = which == Which::kGate ? &w.gate : which == Which::kUp ? &w.up : &w.down; break;
    case ExpertStorage::kMxfp4:
      m.mx = which == Which::kGate ? &w.mx_gate : which == Which::kUp ? &w.mx_up : &w.mx_down;
      break;
    case ExpertStorage::kBf16:
      m.dn = which == Which::kGate ? &w.dense_gate : which == Which::kUp ? &w.dense_up : &w.dense_down;
      break;
  }
  return m;
}

// Double dot product; n % 4 == 0 (every K here is a multiple of 64). Four partial sums break the
// add latency chain; in double the summation order changes the result by ~1e-16 relative.
double dot(const float* a, const float* b, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t i = 0; i < n; i += 4) {
    s0 += static_cast<double>(a[i]) * b[i];
    s1 += static_cast<double>(a[i + 1]) * b[i + 1];
    s2 += static_cast<double>(a[i + 2]) * b[i + 2];
    s3 += static_cast<double>(a[i + 3]) * b[i + 3];
  }
  return (s0 + s1) + (s2 + s3);
}

float activation(const MoeConfig& cfg, float g, float u) {
  return cfg.activation == Activation::kGptOssSwiGLU
             ? gptoss_swiglu_reference(g, u, cfg.swiglu_alpha, cfg.swiglu_limit)
             : swiglu_reference(g, u);
}

// ie: the expert's intermediate width (I, or I * num_shared for the shared expert).
void check_expert(const MoeConfig& cfg, const ExpertWeights& w, int expert, int64_t ie) {
  const int64_t h = cfg.hidden;
  // Routed experts are stored in the config's format; a shared expert may also be dense bf16.
  const ExpertStorage want = cfg.format == WeightFormat::kMxfp4 ? ExpertStorage::kMxfp4 : ExpertStorage::kNvfp4;
  FP4MOE_REQUIRE(w.storage == want || (expert == kSharedExpert && w.storage == ExpertStorage::kBf16),
                 "expert {}: weights are stored as {}; config '{}' needs {}{}", expert, static_cast<int>(w.storage),
                 cfg.name, want == ExpertStorage::kMxfp4 ? "MXFP4" : "NVFP4",
                 expert == kSharedExpert ? " (or bf16 for the shared expert)" : "");
  auto check = [&](Which which, const char* name, int64_t rows, int64_t cols) {
    const Mat t = mat(w, which);
    FP4MOE_REQUIRE(t.rows() == rows && t.cols() == cols,
                   "expert {}: {} is [{}, {}]; config '{}' needs [{}, {}]", expert, name, t.rows(), t.cols(),
                   cfg.name, rows, cols);
    FP4MOE_REQUIRE(t.consistent(), "expert {}: {} [{}, {}] holds a byte count that does not match its shape", expert,
                   name, rows, cols);
  };
  check(Which::kGate, "gate", ie, h);
  check(Which::kUp, "up", ie, h);
  check(Which::kDown, "down", h, ie);
  if (cfg.expert_bias) {
    FP4MOE_REQUIRE(w.bias_gate.size() == static_cast<size_t>(ie) && w.bias_up.size() == static_cast<size_t>(ie) &&
                       w.bias_down.size() == static_cast<size_t>(h),
                   "expert {}: biases have sizes {}, {}, {}; config '{}' (expert_bias) needs {}, {}, {}", expert,
                   w.bias_gate.size(), w.bias_up.size(), w.bias_down.size(), cfg.name, ie, ie, h);
  }
}

// x: `rows` pointers to H floats. act: [rows, I_e].
void gemm1_rows(const MoeConfig& cfg, const ExpertWeights& w, const std::vector<const float*>& x, bool round,
                int64_t j0, int64_t j1, float* act) {
  const Mat gate = mat(w, Which::kGate), up = mat(w, Which::kUp);
  const int64_t h = gate.cols(), ie = gate.rows();
  const double gs_gate = gate.global(), gs_up = up.global();
  std::vector<float> qg(static_cast<size_t>(h)), qu(static_cast<size_t>(h));
  for (int64_t j = j0; j < j1; ++j) {
    gate.decode(j, qg.data());
    up.decode(j, qu.data());
    for (size_t r = 0; r < x.size(); ++r) {
      float g = static_cast<float>(dot(qg.data(), x[r], h) * gs_gate);
      float u = static_cast<float>(dot(qu.data(), x[r], h) * gs_up);
      if (cfg.expert_bias) {
        g += w.bias_gate[j];
        u += w.bias_up[j];
      }
      const float a = activation(cfg, g, u);
      act[r * ie + j] = round ? round_to_bf16(a) : a;
    }
  }
}

// act: [rows, I_e]; out: [rows, H]; row_scale: per row or null.
void gemm2_rows(const MoeConfig& cfg, const ExpertWeights& w, const float* act, int64_t rows,
                const float* row_scale, bool round, int64_t n0, int64_t n1, float* const* out) {
  const Mat down = mat(w, Which::kDown);
  const int64_t ie = down.cols();
  const double gs = down.global();
  std::vector<float> q(static_cast<size_t>(ie));
  for (int64_t n = n0; n < n1; ++n) {
    down.decode(n, q.data());
    for (int64_t r = 0; r < rows; ++r) {
      float y = static_cast<float>(dot(q.data(), act + r * ie, ie) * gs);
      if (cfg.expert_bias) y += w.bias_down[n];
      if (row_scale) y *= row_scale[r];
      out[r][n] = round ? round_to_bf16(y) : y;
    }
  }
}

// Top-k indices of score[0..n) restricted to allowed (or all when null): descending score, ties to the
// lower index.
void top_k_indices(const float* score, int n, const std::vector<char>* allowed, int k, int32_t* out) {
  std::vector<int32_t> idx;
  idx.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    if (!allowed || (*allowed)[i]) idx.push_back(i);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  std::copy(idx.begin(), idx.begin() + k, out);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------------

Routing route_reference(const MoeConfig& cfg, std::span<const float> logits, std::span<const float> bias,
                        int64_t tokens) {
  cfg.validate();
  FP4MOE_REQUIRE(tokens > 0, "route_reference: tokens = {} must be > 0", tokens);
  const int e_count = cfg.num_experts, k = cfg.top_k;
  FP4MOE_REQUIRE(logits.size() == static_cast<size_t>(tokens * e_count),
                 "route_reference: logits has {} values; tokens * num_experts = {} * {} = {}", logits.size(),
                 tokens, e_count, tokens * e_count);
  FP4MOE_REQUIRE(bias.empty() || bias.size() == static_cast<size_t>(e_count),
                 "route_reference: bias has {} values; it must be empty or num_experts = {}", bias.size(),
                 e_count);
  FP4MOE_REQUIRE(bias.empty() || cfg.router != RouterKind::kSoftmaxTopK,
                 "route_reference: config '{}' uses the softmax router, which takes no bias; got {} values",
                 cfg.name, bias.size());
  for (size_t i = 0; i < logits.size(); ++i)
    FP4MOE_REQUIRE(std::isfinite(logits[i]), "route_reference: logits[token {}, expert {}] = {} is not finite",
                   i / e_count, i % e_count, logits[i]);
  for (size_t i = 0; i < bias.size(); ++i)
    FP4MOE_REQUIRE(std::isfinite(bias[i]), "route_reference: bias[{}] = {} is not finite", i, bias[i]);

  Routing r;
  r.tokens = tokens;
  r.top_k = k;
  r.ids.resize(static_cast<size_t>(tokens * k));
  r.weights.resize(static_cast<size_t>(tokens * k));
  std::vector<float> sel(static_cast<size_t>(e_count)), val(static_cast<size_t>(e_count));
  std::vector<char> allowed;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits.data() + t * e_count;
    int32_t* ids = r.ids.data() + t * k;
    float* w = r.weights.data() + t * k;
    switch (cfg.router) {
      case RouterKind::kSoftmaxTopK: {
        float mx = l[0];
        for (int e = 1; e < e_count; ++e) mx = std::max(mx, l[e]);
        float sum = 0.0f;
        for (int e = 0; e < e_count; ++e) {
          val[e] = std::exp(l[e] - mx);
          sum += val[e];
        }
        top_k_indices(l, e_count, nullptr, k, ids);
        if (cfg.renormalize) {
          float chosen = 0.0f;
          for (int s = 0; s < k; ++s) chosen += val[ids[s]] / sum;
          for (int s = 0; s < k; ++s) w[s] = (val[ids[s]] / sum) / chosen;
        } else {
          for (int s = 0; s < k; ++s) w[s] = val[ids[s]] / sum;
        }
        break;
      }
      case RouterKind::kSigmoidGrouped: {
        for (int e = 0; e < e_count; ++e) {
          val[e] = 1.0f / (1.0f + std::exp(-l[e]));
          sel[e] = val[e] + (bias.empty() ? 0.0f : bias[e]);
        }
        const std::vector<char>* mask = nullptr;
        if (cfg.n_group > 1) {
          const int gsize = e_count / cfg.n_group;
          std::vector<float> gscore(static_cast<size_t>(cfg.n_group));
          for (int g = 0; g < cfg.n_group; ++g) {
            int32_t top2[2];
            top_k_indices(sel.data() + g * gsize, gsize, nullptr, 2, top2);
            gscore[g] = sel[g * gsize + top2[0]] + sel[g * gsize + top2[1]];
          }
          std::vector<int32_t> kept(static_cast<size_t>(cfg.topk_group));
          top_k_indices(gscore.data(), cfg.n_group, nullptr, cfg.topk_group, kept.data());
          allowed.assign(static_cast<size_t>(e_count), 0);
          for (int32_t g : kept) std::fill_n(allowed.begin() + g * gsize, gsize, 1);
          mask = &allowed;
        }
        top_k_indices(sel.data(), e_count, mask, k, ids);
        if (cfg.renormalize) {
          float chosen = 0.0f;
          for (int s = 0; s < k; ++s) chosen += val[ids[s]];
          for (int s = 0; s < k; ++s) w[s] = val[ids[s]] / chosen;
        } else {
          for (int s = 0; s < k; ++s) w[s] = val[ids[s]];
        }
        break;
      }
      case RouterKind::kGptOss: {
        for (int e = 0; e < e_count; ++e) sel[e] = l[e] + (bias.empty() ? 0.0f : bias[e]);
        top_k_indices(sel.data(), e_count, nullptr, k, ids);
        const float mx = sel[ids[0]];
        float sum = 0.0f;
        for (int s = 0; s < k; ++s) {
          w[s] = std::exp(sel[ids[s]] - mx);
          sum += w[s];
        }
        for (int s = 0; s < k; ++s) w[s] /= sum;
        break;
      }
    }
    if (cfg.routed_scaling != 1.0f)
      for (int s = 0; s < k; ++s) w[s] *= cfg.routed_scaling;
  }
  return r;
}

// ---------------------------------------------------------------------------------------------------
// Synthetic weights and inputs
// ---------------------------------------------------------------------------------------------------

float synthetic_weight_std(int64_t k) {
  FP4MOE_REQUIRE(k > 0, "synthetic_weight_std: K = {} must be > 0", k);
  return 1.0f / std::sqrt(static_cast<float>(k));
}

ExpertWeights make_synthetic_expert(const MoeConfig& cfg, uint64_t seed, int expert) {
  cfg.validate();
  FP4MOE_REQUIRE((expert >= 0 && expert < cfg.num_experts) || (expert == kSharedExpert && cfg.num_shared > 0),
                 "make_synthetic_expert: expert = {} must be in [0, {}) or kSharedExpert ({}) when the config "
                 "has shared experts (num_shared = {})", expert, cfg.num_experts, kSharedExpert, cfg.num_shared);
  const bool shared = expert == kSharedExpert;
  const int64_t h = cfg.hidden, ie = expert_width(cfg, expert);
  const uint32_t eid = shared ? 0u : static_cast<uint32_t>(expert);
  const SynthTensor tg = shared ? SynthTensor::kSharedGate : SynthTensor::kW1Gate;
  const SynthTensor tu = shared ? SynthTensor::kSharedUp : SynthTensor::kW1Up;
  const SynthTensor td = shared ? SynthTensor::kSharedDown : SynthTensor::kW2;

  ExpertWeights w;
  {
    const float std1 = synthetic_weight_std(h);
    const std::vector<float> gate = synth_weight_matrix(seed, tg, eid, ie, h, std1);
    const std::vector<float> up = synth_weight_matrix(seed, tu, eid, ie, h, std1);
    // One global scale for gate and up, as newer ModelOpt exports do (a fused GEMM1 has one epilogue
    // multiplier).
    if (cfg.format == WeightFormat::kMxfp4) {
      w.storage = ExpertStorage::kMxfp4;
      w.mx_gate = quantize_mxfp4(gate, ie, h);
      w.mx_up = quantize_mxfp4(up, ie, h);
    } else {
      const float gs = nvfp4_global_scale(std::max(amax(gate), amax(up)));
      w.gate = quantize_nvfp4(gate, ie, h, gs);
      w.up = quantize_nvfp4(up, ie, h, gs);
    }
  }
  {
    const std::vector<float> down = synth_weight_matrix(seed, td, eid, h, ie, synthetic_weight_std(ie));
    if (cfg.format == WeightFormat::kMxfp4) w.mx_down = quantize_mxfp4(down, h, ie);
    else w.down = quantize_nvfp4(down, h, ie);
  }
  if (cfg.expert_bias) {
    const uint32_t bid = shared ? 0xffffffffu : static_cast<uint32_t>(expert);
    w.bias_gate = synth_bias(seed, SynthTensor::kBias1, bid, 0, ie);
    w.bias_up = synth_bias(seed, SynthTensor::kBias1, bid, ie, ie);
    w.bias_down = synth_bias(seed, SynthTensor::kBias2, bid, 0, h);
  }
  return w;
}

std::vector<float> make_synthetic_hidden(const MoeConfig& cfg, uint64_t seed, int64_t tokens) {
  FP4MOE_REQUIRE(tokens > 0, "make_synthetic_hidden: tokens = {} must be > 0", tokens);
  FP4MOE_REQUIRE(cfg.hidden > 0, "make_synthetic_hidden: config '{}' hidden = {} must be > 0", cfg.name, cfg.hidden);
  std::vector<float> x(static_cast<size_t>(tokens * cfg.hidden));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < cfg.hidden; ++c)
      x[t * cfg.hidden + c] = synth_activation(seed, SynthTensor::kHidden, t, c, 1.0f);
  return x;
}

std::vector<float> make_synthetic_router_logits(const MoeConfig& cfg, uint64_t seed, int64_t tokens) {
  FP4MOE_REQUIRE(tokens > 0, "make_synthetic_router_logits: tokens = {} must be > 0", tokens);
  FP4MOE_REQUIRE(cfg.num_experts > 0, "make_synthetic_router_logits: config '{}' num_experts = {} must be > 0",
                 cfg.name, cfg.num_experts);
  const int64_t e_count = cfg.num_experts;
  std::vector<float> l(static_cast<size_t>(tokens * e_count));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < e_count; ++e)
      l[t * e_count + e] = synth_activation(seed, SynthTensor::kRouterLogits, t, e, 2.0f);
  return l;
}

std::vector<float> make_synthetic_router_bias(const MoeConfig& cfg, uint64_t seed) {
  if (cfg.router == RouterKind::kSoftmaxTopK) return {};
  std::vector<float> b(static_cast<size_t>(cfg.num_experts));
  for (int e = 0; e < cfg.num_experts; ++e) b[e] = synth_activation(seed, SynthTensor::kRouterBias, 0, e, 0.1f);
  return b;
}

// ---------------------------------------------------------------------------------------------------
// Providers
// ---------------------------------------------------------------------------------------------------

SyntheticExperts::SyntheticExperts(MoeConfig cfg, uint64_t seed, bool cache)
    : cfg_(std::move(cfg)), seed_(seed), cache_(cache) {
  cfg_.validate();
}

std::shared_ptr<const ExpertWeights> SyntheticExperts::expert(int e) const {
  auto build = [&] {
    auto w = std::make_shared<const ExpertWeights>(make_synthetic_expert(cfg_, seed_, e));
    ++built_;
    return w;
  };
  if (!cache_) return build();
  std::promise<std::shared_ptr<const ExpertWeights>> promise;
  std::shared_future<std::shared_ptr<const ExpertWeights>> existing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cached_.find(e);
    if (it != cached_.end()) existing = it->second;
    else cached_.emplace(e, promise.get_future().share());
  }
  // Another thread owns (or owned) this expert's build: wait for it outside the lock.
  if (existing.valid()) return existing.get();
  // Built outside the lock so that different experts build concurrently.
  try {
    auto w = build();
    promise.set_value(w);
    return w;
  } catch (...) {
    promise.set_exception(std::current_exception());
    throw;
  }
}

VectorExperts::VectorExperts(std::vector<ExpertWeights> routed, std::vector<ExpertWeights> shared)
    : routed_(std::move(routed)), shared_(std::move(shared)) {
  FP4MOE_REQUIRE(shared_.size() <= 1, "VectorExperts: {} shared experts given; at most 1 (of width I * num_shared)",
                 shared_.size());
}

std::shared_ptr<const ExpertWeights> VectorExperts::expert(int e) const {
  if (e == kSharedExpert) {
    FP4MOE_REQUIRE(!shared_.empty(), "VectorExperts: the shared expert was requested but none was given");
    return std::shared_ptr<const ExpertWeights>(std::shared_ptr<void>(), &shared_[0]);
  }
  FP4MOE_REQUIRE(e >= 0 && static_cast<size_t>(e) < routed_.size(), "VectorExperts: expert = {} must be in [0, {})",
                 e, routed_.size());
  // Non-owning: the experts live as long as this provider.
  return std::shared_ptr<const ExpertWeights>(std::shared_ptr<void>(), &routed_[static_cast<size_t>(e)]);
}

// ---------------------------------------------------------------------------------------------------
// Activations
// ---------------------------------------------------------------------------------------------------

float swiglu_reference(float gate, float up) { return gate / (1.0f + std::exp(-gate)) * up; }

float gptoss_swiglu_reference(float gate, float up, float alpha, float limit) {
  const float g = std::min(gate, limit);
  const float u = std::clamp(up, -limit, limit);
  const float glu = g * (1.0f / (1.0f + std::exp(-(alpha * g))));
  return (u + 1.0f) * glu;
}

// ---------------------------------------------------------------------------------------------------
// Expert compute and the layer
// ---------------------------------------------------------------------------------------------------

std::vector<float> expert_gemm1_reference(const MoeConfig& cfg, const ExpertWeights& w, std::span<const float> x,
                                          int64_t rows, const ReferenceOptions& opts) {
  FP4MOE_REQUIRE(rows > 0, "expert_gemm1_reference: rows = {} must be > 0", rows);
  const int64_t gate_rows = mat(w, Which::kGate).rows();
  FP4MOE_REQUIRE(gate_rows > 0 && gate_rows % cfg.intermediate == 0,
                 "expert_gemm1_reference: gate has {} rows; must be a positive multiple of intermediate = {}",
                 gate_rows, cfg.intermediate);
  check_expert(cfg, w, w.storage == ExpertStorage::kBf16 ? kSharedExpert : 0, gate_rows);
  FP4MOE_REQUIRE(x.size() == static_cast<size_t>(rows * cfg.hidden),
                 "expert_gemm1_reference: x has {} values; rows * hidden = {} * {} = {}", x.size(), rows,
                 cfg.hidden, rows * cfg.hidden);
  const int64_t ie = gate_rows;
  std::vector<float> xr(x.begin(), x.end());
  if (opts.round_intermediates)
    for (float& v : xr) v = round_to_bf16(v);
  std::vector<const float*> ptrs(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) ptrs[r] = xr.data() + r * cfg.hidden;
  std::vector<float> act(static_cast<size_t>(rows * ie));
  constexpr int64_t kChunk = 64;
  parallel_for((ie + kChunk - 1) / kChunk, resolve_threads(opts.threads), [&](int64_t c) {
    gemm1_rows(cfg, w, ptrs, opts.round_intermediates, c * kChunk, std::min(ie, (c + 1) * kChunk), act.data());
  });
  return act;
}

std::vector<float> expert_gemm2_reference(const MoeConfig& cfg, const ExpertWeights& w, std::span<const float> act,
                                          int64_t rows, std::span<const float> row_scale,
                                          const ReferenceOptions& opts) {
  FP4MOE_REQUIRE(rows > 0, "expert_gemm2_reference: rows = {} must be > 0", rows);
  const int64_t down_cols = mat(w, Which::kDown).cols();
  FP4MOE_REQUIRE(down_cols > 0 && down_cols % cfg.intermediate == 0,
                 "expert_gemm2_reference: down has {} columns; must be a positive multiple of intermediate = {}",
                 down_cols, cfg.intermediate);
  check_expert(cfg, w, w.storage == ExpertStorage::kBf16 ? kSharedExpert : 0, down_cols);
  const int64_t ie = down_cols, h = cfg.hidden;
  FP4MOE_REQUIRE(act.size() == static_cast<size_t>(rows * ie),
                 "expert_gemm2_reference: act has {} values; rows * I_e = {} * {} = {}", act.size(), rows, ie,
                 rows * ie);
  FP4MOE_REQUIRE(row_scale.empty() || row_scale.size() == static_cast<size_t>(rows),
                 "expert_gemm2_reference: row_scale has {} values; must be empty or rows = {}", row_scale.size(),
                 rows);
  std::vector<float> out(static_cast<size_t>(rows * h));
  std::vector<float*> ptrs(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) ptrs[r] = out.data() + r * h;
  constexpr int64_t kChunk = 64;
  parallel_for((h + kChunk - 1) / kChunk, resolve_threads(opts.threads), [&](int64_t c) {
    gemm2_rows(cfg, w, act.data(), rows, row_scale.empty() ? nullptr : row_scale.data(), opts.round_intermediates,
               c * kChunk, std::min(h, (c + 1) * kChunk), ptrs.data());
  });
  return out;
}

std::vector<float> moe_reference(const MoeConfig& cfg, const ExpertProvider& experts, std::span<const float> hidden,
                                 int64_t tokens, const Routing& routing, const ReferenceOptions& opts) {
  cfg.validate();
  const int threads = resolve_threads(opts.threads);
  FP4MOE_REQUIRE(tokens > 0, "moe_reference: tokens = {} must be > 0", tokens);
  const int64_t h = cfg.hidden;
  const int k = cfg.top_k;
  FP4MOE_REQUIRE(hidden.size() == static_cast<size_t>(tokens * h),
                 "moe_reference: hidden has {} values; tokens * hidden = {} * {} = {}", hidden.size(), tokens, h,
                 tokens * h);
  FP4MOE_REQUIRE(routing.tokens == tokens && routing.top_k == k,
                 "moe_reference: routing is for {} tokens x top-{}; the call needs {} tokens x top-{}", routing.tokens,
                 routing.top_k, tokens, k);
  FP4MOE_REQUIRE(routing.ids.size() == static_cast<size_t>(tokens * k) &&
                     routing.weights.size() == static_cast<size_t>(tokens * k),
                 "moe_reference: routing has {} ids and {} weights; tokens * top_k = {}", routing.ids.size(),
                 routing.weights.size(), tokens * k);
  std::vector<std::vector<int64_t>> assigned(static_cast<size_t>(cfg.num_experts));  // (t * k + slot)
  for (int64_t i = 0; i < tokens * k; ++i) {
    const int32_t e = routing.ids[i];
    FP4MOE_REQUIRE(e >= 0 && e < cfg.num_experts, "moe_reference: routing id[token {}, slot {}] = {} must be in [0, {})",
                   i / k, i % k, e, cfg.num_experts);
    FP4MOE_REQUIRE(std::isfinite(routing.weights[i]), "moe_reference: routing weight[token {}, slot {}] = {} is not finite",
                   i / k, i % k, routing.weights[i]);
    assigned[e].push_back(i);
  }

  std::vector<float> x(hidden.begin(), hidden.end());
  if (opts.round_intermediates)
    for (float& v : x) v = round_to_bf16(v);

  // One task per active expert, the shared expert last (ascending expert index otherwise).
  std::vector<int> tasks;
  for (int e = 0; e < cfg.num_experts; ++e)
    if (!assigned[e].empty()) tasks.push_back(e);
  if (cfg.num_shared > 0) tasks.push_back(kSharedExpert);

  std::vector<float> slot_out(static_cast<size_t>(tokens * k * h));                    // [T, k, H]
  std::vector<float> shared_out(cfg.num_shared > 0 ? static_cast<size_t>(tokens * h) : 0);  // [T, H]

  parallel_for(static_cast<int64_t>(tasks.size()), threads, [&](int64_t ti) {
    const int e = tasks[ti];
    const std::shared_ptr<const ExpertWeights> wp = experts.expert(e);
    FP4MOE_REQUIRE(wp != nullptr, "moe_reference: the expert provider returned no weights for expert {}", e);
    const ExpertWeights& w = *wp;
    const int64_t ie = expert_width(cfg, e);
    check_expert(cfg, w, e, ie);
    std::vector<const float*> xs;
    std::vector<float*> outs;
    std::vector<float> scale;
    if (e == kSharedExpert) {
      for (int64_t t = 0; t < tokens; ++t) {
        xs.push_back(x.data() + t * h);
        outs.push_back(shared_out.data() + t * h);
      }
    } else {
      for (int64_t i : assigned[e]) {
        xs.push_back(x.data() + (i / k) * h);
        outs.push_back(slot_out.data() + i * h);
        scale.push_back(routing.weights[i]);
      }
    }
    const int64_t rows = static_cast<int64_t>(xs.size());
    std::vector<float> act(static_cast<size_t>(rows * ie));
    gemm1_rows(cfg, w, xs, opts.round_intermediates, 0, ie, act.data());
    gemm2_rows(cfg, w, act.data(), rows, scale.empty() ? nullptr : scale.data(), opts.round_intermediates, 0, h,
               outs.data());
  });

  std::vector<float> out(static_cast<size_t>(tokens * h));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < h; ++c) {
      float s = 0.0f;
      for (int slot = 0; slot < k; ++slot) s += slot_out[(t * k + slot) * h + c];
      if (cfg.num_shared > 0) s += shared_out[t * h + c];
      out[t * h + c] = opts.round_intermediates ? round_to_bf16(s) : s;
    }
  }
  return out;
}

std::vector<float> moe_reference(const MoeConfig& cfg, const std::vector<ExpertWeights>& experts,
                                 std::span<const float> hidden, int64_t tokens, const Routing& routing,
                                 const ReferenceOptions& opts) {
  const size_t want = static_cast<size_t>(cfg.num_experts) + (cfg.num_shared > 0 ? 1 : 0);
  FP4MOE_REQUIRE(experts.size() == want,
                 "moe_reference: {} experts given; config '{}' needs num_experts = {}{} = {}", experts.size(),
                 cfg.name, cfg.num_experts, cfg.num_shared > 0 ? " + 1 shared" : "", want);
  // The provider borrows the weights; copying them would double a large layer's memory, so wrap
  // non-owning pointers instead.
  class Borrowed final : public ExpertProvider {
   public:
    Borrowed(const std::vector<ExpertWeights>& v, int e) : v_(v), e_(e) {}
    std::shared_ptr<const ExpertWeights> expert(int e) const override {
      const size_t i = e == kSharedExpert ? static_cast<size_t>(e_) : static_cast<size_t>(e);
      return std::shared_ptr<const ExpertWeights>(std::shared_ptr<void>(), &v_[i]);
    }

   private:
    const std::vector<ExpertWeights>& v_;
    int e_;
  };
  return moe_reference(cfg, Borrowed(experts, cfg.num_experts), hidden, tokens, routing, opts);
}

}  // namespace fp4moe

// The CPU reference MoE layer: the oracle every GPU test compares against, and `fp4moe run` without a
// GPU. Plain C++ with std::thread; no CUDA calls.
//
// Layer:  out[t] = sum_{slot < k} w[t,slot] * expert_{id[t,slot]}(x[t])  +  sum_shared shared(x[t])
//         expert(x) = down( act( gate(x), up(x) ) )
//
// Rounding points (ReferenceOptions::round_intermediates = true, the default) are the GPU's, so a GPU
// result can be checked against a tight bound:
//   1. hidden is rounded to bf16 (the GPU consumes bf16 activations; a no-op for synthetic inputs).
//   2. GEMM1 (gate and up): accumulated in DOUBLE over the exact dequantized weights: e2m1 * e4m3 is
//      exact in float, the dot product runs in double, and the FP32 global scale multiplies the double
//      sum once (as the GPU applies it once in the epilogue). The result is converted to float, then
//      the gpt-oss bias is added in float.
//   3. The activation is computed in float (expf), then ROUNDED TO BF16 (the GPU stores it as bf16).
//   4. GEMM2 (down): double accumulation as in 2, converted to float, + bias (gpt-oss), times the
//      routing weight in float, then ROUNDED TO BF16 per (token, slot) (the GEMM2 epilogue stores bf16).
//      The shared expert's output is rounded to bf16 the same way (weight 1, no multiply).
//   5. out[t] = float32 sum over slots 0..k-1 in slot order, starting from 0, then + the shared expert
//      output; ROUNDED TO BF16.
// With round_intermediates = false every bf16 rounding above is skipped (hidden is used as given): the
// pure float path, for error-budget tests.
#pragma once
#include <atomic>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "fp4moe/config.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe {

// ---------------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------------

// Row-major [tokens, top_k]. For each token the slots are ordered by DESCENDING selection score; equal
// scores are broken by the LOWER expert index first (so the result is a pure function of the inputs).
// Selection scores: softmax router: the logit (softmax is monotonic; selecting on logits avoids ties
// that rounding of expf would create); sigmoid grouped: sigmoid(logit) + bias; gpt-oss: logit + bias.
struct Routing {
  int64_t tokens = 0;
  int top_k = 0;
  std::vector<int32_t> ids;      // [tokens, top_k], each in [0, num_experts)
  std::vector<float> weights;    // [tokens, top_k]
};

// logits: [T, E] fp32; bias: [E] or empty (empty = zeros). All arithmetic in float32 with expf, as the
// GPU router does:
//   kSoftmaxTopK:    p = softmax(logits) (max subtracted, sum in index order); top-k of the logits;
//                    w = p / (sum of the chosen p, in slot order) if cfg.renormalize, else p. No bias
//                    (a non-empty bias is an error).
//   kSigmoidGrouped: s = 1 / (1 + expf(-logit)); b = s + bias; group score = sum of the top-2 b of each
//                    of the n_group contiguous groups; keep the topk_group best groups (ties -> lower
//                    group index); top-k of b over the kept groups; w = s of the chosen (UNBIASED),
//                    divided by their sum (slot order) if cfg.renormalize.
//   kGptOss:         z = logit + bias; top-k of z; w = softmax over the k chosen z (max = slot 0).
// Every kind then multiplies w by cfg.routed_scaling (1 unless the preset says otherwise).
Routing route_reference(const MoeConfig& cfg, std::span<const float> logits, std::span<const float> bias,
                        int64_t tokens);

// ---------------------------------------------------------------------------------------------------
// Expert weights
// ---------------------------------------------------------------------------------------------------

// One expert in the on-disk (ModelOpt) NVFP4 layout. gate, up: [I_e, H]; down: [H, I_e], where
// I_e = cfg.intermediate for a routed expert and cfg.intermediate * cfg.num_shared for the shared one.
// Biases only when cfg.expert_bias (gpt-oss): bias_gate, bias_up [I_e], bias_down [H]; else empty.
// How an expert's three matrices are held: NVFP4 (gate, up, down), MXFP4 (mx_gate, mx_up, mx_down:
// cfg.format == kMxfp4, OCP E8M0 scales, no global scale) or dense bf16 values (dense_*: a shared
// expert that a checkpoint keeps unquantized). The GEMMs treat all three alike: exact dequantized
// values in float, a double dot product, the global scale (NVFP4 only) once on the sum.
enum class ExpertStorage { kNvfp4, kMxfp4, kBf16 };

// Row-major [rows, cols] floats (bf16-valued when they come from a bf16 checkpoint tensor).
struct DenseMatrix {
  int64_t rows = 0, cols = 0;
  std::vector<float> values;
};

struct ExpertWeights {
  Nvfp4Tensor gate, up, down;
  std::vector<float> bias_gate, bias_up, bias_down;
  ExpertStorage storage = ExpertStorage::kNvfp4;
  Mxfp4Tensor mx_gate, mx_up, mx_down;        // storage == kMxfp4
  DenseMatrix dense_gate, dense_up, dense_down;  // storage == kBf16
};

// The expert index that names the shared expert(s): one expert of width I * num_shared.
inline constexpr int kSharedExpert = -1;

// ---- The synthetic recipe (re-implemented on the GPU for benchmarks: keep the two in step) ----
// Routed expert e (tensor ids kW1Gate, kW1Up, kW2, "expert" = e) or the shared expert (kSharedGate,
// kSharedUp, kSharedDown, "expert" = 0):
//   gate[j, h] = synth_weight(seed, kW1Gate, e, j, h, std1)   j < I_e, h < H, std1 = synthetic_weight_std(H)
//   up[j, h]   = synth_weight(seed, kW1Up,   e, j, h, std1)
//   down[n, j] = synth_weight(seed, kW2,     e, n, j, std2)   std2 = synthetic_weight_std(I_e)
//   gate and up are quantized with ONE global scale nvfp4_global_scale(max(amax(gate), amax(up)));
//   down with its own (quantize_nvfp4 default).
//   cfg.format == kMxfp4: the same values quantized with quantize_mxfp4 (storage kMxfp4, mx_* tensors).
//   gpt-oss biases (cfg.expert_bias), bf16-valued (the checkpoint stores bf16):
//     bias_gate[j] = round_to_bf16(synth_weight(seed, kBias1, e, 0, j,       0.1f))
//     bias_up[j]   = round_to_bf16(synth_weight(seed, kBias1, e, 0, I_e + j, 0.1f))   (fused [gate; up])
//     bias_down[n] = round_to_bf16(synth_weight(seed, kBias2, e, 0, n,       0.1f))
//     (the shared expert uses expert index 0xffffffff for its biases).
// std(K) = 1.0f / std::sqrt(float(K)) in float: keeps GEMM outputs O(1) whatever the shape.
float synthetic_weight_std(int64_t k);
ExpertWeights make_synthetic_expert(const MoeConfig& cfg, uint64_t seed, int expert);

// Inputs: hidden [T, H] = synth_activation(seed, kHidden, t, h, 1.0f) (bf16-valued);
// router logits [T, E] = synth_activation(seed, kRouterLogits, t, e, 2.0f) (std 2 spreads the softmax
// like a trained router); router bias [E] = synth_activation(seed, kRouterBias, 0, e, 0.1f) for the
// sigmoid grouped and gpt-oss routers, empty for softmax.
std::vector<float> make_synthetic_hidden(const MoeConfig& cfg, uint64_t seed, int64_t tokens);
std::vector<float> make_synthetic_router_logits(const MoeConfig& cfg, uint64_t seed, int64_t tokens);
std::vector<float> make_synthetic_router_bias(const MoeConfig& cfg, uint64_t seed);

// Where moe_reference gets expert weights: on demand, so that only routed experts are materialized
// (GLM-5 has 256 experts of 3 * 6144 * 2048 weights). expert() must be thread-safe; it takes an index
// in [0, E) or kSharedExpert, and the result stays valid as long as the returned pointer is held.
class ExpertProvider {
 public:
  virtual ~ExpertProvider() = default;
  virtual std::shared_ptr<const ExpertWeights> expert(int e) const = 0;
};

// Builds synthetic experts lazily with make_synthetic_expert. cache = true keeps every built expert
// (repeated calls, tests); cache = false builds on each request and frees when the caller drops it
// (bounded memory: `fp4moe run` on GLM-5). Concurrent requests for the same cached expert build it
// once; different experts build concurrently.
class SyntheticExperts final : public ExpertProvider {
 public:
  SyntheticExperts(MoeConfig cfg, uint64_t seed, bool cache = true);
  std::shared_ptr<const ExpertWeights> expert(int e) const override;
  int64_t built() const { return built_.load(); }  // experts built so far (laziness checks)

 private:
  MoeConfig cfg_;
  uint64_t seed_;
  bool cache_;
  mutable std::mutex mu_;
  mutable std::map<int, std::shared_future<std::shared_ptr<const ExpertWeights>>> cached_;
  mutable std::atomic<int64_t> built_{0};
};

// Experts given explicitly: routed[e] for e in [0, E), and the shared expert when cfg.num_shared > 0.
class VectorExperts final : public ExpertProvider {
 public:
  explicit VectorExperts(std::vector<ExpertWeights> routed, std::vector<ExpertWeights> shared = {});
  std::shared_ptr<const ExpertWeights> expert(int e) const override;

 private:
  std::vector<ExpertWeights> routed_, shared_;  // shared_: empty or one expert
};

// ---------------------------------------------------------------------------------------------------
// Expert compute
// ---------------------------------------------------------------------------------------------------

struct ReferenceOptions {
  bool round_intermediates = true;  // the GPU's bf16 rounding points (see the top of this file)
  int threads = 0;                  // worker threads; 0 = std::thread::hardware_concurrency()
};

// The layer. hidden: [T, H]. Returns out [T, H] (bf16-valued when round_intermediates).
// Work is split by expert (each active expert, and the shared one, is one task: fetching its weights
// dominates); per-(token, slot) outputs are summed after all tasks in a fixed order, so the result
// does not depend on the thread count or the scheduling.
std::vector<float> moe_reference(const MoeConfig& cfg, const ExpertProvider& experts,
                                 std::span<const float> hidden, int64_t tokens, const Routing& routing,
                                 const ReferenceOptions& opts = {});
// experts: E routed experts, followed by the shared expert when cfg.num_shared > 0 (size E or E + 1).
std::vector<float> moe_reference(const MoeConfig& cfg, const std::vector<ExpertWeights>& experts,
                                 std::span<const float> hidden, int64_t tokens, const Routing& routing,
                                 const ReferenceOptions& opts = {});

// The two halves of one expert, for GEMM-level GPU tests; same arithmetic as moe_reference.
// GEMM1 + activation: x [rows, H] -> act [rows, I_e] (bf16-valued when rounding).
std::vector<float> expert_gemm1_reference(const MoeConfig& cfg, const ExpertWeights& w,
                                          std::span<const float> x, int64_t rows,
                                          const ReferenceOptions& opts = {});
// GEMM2: act [rows, I_e] -> [rows, H] = (act . down^T + bias_down) * row_scale[r] (row_scale may be
// empty = 1 and then no multiply), bf16-valued when rounding.
std::vector<float> expert_gemm2_reference(const MoeConfig& cfg, const ExpertWeights& w,
                                          std::span<const float> act, int64_t rows,
                                          std::span<const float> row_scale,
                                          const ReferenceOptions& opts = {});

// The activations, in float, exactly as the reference (and the GPU epilogue) compute them.
float swiglu_reference(float gate, float up);                                  // silu(g) * up
float gptoss_swiglu_reference(float gate, float up, float alpha, float limit);  // clamped, see config.hpp

}  // namespace fp4moe

// The whole MoE layer on the GPU as one call: router (optional cuBLAS logits) -> top-k -> permutation
// -> grouped NVFP4 GEMM1 (+SwiGLU) -> grouped GEMM2 (x routing weight) -> deterministic combine
// (+ shared expert). forward() allocates nothing and never synchronizes, so it can be captured in a
// CUDA graph; its output is bit-identical run to run (fixed-order reductions, no atomics deciding
// anything but counts).
//
// Rounding points are moe_reference's (reference.hpp): bf16 activations in, GEMM1 output stored bf16,
// GEMM2 output (weight applied) stored bf16 per (token, slot), fp32 sum over slots in slot order
// starting from 0, then + shared expert output, rounded to bf16.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "fp4moe/arch.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe {

struct TuneLookup;  // tuner.hpp

// DEVICE pointers, on-disk (ModelOpt) layout, all experts stacked. I = cfg.intermediate,
// Is = I * cfg.num_shared (the shared expert is one expert of width Is).
// The constructor copies what it needs (repacked codes and scales, global scales, biases, router
// tensors) into memory the layer owns, so these buffers may be freed once it returns.
// cfg.format == kMxfp4 (gpt-oss): the scales are E8M0 [.., K/32] instead and the global scales must be
// null (the repack derives each expert's FP32 scale from its E8M0 exponents); K % 32 == 0.
struct MoeLayerWeights {
  const uint8_t* w13_codes = nullptr;      // [E, 2I, H/2]: rows 0..I-1 gate, I..2I-1 up
  const uint8_t* w13_scales = nullptr;     // [E, 2I, H/16] E4M3 (MXFP4: [E, 2I, H/32] E8M0)
  const float* w13_global = nullptr;       // [E] gate (and up, unless w13_global_up is given); MXFP4: null
  const float* w13_global_up = nullptr;    // [E] or null
  const float* b13 = nullptr;              // [E, 2I] fp32 (gate then up) or null; required iff cfg.expert_bias
  const uint8_t* w2_codes = nullptr;       // [E, H, I/2]
  const uint8_t* w2_scales = nullptr;      // [E, H, I/16] E4M3
  const float* w2_global = nullptr;        // [E]
  const float* b2 = nullptr;               // [E, H] fp32 or null; required iff cfg.expert_bias
  const float* router_bias = nullptr;      // [E] fp32 or null (= 0); must be null for the softmax router
  const void* router_weight = nullptr;     // bf16 [E, H] or null (then forward needs router logits)
  // Shared expert (cfg.num_shared > 0): the same tensors with E = 1 and I -> Is.
  const uint8_t* shared_w13_codes = nullptr;   // [2Is, H/2]
  const uint8_t* shared_w13_scales = nullptr;  // [2Is, H/16]
  const float* shared_w13_global = nullptr;    // [1]
  const float* shared_w13_global_up = nullptr; // [1] or null
  const float* shared_b13 = nullptr;           // [2Is] or null; required iff cfg.expert_bias
  const uint8_t* shared_w2_codes = nullptr;    // [H, Is/2]
  const uint8_t* shared_w2_scales = nullptr;   // [H, Is/16]
  const float* shared_w2_global = nullptr;     // [1]
  const float* shared_b2 = nullptr;            // [H] or null; required iff cfg.expert_bias
  // A bf16 shared expert instead (checkpoints that keep it unquantized, e.g. ModelOpt's experts-only
  // recipe): give these two and leave the quantized shared_* pointers null. It runs as two cuBLAS bf16
  // GEMMs (fp32 accumulation; gate/up kept fp32, activation rounded to bf16, output rounded to bf16:
  // the reference's rounding points). No biases (expert_bias must be false).
  const void* shared_w13_bf16 = nullptr;       // bf16 [2Is, H]: rows 0..Is-1 gate, Is..2Is-1 up
  const void* shared_w2_bf16 = nullptr;        // bf16 [H, Is]
  // Routed experts only: the layer ignores cfg.num_shared (config() reports num_shared = 0) and the
  // caller adds its own shared expert's output to `out`. Shared-expert pointers must then be null.
  bool routed_only = false;
};

// Stages, in order, for timing (forward's stage_events). The shared expert's two GEMMs are counted in
// kGemm1 and kGemm2.
enum class MoeStage : int { kRouting = 0, kPermute, kGemm1, kGemm2, kCombine };
inline constexpr int kNumMoeStages = 5;

// Tile configs of the four grouped GEMM calls; an empty one is chosen per call by
// moe_layer_tile_configs (a tuner table of the GPU, else heuristic_tile_config).
struct MoeTileConfigs {
  std::optional<TileConfig> gemm1, gemm2, shared_gemm1, shared_gemm2;
};
struct MoeResolvedTileConfigs {
  TileConfig gemm1, gemm2, shared_gemm1, shared_gemm2;
};

// Where each intermediate lives inside a workspace (byte offsets from its start, 256-byte aligned;
// the layout is fixed by max_tokens, not by T). I and Is here are the kernels' widths
// (cfg.kernel_intermediate(), cfg.kernel_shared_intermediate()): with an intermediate size that is not
// a multiple of 64 the GEMM1 outputs carry zero columns up to the next multiple of 64.
struct MoeWorkspaceLayout {
  size_t router_logits = 0;      // fp32 [max_T, E]        (only when the layer has a router weight)
  size_t topk_ids = 0;           // int32 [max_T, k]
  size_t topk_weights = 0;       // fp32 [max_T, k]
  size_t chunk_counts = 0;       // int32 [chunks, E]      (permutation scratch)
  size_t expert_offsets = 0;     // int32 [E + 1]
  size_t shared_offsets = 0;     // int32 [2] = {0, T}
  size_t row_of = 0;             // int32 [max_T, k]: (token, slot) -> expert-sorted row
  size_t row_scale = 0;          // fp32 [max_T * k]: routing weight per sorted row (GEMM2 row_scale)
  size_t sorted_hidden = 0;      // bf16 [max_T * k, H]
  size_t gemm1_out = 0;          // bf16 [max_T * k, I]
  size_t gemm2_out = 0;          // bf16 [max_T * k, H]
  size_t shared_gemm1_out = 0;   // bf16 [max_T, Is]
  size_t shared_gemm2_out = 0;   // bf16 [max_T, H]
  size_t shared_gate_up = 0;     // fp32 [max_T, 2Is]   (only for a bf16 shared expert)
  size_t total = 0;
};

// Device pointers of the intermediates of the last forward() that used a workspace (tests, tools).
struct MoeIntermediates {
  float* router_logits = nullptr;
  int32_t* topk_ids = nullptr;
  float* topk_weights = nullptr;
  int32_t* expert_offsets = nullptr;
  int32_t* row_of = nullptr;
  float* row_scale = nullptr;
  void* sorted_hidden = nullptr;
  void* gemm1_out = nullptr;
  void* gemm2_out = nullptr;
  void* shared_gemm2_out = nullptr;
};

// ---- Host-only checks and sizes (no GPU needed) ----
// cfg.validate() plus the layer's own limits (n_group <= 32). Throws fp4moe::Error.
void validate_moe_layer_config(const MoeConfig& cfg);
// Null / alignment checks of the weight pointers against the config.
void validate_moe_layer_weights(const MoeConfig& cfg, const MoeLayerWeights& w);
// bf16_shared: the layer's shared expert is bf16 (MoeLayerWeights::shared_w13_bf16).
MoeWorkspaceLayout moe_workspace_layout(const MoeConfig& cfg, int64_t max_tokens, bool router_gemm,
                                        bool bf16_shared = false);
// The tile configs the layer picks at T tokens on an architecture: choose_config (tuner.hpp: a tuner
// table when `arch` is the present GPU, else heuristic_tile_config) for GEMM1, GEMM2 and the shared
// expert's two GEMMs. MoeLayer calls it with arch_from_device(device) at each resolution point up to
// max_tokens (tuner.hpp, layer_resolution_point).
// Every pick is planner-valid on `arch`. With an arch from the table (arch_from_name) it needs no GPU,
// which is how tests and `fp4moe explain --arch` see another GPU's choice. `why`, if given, receives
// the four lookups (GEMM1, GEMM2, shared GEMM1, shared GEMM2; the last two only with a shared expert).
MoeResolvedTileConfigs moe_layer_tile_configs(const MoeConfig& cfg, int64_t tokens, const ArchInfo& arch,
                                              std::vector<TuneLookup>* why = nullptr);
// The permutation works on chunks of this many (token, slot) entries, one block each.
inline constexpr int kMoePermuteChunk = 2048;
int64_t moe_permute_chunks(int64_t n);  // ceil(n / kMoePermuteChunk)

// ---- The stages as free functions (MoeLayer::forward calls these; tests and tools may too) ----
// All pointers are device memory; nothing synchronizes or allocates.
// Routing: logits fp32 [T, E], router_bias [E] or null -> topk_ids int32 [T, k], topk_weights fp32 [T, k]
// (slots in descending selection score, ties -> lower expert index; route_reference's arithmetic).
// Which routing kernel runs. kAuto: kCtaPerToken where it applies (top_k <= 8) with more than
// kRoutingCtaMinExperts (128) experts, for tokens <= kRoutingCtaMaxTokens (64), and at any token count with
// grouped selection (n_group > 1); else kWarpPerToken.
// Both give bit-identical outputs; forcing one is for tests (kCtaPerToken where it does not apply is
// refused).
//   kWarpPerToken: one warp per token (kernels/routing_topk.cuh, routing_topk_kernel);
//   kCtaPerToken:  four warps per token, each over a quarter of the experts, then a merge of their
//                  top k: a quarter of the dependency chain, for decode (routing_topk_cta_kernel).
enum class RoutingPath { kAuto, kWarpPerToken, kCtaPerToken };
inline constexpr int64_t kRoutingCtaMaxTokens = 64;
inline constexpr int kRoutingCtaMinExperts = 128;
void moe_route(const MoeConfig& cfg, const float* logits, const float* router_bias, int64_t tokens,
               int32_t* topk_ids, float* topk_weights, cudaStream_t stream, RoutingPath path = RoutingPath::kAuto);
// Permutation: expert_offsets [E + 1], row_of [T, k] (row of (t, s) in expert-sorted order, stable:
// within an expert by token then slot), row_scale [T * k] (topk_weights in row order). chunk_counts:
// scratch of moe_permute_chunks(T * k) * E int32. shared_offsets: null or [2], set to {0, T}.
void moe_permute(int num_experts, int top_k, int64_t tokens, const int32_t* topk_ids, const float* topk_weights,
                 int32_t* chunk_counts, int32_t* expert_offsets, int32_t* row_of, float* row_scale,
                 int32_t* shared_offsets, cudaStream_t stream);
// Permutation and gather in one call (MoeLayer::forward uses this):
// tokens * top_k up to this takes the one-launch permutation (kernels::kSmallPermuteMaxEntries).
inline constexpr int kMoeSmallPermuteMaxEntries = 4096;

// Which permutation kernels run. kAuto: kSmall when tokens * top_k <= kSmallPermuteMaxEntries (4096,
// kernels/moe_permute.cuh), else kChunked. Both give bit-identical outputs; forcing one is for tests.
enum class PermutePath { kAuto, kSmall, kChunked };

// moe_permute and, when hidden is non-null, moe_gather into `sorted` as well:
//   kSmall:   ONE launch (count + scan + scatter + gather, moe_permute_small_kernel);
//   kChunked: count, scan, scatter, gather (four launches; chunk_counts is their scratch).
// hidden / sorted: bf16 [T, H] / [T * k, H], 16-byte aligned, H % 8 == 0; both null for permute only.
void moe_permute_gather(int num_experts, int top_k, int64_t tokens, const int32_t* topk_ids,
                        const float* topk_weights, int32_t* chunk_counts, int32_t* expert_offsets,
                        int32_t* row_of, float* row_scale, int32_t* shared_offsets, const void* hidden,
                        int64_t hidden_size, void* sorted, cudaStream_t stream,
                        PermutePath path = PermutePath::kAuto, bool programmatic_launch = false);


// sorted[row_of[t, s], :] = hidden[t, :] (bf16, H % 8 == 0, 16-byte aligned).
void moe_gather(const void* hidden, int64_t tokens, int64_t hidden_size, const int32_t* row_of, int top_k,
                void* sorted, cudaStream_t stream);
// out[t, :] = bf16(sum_{s<k} float(y[row_of[t, s], :]) + float(shared_y[t, :])), shared_y may be null.
// programmatic_launch (here and in moe_permute_gather, GroupedGemmArgs): launched with programmatic
// dependent launch (sm_90+), so the kernel's launch overlaps its predecessor's tail; the kernels wait
// for the predecessor's results before reading them, so any predecessor is safe.
void moe_combine(const void* y, const void* shared_y, const int32_t* row_of, int top_k, int64_t tokens,
                 int64_t hidden_size, void* out, cudaStream_t stream, bool programmatic_launch = false);

// ---- Routing given by the caller (MoeLayer::forward_routed) ----
// Host-only checks of forward_routed's arguments (no GPU needed; forward_routed runs them first).
// workspace_bytes: the layer's workspace_bytes().
void validate_moe_routed_args(const MoeConfig& cfg, int64_t max_tokens, size_t workspace_bytes,
                              const void* hidden, int64_t tokens, const int32_t* topk_ids,
                              const float* topk_weights, const void* out, const void* workspace,
                              size_t workspace_size);
// A routing error record of forward_routed (kernels/moe_routing_given.cuh: ((flat index + 1) << 32) |
// id) as a sentence naming the token, the slot and the id; "" for 0 (no error).
std::string describe_routing_error(uint64_t record, int top_k, int num_experts);
// ids/weights [n] -> ids_out/weights_out [n] with every id outside [0, E) replaced by (0, 0.0f); a bad
// id other than -1 is written to error_record (host-mapped, or null). Device pointers, no sync.
void moe_routing_given(int num_experts, int64_t n, const int32_t* ids, const float* weights, int32_t* ids_out,
                       float* weights_out, unsigned long long* error_record, cudaStream_t stream);
// bf16 [n] -> fp32 [n] (router logits given in bf16). Device pointers, no sync.
void moe_logits_bf16_to_fp32(const void* logits_bf16, int64_t n, float* out, cudaStream_t stream);

class MoeLayer {
 public:
  // Validates, repacks the expert weights once (repack_nvfp4_weights_device; gate/up interleaved for
  // GEMM1) into owned device memory, creates the cuBLAS handle (with its own workspace, so the router
  // GEMM is graph-capturable) and synchronizes `stream` once at the end.
  MoeLayer(const MoeConfig& cfg, const MoeLayerWeights& weights, int64_t max_tokens, cudaStream_t stream);
  ~MoeLayer();
  MoeLayer(MoeLayer&&) noexcept;
  MoeLayer& operator=(MoeLayer&&) noexcept;
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  const MoeConfig& config() const;
  int64_t max_tokens() const;
  bool has_router_weight() const;
  size_t workspace_bytes() const;
  MoeWorkspaceLayout workspace_layout() const;
  MoeIntermediates intermediates(void* workspace) const;

  // hidden: bf16 [T, H]; router_logits: fp32 [T, E] or null (then the router weight computes them);
  // out: bf16 [T, H]; workspace: workspace_bytes() bytes, 16-byte aligned, owned by the caller (one
  // workspace per concurrently running forward). stage_events: null, or kNumMoeStages + 1 events,
  // recorded before routing and after each stage. Never synchronizes; allocates nothing.
  // Not thread-safe for concurrent calls on one MoeLayer (the cuBLAS handle is bound to `stream`).
  void forward(cudaStream_t stream, const void* hidden, int64_t tokens, const float* router_logits,
               void* out, void* workspace, size_t workspace_size,
               const cudaEvent_t* stage_events = nullptr) const;

  void set_tile_configs(const MoeTileConfigs& tiles);
  MoeResolvedTileConfigs tile_configs(int64_t tokens) const;

  // Routing given by the caller (an engine's own router, as vLLM / SGLang / FlashInfer pass it):
  // topk_ids int32 [T, k] and topk_weights fp32 [T, k], device memory. Slot s of token t adds
  // topk_weights[t, s] * expert_{topk_ids[t, s]}(hidden[t]); the shared expert (if any) is added as in
  // forward(). The weights are used AS GIVEN: cfg.routed_scaling and cfg.renormalize belong to the
  // layer's own router (forward()), which applies them once; here the caller's weights already are
  // the final ones. The routing stage is replaced by one copy kernel into the workspace
  // (kernels/moe_routing_given.cuh), so the launch count equals forward()'s.
  // Ids outside [0, E): the slot contributes nothing (never an out-of-bounds access). -1 is the
  // expert-parallel "expert not on this rank" convention and is skipped silently; any other bad id is
  // recorded on the device and reported by the next forward() / forward_routed() (which throws
  // fp4moe::Error naming the token, slot and id, before doing anything) or by take_routing_error().
  // Same rules as forward() otherwise: never synchronizes, allocates nothing, graph-capturable.
  void forward_routed(cudaStream_t stream, const void* hidden, int64_t tokens, const int32_t* topk_ids,
                      const float* topk_weights, void* out, void* workspace, size_t workspace_size,
                      const cudaEvent_t* stage_events = nullptr) const;
  // The layer's routing stage alone: fp32 logits [T, E] -> topk_ids [T, k], topk_weights [T, k]
  // (routed_scaling applied), with the layer's router bias. forward_routed on its result equals
  // forward(logits) bit for bit.
  void route(cudaStream_t stream, const float* router_logits, int64_t tokens, int32_t* topk_ids,
             float* topk_weights) const;
  // The bad-id record of an earlier forward_routed as a sentence ("" if none), and clears it. The
  // device writes it asynchronously: a call made before that kernel ran cannot see it yet.
  std::string take_routing_error() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  void throw_pending_routing_error(const char* fn) const;
  // Everything after routing: permutation, the GEMMs, the combine (stage events 1..5).
  void forward_experts(cudaStream_t stream, const void* hidden, int64_t tokens, const int32_t* topk_ids,
                       const float* topk_weights, void* out, void* workspace,
                       const cudaEvent_t* stage_events) const;
};

// ---- Synthetic layers generated on the device (benchmarks, large tests) ----
// The recipe of make_synthetic_expert / make_synthetic_router_bias (reference.hpp), bit for bit, for
// every expert at once, with no host round trip.
// A byte buffer in device memory (the library's one owning device allocation, device_buffer.hpp).
using OwnedDeviceBuffer = DeviceBuffer<uint8_t>;

struct SyntheticDeviceLayer {
  MoeConfig cfg;
  uint64_t seed = 0;
  std::vector<OwnedDeviceBuffer> buffers;  // owns everything `weights` points to
  MoeLayerWeights weights;
};

// with_router_weight: also a bf16 [E, H] router weight (synth_weight(seed, kRouterWeight, 0, e, h,
// synthetic_weight_std(H)) rounded to bf16; it has no CPU counterpart in reference.hpp).
// Asynchronous on `stream`; the buffers are valid once the stream reaches this point.
SyntheticDeviceLayer make_synthetic_layer_device(const MoeConfig& cfg, uint64_t seed, cudaStream_t stream,
                                                 bool with_router_weight = false);
// make_synthetic_hidden (bf16 [T, H]) and make_synthetic_router_logits (fp32 [T, E]) on the device.
void make_synthetic_hidden_device(const MoeConfig& cfg, uint64_t seed, int64_t tokens, void* hidden_bf16,
                                  cudaStream_t stream);
void make_synthetic_router_logits_device(const MoeConfig& cfg, uint64_t seed, int64_t tokens, float* logits,
                                         cudaStream_t stream);

}  // namespace fp4moe

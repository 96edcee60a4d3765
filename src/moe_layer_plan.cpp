// Host-only parts of the MoE layer: config and weight checks, the workspace layout, the tile-config
// choice. No CUDA calls for an arch from the table, so the CPU test suite covers them.
#include <cstdint>

#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/tuner.hpp"

namespace fp4moe {

namespace {

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

void require_ptr(const void* p, const char* name, size_t align, const MoeConfig& cfg) {
  FP4MOE_REQUIRE(p != nullptr, "MoeLayerWeights::{} is null; config '{}' needs it", name, cfg.name);
  FP4MOE_REQUIRE(aligned(p, align), "MoeLayerWeights::{} = {} must be {}-byte aligned", name, p, align);
}

void require_opt(const void* p, const char* name, size_t align) {
  FP4MOE_REQUIRE(p == nullptr || aligned(p, align), "MoeLayerWeights::{} = {} must be {}-byte aligned",
                 name, p, align);
}

}  // namespace

void validate_moe_layer_config(const MoeConfig& cfg) {
  cfg.validate();
  // The router keeps one group score per lane of a warp.
  FP4MOE_REQUIRE(cfg.router != RouterKind::kSigmoidGrouped || cfg.n_group <= 32,
                 "config '{}': n_group = {} must be <= 32 (the GPU router holds one group per warp lane)",
                 cfg.name, cfg.n_group);
}

void validate_moe_layer_weights(const MoeConfig& cfg, const MoeLayerWeights& w) {
  // Codes and scales are read by the repack kernel with 16-byte vectors where possible; requiring
  // 16-byte alignment of every tensor keeps all paths legal. Scalars arrays need 4 bytes.
  const bool mx = cfg.format == WeightFormat::kMxfp4;
  require_ptr(w.w13_codes, "w13_codes", 16, cfg);
  require_ptr(w.w13_scales, "w13_scales", 16, cfg);
  require_ptr(w.w2_codes, "w2_codes", 16, cfg);
  require_ptr(w.w2_scales, "w2_scales", 16, cfg);
  if (mx) {
    // MXFP4 carries its scale in the E8M0 exponents; the repack derives the FP32 one per expert.
    FP4MOE_REQUIRE(w.w13_global == nullptr && w.w13_global_up == nullptr && w.w2_global == nullptr,
                   "MoeLayerWeights::w13_global / w13_global_up / w2_global must be null for config '{}' (MXFP4 "
                   "weights have no global scale)", cfg.name);
  } else {
    require_ptr(w.w13_global, "w13_global", 4, cfg);
    require_opt(w.w13_global_up, "w13_global_up", 4);
    require_ptr(w.w2_global, "w2_global", 4, cfg);
  }
  if (cfg.expert_bias) {
    require_ptr(w.b13, "b13", 4, cfg);
    require_ptr(w.b2, "b2", 4, cfg);
  } else {
    FP4MOE_REQUIRE(w.b13 == nullptr && w.b2 == nullptr,
                   "MoeLayerWeights::b13 = {} / b2 = {}: config '{}' has expert_bias = false, so both must "
                   "be null (set expert_bias to use them)", static_cast<const void*>(w.b13),
                   static_cast<const void*>(w.b2), cfg.name);
  }
  FP4MOE_REQUIRE(cfg.router != RouterKind::kSoftmaxTopK || w.router_bias == nullptr,
                 "MoeLayerWeights::router_bias = {}: config '{}' uses the softmax router, which takes no "
                 "bias; pass null", static_cast<const void*>(w.router_bias), cfg.name);
  require_opt(w.router_bias, "router_bias", 4);
  require_opt(w.router_weight, "router_weight", 16);
  const bool shared_bf16 = w.shared_w13_bf16 != nullptr || w.shared_w2_bf16 != nullptr;
  const bool shared_quant = w.shared_w13_codes || w.shared_w13_scales || w.shared_w13_global ||
                            w.shared_w13_global_up || w.shared_w2_codes || w.shared_w2_scales || w.shared_w2_global;
  if (w.routed_only || cfg.num_shared == 0) {
    FP4MOE_REQUIRE(!shared_bf16 && !(w.routed_only && shared_quant),
                   "MoeLayerWeights: shared-expert pointers given for config '{}' with {}; pass null", cfg.name,
                   w.routed_only ? "routed_only = true" : "num_shared = 0");
  } else if (shared_bf16) {
    require_ptr(w.shared_w13_bf16, "shared_w13_bf16", 16, cfg);
    require_ptr(w.shared_w2_bf16, "shared_w2_bf16", 16, cfg);
    FP4MOE_REQUIRE(!shared_quant, "MoeLayerWeights: config '{}' got both a bf16 shared expert (shared_*_bf16) and "
                   "quantized shared_* tensors; give one of the two", cfg.name);
    FP4MOE_REQUIRE(!cfg.expert_bias, "MoeLayerWeights: a bf16 shared expert takes no biases; config '{}' has "
                   "expert_bias = true", cfg.name);
  } else if (cfg.num_shared > 0) {
    require_ptr(w.shared_w13_codes, "shared_w13_codes", 16, cfg);
    require_ptr(w.shared_w13_scales, "shared_w13_scales", 16, cfg);
    if (mx) {
      FP4MOE_REQUIRE(w.shared_w13_global == nullptr && w.shared_w13_global_up == nullptr &&
                         w.shared_w2_global == nullptr,
                     "MoeLayerWeights::shared_*_global must be null for config '{}' (MXFP4)", cfg.name);
    } else {
      require_ptr(w.shared_w13_global, "shared_w13_global", 4, cfg);
      require_opt(w.shared_w13_global_up, "shared_w13_global_up", 4);
      require_ptr(w.shared_w2_global, "shared_w2_global", 4, cfg);
    }
    require_ptr(w.shared_w2_codes, "shared_w2_codes", 16, cfg);
    require_ptr(w.shared_w2_scales, "shared_w2_scales", 16, cfg);
    if (cfg.expert_bias) {
      require_ptr(w.shared_b13, "shared_b13", 4, cfg);
      require_ptr(w.shared_b2, "shared_b2", 4, cfg);
    }
  }
  if (!cfg.expert_bias || cfg.num_shared == 0)
    FP4MOE_REQUIRE(w.shared_b13 == nullptr && w.shared_b2 == nullptr,
                   "MoeLayerWeights::shared_b13 / shared_b2 must be null for config '{}' (expert_bias = {}, "
                   "num_shared = {})", cfg.name, cfg.expert_bias, cfg.num_shared);
}

int64_t moe_permute_chunks(int64_t n) { return (n + kMoePermuteChunk - 1) / kMoePermuteChunk; }

MoeWorkspaceLayout moe_workspace_layout(const MoeConfig& cfg, int64_t max_tokens, bool router_gemm,
                                        bool bf16_shared) {
  validate_moe_layer_config(cfg);
  FP4MOE_REQUIRE(max_tokens >= 1, "max_tokens = {} must be >= 1", max_tokens);
  const int64_t rows = max_tokens * cfg.top_k;
  // Row indices and the GEMM's expert offsets are int32.
  FP4MOE_REQUIRE(rows <= INT32_MAX / 2,
                 "max_tokens * top_k = {} * {} = {} rows exceeds the int32 row index range", max_tokens,
                 cfg.top_k, rows);
  // The intermediates are as wide as the kernels run them (zero-padded, MoeConfig::kernel_intermediate).
  const int64_t E = cfg.num_experts, H = cfg.hidden, I = cfg.kernel_intermediate();
  const int64_t Is = cfg.kernel_shared_intermediate();  // 0 without a shared expert
  MoeWorkspaceLayout l;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes, 256);
    return at;
  };
  l.router_logits = take(router_gemm ? static_cast<size_t>(max_tokens * E) * 4 : 0);
  l.topk_ids = take(static_cast<size_t>(rows) * 4);
  l.topk_weights = take(static_cast<size_t>(rows) * 4);
  l.chunk_counts = take(static_cast<size_t>(moe_permute_chunks(rows) * E) * 4);
  l.expert_offsets = take(static_cast<size_t>(E + 1) * 4);
  l.shared_offsets = take(2 * 4);
  l.row_of = take(static_cast<size_t>(rows) * 4);
  l.row_scale = take(static_cast<size_t>(rows) * 4);
  l.sorted_hidden = take(static_cast<size_t>(rows * H) * 2);
  l.gemm1_out = take(static_cast<size_t>(rows * I) * 2);
  l.gemm2_out = take(static_cast<size_t>(rows * H) * 2);
  l.shared_gemm1_out = take(static_cast<size_t>(max_tokens * Is) * 2);
  l.shared_gemm2_out = take(cfg.num_shared > 0 ? static_cast<size_t>(max_tokens * H) * 2 : 0);
  l.shared_gate_up = take(bf16_shared && cfg.num_shared > 0 ? static_cast<size_t>(max_tokens * 2 * Is) * 4 : 0);
  l.total = off;
  return l;
}

MoeResolvedTileConfigs moe_layer_tile_configs(const MoeConfig& cfg, int64_t tokens, const ArchInfo& arch,
                                              std::vector<TuneLookup>* why) {
  const int E = cfg.num_experts;
  // The GEMM shapes the kernels run (intermediate zero-padded to a multiple of 64).
  const int64_t H = cfg.hidden, I = cfg.kernel_intermediate(), Is = cfg.kernel_shared_intermediate();
  const GemmEpilogue act =
      cfg.activation == Activation::kGptOssSwiGLU ? GemmEpilogue::kGptOssSwiGLU : GemmEpilogue::kSwiGLU;
  const TuneProblem p1{E, cfg.top_k, 2 * I, H, act};
  const TuneProblem p2{E, cfg.top_k, H, I, GemmEpilogue::kPlain};
  MoeResolvedTileConfigs r;
  std::vector<TuneLookup> looks;
  looks.push_back(choose_config(p1, tokens, arch));
  looks.push_back(choose_config(p2, tokens, arch));
  r.gemm1 = *looks[0].config;
  r.gemm2 = *looks[1].config;
  if (cfg.num_shared > 0) {
    // The shared expert sees every token: one expert, top-1.
    looks.push_back(choose_config(TuneProblem{1, 1, 2 * Is, H, act}, tokens, arch));
    looks.push_back(choose_config(TuneProblem{1, 1, H, Is, GemmEpilogue::kPlain}, tokens, arch));
    r.shared_gemm1 = *looks[2].config;
    r.shared_gemm2 = *looks[3].config;
  }
  if (why != nullptr) *why = std::move(looks);
  return r;
}

}  // namespace fp4moe

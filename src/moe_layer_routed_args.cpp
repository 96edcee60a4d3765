// Host-only parts of MoeLayer::forward_routed (moe_layer.hpp): argument checks and the wording of a
// bad-id record. No CUDA calls, so the CPU test suite covers them.
#include <cstdint>
#include <string>

#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"

namespace fp4moe {

namespace {
bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }
}  // namespace

void validate_moe_routed_args(const MoeConfig& cfg, int64_t max_tokens, size_t workspace_bytes,
                              const void* hidden, int64_t tokens, const int32_t* topk_ids,
                              const float* topk_weights, const void* out, const void* workspace,
                              size_t workspace_size) {
  const char* fn = "MoeLayer::forward_routed";
  FP4MOE_REQUIRE(tokens >= 1 && tokens <= max_tokens,
                 "{}: tokens = {} must be in [1, max_tokens = {}] (max_tokens is fixed at construction; it "
                 "sizes the workspace)", fn, tokens, max_tokens);
  FP4MOE_REQUIRE(hidden != nullptr && aligned(hidden, 16),
                 "{}: hidden = {} must be a non-null, 16-byte aligned bf16 [T, H] device pointer", fn, hidden);
  FP4MOE_REQUIRE(out != nullptr && aligned(out, 16),
                 "{}: out = {} must be a non-null, 16-byte aligned bf16 [T, H] device pointer", fn, out);
  FP4MOE_REQUIRE(topk_ids != nullptr && aligned(topk_ids, 4),
                 "{}: topk_ids = {} must be a non-null, 4-byte aligned int32 [T, top_k = {}] device pointer", fn,
                 static_cast<const void*>(topk_ids), cfg.top_k);
  FP4MOE_REQUIRE(topk_weights != nullptr && aligned(topk_weights, 4),
                 "{}: topk_weights = {} must be a non-null, 4-byte aligned fp32 [T, top_k = {}] device pointer",
                 fn, static_cast<const void*>(topk_weights), cfg.top_k);
  FP4MOE_REQUIRE(workspace != nullptr && aligned(workspace, 16),
                 "{}: workspace = {} must be a non-null, 16-byte aligned device pointer", fn, workspace);
  FP4MOE_REQUIRE(workspace_size >= workspace_bytes,
                 "{}: workspace_size = {} bytes is less than workspace_bytes() = {} (max_tokens = {})", fn,
                 workspace_size, workspace_bytes, max_tokens);
}

std::string describe_routing_error(uint64_t record, int top_k, int num_experts) {
  if (record == 0) return "";
  const int64_t flat = static_cast<int64_t>(record >> 32) - 1;
  const auto id = static_cast<int32_t>(static_cast<uint32_t>(record & 0xffffffffu));
  const int k = top_k > 0 ? top_k : 1;
  return fmt::format(
      "an earlier forward_routed call got topk_ids[{}, {}] = {}, outside [0, num_experts = {}) (and not -1, the "
      "'expert not on this rank' marker); that slot contributed nothing to token {}'s output",
      flat / k, flat % k, id, num_experts, flat / k);
}

}  // namespace fp4moe

// Launch code of the routing-given entry (MoeLayer::forward_routed); device code in
// include/fp4moe/kernels/moe_routing_given.cuh.
#include <cuda_runtime.h>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/kernels/moe_routing_given.cuh"
#include "fp4moe/moe_layer.hpp"

namespace fp4moe {

namespace {
unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>((n + kernels::kRoutingGivenThreads - 1) / kernels::kRoutingGivenThreads);
}
}  // namespace

void moe_routing_given(int num_experts, int64_t n, const int32_t* ids, const float* weights, int32_t* ids_out,
                       float* weights_out, unsigned long long* error_record, cudaStream_t stream) {
  FP4MOE_REQUIRE(num_experts >= 1, "moe_routing_given: num_experts = {} must be >= 1", num_experts);
  FP4MOE_REQUIRE(n >= 1 && n <= INT32_MAX,
                 "moe_routing_given: n = {} (tokens * top_k) must be in [1, 2^31 - 1]", n);
  FP4MOE_REQUIRE(ids && weights && ids_out && weights_out,
                 "moe_routing_given: ids, weights, ids_out and weights_out must all be non-null");
  kernels::moe_routing_given_kernel<<<blocks_for(n), kernels::kRoutingGivenThreads, 0, stream>>>(
      ids, weights, n, num_experts, ids_out, weights_out, error_record);
  FP4MOE_CUDA_CHECK_LAUNCH();
}

void moe_logits_bf16_to_fp32(const void* logits_bf16, int64_t n, float* out, cudaStream_t stream) {
  FP4MOE_REQUIRE(n >= 1 && n <= INT32_MAX, "moe_logits_bf16_to_fp32: n = {} must be in [1, 2^31 - 1]", n);
  FP4MOE_REQUIRE(logits_bf16 != nullptr && out != nullptr,
                 "moe_logits_bf16_to_fp32: logits_bf16 and out must be non-null");
  kernels::moe_logits_bf16_to_fp32_kernel<<<blocks_for(n), kernels::kRoutingGivenThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(logits_bf16), n, out);
  FP4MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4moe

// Routing given by the caller (MoeLayer::forward_routed): the engine's own top-k ids and weights are
// copied into the layer's workspace with every id outside [0, E) replaced by (expert 0, weight 0).
// Why a copy instead of reading the caller's ids directly: the permutation trusts its ids (an id out of
// range is not counted, so its row_of entry is never written and the combine would read a stale row),
// and a bad id from an engine must never become an out-of-bounds access. Routed to expert 0 with
// weight 0, the slot's GEMM2 row is 0 * (finite value) = 0, so the token's output is exactly what it
// would be without the slot. The copy costs one launch, the one the routing kernel costs on the
// logits path, so both entries launch the same number of kernels.
//
// A bad id other than -1 (the expert-parallel "not on this rank" convention, skipped silently) is
// recorded in `error_record` (host-mapped memory, so the host reads it without synchronizing):
// ((flat index + 1) << 32) | (uint32) id. Several bad entries race to write it; each 64-bit store is
// a single transaction, so whichever lands is one consistent (index, id) pair.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace fp4moe::kernels {

inline constexpr int kRoutingGivenThreads = 256;

__global__ void __launch_bounds__(kRoutingGivenThreads)
    moe_routing_given_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, int64_t n,
                             int num_experts, int32_t* __restrict__ ids_out, float* __restrict__ weights_out,
                             unsigned long long* error_record) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRoutingGivenThreads + threadIdx.x;
  if (i >= n) return;
  int32_t e = ids[i];
  float w = weights[i];
  if (e < 0 || e >= num_experts) {
    if (e != -1 && error_record != nullptr)
      *reinterpret_cast<volatile unsigned long long*>(error_record) =
          (static_cast<unsigned long long>(i + 1) << 32) | static_cast<uint32_t>(e);
    e = 0;
    w = 0.0f;
  }
  ids_out[i] = e;
  weights_out[i] = w;
}

// bf16 router logits -> fp32 (the router reads fp32). One element per thread; n = T * E is small.
__global__ void __launch_bounds__(kRoutingGivenThreads)
    moe_logits_bf16_to_fp32_kernel(const __nv_bfloat16* __restrict__ in, int64_t n, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRoutingGivenThreads + threadIdx.x;
  if (i < n) out[i] = __bfloat162float(in[i]);
}

}  // namespace fp4moe::kernels

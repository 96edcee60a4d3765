// Host entry of the fused permutation + gather (src/moe_layer.cu). A separate header (not moe_layer.hpp)
// only because this change did not own moe_layer.hpp; it may move there.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace fp4moe {

// tokens * top_k up to this takes the one-launch permutation (kernels::kSmallPermuteMaxEntries).
inline constexpr int kMoeSmallPermuteMaxEntries = 4096;

// Which permutation kernels run. kAuto: kSmall when tokens * top_k <= kSmallPermuteMaxEntries (4096,
// kernels/moe_permute.cuh), else kChunked. Both give bit-identical outputs; forcing one is for tests.
enum class PermutePath { kAuto, kSmall, kChunked };

// moe_permute (moe_layer.hpp) and, when hidden is non-null, moe_gather into `sorted` as well:
//   kSmall:   ONE launch (count + scan + scatter + gather, moe_permute_small_kernel);
//   kChunked: count, scan, scatter, gather (four launches; chunk_counts is their scratch).
// hidden / sorted: bf16 [T, H] / [T * k, H], 16-byte aligned, H % 8 == 0; both null for permute only.
void moe_permute_gather(int num_experts, int top_k, int64_t tokens, const int32_t* topk_ids,
                        const float* topk_weights, int32_t* chunk_counts, int32_t* expert_offsets,
                        int32_t* row_of, float* row_scale, int32_t* shared_offsets, const void* hidden,
                        int64_t hidden_size, void* sorted, cudaStream_t stream,
                        PermutePath path = PermutePath::kAuto);

}  // namespace fp4moe

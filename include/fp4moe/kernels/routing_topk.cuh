// Router: logits [T, E] -> top-k expert ids and weights, one warp per token, for the three router kinds
// of config.hpp. The arithmetic and the selection order are route_reference's (reference.hpp), so ids
// match the CPU exactly whenever the selection scores do:
//   - every comparison orders by (score descending, expert index ascending), a total order, so the
//     butterfly argmax below gives the same winner on every lane whatever the reduction tree;
//   - the softmax denominator is summed sequentially in expert-index order (one lane), as the reference
//     sums it; a warp tree would differ from it by a few ulps, which matters when renormalize is off;
//   - no multiply feeds an add, so nvcc's FMA contraction cannot change a rounding.
// Limits: E <= kMaxExperts (512) gives at most 16 scores per lane, held in registers (the loops over
// them are fully unrolled, so they never spill to local memory); k <= kMaxTopK (16) <= 32, so lane s
// holds slot s; n_group <= 32, so lane g holds group g's score.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "fp4moe/config.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe::kernels {

inline constexpr int kRoutingWarps = 4;  // tokens per block: small blocks keep T = 1..8 on few SMs

struct RoutingParams {
  const float* logits = nullptr;  // [T, E] fp32
  const float* bias = nullptr;    // [E] or null (sigmoid grouped: correction bias; gpt-oss: router bias)
  int32_t* topk_ids = nullptr;    // [T, k]
  float* topk_weights = nullptr;  // [T, k]
  int64_t tokens = 0;
  int num_experts = 0;
  int top_k = 0;
  int n_group = 1;
  int topk_group = 1;
  int renormalize = 1;
  float routed_scaling = 1.0f;
  RouterKind kind = RouterKind::kSoftmaxTopK;
};

// (v, i) beats (bv, bi): larger score, then lower index (reference.hpp's tie rule).
__device__ __forceinline__ bool routing_better(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (routing_better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// Merge two (largest, second largest) pairs.
__device__ __forceinline__ void top2_merge(float& a1, float& a2, float b1, float b2) {
  if (a1 >= b1) {
    a2 = fmaxf(a2, b1);
  } else {
    a2 = fmaxf(a1, b2);
    a1 = b1;
  }
}

template <int kPerLane>
__global__ void __launch_bounds__(kRoutingWarps * 32) routing_topk_kernel(RoutingParams p) {
  // Softmax denominators are summed sequentially by one lane from here (see the file comment).
  __shared__ float exp_buf[kRoutingWarps][kPerLane * 32];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRoutingWarps + warp;
  if (t >= p.tokens) return;  // the whole warp leaves together: the shuffles below stay full-warp
  const int E = p.num_experts;
  const float* row = p.logits + t * E;
  const float kNegInf = -__int_as_float(0x7f800000);

  float sel[kPerLane];   // selection score
  float wval[kPerLane];  // the value the weight is computed from (logit, unbiased sigmoid, z)
  uint32_t valid = 0;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    sel[j] = kNegInf;
    wval[j] = 0.0f;
    if (e < E) {
      const float x = row[e];
      valid |= 1u << j;
      if (p.kind == RouterKind::kSoftmaxTopK) {
        sel[j] = x;
        wval[j] = x;
      } else if (p.kind == RouterKind::kSigmoidGrouped) {
        const float s = 1.0f / (1.0f + expf(-x));
        sel[j] = p.bias ? s + p.bias[e] : s;
        wval[j] = s;
      } else {
        const float z = p.bias ? x + p.bias[e] : x;
        sel[j] = z;
        wval[j] = z;
      }
      // A NaN score must still select an in-range expert (the permutation indexes with it): it
      // ranks below every number, ties resolved by index.
      if (sel[j] != sel[j]) sel[j] = kNegInf;
    }
  }

  // ---- group selection (sigmoid grouped, n_group > 1) ----
  if (p.kind == RouterKind::kSigmoidGrouped && p.n_group > 1) {
    const int gsize = E / p.n_group;
    float my_group_score = kNegInf;
    for (int g = 0; g < p.n_group; ++g) {
      float a1 = kNegInf, a2 = kNegInf;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        if (((valid >> j) & 1u) && e / gsize == g) top2_merge(a1, a2, sel[j], kNegInf);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float b1 = __shfl_xor_sync(0xffffffffu, a1, off);
        const float b2 = __shfl_xor_sync(0xffffffffu, a2, off);
        top2_merge(a1, a2, b1, b2);
      }
      if (lane == g) my_group_score = a1 + a2;
    }
    uint32_t kept = 0;
    bool taken = false;
    for (int r = 0; r < p.topk_group; ++r) {
      float v = (lane < p.n_group && !taken) ? my_group_score : kNegInf;
      int i = (lane < p.n_group && !taken) ? lane : 0x7fffffff;
      warp_argmax(v, i);
      if (i == lane) taken = true;
      kept |= 1u << (i & 31);
    }
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (!((kept >> ((e / gsize) & 31)) & 1u)) valid &= ~(1u << j);
    }
  }

  // ---- top-k: k rounds of a warp argmax; lane s keeps slot s ----
  int my_id = 0;
  float my_wval = 0.0f;
  for (int s = 0; s < p.top_k; ++s) {
    float bv = kNegInf;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (((valid >> j) & 1u) && routing_better(sel[j], e, bv, bi)) {
        bv = sel[j];
        bi = e;
      }
    }
    warp_argmax(bv, bi);
    // bi is always a valid expert: validation guarantees >= k selectable experts.
    float wv = 0.0f;
    if ((bi & 31) == lane) {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j)
        if (j == (bi >> 5)) {
          wv = wval[j];
          valid &= ~(1u << j);
        }
    }
    wv = __shfl_sync(0xffffffffu, wv, bi & 31);
    if (lane == s) {
      my_id = bi;
      my_wval = wv;
    }
  }

  // ---- weights ----
  float w = 0.0f;
  if (p.kind == RouterKind::kSoftmaxTopK) {
    float m = kNegInf;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if ((lane + 32 * j) < E) m = fmaxf(m, sel[j]);  // sel = the logit here
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < E) exp_buf[warp][e] = expf(row[e] - m);
    }
    __syncwarp();
    float denom = 0.0f;
    if (lane == 0)
      for (int e = 0; e < E; ++e) denom += exp_buf[warp][e];
    denom = __shfl_sync(0xffffffffu, denom, 0);
    w = expf(my_wval - m) / denom;
  } else if (p.kind == RouterKind::kSigmoidGrouped) {
    w = my_wval;
  } else {
    const float z0 = __shfl_sync(0xffffffffu, my_wval, 0);  // slot 0 holds the largest z
    w = expf(my_wval - z0);
  }
  const bool normalize = p.kind == RouterKind::kGptOss || p.renormalize;
  if (normalize) {
    float sum = 0.0f;
    for (int s = 0; s < p.top_k; ++s) sum += __shfl_sync(0xffffffffu, w, s);
    w = w / sum;
  }
  w = w * p.routed_scaling;
  if (lane < p.top_k) {
    p.topk_ids[t * p.top_k + lane] = my_id;
    p.topk_weights[t * p.top_k + lane] = w;
  }
}

}  // namespace fp4moe::kernels

// Router: logits [T, E] -> top-k expert ids and weights, one warp per token, for the three router kinds
// of config.hpp. The arithmetic and the selection order are route_reference's (reference.hpp), so ids
// match the CPU exactly whenever the selection scores do:
//   - every comparison orders by (score descending, expert index ascending), a total order, so the
//     butterfly argmax below gives the same winner on every lane whatever the reduction tree;
//   - the softmax denominator is summed sequentially in expert-index order, as the reference sums it;
//     a warp tree would differ from it by a few ulps, which matters when renormalize is off;
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

// Order-preserving 32-bit key of a selection score: a larger key <=> a larger score. -0 is folded onto
// +0 (they compare equal as floats, so their tie must go to the index rule). NaN never reaches here
// (mapped to -inf above). Key 0 is below every score's key (-inf maps to 0x007fffff): it marks "no
// candidate" (an invalid, masked or already taken expert).
__device__ __forceinline__ uint32_t routing_key(float v) {
  const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// (key, index) a beats b: larger key, then lower index. The total order of routing_better.
__device__ __forceinline__ bool key_better(uint32_t ka, uint32_t ia, uint32_t kb, uint32_t ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// Sorts a lane's N (power of two) candidates best first with a bitonic network. Every index is a
// compile-time constant once unrolled, so the arrays stay in registers (a run-time index would put
// them in local memory, i.e. DRAM-backed, ~500-cycle loads).
template <int N>
__device__ __forceinline__ void sort_candidates(uint32_t (&key)[N], uint32_t (&idx)[N]) {
#pragma unroll
  for (int size = 2; size <= N; size <<= 1) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride >>= 1) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          // blocks with (i & size) == 0 sort best-first, the others worst-first (bitonic merge);
          // the last pass (size == N) sorts everything best-first.
          const bool best_first = (i & size) == 0;
          const bool swap = best_first ? key_better(key[j], idx[j], key[i], idx[i])
                                       : key_better(key[i], idx[i], key[j], idx[j]);
          if (swap) {
            const uint32_t tk = key[i], ti = idx[i];
            key[i] = key[j];
            idx[i] = idx[j];
            key[j] = tk;
            idx[j] = ti;
          }
        }
      }
    }
  }
}

// Why this is fast at small T (one warp per token, so a token's latency is one warp's dependency
// chain; at T <= 128 the GPU is nearly empty and nothing hides it):
//   - all logits/bias loads of a lane are issued before any use (one DRAM/L2 round trip, not E/32);
//   - each lane sorts its E/32 candidates ONCE (bitonic network in registers, ~6-10 compare layers),
//     so a top-k round only looks at the lane's head instead of rescanning E/32 values;
//   - a round's warp argmax is two REDUX instructions (sm_80+ single-instruction warp reductions:
//     max of the 32-bit order-preserving score key, then min of the expert index among the lanes that
//     hold that key) instead of a 5-step butterfly of two shuffles and a compare each;
//   - the winner's weight value is not broadcast per round: every lane's values sit in shared memory
//     and the slot lane reads its own after the loop (off the round-to-round critical path).
// The selection is the same total order (score descending, index ascending) as before, and the weight
// arithmetic is unchanged, so ids and weights are bit-identical to the butterfly version.
template <int kPerLane>
__global__ void __launch_bounds__(kRoutingWarps * 32) routing_topk_kernel(RoutingParams p) {
  // Per warp: the weight value of every expert (read back by the slot lanes), and for the softmax the
  // exp values that the denominator sums in expert order.
  __shared__ float wval_buf[kRoutingWarps][kPerLane * 32];
  __shared__ float exp_buf[kRoutingWarps][kPerLane * 32];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRoutingWarps + warp;
  if (t >= p.tokens) return;  // the whole warp leaves together: the warp collectives below stay full-warp
  const int E = p.num_experts;
  const float* row = p.logits + t * E;
  const float kNegInf = -__int_as_float(0x7f800000);

  // Issue every load first (kPerLane independent logits + bias loads in flight at once).
  float x[kPerLane], b[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    x[j] = e < E ? row[e] : 0.0f;
    b[j] = (e < E && p.bias != nullptr) ? p.bias[e] : 0.0f;
  }

  float sel[kPerLane];   // selection score
  float wval[kPerLane];  // the value the weight is computed from (logit, unbiased sigmoid, z)
  uint32_t valid = 0;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    sel[j] = kNegInf;
    wval[j] = 0.0f;
    if (e < E) {
      valid |= 1u << j;
      if (p.kind == RouterKind::kSoftmaxTopK) {
        sel[j] = x[j];
        wval[j] = x[j];
      } else if (p.kind == RouterKind::kSigmoidGrouped) {
        const float s = 1.0f / (1.0f + expf(-x[j]));
        sel[j] = p.bias ? s + b[j] : s;
        wval[j] = s;
      } else {
        const float z = p.bias ? x[j] + b[j] : x[j];
        sel[j] = z;
        wval[j] = z;
      }
      // A NaN score must still select an in-range expert (the permutation indexes with it): it
      // ranks below every number, ties resolved by index.
      if (sel[j] != sel[j]) sel[j] = kNegInf;
      wval_buf[warp][e] = wval[j];
    }
  }

  // ---- group selection (sigmoid grouped, n_group > 1): clears `valid` bits of dropped groups ----
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

  // ---- top-k: per-lane sorted candidate lists, k rounds of a REDUX argmax; lane s keeps slot s ----
  uint32_t key[kPerLane], idx[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const bool ok = (valid >> j) & 1u;
    key[j] = ok ? routing_key(sel[j]) : 0u;
    idx[j] = ok ? static_cast<uint32_t>(lane + 32 * j) : 0xffffffffu;
  }
  sort_candidates<kPerLane>(key, idx);

  int my_id = 0;
  for (int s = 0; s < p.top_k; ++s) {
    const uint32_t best_key = __reduce_max_sync(0xffffffffu, key[0]);
    const uint32_t bi = __reduce_min_sync(0xffffffffu, key[0] == best_key ? idx[0] : 0xffffffffu);
    // bi is always a valid expert: validation guarantees >= k selectable experts. Its lane pops it.
    if (idx[0] == bi) {
#pragma unroll
      for (int j = 0; j + 1 < kPerLane; ++j) {
        key[j] = key[j + 1];
        idx[j] = idx[j + 1];
      }
      key[kPerLane - 1] = 0u;
      idx[kPerLane - 1] = 0xffffffffu;
    }
    if (lane == s) my_id = static_cast<int>(bi);
  }
  __syncwarp();  // wval_buf writes (all lanes) before the slot lanes read them
  const float my_wval = lane < p.top_k ? wval_buf[warp][my_id] : 0.0f;

  // ---- weights ----
  float w = 0.0f;
  if (p.kind == RouterKind::kSoftmaxTopK) {
    float denom = 0.0f;
    float m = kNegInf;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if ((lane + 32 * j) < E) m = fmaxf(m, sel[j]);  // sel = the logit here
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < E) exp_buf[warp][e] = expf(x[j] - m);
    }
    __syncwarp();
    // Sequential in expert order, as the reference sums it. Every lane runs the same loop on
    // broadcast shared-memory reads: no divergent single-lane branch and no broadcast shuffle after.
    for (int e = 0; e < E; ++e) denom += exp_buf[warp][e];
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

__device__ __forceinline__ float routing_neg_inf() { return -__int_as_float(0x7f800000); }

// The CTA kernel's pieces (below). routing_topk_kernel keeps its own inline copy of the same arithmetic:
// built from these helpers, it compiled to other code (34 -> 40 registers at 128 experts), and the
// layers that run it at T = 1 (gpt-oss-120b, qwen3-30b) took 0.3-0.6 us longer on an H100 (bench/NOTES.md,
// twenty-fifth session).
//
// One expert's selection score and the value its weight is computed from (the logit, the unbiased
// sigmoid, z), as route_reference computes them.
__device__ __forceinline__ void routing_score(const RoutingParams& p, float x, float b, float& sel, float& wval) {
  if (p.kind == RouterKind::kSoftmaxTopK) {
    sel = x;
    wval = x;
  } else if (p.kind == RouterKind::kSigmoidGrouped) {
    const float s = 1.0f / (1.0f + expf(-x));
    sel = p.bias ? s + b : s;
    wval = s;
  } else {
    const float z = p.bias ? x + b : x;
    sel = z;
    wval = z;
  }
  // A NaN score must still select an in-range expert (the permutation indexes with it): it ranks below
  // every number, ties resolved by index.
  if (sel != sel) sel = routing_neg_inf();
}

// k rounds of a warp argmax over the lanes' sorted candidate lists (best first): each round's winner is
// two REDUX instructions (max of the key, then min of the index among the lanes that hold it) and its
// lane pops it. Lane s keeps round s's winner. With fewer than k candidates left, a round's winner is
// (0, 0xffffffff), which loses to every candidate.
template <int kPerLane>
__device__ __forceinline__ void topk_rounds(uint32_t (&key)[kPerLane], uint32_t (&idx)[kPerLane], int k, int lane,
                                            uint32_t& my_key, uint32_t& my_idx) {
  for (int s = 0; s < k; ++s) {
    const uint32_t best_key = __reduce_max_sync(0xffffffffu, key[0]);
    const uint32_t bi = __reduce_min_sync(0xffffffffu, key[0] == best_key ? idx[0] : 0xffffffffu);
    if (idx[0] == bi) {
#pragma unroll
      for (int j = 0; j + 1 < kPerLane; ++j) {
        key[j] = key[j + 1];
        idx[j] = idx[j + 1];
      }
      key[kPerLane - 1] = 0u;
      idx[kPerLane - 1] = 0xffffffffu;
    }
    if (lane == s) {
      my_key = best_key;
      my_idx = bi;
    }
  }
}

// Slot lane s < k holds its expert and that expert's weight value; every lane of the warp calls this
// (the renormalization reads the slots by shuffle). m, denom: the softmax's max logit and denominator.
__device__ __forceinline__ void routing_store_slots(const RoutingParams& p, int64_t t, int lane, int my_id,
                                                    float my_wval, float m, float denom) {
  float w;
  if (p.kind == RouterKind::kSoftmaxTopK) {
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

// A CTA per token, for few tokens (the layer's decode steps; moe_route picks it): with one warp per token
// the routing kernel is that warp's dependency chains, which grow with the experts per lane (on an H100
// the kernel took 1.9 / 3.5 / 5.4 us for 128 / 256 / 384 experts at T = 1, and everything after it in
// the layer waits for it). Here kRoutingCtaWarps warps split the experts (warp w holds experts
// [w x 32 kPerLane, (w + 1) x 32 kPerLane)), each warp selects its own top k as above, and warp 0 merges
// the warps' k candidates each, one per lane, in k more REDUX rounds. The union of the warps' top k
// holds the token's top k, and every comparison is the same total order, so the ids, their slot order
// and the weights are bit-identical to routing_topk_kernel's (the softmax's max is a max, and its
// denominator is summed by one loop in expert order, as there). Grouped selection (DeepSeek-V3) runs
// before the warps' own top k: each warp reduces the (top score, second score) pair of every group its
// experts meet, the pairs of a group meet across warps through shared memory, and every warp then picks
// the same topk_group groups (cta_kept_groups). For kRoutingCtaWarps x k <= 32 (one candidate per lane
// in the merge).
inline constexpr int kRoutingCtaWarps = 4;

// The float whose routing_key is k (k != 0): routing_key is a bijection on the floats it is given
// (-0 excepted, which it folds onto +0, and no selection score is -0: a sigmoid is > 0 and s + b rounds
// an exact zero to +0).
__device__ __forceinline__ float routing_key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Grouped selection with the experts split over W warps: the bit mask of the topk_group kept groups,
// the same in every warp (every warp calls it: it holds a CTA barrier). A group's score is the sum of its
// two best selection scores, as in routing_topk_kernel. That pair is the max and the second max (with
// multiplicity) of the group's scores, whatever order they are merged in, and the sum is one add of the
// same two floats, so the scores and the kept groups are the warp kernel's bit for bit. Both reductions
// are REDUX instructions on the scores' order-preserving keys instead of shuffle butterflies (the warp
// kernel's group pass took 11.8 us at DeepSeek-V3's 256 experts and 8 groups at T = 1 on an H100):
// a group's pair is the max key, then the max over the other lanes' best and the winning lane's second;
// a round of the group selection is the max key, then the lowest group holding it. pair: 2 x W x 32
// floats of shared memory. sel: this warp's experts' scores (expert warp x 32 kPerLane + 32 j + lane;
// -inf past E).
template <int kPerLane, int W>
__device__ __forceinline__ uint32_t cta_kept_groups(const RoutingParams& p, const float (&sel)[kPerLane], int warp,
                                                    int lane, float* pair) {
  constexpr int kSpan = 32 * kPerLane;
  const float kNegInf = routing_neg_inf();
  const int E = p.num_experts, n_group = p.n_group, gsize = E / n_group;
  float* a1s = pair + warp * 32;
  float* a2s = pair + (W + warp) * 32;
  a1s[lane] = kNegInf;  // groups this warp's experts do not meet
  a2s[lane] = kNegInf;
  __syncwarp();
  const int lo = warp * kSpan, hi = min(E, lo + kSpan);
  for (int g = lo / gsize; lo < hi && g <= (hi - 1) / gsize; ++g) {
    float a1 = kNegInf, a2 = kNegInf;  // this lane's two best of group g
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lo + 32 * j + lane;
      if (e < E && e / gsize == g) top2_merge(a1, a2, sel[j], kNegInf);
    }
    const uint32_t k1 = routing_key(a1);
    const uint32_t best = __reduce_max_sync(0xffffffffu, k1);
    const uint32_t win = __reduce_min_sync(0xffffffffu, k1 == best ? static_cast<uint32_t>(lane) : 32u);
    const uint32_t second = __reduce_max_sync(0xffffffffu, lane == static_cast<int>(win) ? routing_key(a2) : k1);
    if (lane == 0) {
      a1s[g] = routing_key_value(best);
      a2s[g] = routing_key_value(second);
    }
  }
  __syncthreads();
  float a1 = kNegInf, a2 = kNegInf;
  if (lane < n_group) {
#pragma unroll
    for (int w = 0; w < W; ++w) top2_merge(a1, a2, pair[w * 32 + lane], pair[(W + w) * 32 + lane]);
  }
  // Lane g < n_group holds group g's score; key 0 (below every score's key) marks no candidate.
  uint32_t gkey = lane < n_group ? routing_key(a1 + a2) : 0u;
  uint32_t kept = 0;
  for (int r = 0; r < p.topk_group; ++r) {
    const uint32_t top = __reduce_max_sync(0xffffffffu, gkey);
    const uint32_t g = __reduce_min_sync(0xffffffffu, gkey == top && gkey != 0u ? static_cast<uint32_t>(lane) : 32u);
    kept |= 1u << (g & 31);
    if (lane == static_cast<int>(g)) gkey = 0u;
  }
  return kept;
}

template <int kPerLane>
__global__ void __launch_bounds__(kRoutingCtaWarps * 32) routing_topk_cta_kernel(RoutingParams p) {
  constexpr int W = kRoutingCtaWarps;
  constexpr int kSpan = 32 * kPerLane;  // experts per warp
  __shared__ float wval_buf[W * kSpan];
  __shared__ float exp_buf[W * kSpan];
  __shared__ float warp_max[W];
  __shared__ uint32_t cand_key[32], cand_idx[32];
  __shared__ float group_pair[2 * W * 32];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t t = blockIdx.x;
  const int E = p.num_experts, k = p.top_k;
  const float* row = p.logits + t * E;
  const float kNegInf = routing_neg_inf();

  float x[kPerLane], b[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = warp * kSpan + 32 * j + lane;
    x[j] = e < E ? row[e] : 0.0f;
    b[j] = (e < E && p.bias != nullptr) ? p.bias[e] : 0.0f;
  }
  float sel[kPerLane];
  float m = kNegInf;  // softmax: the max logit of this warp's experts, then of all
  uint32_t key[kPerLane], idx[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = warp * kSpan + 32 * j + lane;
    sel[j] = kNegInf;
    if (e < E) {
      float wval;
      routing_score(p, x[j], b[j], sel[j], wval);
      wval_buf[e] = wval;
      m = fmaxf(m, sel[j]);
    }
    key[j] = e < E ? routing_key(sel[j]) : 0u;
    idx[j] = e < E ? static_cast<uint32_t>(e) : 0xffffffffu;
  }
  if (p.kind == RouterKind::kSigmoidGrouped && p.n_group > 1) {  // uniform over the CTA (its barrier)
    const uint32_t kept = cta_kept_groups<kPerLane, W>(p, sel, warp, lane, group_pair);
    const int gsize = E / p.n_group;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = warp * kSpan + 32 * j + lane;
      if (e < E && !((kept >> (e / gsize)) & 1u)) {  // a dropped group's expert: no candidate
        key[j] = 0u;
        idx[j] = 0xffffffffu;
      }
    }
  }
  if (p.kind == RouterKind::kSoftmaxTopK) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) warp_max[warp] = m;
  }
  sort_candidates<kPerLane>(key, idx);
  uint32_t my_key = 0u, my_idx = 0xffffffffu;
  topk_rounds<kPerLane>(key, idx, k, lane, my_key, my_idx);
  if (lane < k) {
    cand_key[warp * k + lane] = my_key;
    cand_idx[warp * k + lane] = my_idx;
  }
  __syncthreads();  // candidates, weight values and the warps' maxima are in
  if (p.kind == RouterKind::kSoftmaxTopK) {
    m = warp_max[0];
#pragma unroll
    for (int w = 1; w < W; ++w) m = fmaxf(m, warp_max[w]);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = warp * kSpan + 32 * j + lane;
      if (e < E) exp_buf[e] = expf(x[j] - m);
    }
    __syncthreads();
  }
  if (warp != 0) return;

  // The merge: lane l holds candidate l (W x k of them, the rest lose to all).
  uint32_t ck[1] = {lane < W * k ? cand_key[lane] : 0u};
  uint32_t ci[1] = {lane < W * k ? cand_idx[lane] : 0xffffffffu};
  my_idx = 0xffffffffu;
  topk_rounds<1>(ck, ci, k, lane, my_key, my_idx);
  const int my_id = static_cast<int>(my_idx);
  const float my_wval = lane < k ? wval_buf[my_id] : 0.0f;
  float denom = 0.0f;
  if (p.kind == RouterKind::kSoftmaxTopK)
    for (int e = 0; e < E; ++e) denom += exp_buf[e];  // in expert order, as routing_topk_kernel sums it
  routing_store_slots(p, t, lane, my_id, my_wval, m, denom);
}

}  // namespace fp4moe::kernels

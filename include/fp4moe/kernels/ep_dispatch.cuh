// Expert parallelism, device side: pack the dispatch messages, unpack what arrived, pack the replies.
// Host launch code: src/ep_moe_layer.cu; the layout and the plan's arithmetic: ep_plan.hpp (whose
// host reference ep_dispatch_plan the tests compare these kernels with).
//
// Dataflow of one forward() on rank r (sizes from EpStepLayout, fixed by host values):
//   route -> moe_permute over ALL experts: r's (token, slot) pairs sorted by expert, hence grouped by
//   destination rank (slices are contiguous) -> ep_pack_kernel: each pair's row and metadata into the
//   message to its rank at its index within that rank's group; pos_of = where its result will come
//   back -> exchange -> ep_unpack_kernel: contiguous local ids / weights of all received rows (padding
//   and anything malformed -> -1) + the status check -> moe_permute_gather over the local experts ->
//   the expert GEMMs -> ep_return_kernel: results back into received order -> exchange ->
//   moe_combine(pos_of), the single-GPU combine, in slot order.
// Nothing here decides an order by scheduling: positions come from the stable permutation, so the
// bytes on the wire and the output are the same run to run.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "fp4moe/ep_plan.hpp"

namespace fp4moe::kernels {

inline constexpr int kEpRowThreads = 128;   // one thread per 16-byte column, like gather and combine
inline constexpr int kEpMetaThreads = 256;
inline constexpr int kEpMaxMetaBlocks = 32;

// Per-destination tables travel as launch arguments (< 2 KB at kMaxEpRanks = 64), so a forward()
// needs no host-to-device copy and stays capturable.
struct EpPackParams {
  const int32_t* topk_ids = nullptr;        // [T, k]
  const float* topk_weights = nullptr;      // [T, k]
  const int32_t* expert_offsets = nullptr;  // [E + 1] of the permutation over all experts (T >= 1)
  const int32_t* row_of = nullptr;          // [T, k]: position in that permutation
  const uint4* hidden = nullptr;            // [T, h8]
  uint4* send_rows = nullptr;
  int32_t* send_meta = nullptr;
  uint4* self_rows = nullptr;               // this rank's own slot of recv_rows / recv_meta
  int32_t* self_meta = nullptr;
  int32_t* pos_of = nullptr;                // [T, k]
  uint4* zero_row = nullptr;                // [h8]: the reply row of dropped slots
  int32_t* shared_offsets = nullptr;        // [2] or null: {0, T}
  int64_t h8 = 0;
  int tokens = 0;
  int top_k = 0;
  int world = 0;
  int rank = 0;
  int row_slices = 0;                       // blocks per token in the row part
  int step_tokens = 0;
  int32_t zero_row_index = 0;
  int32_t total_rows = 0;                   // sum of rows_to
  int32_t expert_begin[kMaxEpRanks + 1] = {};
  int32_t rows_to[kMaxEpRanks] = {};
  int32_t ret_off[kMaxEpRanks] = {};        // exclusive prefix of rows_to
  int64_t row_off[kMaxEpRanks] = {};        // in send_rows (rows); unused for self
  int64_t meta_off[kMaxEpRanks] = {};       // in send_meta (int32); unused for self
};

// The rank owning expert e: the last d with expert_begin[d] <= e.
__device__ __forceinline__ int ep_owner(const EpPackParams& p, int e) {
  int lo = 0, hi = p.world - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.expert_begin[mid] <= e) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ int32_t ep_count_to(const EpPackParams& p, int d) {
  return p.tokens > 0 ? p.expert_offsets[p.expert_begin[d + 1]] - p.expert_offsets[p.expert_begin[d]] : 0;
}

__device__ __forceinline__ int32_t* ep_meta_of(const EpPackParams& p, int d) {
  return d == p.rank ? p.self_meta : p.send_meta + p.meta_off[d];
}

// Grid: tokens * row_slices row blocks (one thread per (token, 16-byte column): the hidden vector is
// read once and stored into every message its slots go to), then meta blocks (padding ids, headers,
// the zero row, the shared expert's offsets). The two parts write disjoint words: a message's entries
// [0, min(count, rows)) belong to the row part, [count, rows) and the header to the meta part.
__global__ void __launch_bounds__(kEpRowThreads) ep_pack_kernel(const __grid_constant__ EpPackParams p) {
  const int64_t row_blocks = static_cast<int64_t>(p.tokens) * p.row_slices;
  const int tid = static_cast<int>(threadIdx.x);
  if (blockIdx.x < row_blocks) {
    const int64_t t = blockIdx.x / p.row_slices;
    const int64_t v = static_cast<int64_t>(blockIdx.x % p.row_slices) * kEpRowThreads + tid;
    if (v >= p.h8) return;
    const uint4 x = p.hidden[t * p.h8 + v];
    const int num_experts = p.expert_begin[p.world];
    for (int j = 0; j < p.top_k; ++j) {
      const int64_t i = t * p.top_k + j;
      const int e = p.topk_ids[i];
      int32_t pos = p.zero_row_index;
      if (e >= 0 && e < num_experts) {  // routing never gives others; anything else is dropped, not written
        const int d = ep_owner(p, e);
        const int32_t idx = p.row_of[i] - p.expert_offsets[p.expert_begin[d]];
        if (idx < p.rows_to[d]) {
          uint4* rows = d == p.rank ? p.self_rows : p.send_rows + p.row_off[d] * p.h8;
          rows[static_cast<int64_t>(idx) * p.h8 + v] = x;
          if (v == 0) {
            int32_t* meta = ep_meta_of(p, d);
            meta[idx] = e - p.expert_begin[d];
            meta[p.rows_to[d] + idx] = __float_as_int(p.topk_weights[i]);
          }
          pos = p.ret_off[d] + idx;
        }
      }
      if (v == 0) p.pos_of[i] = pos;
    }
    return;
  }
  // ---- meta part ----
  const int64_t mb = blockIdx.x - row_blocks;
  const int64_t meta_blocks = gridDim.x - row_blocks;
  for (int64_t q = mb * blockDim.x + tid; q < p.total_rows; q += meta_blocks * blockDim.x) {
    int d = 0;  // the message holding reply row q: the last d with ret_off[d] <= q
    while (d + 1 < p.world && p.ret_off[d + 1] <= q) ++d;
    const int32_t idx = static_cast<int32_t>(q - p.ret_off[d]);
    if (idx >= ep_count_to(p, d)) {
      int32_t* meta = ep_meta_of(p, d);
      meta[idx] = -1;
      meta[p.rows_to[d] + idx] = 0;
    }
  }
  if (mb != 0) return;
  for (int64_t v = tid; v < p.h8; v += blockDim.x) p.zero_row[v] = make_uint4(0, 0, 0, 0);
  if (tid == 0 && p.shared_offsets != nullptr) {
    p.shared_offsets[0] = 0;
    p.shared_offsets[1] = p.tokens;
  }
  if (tid < p.world) {
    // Every message carries the sender's first overflow (of any destination), so every rank learns of
    // it in the same forward().
    int ovf = -1;
    for (int d = 0; d < p.world && ovf < 0; ++d)
      if (ep_count_to(p, d) > p.rows_to[d]) ovf = d;
    const int d = tid;
    int32_t* hdr = ep_meta_of(p, d) + 2 * static_cast<int64_t>(p.rows_to[d]);
    hdr[0] = kEpHeaderMagic;
    hdr[1] = ep_count_to(p, d);
    hdr[2] = p.rows_to[d];
    hdr[3] = p.step_tokens;
    hdr[4] = ovf >= 0 ? static_cast<int32_t>(EpStatusCode::kCapacityOverflow) : 0;
    hdr[5] = ovf;
    hdr[6] = ovf >= 0 ? ep_count_to(p, ovf) : 0;
    hdr[7] = ovf >= 0 ? p.rows_to[ovf] : 0;
  }
}

struct EpUnpackParams {
  const int32_t* recv_meta = nullptr;  // [world, ep_meta_ints(rows_from)]
  int32_t* ids = nullptr;              // [world * rows_from]: local expert or -1
  float* weights = nullptr;            // [world * rows_from]
  EpStatus* status = nullptr;          // host-mapped: the first problem seen, kept until the layer dies
  int64_t meta_ints = 0;
  int world = 0;
  int rank = 0;
  int rows_from = 0;
  int local_experts = 0;
  int step_tokens = 0;
};

__device__ __forceinline__ bool ep_header_ok(const int32_t* hdr, int rows) {
  return hdr[0] == kEpHeaderMagic && hdr[2] == rows;
}

// One thread per received row; block 0's thread 0 also checks the headers in rank order and records
// the first problem (plain stores, fields before the code: host-mapped memory needs no atomics here,
// as this is the only writer).
__global__ void __launch_bounds__(kEpMetaThreads) ep_unpack_kernel(const __grid_constant__ EpUnpackParams p) {
  const int64_t n = static_cast<int64_t>(p.world) * p.rows_from;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    const int s = static_cast<int>(i / p.rows_from);
    const int32_t idx = static_cast<int32_t>(i - static_cast<int64_t>(s) * p.rows_from);
    const int32_t* meta = p.recv_meta + s * p.meta_ints;
    const int32_t* hdr = meta + 2 * static_cast<int64_t>(p.rows_from);
    // A malformed message (another step size, garbage) contributes no row: its ids are never used to
    // index anything.
    const int32_t count = ep_header_ok(hdr, p.rows_from) ? min(hdr[1], p.rows_from) : 0;
    const int32_t id = idx < count ? meta[idx] : -1;
    const bool ok = id >= 0 && id < p.local_experts;
    p.ids[i] = ok ? id : -1;
    p.weights[i] = ok ? __int_as_float(meta[p.rows_from + idx]) : 0.0f;
  }
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  volatile int32_t* st = reinterpret_cast<volatile int32_t*>(p.status);
  if (st[0] != 0) return;  // keep the first report
  for (int s = 0; s < p.world; ++s) {
    const int32_t* hdr = p.recv_meta + s * p.meta_ints + 2 * static_cast<int64_t>(p.rows_from);
    int32_t code = 0, src = s, dst = p.rank, rows = 0, cap = 0;
    if (!ep_header_ok(hdr, p.rows_from)) {
      code = static_cast<int32_t>(EpStatusCode::kStepMismatch);
      rows = hdr[2];
      cap = p.rows_from;
    } else if (hdr[4] != 0) {
      code = static_cast<int32_t>(EpStatusCode::kCapacityOverflow);
      dst = hdr[5];
      rows = hdr[6];
      cap = hdr[7];
    }
    if (code == 0) continue;
    st[1] = p.rank;  // EpStatus: code, reporter, src, dst, rows, capacity, step_tokens, expected_step
    st[2] = src;
    st[3] = dst;
    st[4] = rows;
    st[5] = cap;
    st[6] = hdr[3];
    st[7] = p.step_tokens;
    __threadfence_system();
    st[0] = code;
    return;
  }
}

struct EpReturnParams {
  const int32_t* ids = nullptr;     // [recv_rows]: local expert or -1 (ep_unpack_kernel)
  const int32_t* row_of = nullptr;  // [recv_rows]: expert-sorted row
  const uint4* y = nullptr;         // GEMM2 output, expert-sorted [rows, h8]
  uint4* ret_send = nullptr;        // [recv_rows, h8]: replies in received order
  uint4* ret_self = nullptr;        // this rank's own replies go straight to its ret_recv slot
  int64_t h8 = 0;
  int rows_from = 0;
  int rank = 0;
  int slices = 0;
};

// One thread per (received row, 16-byte column); invalid rows (padding) are skipped.
__global__ void __launch_bounds__(kEpRowThreads) ep_return_kernel(const __grid_constant__ EpReturnParams p) {
  const int64_t i = blockIdx.x / p.slices;
  const int64_t v = static_cast<int64_t>(blockIdx.x % p.slices) * kEpRowThreads + threadIdx.x;
  if (v >= p.h8 || p.ids[i] < 0) return;
  const uint4 x = p.y[static_cast<int64_t>(p.row_of[i]) * p.h8 + v];
  const int64_t s = i / p.rows_from;
  if (s == p.rank) p.ret_self[(i - s * p.rows_from) * p.h8 + v] = x;
  else p.ret_send[i * p.h8 + v] = x;
}

}  // namespace fp4moe::kernels

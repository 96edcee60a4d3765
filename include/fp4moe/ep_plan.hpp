// Expert parallelism (EP): the host-side arithmetic of EpMoeLayer (ep_moe_layer.hpp), with no CUDA
// calls, so the CPU tests cover it: which rank owns which experts, how many rows each message carries,
// where every message lives in the workspace, the dispatch plan the device computes (as a host
// reference), the construction handshake and the messages of the device's error reports.
//
// Why fixed message sizes: NCCL's send and receive counts are host arguments and must match on both
// sides, while how many (token, slot) rows go to each rank is only known on the device after routing.
// Reading the counts back would synchronize the host with every layer (and break CUDA-graph capture),
// so each message has a size both ends compute from host values alone (ep_rows_per_peer): the step
// bound, the partition and the capacity factor. Unused rows are padding marked invalid in the message's
// metadata; rows beyond the size are dropped and reported (EpStatus), never written out of bounds.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/config.hpp"
#include "fp4moe/moe_layer.hpp"

namespace fp4moe {

// Ranks of one expert-parallel group. The dispatch kernel takes per-rank tables as launch arguments.
inline constexpr int kMaxEpRanks = 64;

// Contiguous expert slices in rank order: rank r holds experts [expert_begin[r], expert_begin[r + 1]).
struct EpPartition {
  int num_experts = 0;
  std::vector<int> expert_begin;  // world + 1 entries: 0 = expert_begin[0] < ... < expert_begin[world] = E

  int world() const { return static_cast<int>(expert_begin.size()) - 1; }
  int begin(int rank) const;
  int count(int rank) const;
  int owner(int expert) const;  // the rank holding `expert`; throws when out of [0, E)
};
// E / world experts per rank, the first E % world ranks one more.
EpPartition ep_even_partition(int num_experts, int world);
// Slices of the given sizes in rank order (each >= 1, summing to num_experts).
EpPartition ep_partition_from_counts(int num_experts, const std::vector<int>& counts);

// What an EpMoeLayer is built for.
struct EpCapacity {
  // The most tokens any rank passes to one forward(); the same value on every rank.
  int64_t max_tokens = 0;
  // Rows one rank may receive from one peer in a forward(), as a multiple of the balanced share
  // step_tokens * top_k * (peer's experts) / E, never less than one token's rows (min(top_k, experts))
  // nor more than the worst case step_tokens * min(top_k, experts). 0 (default): the worst case, which
  // never overflows. Smaller values move fewer bytes (every message is sent at its full size) and need
  // a smaller workspace; a forward() whose routing exceeds them drops the excess rows and reports it.
  // Resolution 1/1000 (the arithmetic is integer, so every rank computes the same sizes).
  double capacity_factor = 0.0;
};
void validate_ep_capacity(const MoeConfig& cfg, const EpCapacity& capacity);
// capacity_factor in thousandths, as the message sizes use it (0 = worst case).
int64_t ep_capacity_milli(double capacity_factor);

// Rows rank `dst` receives from each peer (and each peer sends to it) in a forward() whose step bound
// is step_tokens (>= 1). Monotone in step_tokens, so buffers sized at max_tokens hold every step.
int64_t ep_rows_per_peer(const MoeConfig& cfg, const EpPartition& part, int dst, int64_t step_tokens,
                         double capacity_factor);

// A dispatch message's metadata, after its bf16 rows: int32 local expert ids [rows] (-1: padding),
// fp32 routing weights [rows], then a header of kEpHeaderInts int32:
//   0 kEpHeaderMagic, 1 rows routed to the receiver (before the capacity cut), 2 the message's row
//   count as the sender computed it, 3 the sender's step_tokens, 4 the sender's status code (nonzero
//   when ANY of its messages of this forward overflowed, so every rank learns of it in the same step),
//   5-7 that overflow's destination, rows and capacity.
inline constexpr int kEpHeaderInts = 8;
inline constexpr int32_t kEpHeaderMagic = 0x45504d31;  // "EPM1"
constexpr int64_t ep_meta_ints(int64_t rows) { return 2 * rows + kEpHeaderInts; }

// Where every message of one forward() lives, for one rank at one step bound. Rows are bf16 [H].
struct EpStepLayout {
  int rank = 0;
  int world = 0;
  int64_t step_tokens = 0;
  std::vector<int64_t> rows_to;           // [world]: rows of the message to rank d (and of its reply)
  int64_t rows_from = 0;                  // rows of the message from each rank (= rows_to[rank])
  std::vector<int64_t> send_row_offset;   // [world]: d's rows in send_rows; -1 for this rank (its rows go
                                          // straight to its own slot of recv_rows: no copy, no NCCL call)
  std::vector<int64_t> send_meta_offset;  // [world]: d's metadata (int32 units) in send_meta; -1 for self
  std::vector<int64_t> ret_row_offset;    // [world]: the reply from d in ret_recv (self included)
  int64_t send_rows = 0;                  // sum of rows_to over the other ranks
  int64_t send_meta_ints = 0;
  int64_t recv_rows = 0;                  // world * rows_from: source s at rows [s * rows_from, ...)
  int64_t recv_meta_ints = 0;             // world * ep_meta_ints(rows_from)
  int64_t ret_rows = 0;                   // sum of rows_to + 1: the last row is all zeros (dropped slots)
  int64_t zero_row = 0;                   // = ret_rows - 1

  // Bytes this rank puts on the wire and receives per forward() (both exchanges, self excluded).
  int64_t bytes_sent(int64_t hidden) const;
  int64_t bytes_received(int64_t hidden) const;
};
EpStepLayout ep_step_layout(const MoeConfig& cfg, const EpPartition& part, int rank, int64_t step_tokens,
                            double capacity_factor);

// Byte offsets of the workspace (256-byte aligned), sized at step_tokens = capacity.max_tokens.
struct EpWorkspaceLayout {
  // this rank's tokens
  size_t topk_ids = 0;          // int32 [max_T, k]
  size_t topk_weights = 0;      // fp32 [max_T, k]
  size_t chunk_counts = 0;      // permutation scratch over all E experts
  size_t expert_offsets = 0;    // int32 [E + 1]: this rank's (token, slot) pairs sorted by expert
  size_t row_of = 0;            // int32 [max_T, k]: position in that order
  size_t row_scale = 0;         // fp32 [max_T, k] (scratch)
  size_t pos_of = 0;            // int32 [max_T, k]: row of the slot's result in ret_recv
  size_t shared_offsets = 0;    // int32 [2] = {0, T}
  size_t send_rows = 0;         // bf16 [send_rows, H]
  size_t send_meta = 0;         // int32 [send_meta_ints]
  size_t ret_recv = 0;          // bf16 [ret_rows, H]: the replies, in this rank's send order
  // rows received from every rank
  size_t recv_rows = 0;         // bf16 [recv_rows, H]
  size_t recv_meta = 0;         // int32 [recv_meta_ints]
  size_t recv_ids = 0;          // int32 [recv_rows]: local expert id or -1
  size_t recv_weights = 0;      // fp32 [recv_rows]
  size_t recv_chunk_counts = 0; // permutation scratch over the local experts
  size_t local_offsets = 0;     // int32 [local experts + 1]
  size_t recv_row_of = 0;       // int32 [recv_rows]: received row -> expert-sorted row
  size_t recv_row_scale = 0;    // fp32 [recv_rows]
  size_t sorted = 0;            // bf16 [recv_rows, H]
  size_t gemm1_out = 0;         // bf16 [recv_rows, I]
  size_t gemm2_out = 0;         // bf16 [recv_rows, H]
  size_t ret_send = 0;          // bf16 [recv_rows, H]: replies in the received order
  size_t shared_gemm1_out = 0;  // bf16 [max_T, Is]
  size_t shared_gemm2_out = 0;  // bf16 [max_T, H]
  size_t total = 0;
  EpStepLayout max_step;        // the step layout at max_tokens, which sizes the message buffers
};
EpWorkspaceLayout ep_workspace_layout(const MoeConfig& cfg, const EpPartition& part, int rank,
                                      const EpCapacity& capacity);

// ---- The dispatch plan (host reference of the device's arithmetic) ----
// A rank's (token, slot) pairs sorted by expert (stable: token, then slot), which groups them by
// destination rank since slices are contiguous; the message to rank d carries d's first rows_to[d]
// pairs in that order. pos_of[t * k + s] is the pair's result row in ret_recv:
// ret_row_offset[d] + its index in d's message, or zero_row when the capacity cut dropped it.
struct EpDispatchPlan {
  std::vector<int64_t> count_to;                 // [world]: pairs routed to rank d (before the cut)
  std::vector<std::vector<int32_t>> entries_to;  // [world]: flat entries t * k + s in message order
  std::vector<int32_t> pos_of;                   // [T * k]
  int overflow_dst = -1;                         // first d with count_to[d] > rows_to[d], or -1
};
EpDispatchPlan ep_dispatch_plan(const MoeConfig& cfg, const EpPartition& part, const EpStepLayout& step,
                                const std::vector<int32_t>& topk_ids);

// ---- Error reports ----
enum class EpStatusCode : int32_t {
  kOk = 0,
  kCapacityOverflow = 1,  // a rank routed more rows to a peer than the message holds
  kStepMismatch = 2,      // a message's size or header disagrees with what this rank expected
};
// As the device writes it into host-mapped memory (plain int32, code written last).
struct EpStatus {
  int32_t code = 0;
  int32_t reporter = -1;     // the rank that saw it
  int32_t src = -1;          // the sending rank
  int32_t dst = -1;          // the receiving rank
  int32_t rows = 0;          // overflow: rows routed; mismatch: the sender's rows per message
  int32_t capacity = 0;      // overflow: rows the message holds; mismatch: rows this rank expected
  int32_t step_tokens = 0;   // the sender's step bound
  int32_t expected_step = 0; // this rank's step bound
};
std::string ep_status_message(const EpStatus& status, double capacity_factor);

// ---- Construction handshake: every rank's view, gathered, must agree ----
struct EpHandshake {
  int32_t magic = 0;
  int32_t rank = 0;
  int32_t world = 0;
  int32_t expert_begin = 0;
  int32_t expert_count = 0;
  int32_t num_experts = 0;
  int32_t top_k = 0;
  int32_t num_shared = 0;
  int32_t router = 0;
  int32_t activation = 0;
  int32_t expert_bias = 0;
  int32_t n_group = 0;
  int32_t topk_group = 0;
  int32_t renormalize = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t max_tokens = 0;
  int64_t capacity_milli = 0;
};
EpHandshake ep_handshake(const MoeConfig& cfg, int rank, int world, int expert_begin, int expert_count,
                         const EpCapacity& capacity);
// Checks that every rank has the same config and capacity, that entry r came from rank r, and that the
// slices are contiguous in rank order and cover [0, E); returns the partition. Throws naming the rank
// and the field that differ.
EpPartition ep_check_handshake(const std::vector<EpHandshake>& all, int my_rank);

// Pointers to experts [begin, begin + count) of weights stacked over all E experts (the routed
// tensors are offset, the router and shared-expert tensors kept): what one rank passes to EpMoeLayer
// when it holds the whole checkpoint's tensors. Pure pointer arithmetic.
MoeLayerWeights ep_slice_weights(const MoeConfig& cfg, const MoeLayerWeights& all, int begin, int count);

}  // namespace fp4moe

// One MoE layer across GPUs, expert parallel (EP): rank r of R holds a contiguous slice of the routed
// experts (and a copy of the shared expert); forward() takes this rank's own tokens, routes them,
// sends each (token, slot) row to the rank holding its expert, runs the local expert GEMMs on what
// arrived, sends the results back and combines them in slot order. The output is bit-identical to
// the single-GPU MoeLayer over the same tokens and weights, when both run the same GEMM tile configs
// (set_tile_configs; the automatic choice depends on the rows each GPU sees): per (token, slot) the
// same GEMM arithmetic, the result rounded to bf16, the same fp32 combine in slot order.
//
// The caller owns NCCL: it creates the communicator (one process per GPU with ncclGetUniqueId and
// ncclCommInitRank, as torchrun/MPI do, or one process driving several GPUs with ncclCommInitAll) and
// passes it in; fp4moe never starts processes or picks GPUs. The constructor is collective: every
// rank constructs its layer at the same time (a handshake checks that configs, capacities and slices
// agree). forward() is collective too: every rank calls it for every layer step, in the same order,
// with the same EpForwardOptions::step_tokens, even with zero tokens of its own.
//
// forward() never synchronizes and allocates nothing, so it can be captured in a CUDA graph (run one
// eager forward first, as NCCL connects peers on first use; the constructor already exchanges once).
// Message sizes are fixed by host values (ep_plan.hpp explains why); rows routed beyond a message's
// capacity are dropped from that forward's output and reported: the next forward() (or check()) on
// every rank throws an fp4moe::Error with the numbers. As the host does not wait for the GPU, which
// later call throws can differ by one between ranks; a rank that throws leaves its peers' pending
// NCCL operations unmatched, so treat the error as fatal for the communicator (ncclCommAbort), or call
// check(stream) at a point where all ranks have synchronized to make every rank throw at the same call.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include <cuda_runtime.h>

#include "fp4moe/config.hpp"
#include "fp4moe/ep_plan.hpp"
#include "fp4moe/ep_transport.hpp"
#include "fp4moe/moe_layer.hpp"

// nccl.h's own declaration (an identical typedef may be repeated); this header does not need nccl.h.
typedef struct ncclComm* ncclComm_t;

namespace fp4moe {

// Stages, in order, for timing (EpForwardOptions::stage_events).
//   kRoute: routing, the permutation over all experts, packing the messages;
//   kDispatch: the first exchange (NCCL);
//   kExperts: unpacking, the local permutation, both expert GEMMs (+ the shared expert), the replies;
//   kReturn: the second exchange (NCCL);
//   kCombine: the combine in slot order.
enum class EpStage : int { kRoute = 0, kDispatch, kExperts, kReturn, kCombine };
inline constexpr int kNumEpStages = 5;

struct EpForwardOptions {
  // An upper bound on EVERY rank's token count in this call, the same value on every rank (it sizes
  // the messages, like NCCL's counts). 0: the layer's max_tokens. Smaller values move fewer bytes at
  // small batches (decode); a CUDA graph captured at a bound replays that bound.
  int64_t step_tokens = 0;
  // null, or kNumEpStages + 1 events recorded before the first stage and after each stage.
  const cudaEvent_t* stage_events = nullptr;
};

// Device pointers into a workspace (tests, tools).
struct EpIntermediates {
  int32_t* topk_ids = nullptr;        // [T, k]
  float* topk_weights = nullptr;      // [T, k]
  int32_t* expert_offsets = nullptr;  // [E + 1]: this rank's pairs per expert (prefix)
  int32_t* pos_of = nullptr;          // [T, k]: row of each slot's result in ret_recv
  int32_t* recv_ids = nullptr;        // [recv_rows]: local expert of each received row, or -1
  int32_t* local_offsets = nullptr;   // [local experts + 1]
  void* ret_recv = nullptr;           // bf16 [ret_rows, H]
};

class EpMoeLayer {
 public:
  // comm: the caller's NCCL communicator for this rank (null only when world_size == 1, which needs
  // no communication); rank / world_size: this rank's place in it (checked against the communicator).
  // local_weights: MoeLayerWeights whose ROUTED expert tensors hold this rank's experts
  // [expert_begin, expert_begin + expert_count) stacked (E -> expert_count in every shape); the router
  // tensors (router_bias [E]) and the shared expert are whole. ep_slice_weights() makes them from
  // tensors of all experts. Router logits are passed to forward(): router_weight must be null.
  // Like MoeLayer's constructor it copies what it needs (the weight buffers may be freed once it
  // returns), and it synchronizes `stream`.
  EpMoeLayer(ncclComm_t comm, int rank, int world_size, const MoeConfig& cfg, const MoeLayerWeights& local_weights,
             int expert_begin, int expert_count, const EpCapacity& capacity, cudaStream_t stream);
  // The same over any transport (tests run several ranks on one GPU through an in-process one).
  EpMoeLayer(std::shared_ptr<EpTransport> transport, const MoeConfig& cfg, const MoeLayerWeights& local_weights,
             int expert_begin, int expert_count, const EpCapacity& capacity, cudaStream_t stream);
  ~EpMoeLayer();
  EpMoeLayer(EpMoeLayer&&) noexcept;
  EpMoeLayer& operator=(EpMoeLayer&&) noexcept;
  EpMoeLayer(const EpMoeLayer&) = delete;
  EpMoeLayer& operator=(const EpMoeLayer&) = delete;

  const MoeConfig& config() const;
  const EpCapacity& capacity() const;
  const EpPartition& partition() const;  // every rank's slice (from the handshake)
  int rank() const;
  int world_size() const;
  size_t workspace_bytes() const;
  EpWorkspaceLayout workspace_layout() const;
  EpStepLayout step_layout(int64_t step_tokens) const;
  EpIntermediates intermediates(void* workspace) const;

  // hidden: bf16 [T, H]; router_logits: fp32 [T, E]; out: bf16 [T, H]; all three may be null when
  // tokens == 0. workspace: workspace_bytes() bytes, 16-byte aligned, one per concurrently running
  // forward (and per layer when layers run concurrently). Never synchronizes; allocates nothing.
  void forward(cudaStream_t stream, const void* hidden, int64_t tokens, const float* router_logits, void* out,
               void* workspace, size_t workspace_size, const EpForwardOptions& options = {}) const;

  // The first problem any forward() so far reported (read from host-mapped memory without waiting for
  // the GPU: forwards still in flight are not included).
  EpStatus status() const;
  // Synchronizes `stream`, then throws fp4moe::Error if any forward() on it reported a problem.
  void check(cudaStream_t stream) const;

  void set_tile_configs(const MoeTileConfigs& tiles);
  // The configs forward() uses for `tokens` tokens on this rank (chosen as for world_size * tokens
  // tokens on one GPU: that is how many rows a balanced routing gives these experts).
  MoeResolvedTileConfigs tile_configs(int64_t tokens) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fp4moe

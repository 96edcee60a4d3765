// How EpMoeLayer moves bytes between ranks. The NCCL transport (ep_nccl.hpp) is the one for real use;
// the interface exists so the layer's dataflow does not depend on NCCL's API (tests drive several
// ranks on one GPU through an in-process transport, and another backend, e.g. MPI or NCCL's device
// API, can be plugged in without touching the layer).
#pragma once
#include <cstddef>

#include <cuda_runtime.h>

namespace fp4moe {

class EpTransport {
 public:
  virtual ~EpTransport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // The CUDA device this rank's transfers run on, or -1 when the transport does not bind one.
  virtual int device() const { return -1; }

  // Construction only (may synchronize): every rank contributes `bytes` host bytes from `mine`; `all`
  // (host, world_size() * bytes) receives them in rank order.
  virtual void allgather(const void* mine, void* all, size_t bytes, cudaStream_t stream) = 0;

  // One exchange. The sends and receives posted between begin_exchange() and end_exchange() progress
  // together (ncclGroupStart/End); the n-th receive from a peer matches that peer's n-th send to this
  // rank and must have the same byte count. Asynchronous on `stream`; capturable in a CUDA graph.
  // A rank never sends to itself (the layer copies its own rows in place).
  virtual void begin_exchange() = 0;
  virtual void send(const void* buf, size_t bytes, int peer, cudaStream_t stream) = 0;
  virtual void recv(void* buf, size_t bytes, int peer, cudaStream_t stream) = 0;
  virtual void end_exchange(cudaStream_t stream) = 0;

  // Throws if the transport failed asynchronously (e.g. ncclCommGetAsyncError); called once per forward.
  virtual void check_health() {}
};

}  // namespace fp4moe

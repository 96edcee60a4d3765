// NCCL for the expert-parallel layer. fp4moe does not link libnccl: it resolves NCCL's functions at
// run time, the first time one is needed, from
//   1. the library named by $FP4MOE_NCCL_LIBRARY, if set;
//   2. the NCCL already in the process (the one that created the caller's communicator, e.g. the
//      application's own link or PyTorch's), found by its symbols or its soname libnccl.so.2;
//   3. libnccl.so.2 through the dynamic loader's search (LD_LIBRARY_PATH, the executable's run path,
//      ldconfig), then /usr/local/cuda/lib64.
// So everything else in fp4moe loads and runs on a machine without NCCL, and the communicator the
// caller passes is always driven by the NCCL that made it. This header needs no nccl.h.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "fp4moe/ep_transport.hpp"

// nccl.h's own declaration (an identical typedef may be repeated).
typedef struct ncclComm* ncclComm_t;

namespace fp4moe {

// True when NCCL's functions could be resolved; otherwise `why` (if given) says what was tried.
// Never throws.
bool nccl_available(std::string* why = nullptr);
// The loaded NCCL's version code (e.g. 22809 for 2.28.9). Throws when NCCL is unavailable.
int nccl_version();

// Sets NCCL_NVLS_ENABLE=0 unless the variable is already set: NVLink SHARP (multicast) stays off.
// Call before creating communicators (the command-line tool and the tests do).
void nccl_default_environment();

// Caller-side setup for ONE process driving several GPUs (the benchmark, the tests): one communicator
// per device, ncclCommInitAll. Multi-process jobs create theirs with ncclGetUniqueId/ncclCommInitRank
// (README). nccl_comm_destroy never throws.
std::vector<ncclComm_t> nccl_comm_init_all(const std::vector<int>& devices);
void nccl_comm_destroy(ncclComm_t comm);

// The transport over a caller-owned communicator (not owned: destroy it after the layers using it).
std::shared_ptr<EpTransport> make_nccl_transport(ncclComm_t comm);

}  // namespace fp4moe

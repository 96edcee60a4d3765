// NCCL, resolved at run time (ep_nccl.hpp says from where and why), and the EpTransport over it.
#include "fp4moe/ep_nccl.hpp"

#include <cstdlib>
#include <mutex>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/error.hpp"

#if FP4MOE_HAVE_NCCL
#include <dlfcn.h>
#include <nccl.h>
#endif

namespace fp4moe {

void nccl_default_environment() { setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); }

#if FP4MOE_HAVE_NCCL

namespace {

// Send/receive inside groups and their graph capture have been stable since 2.12; CUDA 13's is 2.28.
constexpr int kMinNcclVersion = 21800;

struct NcclApi {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetErrorString) get_error_string = nullptr;
  decltype(&ncclGetLastError) get_last_error = nullptr;  // optional
  decltype(&ncclCommInitAll) comm_init_all = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommCount) comm_count = nullptr;
  decltype(&ncclCommUserRank) comm_user_rank = nullptr;
  decltype(&ncclCommCuDevice) comm_cu_device = nullptr;
  decltype(&ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  int version = 0;
  std::string where;  // where it was found
  std::string error;  // non-empty: unavailable, and why
};

// Resolves every function from `handle` (RTLD_DEFAULT: the process's global scope). Returns the name
// of the first missing required symbol, or "".
std::string resolve(void* handle, NcclApi& a) {
  auto get = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, name));
    return fn != nullptr;
  };
  if (!get(a.get_version, "ncclGetVersion")) return "ncclGetVersion";
  if (!get(a.get_error_string, "ncclGetErrorString")) return "ncclGetErrorString";
  get(a.get_last_error, "ncclGetLastError");
  if (!get(a.comm_init_all, "ncclCommInitAll")) return "ncclCommInitAll";
  if (!get(a.comm_destroy, "ncclCommDestroy")) return "ncclCommDestroy";
  if (!get(a.comm_count, "ncclCommCount")) return "ncclCommCount";
  if (!get(a.comm_user_rank, "ncclCommUserRank")) return "ncclCommUserRank";
  if (!get(a.comm_cu_device, "ncclCommCuDevice")) return "ncclCommCuDevice";
  if (!get(a.comm_get_async_error, "ncclCommGetAsyncError")) return "ncclCommGetAsyncError";
  if (!get(a.all_gather, "ncclAllGather")) return "ncclAllGather";
  if (!get(a.send, "ncclSend")) return "ncclSend";
  if (!get(a.recv, "ncclRecv")) return "ncclRecv";
  if (!get(a.group_start, "ncclGroupStart")) return "ncclGroupStart";
  if (!get(a.group_end, "ncclGroupEnd")) return "ncclGroupEnd";
  return "";
}

bool finish(NcclApi& a, void* handle, const std::string& where) {
  const std::string missing = resolve(handle, a);
  if (!missing.empty()) {
    a.error = fmt::format("{} has no symbol {}", where, missing);
    return false;
  }
  if (a.get_version(&a.version) != ncclSuccess) a.version = 0;
  if (a.version < kMinNcclVersion) {
    a.error = fmt::format("{} is NCCL version code {}; fp4moe needs >= {}", where, a.version, kMinNcclVersion);
    return false;
  }
  a.where = where;
  a.error.clear();
  return true;
}

NcclApi load() {
  NcclApi a;
  if (const char* path = std::getenv("FP4MOE_NCCL_LIBRARY"); path != nullptr && *path != '\0') {
    // An explicit choice is never second-guessed by a fallback.
    void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* err = dlerror();
      a.error = fmt::format("FP4MOE_NCCL_LIBRARY = {}: cannot load it ({})", path, err ? err : "unknown");
      return a;
    }
    finish(a, h, fmt::format("FP4MOE_NCCL_LIBRARY = {}", path));
    return a;
  }
  // The NCCL already in the process drives the caller's communicator: use it before loading any other.
  if (dlsym(RTLD_DEFAULT, "ncclSend") != nullptr && finish(a, RTLD_DEFAULT, "the process's NCCL")) return a;
  if (void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD); h != nullptr)
    if (finish(a, h, "the loaded libnccl.so.2")) return a;
  std::string tried;
  for (const char* name : {"libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"}) {
    void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* err = dlerror();
      tried += fmt::format("{}{} ({})", tried.empty() ? "" : "; ", name, err ? err : "not found");
      continue;
    }
    if (finish(a, h, name)) return a;
    tried += fmt::format("{}{}", tried.empty() ? "" : "; ", a.error);
  }
  a.error = fmt::format(
      "NCCL not found: tried {}. Put libnccl.so.2 on LD_LIBRARY_PATH or set FP4MOE_NCCL_LIBRARY to its path "
      "(e.g. the nvidia-nccl-cu13 Python package's nvidia/nccl/lib/libnccl.so.2)", tried);
  return a;
}

const NcclApi& api() {
  static const NcclApi a = load();
  return a;
}

const NcclApi& api_or_throw() {
  const NcclApi& a = api();
  if (!a.error.empty()) FP4MOE_FAIL("expert parallel needs NCCL: {}", a.error);
  return a;
}

void nccl_check(ncclResult_t r, const char* call, ncclComm_t comm, const char* file, int line) {
  if (r == ncclSuccess) return;
  const NcclApi& a = api();
  const char* last = (a.get_last_error != nullptr) ? a.get_last_error(comm) : nullptr;
  throw_error(file, line,
              fmt::format("NCCL call `{}` failed: {}{}{}", call, a.get_error_string(r),
                          (last != nullptr && *last != '\0') ? ": " : "", last != nullptr ? last : ""));
}
#define FP4MOE_NCCL_CHECK(comm, call) nccl_check((call), #call, (comm), __FILE__, __LINE__)

class NcclTransport final : public EpTransport {
 public:
  explicit NcclTransport(ncclComm_t comm) : a_(api_or_throw()), comm_(comm) {
    FP4MOE_REQUIRE(comm != nullptr, "make_nccl_transport: comm is null");
    FP4MOE_NCCL_CHECK(comm_, a_.comm_count(comm_, &world_));
    FP4MOE_NCCL_CHECK(comm_, a_.comm_user_rank(comm_, &rank_));
    FP4MOE_NCCL_CHECK(comm_, a_.comm_cu_device(comm_, &device_));
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int device() const override { return device_; }

  void allgather(const void* mine, void* all, size_t bytes, cudaStream_t stream) override {
    DeviceBuffer<uint8_t> buf(bytes * (world_ + 1));
    uint8_t* send = buf.get() + bytes * world_;  // apart from the receive region: not in place
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(send, mine, bytes, cudaMemcpyHostToDevice, stream));
    FP4MOE_NCCL_CHECK(comm_, a_.all_gather(send, buf.get(), bytes, ncclInt8, comm_, stream));
    FP4MOE_CUDA_CHECK(cudaMemcpyAsync(all, buf.get(), bytes * world_, cudaMemcpyDeviceToHost, stream));
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  void begin_exchange() override { FP4MOE_NCCL_CHECK(comm_, a_.group_start()); }
  void send(const void* buf, size_t bytes, int peer, cudaStream_t stream) override {
    FP4MOE_NCCL_CHECK(comm_, a_.send(buf, bytes, ncclInt8, peer, comm_, stream));
  }
  void recv(void* buf, size_t bytes, int peer, cudaStream_t stream) override {
    FP4MOE_NCCL_CHECK(comm_, a_.recv(buf, bytes, ncclInt8, peer, comm_, stream));
  }
  void end_exchange(cudaStream_t) override { FP4MOE_NCCL_CHECK(comm_, a_.group_end()); }
  void check_health() override {
    ncclResult_t r = ncclSuccess;
    FP4MOE_NCCL_CHECK(comm_, a_.comm_get_async_error(comm_, &r));
    if (r != ncclSuccess && r != ncclInProgress)
      FP4MOE_FAIL("the NCCL communicator failed asynchronously ({}); abort it (ncclCommAbort) and rebuild",
                  a_.get_error_string(r));
  }

 private:
  const NcclApi& a_;
  ncclComm_t comm_ = nullptr;
  int rank_ = 0, world_ = 0, device_ = -1;
};

}  // namespace

bool nccl_available(std::string* why) {
  const NcclApi& a = api();
  if (why != nullptr) *why = a.error.empty() ? a.where : a.error;
  return a.error.empty();
}

int nccl_version() { return api_or_throw().version; }

std::vector<ncclComm_t> nccl_comm_init_all(const std::vector<int>& devices) {
  const NcclApi& a = api_or_throw();
  FP4MOE_REQUIRE(!devices.empty(), "nccl_comm_init_all: no devices given");
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  FP4MOE_NCCL_CHECK(nullptr, a.comm_init_all(comms.data(), static_cast<int>(devices.size()), devices.data()));
  return comms;
}

void nccl_comm_destroy(ncclComm_t comm) {
  if (comm == nullptr) return;
  const NcclApi& a = api();
  if (a.error.empty()) a.comm_destroy(comm);
}

std::shared_ptr<EpTransport> make_nccl_transport(ncclComm_t comm) { return std::make_shared<NcclTransport>(comm); }

#else  // built without NCCL (FP4MOE_WITH_NCCL=OFF or nccl.h not found)

namespace {
constexpr const char* kNoNccl = "fp4moe was built without NCCL (FP4MOE_WITH_NCCL=OFF, or nccl.h was not found)";
}

bool nccl_available(std::string* why) {
  if (why != nullptr) *why = kNoNccl;
  return false;
}
int nccl_version() { FP4MOE_FAIL("{}", kNoNccl); }
std::vector<ncclComm_t> nccl_comm_init_all(const std::vector<int>&) { FP4MOE_FAIL("{}", kNoNccl); }
void nccl_comm_destroy(ncclComm_t) {}
std::shared_ptr<EpTransport> make_nccl_transport(ncclComm_t) { FP4MOE_FAIL("{}", kNoNccl); }

#endif

}  // namespace fp4moe

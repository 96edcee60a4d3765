#include "kernel_timeline.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cxxabi.h>
#include <mutex>
#include <type_traits>

#if __has_include(<cupti.h>)
#include <cupti.h>
#define FP4MOE_HAVE_CUPTI 1
#else
#define FP4MOE_HAVE_CUPTI 0
#endif

#include "bench_common.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"

#if !FP4MOE_HAVE_CUPTI
namespace fp4moe::bench {
std::vector<KernelSpan> graph_kernel_timeline(const std::function<void(cudaStream_t)>&, cudaStream_t, int) {
  FP4MOE_REQUIRE(false, "--timeline: this build found no CUPTI header (cupti.h of the CUDA toolkit)");
  return {};
}
void print_kernel_timeline(const std::vector<KernelSpan>&, double) {}
}  // namespace fp4moe::bench
#else
namespace fp4moe::bench {
namespace {

// The five CUPTI entry points the timeline uses, resolved with dlopen so that the tool runs where
// libcupti is absent (only --timeline needs it).
struct Cupti {
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
};

const Cupti& cupti() {
  static const Cupti api = [] {
    const char* names[] = {"libcupti.so.13", "libcupti.so", "/usr/local/cuda/lib64/libcupti.so",
                           "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so", "/usr/local/cuda/lib/libcupti.so"};
    void* h = nullptr;
    for (const char* n : names)
      if ((h = dlopen(n, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    FP4MOE_REQUIRE(h != nullptr,
                   "--timeline needs CUPTI (libcupti.so.13 of the CUDA toolkit) and it could not be loaded; add its "
                   "directory to LD_LIBRARY_PATH");
    Cupti c;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      FP4MOE_REQUIRE(fn != nullptr, "--timeline: the loaded CUPTI has no {}", name);
    };
    sym(c.register_callbacks, "cuptiActivityRegisterCallbacks");
    sym(c.enable, "cuptiActivityEnable");
    sym(c.disable, "cuptiActivityDisable");
    sym(c.flush_all, "cuptiActivityFlushAll");
    sym(c.next_record, "cuptiActivityGetNextRecord");
    return c;
  }();
  return api;
}

void check(CUptiResult r, const char* what) { FP4MOE_REQUIRE(r == CUPTI_SUCCESS, "--timeline: {} failed (CUPTI error {})", what, static_cast<int>(r)); }

struct RawSpan {
  std::string name;
  uint64_t start, end;
  int grid, block;
};
std::mutex g_mu;
std::vector<RawSpan> g_spans;

constexpr size_t kBufferBytes = size_t{8} << 20;
void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}
void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  while (cupti().next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    g_spans.push_back({k->name != nullptr ? k->name : "?", k->start, k->end, k->gridX * k->gridY * k->gridZ,
                       k->blockX * k->blockY * k->blockZ});
  }
  std::free(buffer);
}

// "void fp4moe::kernels::foo<8, 12>(fp4moe::kernels::Params)" -> "foo<8, 12>"
std::string short_name(const std::string& mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status);
  std::string s = status == 0 && d != nullptr ? d : mangled;
  std::free(d);
  // drop the parameter list: the last '(' at template depth 0
  int depth = 0;
  size_t cut = std::string::npos;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    else if (s[i] == '>') --depth;
    else if (s[i] == '(' && depth == 0) { cut = i; break; }
  }
  if (cut != std::string::npos) s = s.substr(0, cut);
  if (s.rfind("void ", 0) == 0) s = s.substr(5);
  // drop namespaces outside the template arguments
  depth = 0;
  size_t last = std::string::npos;
  for (size_t i = 0; i + 1 < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    else if (s[i] == '>') --depth;
    else if (depth == 0 && s[i] == ':' && s[i + 1] == ':') last = i + 2;
  }
  return last != std::string::npos ? s.substr(last) : s;
}

}  // namespace

std::vector<KernelSpan> graph_kernel_timeline(const std::function<void(cudaStream_t)>& record, cudaStream_t stream,
                                              int replays) {
  const Cupti& c = cupti();
  static const bool registered = [&] {
    check(c.register_callbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    return true;
  }();
  (void)registered;
  const CapturedGraph graph(record, stream);
  std::vector<std::vector<RawSpan>> runs;
  for (int r = 0; r < replays + 1; ++r) {  // the first replay warms up (code, CUPTI's own first-use costs)
    flush_l2(stream);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    check(c.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
    graph.launch(stream);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    check(c.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityDisable");
    check(c.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
    std::lock_guard<std::mutex> lock(g_mu);
    if (r > 0) runs.push_back(g_spans);
    g_spans.clear();
  }
  // Per kernel position (start order), the median over the replays of its start and end from the
  // replay's first start.
  std::vector<KernelSpan> out;
  size_t n = runs.empty() ? 0 : runs[0].size();
  for (auto& run : runs) {
    std::sort(run.begin(), run.end(), [](const RawSpan& a, const RawSpan& b) { return a.start < b.start; });
    n = std::min(n, run.size());
  }
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> st, en;
    for (const auto& run : runs) {
      st.push_back(static_cast<double>(run[i].start - run[0].start) * 1e-3);
      en.push_back(static_cast<double>(run[i].end - run[0].start) * 1e-3);
    }
    out.push_back({short_name(runs[0][i].name), median(st), median(en), runs[0][i].grid, runs[0][i].block});
  }
  return out;
}

void print_kernel_timeline(const std::vector<KernelSpan>& spans, double graph_us) {
  std::printf("    kernels of one replay (CUPTI, GPU clock; median of the replays; us from the first kernel's start; "
              "the bench's time %.1f us also counts the launch before the first kernel)\n", graph_us);
  std::printf("    %-52s %12s %8s %8s %8s %10s\n", "kernel", "grid x block", "start", "end", "length",
              "gap before");
  double prev_end = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const KernelSpan& s = spans[i];
    const std::string gb = std::to_string(s.grid) + " x " + std::to_string(s.block);
    std::printf("    %-52.52s %12s %8.1f %8.1f %8.1f %10.1f\n", s.name.c_str(), gb.c_str(), s.start_us, s.end_us,
                s.end_us - s.start_us, i == 0 ? 0.0 : s.start_us - prev_end);
    prev_end = std::max(prev_end, s.end_us);
  }
  if (!spans.empty()) std::printf("    %-52s %12s %8s %8.1f\n", "first start -> last end", "", "", prev_end);
}

}  // namespace fp4moe::bench
#endif  // FP4MOE_HAVE_CUPTI

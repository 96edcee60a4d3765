// Development probe (not part of the library or the CLI): what does a kernel's first pass over its own
// code and constants cost at launch? The stream kernel's prologue takes 5-9 us from entry to its first
// MMA for a few thousand instructions (bench/NOTES.md, issue 8); data latency was ruled out, code and
// constant-cache misses were not measured directly. This probe measures them.
//
// code   : every CTA (one per SM, `warps` warps) runs a block of N straight-line IMADs (16 B each, 4
//          independent chains) twice; thread 0 stamps %globaltimer at entry and after each pass. Pass 1
//          fetches the code into the SM's instruction caches, pass 2 runs it warm. Launched after an L2
//          flush ("cold"), and again right after without one ("again": does the code stay cached across
//          launches?).
// const  : the same with L reads of a __constant__ table, one per 128-byte line, each read's address
//          depending on the previous read's value (the worst case: misses in series), then independent
//          (misses overlapping).
//
//   fp4moe_probe_cold_start [--warps N]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "probe_check.hpp"

namespace {

constexpr int kConstWords = 8192;  // 32 KB: 256 lines of 128 B
__constant__ uint32_t g_table[kConstWords];

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// stamps: per CTA [entry, after pass 1, after pass 2]
template <int N>
__global__ void code_kernel(uint32_t m, uint32_t* sink, unsigned long long* stamps) {
  const unsigned long long t0 = now_ns();
  unsigned long long t[2];
  uint32_t x[4] = {threadIdx.x, threadIdx.x + 1, threadIdx.x + 2, threadIdx.x + 3};
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i & 3] = x[i & 3] * m + static_cast<uint32_t>(i) * 0x9E3779B9u;
    // A use of every chain before the stamp, so the pass's instructions cannot sink below it.
    asm volatile("" ::"r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]));
    t[pass] = now_ns();
  }
  if (threadIdx.x == 0) {
    stamps[blockIdx.x * 3 + 0] = t0;
    stamps[blockIdx.x * 3 + 1] = t[0];
    stamps[blockIdx.x * 3 + 2] = t[1];
  }
  if ((x[0] ^ x[1] ^ x[2] ^ x[3]) == 0x12345u) sink[threadIdx.x] = 1;  // keeps the chains alive
}

// L reads, one per 128-byte line of the table; `serial`: each address depends on the last value read.
template <int L, bool SERIAL>
__global__ void const_kernel(uint32_t zero, uint32_t* sink, unsigned long long* stamps) {
  const unsigned long long t0 = now_ns();
  unsigned long long t[2];
  uint32_t acc = 0;
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int i = 0; i < L; ++i) {
      const uint32_t idx = static_cast<uint32_t>(i) * 32u + (SERIAL ? (acc & zero) : 0u);
      uint32_t v;
      asm volatile("ld.const.u32 %0, [%1];" : "=r"(v) : "l"(g_table + idx));
      acc += v;
    }
    asm volatile("" ::"r"(acc));
    t[pass] = now_ns();
  }
  if (threadIdx.x == 0) {
    stamps[blockIdx.x * 3 + 0] = t0;
    stamps[blockIdx.x * 3 + 1] = t[0];
    stamps[blockIdx.x * 3 + 2] = t[1];
  }
  if (acc == 0x12345u) sink[threadIdx.x] = 1;
}

struct Flusher {
  void* buf = nullptr;
  size_t bytes = 0;
  Flusher() {
    int dev = 0, l2 = 0;
    PROBE_CHECK(cudaGetDevice(&dev));
    PROBE_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    bytes = static_cast<size_t>(l2) * 4;
    PROBE_CHECK(cudaMalloc(&buf, bytes));
  }
  ~Flusher() { cudaFree(buf); }
  void flush() { PROBE_CHECK(cudaMemset(buf, 0x5a, bytes)); }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Runs launch() `reps` times as cold / again pairs; prints the medians over CTAs and reps of pass 1 and
// pass 2 (us) and of the per-unit cost of pass 1 minus pass 2.
template <typename Launch>
void measure(const char* name, int units, const char* unit, int grid, unsigned long long* d_stamps, Flusher& fl,
             Launch launch) {
  std::vector<unsigned long long> h(static_cast<size_t>(grid) * 3);
  for (int variant = 0; variant < 2; ++variant) {
    std::vector<double> p1, p2;
    for (int rep = 0; rep < 7; ++rep) {
      fl.flush();
      launch();
      if (variant == 1) launch();  // "again": the measured launch follows an identical one
      PROBE_CHECK(cudaDeviceSynchronize());
      PROBE_CHECK(cudaMemcpy(h.data(), d_stamps, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
      for (int b = 0; b < grid; ++b) {
        p1.push_back((h[b * 3 + 1] - h[b * 3 + 0]) * 1e-3);
        p2.push_back((h[b * 3 + 2] - h[b * 3 + 1]) * 1e-3);
      }
    }
    const double a = median(p1), b = median(p2);
    std::printf("%-22s %-5s %6d %-6s pass1 %7.3f us  pass2 %7.3f us  cold cost %6.1f ns per %s\n", name,
                variant == 0 ? "cold" : "again", units, unit, a, b, (a - b) * 1e3 / units, unit);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int warps = 12;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--warps") && i + 1 < argc) warps = std::atoi(argv[++i]);
  }
  int dev = 0, sms = 0;
  PROBE_CHECK(cudaGetDevice(&dev));
  PROBE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop{};
  PROBE_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("GPU: %s, %d SMs; one CTA of %d warps per SM; medians over CTAs and 7 launches\n", prop.name, sms,
              warps);
  std::vector<uint32_t> table(kConstWords);
  for (int i = 0; i < kConstWords; ++i) table[i] = static_cast<uint32_t>(i * 2654435761u);
  PROBE_CHECK(cudaMemcpyToSymbol(g_table, table.data(), sizeof(uint32_t) * kConstWords));
  uint32_t* sink = nullptr;
  unsigned long long* stamps = nullptr;
  PROBE_CHECK(cudaMalloc(&sink, 4096));
  PROBE_CHECK(cudaMalloc(&stamps, static_cast<size_t>(sms) * 2 * 3 * sizeof(unsigned long long)));
  Flusher fl;
  const int threads = warps * 32;
  auto code = [&](auto kernel, int n) {
    measure("code (16 B / op)", n, "op", sms, stamps, fl, [&] {
      kernel<<<sms, threads>>>(3u, sink, stamps);
      PROBE_CHECK(cudaGetLastError());
    });
  };
  code(code_kernel<128>, 128);
  code(code_kernel<512>, 512);
  code(code_kernel<1024>, 1024);
  code(code_kernel<4096>, 4096);
  auto cst = [&](auto kernel, const char* name, int lines) {
    measure(name, lines, "line", sms, stamps, fl, [&] {
      kernel<<<sms, threads>>>(0u, sink, stamps);
      PROBE_CHECK(cudaGetLastError());
    });
  };
  cst(const_kernel<16, true>, "const serial", 16);
  cst(const_kernel<64, true>, "const serial", 64);
  cst(const_kernel<16, false>, "const independent", 16);
  cst(const_kernel<64, false>, "const independent", 64);
  PROBE_CHECK(cudaFree(sink));
  PROBE_CHECK(cudaFree(stamps));
  return 0;
}

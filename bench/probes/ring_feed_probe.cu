// Development probe (not part of the library or the CLI): how fast can one warp's private weight stream
// be fed, by each of the ways the stream kernel could feed it? Answers, on the GPU at hand, the question
// bench/NOTES.md leaves open after v11: is a shared-memory ring filled by per-warp bulk copies (TMA,
// one lane issues, mbarrier completion) cheap enough in instructions and fast enough in copies per second
// to beat the register ring?
//
// Each warp streams its own contiguous range of "chunks" exactly like the stream kernel: per chunk 512 B
// of codes (16 B per lane) and 64 B of scales (8 B per row pair), from two separate arrays. Per chunk the
// warp then does `work` dependent-free integer operations per lane on the loaded words (the kernel's
// dequantization and mma issue ~75 instructions per chunk), so the probe sees the same issue pressure.
//   ldg   : register ring of DEPTH chunks (ld.global.nc, refilled after each use), as the kernel today
//   bulk  : shared-memory ring of DEPTH stages of S chunks per warp; lane 0 issues one bulk copy of the
//           stage's codes and one of its scales onto the stage's mbarrier (expect_tx); all lanes wait on
//           the barrier's phase, read the chunk with ld.shared (16 B + 8 B), and __syncwarp before lane 0
//           refills the stage
// Output: one line per configuration with the bandwidth and its ratio to a plain 16-byte streaming-read
// kernel over the same bytes measured in the same run.
//
//   fp4moe_probe_ring_feed [--mib N] [--reps N]      (sweeps warps, ring depth, chunks per stage, work)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "fp4moe/kernels/sm80_nvfp4_grouped_stream.cuh"  // the kernel's own streaming loads and smem_u32
#include "probe_check.hpp"

namespace {

constexpr int kCodeBytes = 512;  // per chunk and warp
constexpr int kScaleBytes = 64;

using fp4moe::kernels::smem_u32;

// `work` independent LOP3-class operations folded into acc (the compiler cannot drop them: acc is stored).
__device__ __forceinline__ uint32_t fake_work(uint4 c, uint2 s, int work) {
  uint32_t a = c.x ^ s.x, b = c.y ^ s.y, d = c.z, e = c.w;
  for (int i = 0; i < work; i += 4) {
    a = (a << 3) ^ (b & 0x1c001c0u);
    b = (b >> 5) | (d & 0x81c081c0u);
    d = (d << 1) ^ (e & 0x80008000u);
    e = (e >> 2) + a;
  }
  return a ^ b ^ d ^ e;
}

__global__ void read_ceiling_kernel(const uint4* __restrict__ p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// The stream kernel's loads (ld.global.nc.L1::no_allocate), so the register ring here is the kernel's.
__device__ __forceinline__ uint4 ldg_nc_v4(const uint8_t* p) { return fp4moe::kernels::ldg_stream_v4(p); }
__device__ __forceinline__ uint2 ldg_nc_v2(const uint8_t* p) { return fp4moe::kernels::ldg_stream_v2(p); }

// Register ring: the kernel's scheme (slot d refilled right after use, DEPTH chunks ahead).
template <int DEPTH>
__global__ void ldg_ring_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                int64_t chunks_per_warp, int work, uint32_t* sink) {
  const int lane = threadIdx.x & 31;
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const uint8_t* lc = codes + gw * chunks_per_warp * kCodeBytes + lane * 16;
  const uint8_t* ls = scales + gw * chunks_per_warp * kScaleBytes + (lane >> 2) * 8;
  uint4 rc[DEPTH];
  uint2 rs[DEPTH];
  int64_t q = 0;
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    rc[d] = ldg_nc_v4(lc + q * kCodeBytes);
    rs[d] = ldg_nc_v2(ls + q * kScaleBytes);
    ++q;
  }
  uint32_t acc = 0;
  const int64_t turns = chunks_per_warp / DEPTH;
  for (int64_t t = 0; t < turns; ++t) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      acc += fake_work(rc[d], rs[d], work);
      if (q < chunks_per_warp) {
        rc[d] = ldg_nc_v4(lc + q * kCodeBytes);
        rs[d] = ldg_nc_v2(ls + q * kScaleBytes);
      }
      ++q;
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
      "@!P bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Shared-memory ring fed by bulk copies: per warp DEPTH stages of S chunks (codes S*512 B, then scales
// S*64 B) and DEPTH mbarriers.
template <int DEPTH, int S>
__global__ void bulk_ring_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                 int64_t chunks_per_warp, int work, uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int kStage = S * (kCodeBytes + kScaleBytes);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const uint8_t* wc = codes + gw * chunks_per_warp * kCodeBytes;
  const uint8_t* ws = scales + gw * chunks_per_warp * kScaleBytes;
  const int nwarps = blockDim.x >> 5;
  uint8_t* ring = smem + nwarps * DEPTH * 8 + warp * DEPTH * kStage;  // barriers first
  const uint32_t bars = smem_u32(smem) + warp * DEPTH * 8;
  if (lane == 0) {
    for (int d = 0; d < DEPTH; ++d) mbar_init(bars + d * 8, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncwarp();
  const int64_t stages_total = chunks_per_warp / S;
  auto fill = [&](int d, int64_t stage) {
    if (lane == 0 && stage < stages_total) {
      const uint32_t bar = bars + d * 8;
      const uint32_t dst = smem_u32(ring + d * kStage);
      mbar_arrive_expect_tx(bar, kStage);
      bulk_copy(dst, wc + stage * S * kCodeBytes, S * kCodeBytes, bar);
      bulk_copy(dst + S * kCodeBytes, ws + stage * S * kScaleBytes, S * kScaleBytes, bar);
    }
  };
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) fill(d, d);
  uint32_t acc = 0, phase = 0;  // bit d: parity of stage slot d's next completion
  for (int64_t st = 0; st < stages_total; st += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      if (st + d >= stages_total) break;
      mbar_wait(bars + d * 8, (phase >> d) & 1u);
      phase ^= 1u << d;
      const uint32_t base = smem_u32(ring + d * kStage);
#pragma unroll
      for (int c = 0; c < S; ++c) {
        uint4 w;
        uint2 s;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                     : "r"(base + c * kCodeBytes + lane * 16));
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                     : "=r"(s.x), "=r"(s.y)
                     : "r"(base + S * kCodeBytes + c * kScaleBytes + (lane >> 2) * 8));
        acc += fake_work(w, s, work);
      }
      __syncwarp();  // every lane has read the stage before lane 0 refills it
      fill(d, st + d + DEPTH);
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

struct Sweep {
  const char* mode;
  int warps, ctas, depth, s, work;
};

}  // namespace

int main(int argc, char** argv) {
  int64_t mib = 2048;
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--mib") && i + 1 < argc) mib = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--mib N] [--reps N]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop{};
  PROBE_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const size_t code_bytes = static_cast<size_t>(mib) << 20, scale_bytes = code_bytes / 8;
  uint8_t *codes = nullptr, *scales = nullptr;
  uint32_t* sink = nullptr;
  PROBE_CHECK(cudaMalloc(&codes, code_bytes));
  PROBE_CHECK(cudaMalloc(&scales, scale_bytes));
  PROBE_CHECK(cudaMalloc(&sink, 4));
  PROBE_CHECK(cudaMemset(codes, 0x5a, code_bytes));
  PROBE_CHECK(cudaMemset(scales, 0x21, scale_bytes));
  cudaEvent_t e0, e1;
  PROBE_CHECK(cudaEventCreate(&e0));
  PROBE_CHECK(cudaEventCreate(&e1));
  auto time_us = [&](auto&& launch) {
    launch();
    PROBE_CHECK(cudaGetLastError());
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
      PROBE_CHECK(cudaEventRecord(e0));
      launch();
      PROBE_CHECK(cudaEventRecord(e1));
      PROBE_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      PROBE_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1000.0f);
    }
    std::sort(t.begin(), t.end());
    return static_cast<double>(t[t.size() / 2]);
  };
  const double ceil_us = time_us([&] {
    read_ceiling_kernel<<<sms * 8, 1024>>>(reinterpret_cast<const uint4*>(codes), code_bytes / 16, sink);
  });
  const double ceil_tbps = static_cast<double>(code_bytes) / (ceil_us * 1e-6) / 1e12;
  std::printf("GPU %s, %d SMs; read ceiling (16 B loads over %lld MiB) %.2f TB/s\n", prop.name, sms,
              static_cast<long long>(mib), ceil_tbps);
  std::printf("%-5s %5s %4s %5s %2s %4s %10s %8s %7s\n", "mode", "warps", "ctas", "depth", "S", "work", "us", "TB/s",
              "xread");

  const std::vector<Sweep> sweeps = {
      {"ldg", 24, 1, 4, 1, 0},   {"ldg", 24, 1, 5, 1, 0},   {"ldg", 24, 1, 5, 1, 40},  {"ldg", 24, 1, 4, 1, 40},
      {"bulk", 24, 1, 4, 1, 0},  {"bulk", 24, 1, 8, 1, 0},  {"bulk", 24, 1, 8, 1, 40}, {"bulk", 24, 1, 4, 2, 40},
      {"bulk", 24, 1, 6, 2, 40}, {"bulk", 24, 1, 4, 4, 40}, {"bulk", 32, 1, 6, 2, 40}, {"bulk", 32, 1, 4, 4, 40},
      {"bulk", 16, 1, 8, 2, 40}, {"bulk", 24, 1, 2, 4, 40}, {"bulk", 24, 1, 3, 4, 40},
  };
  for (const Sweep& w : sweeps) {
    const int threads = w.warps * 32;
    const int blocks = sms * w.ctas;
    const int64_t warps_total = static_cast<int64_t>(blocks) * w.warps;
    int64_t cpw = static_cast<int64_t>(code_bytes / kCodeBytes) / warps_total;
    cpw -= cpw % (w.depth * w.s);
    if (cpw <= 0) continue;
    const double bytes = static_cast<double>(cpw) * warps_total * (kCodeBytes + kScaleBytes);
    double us = 0;
    bool ok = true;
    if (!std::strcmp(w.mode, "ldg")) {
      auto run = [&](auto kern) { us = time_us([&] { kern<<<blocks, threads>>>(codes, scales, cpw, w.work, sink); }); };
      if (w.depth == 4) run(ldg_ring_kernel<4>);
      else if (w.depth == 5) run(ldg_ring_kernel<5>);
      else ok = false;
    } else {
      const size_t smem = static_cast<size_t>(w.warps) * w.depth * (8 + w.s * (kCodeBytes + kScaleBytes));
      auto run = [&](auto kern) {
        PROBE_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
        us = time_us([&] { kern<<<blocks, threads, smem>>>(codes, scales, cpw, w.work, sink); });
      };
      const int key = w.depth * 10 + w.s;
      switch (key) {
        case 41: run(bulk_ring_kernel<4, 1>); break;
        case 81: run(bulk_ring_kernel<8, 1>); break;
        case 42: run(bulk_ring_kernel<4, 2>); break;
        case 62: run(bulk_ring_kernel<6, 2>); break;
        case 44: run(bulk_ring_kernel<4, 4>); break;
        case 82: run(bulk_ring_kernel<8, 2>); break;
        case 24: run(bulk_ring_kernel<2, 4>); break;
        case 34: run(bulk_ring_kernel<3, 4>); break;
        default: ok = false;
      }
    }
    if (!ok) continue;
    const double tbps = bytes / (us * 1e-6) / 1e12;
    std::printf("%-5s %5d %4d %5d %2d %4d %10.1f %8.2f %7.3f\n", w.mode, w.warps, w.ctas, w.depth, w.s, w.work, us,
                tbps, tbps / ceil_tbps);
  }
  PROBE_CHECK(cudaFree(codes));
  PROBE_CHECK(cudaFree(scales));
  PROBE_CHECK(cudaFree(sink));
  return 0;
}

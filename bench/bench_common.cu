#include "bench_common.hpp"

#include <algorithm>
#include <random>

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/synthetic.hpp"

namespace fp4moe::bench {
namespace {

__global__ void stream_read_kernel(const uint4* __restrict__ p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads alive; practically never true
}

__global__ void fill_bytes_kernel(uint32_t* p, size_t words, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < words; i += size_t{gridDim.x} * blockDim.x)
    p[i] = static_cast<uint32_t>(splitmix64(seed ^ (i * 0x9e3779b97f4a7c15ull)));
}
__global__ void fill_scales_kernel(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    p[i] = static_cast<uint8_t>(0x08 + splitmix64(seed + i) % (0x50 - 0x08));  // 2^-6 .. 2^3
}
__global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, float std, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    p[i] = __float2bfloat16_rn(synth_normal(splitmix64(seed ^ (i * 0x9e3779b97f4a7c15ull))) * std);
}

// An L2-sized-times-four buffer written before every timed replay evicts the previous replay's data.
DeviceBuffer<uint8_t>& flush_buffer() {
  static DeviceBuffer<uint8_t> buf;
  if (buf.size() == 0) {
    int dev = 0, l2 = 0;
    FP4MOE_CUDA_CHECK(cudaGetDevice(&dev));
    FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    buf = DeviceBuffer<uint8_t>(static_cast<size_t>(std::max(l2, 1 << 20)) * 4);
  }
  return buf;
}

}  // namespace

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void fill_random_bytes(void* p, size_t bytes, uint64_t seed, cudaStream_t s) {
  FP4MOE_REQUIRE(bytes % 4 == 0, "fill_random_bytes: bytes = {} must be a multiple of 4", bytes);
  fill_bytes_kernel<<<1024, 256, 0, s>>>(static_cast<uint32_t*>(p), bytes / 4, seed);
  FP4MOE_CUDA_CHECK_LAUNCH();
}
void fill_random_e4m3_scales(uint8_t* p, size_t count, uint64_t seed, cudaStream_t s) {
  fill_scales_kernel<<<1024, 256, 0, s>>>(p, count, seed);
  FP4MOE_CUDA_CHECK_LAUNCH();
}
void fill_random_bf16(void* p, size_t count, float std, uint64_t seed, cudaStream_t s) {
  fill_bf16_kernel<<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), count, std, seed);
  FP4MOE_CUDA_CHECK_LAUNCH();
}

void flush_l2(cudaStream_t stream) {
  auto& flush = flush_buffer();
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(flush.get(), 0x5a, flush.bytes(), stream));
}

CapturedGraph::CapturedGraph(const std::function<void(cudaStream_t)>& record, cudaStream_t stream) {
  cudaGraph_t graph;
  FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  record(stream);
  FP4MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph, 0));
  FP4MOE_CUDA_CHECK(cudaGraphDestroy(graph));  // the executable graph does not need it
}
CapturedGraph::~CapturedGraph() { cudaGraphExecDestroy(exec_); }
void CapturedGraph::launch(cudaStream_t stream) const { FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

double time_graph_us(const std::function<void(cudaStream_t)>& record, cudaStream_t stream, int reps, int warmup) {
  const CapturedGraph graph(record, stream);
  auto& flush = flush_buffer();
  cudaEvent_t a, b;
  FP4MOE_CUDA_CHECK(cudaEventCreate(&a));
  FP4MOE_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> times;
  for (int i = 0; i < warmup + reps; ++i) {
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(flush.get(), i & 0xff, flush.bytes(), stream));
    FP4MOE_CUDA_CHECK(cudaEventRecord(a, stream));
    graph.launch(stream);
    FP4MOE_CUDA_CHECK(cudaEventRecord(b, stream));
    FP4MOE_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= warmup) times.push_back(ms * 1000.0);
  }
  FP4MOE_CUDA_CHECK(cudaEventDestroy(a));
  FP4MOE_CUDA_CHECK(cudaEventDestroy(b));
  return median(times);
}

Ceilings measure_ceilings(cudaStream_t stream) {
  Ceilings c;
  int dev = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  c.gpu = prop.name;
  {
    // streaming read: 4 GiB (>> 50 MB L2), 8 blocks of 1024 threads per SM, 16-byte loads
    const size_t bytes = size_t{4} << 30;
    DeviceBuffer<uint8_t> buf(bytes);
    DeviceBuffer<uint32_t> sink(1);
    fill_random_bytes(buf.get(), bytes, 1, stream);
    const int blocks = prop.multiProcessorCount * 8;
    const double us = time_graph_us(
        [&](cudaStream_t s) {
          stream_read_kernel<<<blocks, 1024, 0, s>>>(reinterpret_cast<const uint4*>(buf.get()), bytes / 16, sink.get());
        },
        stream, 10, 2);
    c.stream_read_tbps = static_cast<double>(bytes) / (us * 1e-6) / 1e12;
  }
  {
    const int n = 8192;
    DeviceBuffer<__nv_bfloat16> A(size_t{n} * n), B(size_t{n} * n), C(size_t{n} * n);
    fill_random_bf16(A.get(), A.size(), 1.0f, 2, stream);
    fill_random_bf16(B.get(), B.size(), 1.0f, 3, stream);
    cublasHandle_t h;
    FP4MOE_CUBLAS_CHECK(cublasCreate(&h));
    FP4MOE_CUBLAS_CHECK(cublasSetStream(h, stream));
    const float alpha = 1.f, beta = 0.f;
    auto gemm = [&](cudaStream_t) {
      FP4MOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, A.get(), CUDA_R_16BF, n, B.get(),
                                       CUDA_R_16BF, n, &beta, C.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT));
    };
    gemm(stream);  // cuBLAS picks and loads its kernel outside the capture
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double us = time_graph_us(gemm, stream, 10, 2);
    c.bf16_tflops = 2.0 * n * double(n) * n / (us * 1e-6) / 1e12;
    FP4MOE_CUBLAS_CHECK(cublasDestroy(h));
  }
  return c;
}

std::vector<int32_t> random_expert_counts(int64_t tokens, int experts, int top_k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> counts(experts, 0);
  std::vector<int> perm(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    // partial Fisher-Yates: top_k distinct experts
    for (int i = 0; i < experts; ++i) perm[i] = i;
    for (int i = 0; i < top_k; ++i) {
      const int j = i + static_cast<int>(rng() % static_cast<uint64_t>(experts - i));
      std::swap(perm[i], perm[j]);
      ++counts[perm[i]];
    }
  }
  return counts;
}

}  // namespace fp4moe::bench

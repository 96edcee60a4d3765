// Benchmark harness shared by `fp4moe bench` and `fp4moe tune`: ceilings measured in the same run,
// graph-replay timing with a cold L2, synthetic routing and device buffers.
// Method (docs/performance-targets.md): warm-up apart, median of many replays, L2 flushed before each
// timed replay (so weights stream from HBM as they do in serving), random data, never zeros.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace fp4moe::bench {

struct Ceilings {
  double stream_read_tbps = 0;  // plain 16-byte-load streaming read over a buffer >> L2
  double bf16_tflops = 0;       // cuBLAS bf16 GEMM 8192^3 (fp32 accumulate), random data
  std::string gpu;
};
Ceilings measure_ceilings(cudaStream_t stream);

// The median of v (the upper of the two middle values for an even count; 0 for none), as every bench
// table reports it.
double median(std::vector<double> v);

// Writes a buffer of four times the L2 size, so the next kernel finds nothing of its inputs in L2.
void flush_l2(cudaStream_t stream);

// The work `record` puts on `stream`, captured once and instantiated; the executable graph is destroyed
// with this object. Shared by the timing loops (time_graph_us, the EP bench, --timeline).
class CapturedGraph {
 public:
  CapturedGraph(const std::function<void(cudaStream_t)>& record, cudaStream_t stream);
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void launch(cudaStream_t stream) const;

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// Median time (microseconds) of `reps` replays of the work recorded by `record` (captured once in a
// CUDA graph), each preceded by an L2 flush outside the timed region.
double time_graph_us(const std::function<void(cudaStream_t)>& record, cudaStream_t stream, int reps = 20,
                     int warmup = 3);

// Random top-k routing of T tokens over E experts (distinct experts per token, uniform): the number of
// rows each expert receives. Deterministic in seed.
std::vector<int32_t> random_expert_counts(int64_t tokens, int experts, int top_k, uint64_t seed);

// Device fills with non-trivial data.
void fill_random_bytes(void* p, size_t bytes, uint64_t seed, cudaStream_t s);
void fill_random_e4m3_scales(uint8_t* p, size_t count, uint64_t seed, cudaStream_t s);  // in [2^-6, 2^3]
void fill_random_bf16(void* p, size_t count, float std, uint64_t seed, cudaStream_t s);

}  // namespace fp4moe::bench

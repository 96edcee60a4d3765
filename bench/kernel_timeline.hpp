// `fp4moe bench --timeline`: the kernels of one CUDA-graph replay on the GPU's own clock (start, end,
// grid), from CUPTI's kernel activity records. What it is for: where the layer's microseconds go at
// decode, where the kernels overlap through programmatic dependent launch, which event timing between
// launches cannot show (events serialize the stream) and ncu cannot either (it replays kernels alone).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace fp4moe::bench {

struct KernelSpan {
  std::string name;  // demangled, parameters dropped
  double start_us = 0, end_us = 0;  // from the replay's first kernel start
  int grid = 0, block = 0;
};

// Replays the graph of `record` `replays` times, each after the L2 flush that time_graph_us() uses, with
// CUPTI recording kernels; returns each kernel's median start and end over the replays (kernels in
// start order). CUPTI is loaded at run time (libcupti of the CUDA toolkit): the tool does not depend on
// it otherwise. Throws fp4moe::Error naming the library when it cannot be loaded.
std::vector<KernelSpan> graph_kernel_timeline(const std::function<void(cudaStream_t)>& record, cudaStream_t stream,
                                              int replays);

// The table `--timeline` prints under a layer row.
void print_kernel_timeline(const std::vector<KernelSpan>& spans, double graph_us);

}  // namespace fp4moe::bench

#include "layer_bench.hpp"

#include "fp4moe/error.hpp"

namespace fp4moe::bench {

void run_layer_bench(const MoeConfig&, const LayerBenchOptions&, const Ceilings&, cudaStream_t, nlohmann::json&) {
  FP4MOE_FAIL("layer benchmark: the GPU layer is not wired into the benchmark yet; use --mode gemm");
}

}  // namespace fp4moe::bench

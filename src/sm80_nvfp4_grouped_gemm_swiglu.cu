// Instantiations of sm80-nvfp4-grouped for the swiglu epilogue (every config of kGemmConfigs).
#include "sm80_nvfp4_grouped_gemm_internal.hpp"

namespace fp4moe::detail {

const std::array<GemmKernelFn, kNumGemmConfigs>& gemm_kernels_swiglu() {
  static const auto table =
      make_gemm_kernel_table<kernels::kEpiSwiGLU>(std::make_index_sequence<kNumGemmConfigs>{});
  return table;
}

}  // namespace fp4moe::detail

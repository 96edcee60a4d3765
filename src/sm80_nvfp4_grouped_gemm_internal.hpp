// Kernel tables of the sm80-nvfp4-grouped instantiations (one .cu per epilogue, so they compile in
// parallel), indexed like kGemmConfigs.
#pragma once
#include <array>
#include <utility>

#include "fp4moe/kernels/sm80_nvfp4_grouped_gemm.cuh"
#include "fp4moe/tile_config.hpp"

namespace fp4moe::detail {

using GemmKernelFn = void (*)(kernels::GroupedGemmParams);

template <int EPI, size_t... I>
constexpr std::array<GemmKernelFn, sizeof...(I)> make_gemm_kernel_table(std::index_sequence<I...>) {
  return {&kernels::sm80_nvfp4_grouped_gemm_kernel<kGemmConfigs[I].bn, kGemmConfigs[I].bt, kGemmConfigs[I].bk,
                                                   kGemmConfigs[I].stages, kGemmConfigs[I].warps,
                                                   kGemmConfigs[I].mma, kGemmConfigs[I].ctas, EPI>...};
}

const std::array<GemmKernelFn, kNumGemmConfigs>& gemm_kernels_plain();
const std::array<GemmKernelFn, kNumGemmConfigs>& gemm_kernels_swiglu();
const std::array<GemmKernelFn, kNumGemmConfigs>& gemm_kernels_gptoss();

}  // namespace fp4moe::detail

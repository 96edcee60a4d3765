// Kernel tables of the sm80-nvfp4-grouped instantiations (one .cu per epilogue, so they compile in
// parallel), indexed like kGemmConfigs.
#pragma once
#include <array>
#include <utility>

#include "fp4moe/kernels/sm80_nvfp4_grouped_gemm.cuh"
#include "fp4moe/kernels/sm80_nvfp4_grouped_stream.cuh"
#include "fp4moe/kernels/sm90_nvfp4_grouped_tma.cuh"
#include "fp4moe/tile_config.hpp"

namespace fp4moe::detail {

using GemmKernelFn = void (*)(kernels::GroupedGemmParams);

// The kernel of config I: stream configs (mma == 2) and tma configs (mma == 3) have their own kernels;
// only the one that applies is instantiated.
template <int EPI, size_t I>
constexpr GemmKernelFn gemm_kernel_for() {
  constexpr TileConfig c = kGemmConfigs[I];
  if constexpr (c.mma == 2)
    return &kernels::sm80_nvfp4_grouped_stream_kernel<c.bt, c.warps, c.stages, c.ctas, EPI>;
  else if constexpr (c.mma == 3)
    return &kernels::sm90_nvfp4_grouped_tma_kernel<c.bn, c.bt, c.bk, c.stages, c.warps, c.ctas, EPI>;
  else
    return &kernels::sm80_nvfp4_grouped_gemm_kernel<c.bn, c.bt, c.bk, c.stages, c.warps, c.mma, c.ctas, EPI>;
}

template <int EPI, size_t... I>
constexpr std::array<GemmKernelFn, sizeof...(I)> make_gemm_kernel_table(std::index_sequence<I...>) {
  return {gemm_kernel_for<EPI, I>()...};
}

const std::array<GemmKernelFn, kNumGemmConfigs>& gemm_kernels_plain();
const std::array<GemmKernelFn, kNumGemmConfigs>& gemm_kernels_swiglu();
const std::array<GemmKernelFn, kNumGemmConfigs>& gemm_kernels_gptoss();

}  // namespace fp4moe::detail

// TMA tensor maps of the tma tile configs (TileConfig::mma == 3). Host code only; internal to the library.
#pragma once
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/kernels/sm80_nvfp4_grouped_gemm.cuh"
#include "fp4moe/tile_config.hpp"

namespace fp4moe::detail {

// Encodes the launch's maps (codes, scales and activation rows of the routed set and, when given, of
// the second weight set) into `maps`. Throws with the arguments when the driver refuses one.
void encode_tma_maps(kernels::GroupedGemmTmaMaps& maps, const TileConfig& cfg, const GroupedWeightsView& w,
                     const GroupedGemmArgs& a, const GroupedWeightsView* xw, const GroupedGemmArgs* xa);

}  // namespace fp4moe::detail

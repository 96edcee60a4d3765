// TMA tensor maps of the tma configs (TileConfig::mma == 3): host code only. The maps are encoded per
// launch (a few microseconds of host work, legal inside stream capture) because they hold the
// buffers' addresses; cuTensorMapEncodeTiled comes from the driver through the runtime's entry-point
// query, so the library does not link libcuda.
#include <cstdint>
#include <mutex>

#include <cuda.h>
#include <cuda_runtime.h>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "sm90_tensor_maps.hpp"

namespace fp4moe::detail {

namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static std::once_flag once;
  static EncodeTiledFn fn = nullptr;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    FP4MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    if (q == cudaDriverEntryPointSuccess) fn = reinterpret_cast<EncodeTiledFn>(p);
  });
  if (fn == nullptr)
    throw ResourceError("fp4moe: the CUDA driver does not provide cuTensorMapEncodeTiled (CUDA 12.0 or newer is "
                        "needed for the tma tile configs)");
  return fn;
}

// A 2-D map: d0 elements per row (contiguous), d1 rows `row_bytes` apart, box b0 x b1.
void encode_2d(CUtensorMap& map, const char* what, CUtensorMapDataType type, const void* base, uint64_t d0,
               uint64_t d1, uint64_t row_bytes, uint32_t b0, uint32_t b1, CUtensorMapSwizzle swizzle,
               CUtensorMapL2promotion promotion) {
  const cuuint64_t dims[2] = {d0, d1};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {b0, b1};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FP4MOE_REQUIRE(r == CUDA_SUCCESS,
                 "TMA tensor map of the {}: cuTensorMapEncodeTiled failed (CUresult {}) for address {}, dims "
                 "{} x {}, row stride {} B, box {} x {} (rules: 16-byte aligned address, row stride a multiple of "
                 "16 below 2^40, box dims at most 256)",
                 what, static_cast<int>(r), fmt::ptr(base), d0, d1, row_bytes, b0, b1);
}

void encode_set(CUtensorMap& codes, CUtensorMap& scales, CUtensorMap (&act)[4], CUtensorMap& codes_tail,
                CUtensorMap& scales_tail, const TileConfig& cfg, const uint8_t* c, const uint8_t* s, int64_t experts,
                int64_t n, int64_t k, const void* a, int64_t max_rows) {
  const uint64_t mrows = static_cast<uint64_t>(experts) * static_cast<uint64_t>(n / 16);
  // codes: an m-tile row is k/64 chunks of 512 B = k 8-byte elements; a stage box is bk of them
  encode_2d(codes, "weight codes", CU_TENSOR_MAP_DATA_TYPE_UINT64, c, static_cast<uint64_t>(k), mrows,
            static_cast<uint64_t>(k) * 8, static_cast<uint32_t>(cfg.bk), static_cast<uint32_t>(cfg.bn / 16),
            CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  // scales: k/64 chunks of 64 B = k/8 8-byte elements per m-tile row
  encode_2d(scales, "block scales", CU_TENSOR_MAP_DATA_TYPE_UINT64, s, static_cast<uint64_t>(k / 8), mrows,
            static_cast<uint64_t>(k), static_cast<uint32_t>(cfg.bk / 8), static_cast<uint32_t>(cfg.bn / 16),
            CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  // an expert's last feature tile where it is partial: the same maps with a box of its m-tile rows only
  const int tail = static_cast<int>((n / 16) % (cfg.bn / 16));
  if (tail > 0) {
    encode_2d(codes_tail, "weight codes (last feature tile)", CU_TENSOR_MAP_DATA_TYPE_UINT64, c, static_cast<uint64_t>(k),
              mrows, static_cast<uint64_t>(k) * 8, static_cast<uint32_t>(cfg.bk), static_cast<uint32_t>(tail),
              CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
    encode_2d(scales_tail, "block scales (last feature tile)", CU_TENSOR_MAP_DATA_TYPE_UINT64, s,
              static_cast<uint64_t>(k / 8), mrows, static_cast<uint64_t>(k), static_cast<uint32_t>(cfg.bk / 8),
              static_cast<uint32_t>(tail), CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  }
  // activations: 64 bf16 (128 B) x w rows per slab, 128-byte swizzle (wgmma's K-major layout), for each
  // token-tile width w = bt/4, bt/2, 3bt/4, bt
  for (int i = 0; i < 4; ++i)
    encode_2d(act[i], "activation rows", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a, static_cast<uint64_t>(k),
              static_cast<uint64_t>(max_rows), static_cast<uint64_t>(k) * 2, 64,
              static_cast<uint32_t>((i + 1) * (cfg.bt / 4)), CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
}

}  // namespace

void encode_tma_maps(kernels::GroupedGemmTmaMaps& maps, const TileConfig& cfg, const GroupedWeightsView& w,
                     const GroupedGemmArgs& a, const GroupedWeightsView* xw, const GroupedGemmArgs* xa) {
  encode_set(maps.codes, maps.scales, maps.act, maps.codes_tail, maps.scales_tail, cfg, w.codes, w.scales, w.num_experts,
             w.n, w.k, a.act, a.max_rows);
  if (xw != nullptr)
    encode_set(maps.x_codes, maps.x_scales, maps.x_act, maps.x_codes_tail, maps.x_scales_tail, cfg, xw->codes,
               xw->scales, 1, xw->n, xw->k, xa->act, xa->max_rows);
}

}  // namespace fp4moe::detail

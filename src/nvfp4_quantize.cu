// Host launcher for the bf16 -> NVFP4 row quantizer (device code: kernels/nvfp4_quantize.cuh).
#include <cstdint>
#include <limits>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/kernels/nvfp4_quantize.cuh"

namespace fp4moe {

void quantize_nvfp4_rows_device(const void* x, int64_t rows, int64_t cols, uint8_t* codes,
                                uint8_t* scales, float* global, cudaStream_t stream) {
  FP4MOE_REQUIRE(rows >= 0, "rows = {} must be >= 0", rows);
  FP4MOE_REQUIRE(cols >= 0 && cols % kNvfp4Block == 0,
                 "cols = {} must be a non-negative multiple of 16 (the NVFP4 block)", cols);
  if (rows == 0) return;
  FP4MOE_REQUIRE(global != nullptr, "global is null but rows = {}", rows);
  FP4MOE_REQUIRE(reinterpret_cast<uintptr_t>(global) % alignof(float) == 0,
                 "global = {} must be 4-byte aligned (float)", fmt::ptr(global));
  if (cols > 0) {
    FP4MOE_REQUIRE(x != nullptr && codes != nullptr && scales != nullptr,
                   "x = {}, codes = {}, scales = {}: none may be null for a [{}, {}] input",
                   fmt::ptr(x), fmt::ptr(codes), fmt::ptr(scales), rows, cols);
    // Rows start 32*cols/16 bytes apart (x) and cols/2 bytes apart (codes), multiples of 32 and 8,
    // so aligning the base pointers aligns every row for the vector loads and stores.
    FP4MOE_REQUIRE(reinterpret_cast<uintptr_t>(x) % 16 == 0,
                   "x = {} must be 16-byte aligned (the kernel loads 8 bf16 per instruction)",
                   fmt::ptr(x));
    FP4MOE_REQUIRE(reinterpret_cast<uintptr_t>(codes) % 8 == 0,
                   "codes = {} must be 8-byte aligned (the kernel stores one block, 8 bytes, at once)",
                   fmt::ptr(codes));
  }
  const int64_t ctas = (rows + kernels::kQuantizeWarpsPerCta - 1) / kernels::kQuantizeWarpsPerCta;
  FP4MOE_REQUIRE(ctas <= std::numeric_limits<int32_t>::max(),
                 "rows = {} needs {} CTAs, more than the grid limit 2^31-1", rows, ctas);
  kernels::nvfp4_quantize_rows_kernel<<<static_cast<unsigned>(ctas), kernels::kQuantizeThreads, 0,
                                        stream>>>(static_cast<const uint16_t*>(x), rows, cols, codes,
                                                  scales, global);
  FP4MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fp4moe

// NVFP4 / MXFP4 tensors on the host: quantize, dequantize, pack, scale layouts.
// The element arithmetic lives in format_math.hpp (shared with the device).
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <cuda_runtime.h>

#include "fp4moe/format_math.hpp"

namespace fp4moe {

// Two E2M1 codes per byte, element 2i in the low nibble.
void pack_e2m1(std::span<const uint8_t> codes, std::span<uint8_t> packed);    // codes.size() even
void unpack_e2m1(std::span<const uint8_t> packed, std::span<uint8_t> codes);
inline uint8_t packed_code(const uint8_t* packed, int64_t i) {
  return static_cast<uint8_t>((packed[i >> 1] >> ((i & 1) * 4)) & 0xf);
}

// Row-major [rows, cols] NVFP4 tensor in the on-disk (ModelOpt) layout.
struct Nvfp4Tensor {
  int64_t rows = 0, cols = 0;       // cols % 16 == 0
  std::vector<uint8_t> codes;       // rows * cols / 2, packed
  std::vector<uint8_t> scales;      // rows * cols / 16, E4M3, row-major, not swizzled
  float global_scale = 1.0f;        // dequant multiplier (ModelOpt weight_scale_2)

  float at(int64_t r, int64_t c) const;  // exact dequantized value
};

// Quantize as ModelOpt does. global_scale: when given, used instead of the tensor's own
// (an expert's gate and up share one: nvfp4_global_scale(max(amax_gate, amax_up))).
Nvfp4Tensor quantize_nvfp4(std::span<const float> x, int64_t rows, int64_t cols,
                           std::optional<float> global_scale = std::nullopt);
// bf16 input given as raw bits.
Nvfp4Tensor quantize_nvfp4_bf16(std::span<const uint16_t> x, int64_t rows, int64_t cols,
                                std::optional<float> global_scale = std::nullopt);
std::vector<float> dequantize_nvfp4(const Nvfp4Tensor& t);
float amax(std::span<const float> x);

// Row-major [rows, cols] MXFP4 tensor (OCP MX: 32-element blocks, E8M0 scales).
struct Mxfp4Tensor {
  int64_t rows = 0, cols = 0;       // cols % 32 == 0
  std::vector<uint8_t> codes;       // rows * cols / 2, packed
  std::vector<uint8_t> scales;      // rows * cols / 32, E8M0, row-major
  float at(int64_t r, int64_t c) const;
};
Mxfp4Tensor quantize_mxfp4(std::span<const float> x, int64_t rows, int64_t cols);
std::vector<float> dequantize_mxfp4(const Mxfp4Tensor& t);

// Scale-factor layouts: row-major [rows, kblocks] <-> CUTLASS 128x4 swizzled (padded to
// pad128(rows) x pad4(kblocks), padding bytes zero).
std::vector<uint8_t> swizzle_scales_128x4(std::span<const uint8_t> row_major, int64_t rows, int64_t kblocks);
std::vector<uint8_t> unswizzle_scales_128x4(std::span<const uint8_t> swizzled, int64_t rows, int64_t kblocks);

// GPU quantization of bf16 rows (activations): one FP32 global scale per row computed from the row's
// amax with the same recipe (nvfp4_global_scale), E4M3 block scales, packed codes. Matches
// quantize_nvfp4 applied row by row, bit for bit. All pointers device memory.
//   x: bf16 [rows, cols]; codes: [rows, cols/2]; scales: [rows, cols/16] row-major; global: [rows]
void quantize_nvfp4_rows_device(const void* x, int64_t rows, int64_t cols, uint8_t* codes,
                                uint8_t* scales, float* global, cudaStream_t stream);

}  // namespace fp4moe

// Zero padding of expert weights from a config's intermediate size to the width the GEMM kernels run
// (MoeConfig::kernel_intermediate: the next multiple of 64, the repacked chunk). Host-only arithmetic:
// the layer applies a plan on the device with cudaMemsetAsync + cudaMemcpy2DAsync, the tests apply the
// same plan on the host (apply_pad_copy_host) and check that the padded layer computes what the
// unpadded one does (tests/cpu/test_padding.cpp).
//
// Why zeros are exact: a padded GEMM1 feature has zero codes and a zero bias, so its gate and up
// accumulators are 0 and both activations give 0 (silu(0) * 0; gpt-oss: (0 + 1) * 0 * sigmoid(0));
// GEMM2 then multiplies that 0 by zero codes in the padded K columns. Every added product is +-0, which
// leaves an FP32 (or double) sum unchanged.
#pragma once
#include <cstddef>
#include <cstdint>

#include "fp4moe/config.hpp"

namespace fp4moe {

// One strided copy into a zero-filled destination of dst_bytes: `height` rows of `width` bytes, source
// rows `spitch` bytes apart, destination rows `dpitch` apart (cudaMemcpy2D's arguments).
struct PadCopy {
  size_t width = 0, height = 0, spitch = 0, dpitch = 0, dst_bytes = 0;
  size_t src_bytes() const { return width * height; }  // spitch == width in every plan here
};

// [groups, rows, row_bytes] -> [groups, rows_pad, row_bytes]: each group's rows, then zero rows.
PadCopy pad_rows(int64_t groups, int64_t rows, int64_t rows_pad, int64_t row_bytes);
// [rows, row_bytes] -> [rows, row_bytes_pad]: each row, then zero bytes.
PadCopy pad_cols(int64_t rows, int64_t row_bytes, int64_t row_bytes_pad);

// One grouped-GEMM operand of the layer (MoeLayerWeights' layout): per expert codes [n, k/2], scales
// [n, k/block] (16 E4M3 or 32 E8M0), bias [n] fp32, padded to n_pad x k_pad. gate_up: the n rows are two
// halves (gate, then up), each padded to n_pad / 2, so the repack's gate/up interleave still pairs
// feature j of the gate with feature j of the up projection. Either the rows or K grow, not both (GEMM1
// pads its features, GEMM2 its K). Throws fp4moe::Error naming the sizes otherwise.
struct GemmPadPlan {
  PadCopy codes, scales, bias;  // bias: meaningful only when the operand has one
};
GemmPadPlan gemm_pad_plan(int num_experts, int64_t n, int64_t k, int64_t n_pad, int64_t k_pad, bool gate_up,
                          WeightFormat format);

// The host twin of the layer's device copy: dst[0, dst_bytes) = 0, then the strided copy.
void apply_pad_copy_host(const PadCopy& c, const void* src, void* dst);

}  // namespace fp4moe

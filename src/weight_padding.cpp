// Zero-padding plans of expert weights (weight_padding.hpp). Host-only.
#include "fp4moe/weight_padding.hpp"

#include <cstring>

#include "fp4moe/error.hpp"

namespace fp4moe {

PadCopy pad_rows(int64_t groups, int64_t rows, int64_t rows_pad, int64_t row_bytes) {
  FP4MOE_REQUIRE(groups >= 1 && rows >= 1 && rows_pad >= rows && row_bytes >= 1,
                 "pad_rows: groups = {}, rows = {}, rows_pad = {}, row_bytes = {} (need groups, rows, row_bytes "
                 ">= 1 and rows_pad >= rows)", groups, rows, rows_pad, row_bytes);
  PadCopy c;
  c.width = static_cast<size_t>(rows * row_bytes);
  c.height = static_cast<size_t>(groups);
  c.spitch = c.width;
  c.dpitch = static_cast<size_t>(rows_pad * row_bytes);
  c.dst_bytes = c.dpitch * c.height;
  return c;
}

PadCopy pad_cols(int64_t rows, int64_t row_bytes, int64_t row_bytes_pad) {
  FP4MOE_REQUIRE(rows >= 1 && row_bytes >= 1 && row_bytes_pad >= row_bytes,
                 "pad_cols: rows = {}, row_bytes = {}, row_bytes_pad = {} (need rows, row_bytes >= 1 and "
                 "row_bytes_pad >= row_bytes)", rows, row_bytes, row_bytes_pad);
  PadCopy c;
  c.width = static_cast<size_t>(row_bytes);
  c.height = static_cast<size_t>(rows);
  c.spitch = c.width;
  c.dpitch = static_cast<size_t>(row_bytes_pad);
  c.dst_bytes = c.dpitch * c.height;
  return c;
}

GemmPadPlan gemm_pad_plan(int num_experts, int64_t n, int64_t k, int64_t n_pad, int64_t k_pad, bool gate_up,
                          WeightFormat format) {
  const int64_t block = format == WeightFormat::kMxfp4 ? 32 : 16;
  const int64_t halves = gate_up ? 2 : 1;
  FP4MOE_REQUIRE(num_experts >= 1 && n >= 1 && k >= 1 && n % halves == 0 && n_pad % halves == 0 && n_pad >= n &&
                     k_pad >= k && k % block == 0 && k_pad % block == 0,
                 "gemm_pad_plan: E = {}, n = {} -> {}, k = {} -> {}, gate_up = {}: the sizes must be positive, "
                 "only grow, keep K a multiple of the {}-wide scale block and (gate_up) n even",
                 num_experts, n, n_pad, k, k_pad, gate_up, block);
  FP4MOE_REQUIRE(n_pad == n || k_pad == k,
                 "gemm_pad_plan: n = {} -> {} and k = {} -> {}: only one of the two may be padded", n, n_pad, k, k_pad);
  GemmPadPlan p;
  const int64_t groups = num_experts * halves, rows = n / halves, rows_pad = n_pad / halves;
  if (k_pad == k) {  // features grow (or nothing does): rows per half, then zero rows
    p.codes = pad_rows(groups, rows, rows_pad, k / 2);
    p.scales = pad_rows(groups, rows, rows_pad, k / block);
    p.bias = pad_cols(groups, rows * 4, rows_pad * 4);  // bias [E, halves, rows] fp32
  } else {           // K grows: every row, then zero columns
    p.codes = pad_cols(num_experts * n, k / 2, k_pad / 2);
    p.scales = pad_cols(num_experts * n, k / block, k_pad / block);
    p.bias = pad_cols(num_experts, n * 4, n * 4);        // bias [E, n]: unchanged
  }
  return p;
}

void apply_pad_copy_host(const PadCopy& c, const void* src, void* dst) {
  FP4MOE_REQUIRE(src != nullptr && dst != nullptr, "apply_pad_copy_host: src = {}, dst = {} must be non-null", src,
                 dst);
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  std::memset(d, 0, c.dst_bytes);
  for (size_t r = 0; r < c.height; ++r) std::memcpy(d + r * c.dpitch, s + r * c.spitch, c.width);
}

}  // namespace fp4moe

// Offline repack of NVFP4 expert weights: on-disk (ModelOpt) layout <-> the kernel layout of
// nvfp4_weight_layout.hpp. The host and device versions call the same word/scale functions.
#include <algorithm>
#include <thread>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/nvfp4_weight_layout.hpp"

namespace fp4moe {
namespace {

using layout::RowOrder;

// Scale problems found during a repack, reported by the first offending element.
enum ScaleStatus : int { kScaleOk = 0, kScaleNegative = 1, kScaleNaN = 2 };

FP4MOE_HD uint8_t nibble(const uint8_t* codes, int64_t row, int64_t col, int64_t k) {
  const uint8_t b = codes[row * (k / 2) + (col >> 1)];
  return static_cast<uint8_t>((col & 1) ? (b >> 4) : (b & 0xf));
}
FP4MOE_HD bool scale_is_zero(uint8_t s) { return (s & 0x7f) == 0; }

// The repacked word (mtile, chunk, lane, j) of one expert.
FP4MOE_HD uint32_t repack_word(const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t k, RowOrder order,
                               int64_t mtile, int64_t chunk, int lane, int j) {
  uint32_t word = 0;
  for (int v = 0; v < 8; ++v) {
    const int64_t row = layout::disk_row(mtile, layout::frag_row(lane, v), n, order);
    const int64_t col = chunk * 64 + j * 16 + layout::frag_k(lane, v);
    uint8_t code = nibble(codes, row, col, k);
    // A zero scale makes the whole block zero whatever its codes; the kernel encoding has no zero
    // scale, so the block is stored as zero codes with the smallest scale (same dequantized values).
    if (scale_is_zero(scales[row * (k / 16) + col / 16])) code = 0;
    word |= layout::place_code(code, v);
  }
  return word;
}

FP4MOE_HD uint8_t repack_scale(const uint8_t* scales, int64_t n, int64_t k, RowOrder order, int64_t mtile,
                               int64_t chunk, int g, int j, int half, int* status) {
  const int64_t row = layout::disk_row(mtile, g + 8 * half, n, order);
  const uint8_t s = scales[row * (k / 16) + chunk * 4 + j];
  if (scale_is_zero(s)) return layout::encode_scale(1);
  if ((s & 0x7f) == 0x7f) { *status = kScaleNaN; return 0; }
  if (s & 0x80) { *status = kScaleNegative; return 0; }
  return layout::encode_scale(s);
}

void check_shape(int64_t n, int64_t k) {
  FP4MOE_REQUIRE(n > 0 && n % 16 == 0, "repack: n = {} must be a positive multiple of 16", n);
  FP4MOE_REQUIRE(k > 0 && k % 64 == 0, "repack: k = {} must be a positive multiple of 64", k);
}

__global__ void repack_kernel(const uint8_t* codes, const uint8_t* scales, int num_experts, int64_t n, int64_t k,
                              RowOrder order, uint8_t* codes_out, uint8_t* scales_out, int* status,
                              long long* bad_index) {
  const int64_t words_per_expert = n * k / 8;
  const int64_t total = words_per_expert * num_experts;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e = i / words_per_expert;
    const int64_t wi = i - e * words_per_expert;  // = ((mtile * (k/64) + chunk) * 32 + lane) * 4 + j
    const int j = static_cast<int>(wi & 3);
    const int lane = static_cast<int>((wi >> 2) & 31);
    const int64_t mc = wi >> 7;
    const int64_t mtile = mc / (k / 64), chunk = mc % (k / 64);
    const uint8_t* ec = codes + e * (n * k / 2);
    const uint8_t* es = scales + e * (n * k / 16);
    reinterpret_cast<uint32_t*>(codes_out + e * (n * k / 2))[wi] =
        repack_word(ec, es, n, k, order, mtile, chunk, lane, j);
    // one scale byte per (mtile, chunk, g, j, half): the first 64 words of each 128-word group do it
    const int sl = static_cast<int>(wi & 127);
    if (sl < 64) {
      const int g = sl >> 3, jj = (sl >> 1) & 3, half = sl & 1;
      int st = kScaleOk;
      const uint8_t v = repack_scale(es, n, k, order, mtile, chunk, g, jj, half, &st);
      scales_out[e * (n * k / 16) + layout::scale_byte_offset(mtile, chunk, g, jj, half, k)] = v;
      if (st != kScaleOk) {
        atomicExch(status, st);
        atomicMin(bad_index, static_cast<long long>(e * (n * k / 16) + layout::disk_row(mtile, g + 8 * half, n, order) * (k / 16) + chunk * 4 + jj));
      }
    }
  }
}

[[noreturn]] void throw_bad_scale(int status, long long index, int64_t n, int64_t k) {
  const int64_t per_expert = n * k / 16;
  const int64_t e = index / per_expert, r = (index % per_expert) / (k / 16), b = index % (k / 16);
  FP4MOE_FAIL("malformed NVFP4 weights: block scale of expert {}, row {}, k-block {} is {} (scales must be finite "
              "and non-negative E4M3)",
              e, r, b, status == kScaleNaN ? "NaN" : "negative");
}

}  // namespace

size_t repacked_codes_bytes(int64_t n, int64_t k) { return static_cast<size_t>(n * k / 2); }
size_t repacked_scales_bytes(int64_t n, int64_t k) { return static_cast<size_t>(n * k / 16); }

void repack_nvfp4_weights(const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t k, bool gate_up_interleave,
                          uint8_t* codes_out, uint8_t* scales_out) {
  check_shape(n, k);
  FP4MOE_REQUIRE(codes && scales && codes_out && scales_out, "repack: null pointer among codes/scales/outputs");
  const RowOrder order = gate_up_interleave ? RowOrder::kGateUp : RowOrder::kPairs;
  const int64_t mtiles = n / 16, chunks = k / 64;
  for (int64_t mt = 0; mt < mtiles; ++mt)
    for (int64_t c = 0; c < chunks; ++c) {
      for (int lane = 0; lane < 32; ++lane)
        for (int j = 0; j < 4; ++j) {
          const uint32_t wd = repack_word(codes, scales, n, k, order, mt, c, lane, j);
          uint8_t* dst = codes_out + layout::codes_word_offset(mt, c, lane, j, k);
          for (int b = 0; b < 4; ++b) dst[b] = static_cast<uint8_t>(wd >> (8 * b));
        }
      for (int g = 0; g < 8; ++g)
        for (int j = 0; j < 4; ++j)
          for (int half = 0; half < 2; ++half) {
            int st = kScaleOk;
            const uint8_t v = repack_scale(scales, n, k, order, mt, c, g, j, half, &st);
            if (st != kScaleOk)
              throw_bad_scale(st, layout::disk_row(mt, g + 8 * half, n, order) * (k / 16) + c * 4 + j, n, k);
            scales_out[layout::scale_byte_offset(mt, c, g, j, half, k)] = v;
          }
    }
}

void unpack_nvfp4_weights(const uint8_t* codes_in, const uint8_t* scales_in, int64_t n, int64_t k,
                          bool gate_up_interleave, uint8_t* codes, uint8_t* scales) {
  check_shape(n, k);
  FP4MOE_REQUIRE(codes_in && scales_in && codes && scales, "unpack: null pointer among inputs/outputs");
  const RowOrder order = gate_up_interleave ? RowOrder::kGateUp : RowOrder::kPairs;
  std::fill(codes, codes + n * k / 2, uint8_t{0});
  for (int64_t mt = 0; mt < n / 16; ++mt)
    for (int64_t c = 0; c < k / 64; ++c) {
      for (int lane = 0; lane < 32; ++lane)
        for (int j = 0; j < 4; ++j) {
          const uint8_t* src = codes_in + layout::codes_word_offset(mt, c, lane, j, k);
          const uint32_t wd = uint32_t{src[0]} | uint32_t{src[1]} << 8 | uint32_t{src[2]} << 16 | uint32_t{src[3]} << 24;
          for (int v = 0; v < 8; ++v) {
            const int64_t row = layout::disk_row(mt, layout::frag_row(lane, v), n, order);
            const int64_t col = c * 64 + j * 16 + layout::frag_k(lane, v);
            const uint8_t code = layout::extract_code(wd, v);
            codes[row * (k / 2) + col / 2] |= static_cast<uint8_t>((col & 1) ? code << 4 : code);
          }
        }
      for (int g = 0; g < 8; ++g)
        for (int j = 0; j < 4; ++j)
          for (int half = 0; half < 2; ++half) {
            const int64_t row = layout::disk_row(mt, g + 8 * half, n, order);
            scales[row * (k / 16) + c * 4 + j] =
                layout::decode_scale(scales_in[layout::scale_byte_offset(mt, c, g, j, half, k)]);
          }
    }
}

void repack_nvfp4_weights_device(const uint8_t* codes, const uint8_t* scales, int num_experts, int64_t n, int64_t k,
                                 bool gate_up_interleave, uint8_t* codes_out, uint8_t* scales_out,
                                 cudaStream_t stream) {
  check_shape(n, k);
  FP4MOE_REQUIRE(num_experts >= 1, "repack: num_experts = {} must be >= 1", num_experts);
  FP4MOE_REQUIRE(codes && scales && codes_out && scales_out, "repack: null pointer among codes/scales/outputs");
  FP4MOE_REQUIRE(reinterpret_cast<uintptr_t>(codes_out) % 4 == 0, "repack: codes_out must be 4-byte aligned");
  // The status word tells malformed scales apart; reading it back synchronizes, which is fine for a
  // one-time weight preparation step (not part of forward()).
  int* d_status = nullptr;
  long long* d_bad = nullptr;
  FP4MOE_CUDA_CHECK(cudaMallocAsync(&d_status, sizeof(int), stream));
  FP4MOE_CUDA_CHECK(cudaMallocAsync(&d_bad, sizeof(long long), stream));
  const long long big = (1ll << 62);
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(d_status, 0, sizeof(int), stream));
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(d_bad, &big, sizeof(big), cudaMemcpyHostToDevice, stream));
  const int64_t total = n * k / 8 * num_experts;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((total + threads - 1) / threads, 65536));
  repack_kernel<<<blocks, threads, 0, stream>>>(codes, scales, num_experts, n, k,
                                                gate_up_interleave ? RowOrder::kGateUp : RowOrder::kPairs, codes_out,
                                                scales_out, d_status, d_bad);
  FP4MOE_CUDA_CHECK_LAUNCH();
  int status = 0;
  long long bad = 0;
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(&status, d_status, sizeof(int), cudaMemcpyDeviceToHost, stream));
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(&bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost, stream));
  FP4MOE_CUDA_CHECK(cudaFreeAsync(d_status, stream));
  FP4MOE_CUDA_CHECK(cudaFreeAsync(d_bad, stream));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (status != kScaleOk) throw_bad_scale(status, bad, n, k);
}

}  // namespace fp4moe

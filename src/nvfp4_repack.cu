// Offline repack of NVFP4 expert weights: on-disk (ModelOpt) layout <-> the kernel layout of
// nvfp4_weight_layout.hpp. The host and device versions call the same word/scale functions.
#include <algorithm>
#include <cmath>
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
    // MXFP4 (scales == null) has no zero scale.
    if (scales != nullptr && scale_is_zero(scales[row * (k / 16) + col / 16])) code = 0;
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

// ---- MXFP4 ----
enum MxStatus : int { kMxOk = 0, kMxNaN = 3, kMxRange = 4, kMxTiny = 5 };

// Whether the MXFP4 block (row, blk) of one expert holds a nonzero code (+-0 are codes 0 and 8).
FP4MOE_HD bool mx_block_nonzero(const uint8_t* codes, int64_t row, int64_t blk, int64_t k) {
  const uint8_t* c = codes + row * (k / 2) + blk * 16;
  uint32_t any = 0;
  for (int i = 0; i < 16; ++i) any |= c[i] & 0x77u;
  return any != 0;
}

// The repacked byte of one MXFP4 block: b = e + c_expert; nonzero blocks must reach kMxfp4MinByte,
// all-zero blocks are clamped into [1, 254] (their products are zero whatever the scale).
FP4MOE_HD uint8_t mx_scale_byte(uint8_t e, bool nonzero, int c_expert, int* status) {
  if (e == 0xff) { *status = kMxNaN; return 0; }
  int b = static_cast<int>(e) + c_expert;
  if (nonzero && b < layout::kMxfp4MinByte) { *status = kMxRange; return 0; }
  b = b < 1 ? 1 : (b > 254 ? 254 : b);
  return static_cast<uint8_t>(b);
}

// The scale byte (mtile, chunk, g, j, half) of one MXFP4 expert.
FP4MOE_HD uint8_t repack_mx_scale(const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t k, RowOrder order,
                                  int64_t mtile, int64_t chunk, int g, int j, int half, int c_expert, int* status,
                                  int64_t* block_index) {
  const int64_t row = layout::disk_row(mtile, g + 8 * half, n, order);
  const int64_t blk = chunk * 2 + j / 2;
  *block_index = row * (k / 32) + blk;
  return mx_scale_byte(scales[row * (k / 32) + blk], mx_block_nonzero(codes, row, blk, k), c_expert, status);
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
    const uint8_t* es = scales != nullptr ? scales + e * (n * k / 16) : nullptr;  // null: MXFP4 (no zero-scale rewrite)
    reinterpret_cast<uint32_t*>(codes_out + e * (n * k / 2))[wi] =
        repack_word(ec, es, n, k, order, mtile, chunk, lane, j);
    // one scale byte per (mtile, chunk, g, j, half): the first 64 words of each 128-word group do it
    const int sl = static_cast<int>(wi & 127);
    if (scales != nullptr && sl < 64) {  // null: MXFP4, whose scales mx_scale_kernel writes
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

// The codes half of the inverse repack (shared by NVFP4 and MXFP4).
void unpack_nvfp4_codes_only(const uint8_t* codes_in, int64_t n, int64_t k, RowOrder order, uint8_t* codes) {
  std::fill(codes, codes + n * k / 2, uint8_t{0});
  for (int64_t mt = 0; mt < n / 16; ++mt)
    for (int64_t c = 0; c < k / 64; ++c)
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
}

[[noreturn]] void throw_bad_mx(int status, long long index, int64_t n, int64_t k, int max_e) {
  const int64_t per_expert = n * k / 32;
  const int64_t e = index / per_expert, r = (index % per_expert) / (k / 32), b = index % (k / 32);
  if (status == kMxTiny)
    FP4MOE_FAIL("MXFP4 weights: expert {}: its largest E8M0 scale (exponent field {}) is below 2^-117 (field {}); "
                "the per-expert FP32 scale 2^(max - 136) would not be a normal float", index, max_e,
                layout::kMxfp4MinMaxExponent);
  if (status == kMxNaN)
    FP4MOE_FAIL("MXFP4 weights: E8M0 scale of expert {}, row {}, k-block {} (32 wide) is 0xFF, the NaN encoding", e, r,
                b);
  FP4MOE_FAIL("MXFP4 weights: the scale of expert {}, row {}, k-block {} (32 wide) is more than {} binades below the "
              "expert's largest scale (exponent field {}); its bf16 weights would underflow in the GEMM", e, r, b,
              254 - layout::kMxfp4MinByte, max_e);
}

// Largest E8M0 exponent field over the blocks with a nonzero code; -1 when there is none. NaN -> status.
int mx_max_exponent(const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t k, int* status, int64_t* bad) {
  int m = -1;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < k / 32; ++b) {
      const uint8_t e = scales[r * (k / 32) + b];
      if (e == 0xff) {
        *status = kMxNaN;
        *bad = r * (k / 32) + b;
        return m;
      }
      if (mx_block_nonzero(codes, r, b, k)) m = std::max(m, static_cast<int>(e));
    }
  return m;
}

// c_expert from the largest exponent (an all-zero expert: any offset works; 118 pairs with global 1).
int mx_offset(int max_e) { return max_e < 0 ? 118 : layout::mxfp4_expert_offset(max_e); }
float mx_global(int max_e) { return max_e < 0 ? 1.0f : layout::mxfp4_expert_global(max_e); }

__global__ void mx_max_kernel(const uint8_t* codes, const uint8_t* scales, int num_experts, int64_t n, int64_t k,
                              int* max_e, int* status, long long* bad_index) {
  const int64_t per_expert = n * k / 32;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < per_expert * num_experts;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e = i / per_expert, local = i - e * per_expert;
    const int64_t r = local / (k / 32), b = local % (k / 32);
    const uint8_t s = scales[i];
    if (s == 0xff) {
      atomicExch(status, static_cast<int>(kMxNaN));
      atomicMin(bad_index, static_cast<long long>(i));
    } else if (mx_block_nonzero(codes + e * (n * k / 2), r, b, k)) {
      atomicMax(max_e + e, static_cast<int>(s));
    }
  }
}

// One thread per repacked scale byte; the first thread of each expert also writes its global scale.
__global__ void mx_scale_kernel(const uint8_t* codes, const uint8_t* scales, int num_experts, int64_t n, int64_t k,
                                RowOrder order, const int* max_e, uint8_t* scales_out, float* global_out, int* status,
                                long long* bad_index) {
  const int64_t per_expert = n * k / 16;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < per_expert * num_experts;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e = i / per_expert, local = i - e * per_expert;
    const int me = max_e[e];
    if (local == 0) {
      global_out[e] = me < 0 ? 1.0f : layout::mxfp4_expert_global(me);
      if (me >= 0 && me < layout::kMxfp4MinMaxExponent) {
        atomicExch(status, static_cast<int>(kMxTiny));
        atomicMin(bad_index, static_cast<long long>(e));
      }
    }
    // local = (mtile * (k/64) + chunk) * 64 + g * 8 + j * 2 + half
    const int64_t mc = local >> 6;
    const int sl = static_cast<int>(local & 63);
    const int g = sl >> 3, j = (sl >> 1) & 3, half = sl & 1;
    const int64_t mtile = mc / (k / 64), chunk = mc % (k / 64);
    int st = kMxOk;
    int64_t blk = 0;
    const uint8_t v = repack_mx_scale(codes + e * (n * k / 2), scales + e * (n * k / 32), n, k, order, mtile, chunk, g,
                                      j, half, me < 0 ? 118 : 254 - me, &st, &blk);
    scales_out[i] = v;
    if (st != kMxOk) {
      atomicExch(status, st);
      atomicMin(bad_index, static_cast<long long>(e * (n * k / 32) + blk));
    }
  }
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
  unpack_nvfp4_codes_only(codes_in, n, k, order, codes);
  for (int64_t mt = 0; mt < n / 16; ++mt)
    for (int64_t c = 0; c < k / 64; ++c) {
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

void repack_mxfp4_weights(const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t k, bool gate_up_interleave,
                          uint8_t* codes_out, uint8_t* scales_out, float* global_out) {
  check_shape(n, k);
  FP4MOE_REQUIRE(codes && scales && codes_out && scales_out && global_out,
                 "repack: null pointer among codes/scales/outputs/global");
  const RowOrder order = gate_up_interleave ? RowOrder::kGateUp : RowOrder::kPairs;
  int status = kMxOk;
  int64_t bad = 0;
  const int max_e = mx_max_exponent(codes, scales, n, k, &status, &bad);
  if (status != kMxOk) throw_bad_mx(status, bad, n, k, max_e);
  if (max_e >= 0 && max_e < layout::kMxfp4MinMaxExponent) throw_bad_mx(kMxTiny, 0, n, k, max_e);
  const int c = mx_offset(max_e);
  *global_out = mx_global(max_e);
  for (int64_t mt = 0; mt < n / 16; ++mt)
    for (int64_t ch = 0; ch < k / 64; ++ch) {
      for (int lane = 0; lane < 32; ++lane)
        for (int j = 0; j < 4; ++j) {
          const uint32_t wd = repack_word(codes, nullptr, n, k, order, mt, ch, lane, j);
          uint8_t* dst = codes_out + layout::codes_word_offset(mt, ch, lane, j, k);
          for (int b = 0; b < 4; ++b) dst[b] = static_cast<uint8_t>(wd >> (8 * b));
        }
      for (int g = 0; g < 8; ++g)
        for (int j = 0; j < 4; ++j)
          for (int half = 0; half < 2; ++half) {
            int st = kMxOk;
            int64_t blk = 0;
            const uint8_t v = repack_mx_scale(codes, scales, n, k, order, mt, ch, g, j, half, c, &st, &blk);
            if (st != kMxOk) throw_bad_mx(st, blk, n, k, max_e);
            scales_out[layout::scale_byte_offset(mt, ch, g, j, half, k)] = v;
          }
    }
}

void unpack_mxfp4_weights(const uint8_t* codes_in, const uint8_t* scales_in, float global, int64_t n, int64_t k,
                          bool gate_up_interleave, uint8_t* codes, uint8_t* scales) {
  check_shape(n, k);
  FP4MOE_REQUIRE(codes_in && scales_in && codes && scales, "unpack: null pointer among inputs/outputs");
  FP4MOE_REQUIRE(global > 0.0f && std::isfinite(global), "unpack: global = {} must be a positive float", global);
  const RowOrder order = gate_up_interleave ? RowOrder::kGateUp : RowOrder::kPairs;
  // global = 2^(118 - c): c from the exponent field of global
  const int c = 118 - (static_cast<int>((float_bits(global) >> 23) & 0xff) - 127);
  unpack_nvfp4_codes_only(codes_in, n, k, order, codes);
  for (int64_t mt = 0; mt < n / 16; ++mt)
    for (int64_t ch = 0; ch < k / 64; ++ch)
      for (int g = 0; g < 8; ++g)
        for (int j = 0; j < 4; ++j)
          for (int half = 0; half < 2; ++half) {
            const int64_t row = layout::disk_row(mt, g + 8 * half, n, order);
            const int b = scales_in[layout::scale_byte_offset(mt, ch, g, j, half, k)];
            scales[row * (k / 32) + ch * 2 + j / 2] = static_cast<uint8_t>(std::clamp(b - c, 0, 254));
          }
}

void repack_mxfp4_weights_device(const uint8_t* codes, const uint8_t* scales, int num_experts, int64_t n, int64_t k,
                                 bool gate_up_interleave, uint8_t* codes_out, uint8_t* scales_out, float* global_out,
                                 cudaStream_t stream) {
  check_shape(n, k);
  FP4MOE_REQUIRE(num_experts >= 1, "repack: num_experts = {} must be >= 1", num_experts);
  FP4MOE_REQUIRE(codes && scales && codes_out && scales_out && global_out,
                 "repack: null pointer among codes/scales/outputs/global");
  FP4MOE_REQUIRE(reinterpret_cast<uintptr_t>(codes_out) % 4 == 0, "repack: codes_out must be 4-byte aligned");
  const RowOrder order = gate_up_interleave ? RowOrder::kGateUp : RowOrder::kPairs;
  int* d_status = nullptr;
  long long* d_bad = nullptr;
  int* d_max = nullptr;
  FP4MOE_CUDA_CHECK(cudaMallocAsync(&d_status, sizeof(int), stream));
  FP4MOE_CUDA_CHECK(cudaMallocAsync(&d_bad, sizeof(long long), stream));
  FP4MOE_CUDA_CHECK(cudaMallocAsync(&d_max, sizeof(int) * num_experts, stream));
  const long long big = (1ll << 62);
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(d_status, 0, sizeof(int), stream));
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(d_bad, &big, sizeof(big), cudaMemcpyHostToDevice, stream));
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(d_max, 0xff, sizeof(int) * num_experts, stream));  // -1: no nonzero block
  const int threads = 256;
  auto blocks_for = [&](int64_t total) {
    return static_cast<int>(std::min<int64_t>((total + threads - 1) / threads, 65536));
  };
  mx_max_kernel<<<blocks_for(n * k / 32 * num_experts), threads, 0, stream>>>(codes, scales, num_experts, n, k, d_max,
                                                                              d_status, d_bad);
  FP4MOE_CUDA_CHECK_LAUNCH();
  // codes exactly as NVFP4's (no zero-scale rewrite); the NVFP4 scale writes are skipped (scales = null)
  repack_kernel<<<blocks_for(n * k / 8 * num_experts), threads, 0, stream>>>(codes, nullptr, num_experts, n, k, order,
                                                                             codes_out, nullptr, d_status, d_bad);
  FP4MOE_CUDA_CHECK_LAUNCH();
  mx_scale_kernel<<<blocks_for(n * k / 16 * num_experts), threads, 0, stream>>>(
      codes, scales, num_experts, n, k, order, d_max, scales_out, global_out, d_status, d_bad);
  FP4MOE_CUDA_CHECK_LAUNCH();
  int status = 0;
  long long bad = 0;
  std::vector<int> max_e(static_cast<size_t>(num_experts));
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(&status, d_status, sizeof(int), cudaMemcpyDeviceToHost, stream));
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(&bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost, stream));
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(max_e.data(), d_max, sizeof(int) * num_experts, cudaMemcpyDeviceToHost, stream));
  FP4MOE_CUDA_CHECK(cudaFreeAsync(d_status, stream));
  FP4MOE_CUDA_CHECK(cudaFreeAsync(d_bad, stream));
  FP4MOE_CUDA_CHECK(cudaFreeAsync(d_max, stream));
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (status != kMxOk) {
    const int64_t e = status == kMxTiny ? bad : bad / (n * k / 32);
    throw_bad_mx(status, bad, n, k, max_e[static_cast<size_t>(std::min<int64_t>(e, num_experts - 1))]);
  }
}

}  // namespace fp4moe

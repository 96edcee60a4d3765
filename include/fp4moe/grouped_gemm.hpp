// Grouped (per-expert) GEMM with NVFP4 weights and bf16 activations: the host API.
//
//   out[r, n] = epilogue( sum_k act[r, k] * W_e[n, k] )   for every row r of expert e
//
// Rows are in expert-sorted order; expert e owns rows [offsets[e], offsets[e+1]) (device array, so no
// host synchronization is needed and the call is CUDA-graph capturable). W_e is NVFP4:
// e2m1 codes * E4M3 block scale (16 along K) * FP32 global scale, repacked once by repack_nvfp4_*.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "fp4moe/config.hpp"
#include "fp4moe/arch.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe {

enum class GemmEpilogue {
  kPlain,         // out[r, n] = (acc * global + bias[e, n]) * row_scale[r]           -> [rows, N]
  kSwiGLU,        // out[r, j] = silu(gate_j) * up_j                                 -> [rows, N/2]
  kGptOssSwiGLU,  // gate=min(g,limit), up=clamp(u,-limit,limit), (up+1)*gate*sigmoid(alpha*gate)
};

// Repacked weights of all experts of one GEMM, in device memory (see repack_nvfp4_weights).
struct GroupedWeightsView {
  int num_experts = 0;
  int64_t n = 0;                            // output features per expert
  int64_t k = 0;                            // reduction size
  bool gate_up_interleaved = false;         // repacked for a SwiGLU epilogue (first N/2 rows gate)
  const uint8_t* codes = nullptr;           // repacked e2m1 codes, E * n * k / 2 bytes
  const uint8_t* scales = nullptr;          // repacked block scales, E * n * k / 16 bytes
  const float* global_scale = nullptr;      // [E]: dequant multiplier (ModelOpt weight_scale_2)
  const float* global_scale_up = nullptr;   // [E] or null: the up half's own global scale (SwiGLU)
  const float* bias = nullptr;              // [E, n] fp32 or null (gpt-oss), rows of the on-disk order
  // How the repacked scale bytes decode (nvfp4_weight_layout.hpp): kNvfp4 (repack_nvfp4_*) or kMxfp4
  // (repack_mxfp4_*, whose global_scale carries each expert's exponent offset).
  WeightFormat format = WeightFormat::kNvfp4;
};

struct GroupedGemmArgs {
  const void* act = nullptr;                // bf16 [max_rows, k], row stride k, 16-byte aligned
  const int32_t* expert_offsets = nullptr;  // device [E + 1], non-decreasing, offsets[E] <= max_rows
  int64_t max_rows = 0;                     // capacity the buffers were sized for
  const float* row_scale = nullptr;         // [max_rows] or null (router weights, plain epilogue only)
  void* out = nullptr;                      // bf16 [max_rows, n] or [max_rows, n/2] for SwiGLU
  GemmEpilogue epilogue = GemmEpilogue::kPlain;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  // Launch with programmatic dependent launch (sm_90+; see moe_combine in moe_layer.hpp).
  bool programmatic_launch = false;
  // With programmatic_launch: expert_offsets (and an extra set's) were complete before the previous
  // kernel in the stream began (GEMM2 reads the offsets GEMM1 read). The config then builds its
  // schedule and requests weights before waiting for the predecessor, whose output (`act`) it reads
  // only after the wait, while the predecessor's last CTAs finish: the stream configs fill their weight
  // ring; the pipeline and wgmma configs request their first stages' weights; the bt 32 tma configs
  // request their first tile's first stages' weights and claim from the tile counter only after the
  // wait. Ignored by the other tma configs and without programmatic_launch.
  bool offsets_ready_at_launch = false;
  // With programmatic_launch, stream configs only: expert_offsets are being written by the previous kernel
  // in the stream as the stable counting sort of these route_entries routing ids (ids outside
  // [0, num_experts) dropped; the layer's permutation), the ids were complete before that kernel began,
  // and an extra set's rows are [0, its max_rows). The kernel then counts the ids itself, builds its
  // schedule and starts streaming weights before waiting for the predecessor (GEMM1 after the
  // permutation). Ignored by the other configs and without programmatic_launch.
  const int32_t* route_ids = nullptr;
  int64_t route_entries = 0;
  // At most this many CTAs (0: as many as are resident at once, one wave); tile-scheduled configs only
  // (pipeline, wgmma, tma), whose CTAs then take more work tiles each in turn, e.g. to leave SMs to a
  // concurrent kernel. The stream configs split their work over every resident CTA and refuse it.
  int max_ctas = 0;
  // Optional timeline of a stream-config launch (a measuring aid: `fp4moe bench --mode gemm --trace`, in
  // a build configured with -DFP4MOE_STREAM_TRACE=ON): per warp of the grid, kStreamTraceSlots 64-bit
  // values (event times from %globaltimer in ns, summed waits, counts; kernels/sm80_nvfp4_grouped_stream.cuh
  // names them). trace_capacity is its length in values and must cover grouped_gemm_trace_values(cfg, k);
  // ignored by the other configs. Null: no trace.
  unsigned long long* trace = nullptr;
  size_t trace_capacity = 0;
  // Optional, tma configs (ignored by the others, and in an extra set's args): device int32[2], 8-byte
  // aligned, zero before its first launch; every launch leaves it zero. The CTAs then take work tiles in
  // arrival order (each its first by index, every later one claimed from this counter), so the CTAs that
  // start late or draw slow tiles take fewer instead of ending last. Results are bit-identical either
  // way (a tile is computed whole by one CTA). Launches that may run at the same time (other streams)
  // need their own counters; launches in one stream may share one (each reads it only once its
  // predecessor completed, after griddepcontrol.wait under a programmatic launch). Null: each CTA takes
  // every grid-th tile from its index.
  int32_t* tile_counter = nullptr;
};

// int32s between the tile counters of launches that share one buffer (the layer's four, the GEMM bench's
// two): 128 bytes, so their atomics never share a cache line.
inline constexpr int kTileCounterStride = 32;

// Values a stream-config launch writes to GroupedGemmArgs::trace on this GPU (0 for other configs).
size_t grouped_gemm_trace_values(const TileConfig& cfg, GemmEpilogue epilogue, int64_t k);

// Validates (shapes, alignment, config fits) and launches; never synchronizes, allocates nothing.
// Throws fp4moe::Error naming the argument, the value and the rule.
void grouped_gemm_nvfp4(const GroupedWeightsView& w, const GroupedGemmArgs& args, const TileConfig& cfg,
                        cudaStream_t stream);

// Two weight sets in one launch: `w`/`args` (the routed experts) and `extra_w`/`extra_args` (one expert,
// e.g. a shared expert seeing every token). The extra set must have the same n, k, row order and
// epilogue; it has its own activations, expert_offsets (2 entries), max_rows and output, and no row
// scale. Its tiles are scheduled with the routed experts' tiles, so a small shared expert does not run
// as a separate, mostly idle launch.
void grouped_gemm_nvfp4(const GroupedWeightsView& w, const GroupedGemmArgs& args, const GroupedWeightsView& extra_w,
                        const GroupedGemmArgs& extra_args, const TileConfig& cfg, cudaStream_t stream);

// The compiled kernel's own attributes for a config (registers, static smem, max threads), from
// cudaFuncGetAttributes; needs a GPU. Throws if cfg is not in kGemmConfigs.
cudaFuncAttributes grouped_gemm_kernel_attributes(const TileConfig& cfg, GemmEpilogue epilogue);

// CTAs per SM of the compiled kernel with its launch shared memory (CUDA occupancy calculator) for a
// GEMM of reduction size k (stream configs hold the activation rows for the whole K); needs a GPU.
// Throws a ResourceError when the config cannot be resident.
int grouped_gemm_max_active_ctas(const TileConfig& cfg, GemmEpilogue epilogue, int64_t k = 64);

// The configuration the heuristic picks for a problem (rows_per_expert = expected rows of an active
// expert, e.g. T * top_k / E) on an architecture (arch_from_device, or arch_from_name for a GPU that
// is not present): always a config the planner calls valid there. Throws when none is. `why`, if
// given, receives the rule that picked it (and what it replaced when Hopper's pick cannot run here).
TileConfig heuristic_tile_config(int64_t n, int64_t k, double rows_per_expert, const ArchInfo& arch,
                                 std::string* why = nullptr);

// ---- Offline repack: on-disk (ModelOpt) layout -> kernel layout ----
// codes: [n, k/2] bytes, element 2i in the low nibble; scales: [n, k/16] E4M3, row-major.
// gate_up_interleave: the n rows are [gate (n/2 rows); up (n/2 rows)] and are interleaved per 16-row
// tile (8 gate rows, then the same 8 up rows) so SwiGLU happens in registers.
// Requirements (checked): n % 16 == 0, k % 64 == 0, scales finite and >= 0 (a zero scale block must
// have zero codes' value; it is stored as the smallest scale with zero codes).
size_t repacked_codes_bytes(int64_t n, int64_t k);
size_t repacked_scales_bytes(int64_t n, int64_t k);
void repack_nvfp4_weights(const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t k,
                          bool gate_up_interleave, uint8_t* codes_out, uint8_t* scales_out);
// The inverse (tests): kernel layout -> on-disk layout.
void unpack_nvfp4_weights(const uint8_t* codes_in, const uint8_t* scales_in, int64_t n, int64_t k,
                          bool gate_up_interleave, uint8_t* codes, uint8_t* scales);
// The same repack on the device, for weights already in device memory (one expert per call,
// or num_experts consecutive experts of identical shape).
void repack_nvfp4_weights_device(const uint8_t* codes, const uint8_t* scales, int num_experts, int64_t n,
                                 int64_t k, bool gate_up_interleave, uint8_t* codes_out,
                                 uint8_t* scales_out, cudaStream_t stream);

// ---- MXFP4 (OCP: E8M0 scale 2^(e-127) per 32 elements along K) into the same kernel layout ----
// codes: [n, k/2] as above; scales: [n, k/32] E8M0. Each per-32 scale fills the two per-16 slots of
// the NVFP4 layout with the byte e + c_expert (nvfp4_weight_layout.hpp), and global_out[0] (per expert)
// receives 2^(max_e - 136), the scale the epilogue applies; the kernel then reproduces the MXFP4
// values exactly. Refused, naming expert, row and k-block: an E8M0 NaN (0xFF); a block with nonzero
// codes more than 126 binades below the expert's largest (its bf16 products would be subnormal);
// an expert whose largest scale is below 2^-117. Requires n % 16 == 0, k % 64 == 0.
void repack_mxfp4_weights(const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t k,
                          bool gate_up_interleave, uint8_t* codes_out, uint8_t* scales_out, float* global_out);
// The inverse (tests): codes and the E8M0 scales of every block with a nonzero code (a block whose
// codes are all zero dequantizes to zero whatever its scale; its scale is returned clamped).
void unpack_mxfp4_weights(const uint8_t* codes_in, const uint8_t* scales_in, float global, int64_t n, int64_t k,
                          bool gate_up_interleave, uint8_t* codes, uint8_t* scales);
// num_experts consecutive experts in device memory; global_out: device [num_experts]. Synchronizes
// `stream` once (to report malformed scales).
void repack_mxfp4_weights_device(const uint8_t* codes, const uint8_t* scales, int num_experts, int64_t n,
                                 int64_t k, bool gate_up_interleave, uint8_t* codes_out, uint8_t* scales_out,
                                 float* global_out, cudaStream_t stream);

}  // namespace fp4moe

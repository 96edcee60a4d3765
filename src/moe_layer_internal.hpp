// Pieces of the MoE layer shared by MoeLayer (moe_layer.cu) and EpMoeLayer (ep_moe_layer.cu): weight
// repacking into owned memory, the tile-config choice per token bucket and the two expert GEMM stages.
// One definition each, so the expert-parallel layer runs exactly the single-GPU layer's arithmetic
// (same GEMM launches, same fused shared expert, same tile rule) and its output stays bit-identical.
// Internal to the library (src/), not a public header.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "fp4moe/arch.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/weight_padding.hpp"

namespace fp4moe::detail {

OwnedDeviceBuffer copy_to_owned(const void* src, size_t bytes, cudaStream_t stream);
// The device side of a PadCopy (weight_padding.hpp): zero dst, then the strided copy from src.
void pad_copy_device(const PadCopy& c, const void* src, void* dst, cudaStream_t stream);

// The tile counters of the layer's four GEMM launches (GroupedGemmArgs::tile_counter): routed GEMM1, the
// shared expert's own GEMM1, routed GEMM2, the shared GEMM2; kTileCounterStride (grouped_gemm.hpp) apart.
// Owned by the layer and zeroed once here (each launch leaves its counter zero), because the caller's
// workspace arrives uninitialized.
inline constexpr int kLayerTileCounters = 4;
OwnedDeviceBuffer make_tile_counters(cudaStream_t stream);

// One grouped GEMM's weights repacked into memory the layer owns, and the view the kernel reads.
struct RepackedGemm {
  OwnedDeviceBuffer codes, scales, global, global_up, bias;
  GroupedWeightsView view;
};

// format: NVFP4 (global = the [E] FP32 scales) or MXFP4 (the repack computes each expert's FP32 scale
// from its E8M0 exponents; global is ignored). n_pad / k_pad (0 = n / k): the size the kernels run;
// the caller's n x k tensors are zero-padded to it first (weight_padding.hpp; gate_up pads each half),
// and a malformed scale is then reported with the mapping back to the caller's rows.
RepackedGemm repack_gemm(const uint8_t* codes, const uint8_t* scales, const float* global,
                         const float* global_up, const float* bias, int num_experts, int64_t n, int64_t k,
                         bool gate_up, WeightFormat format, cudaStream_t stream, int64_t n_pad = 0,
                         int64_t k_pad = 0);

// The layer's quantized GEMM operands, repacked at the widths the kernels run: GEMM1 (gate/up
// interleaved) and GEMM2 of `num_experts` stacked experts, and the shared expert's two when cfg has
// one and `w` gives it quantized (shared1/2 stay empty otherwise). Widths that are not multiples of 64
// are zero-padded (MoeConfig::kernel_intermediate, kernel_shared_intermediate).
struct LayerGemms {
  RepackedGemm gemm1, gemm2, shared1, shared2;
};
LayerGemms repack_layer_gemms(const MoeConfig& cfg, const MoeLayerWeights& w, int num_experts, cudaStream_t stream);

// Automatic tile configs per token bucket [2^b, 2^(b+1)), b = 0 .. log2(max_tokens): tuner cache, else
// heuristic, for the problems of `cfg` (all cfg.num_experts experts, cfg.top_k). Resolved once at
// construction so forward() never reads the cache file.
// shared_nvfp4 = false: the shared expert (if any) does not run on the grouped GEMM (bf16 shared expert).
std::vector<MoeResolvedTileConfigs> resolve_auto_tiles(const MoeConfig& cfg, int64_t max_tokens, const ArchInfo& arch,
                                                       bool shared_nvfp4 = true);
// The bucket of `tokens`, then the explicit overrides.
MoeResolvedTileConfigs pick_tiles(const std::vector<MoeResolvedTileConfigs>& auto_tiles,
                                  const MoeTileConfigs& overrides, int64_t tokens);

// The buffers of the two expert GEMM stages. Routed rows are expert-sorted: expert e of the weight set
// owns rows [expert_offsets[e], expert_offsets[e + 1]) (device array). The shared expert (when the
// config has one) sees `shared_rows` rows of shared_act in token order, with offsets {0, T}.
struct ExpertGemmBuffers {
  const void* sorted = nullptr;            // bf16 [rows, H]
  const int32_t* expert_offsets = nullptr;
  int64_t rows = 0;                        // capacity of the routed buffers (max_rows)
  const float* row_scale = nullptr;        // [rows]: routing weight per sorted row
  void* gemm1_out = nullptr;               // bf16 [rows, I]
  void* gemm2_out = nullptr;               // bf16 [rows, H]
  const void* shared_act = nullptr;        // bf16 [shared_rows, H]
  const int32_t* shared_offsets = nullptr; // [2]
  int64_t shared_rows = 0;
  void* shared_gemm1_out = nullptr;        // bf16 [shared_rows, Is]
  void* shared_gemm2_out = nullptr;        // bf16 [shared_rows, H]
  bool programmatic_launch = false;        // GroupedGemmArgs::programmatic_launch of every launch
  // The routing ids the permutation (the launch right before GEMM1) sorts, complete before it began:
  // GEMM1's stream configs count them before waiting (GroupedGemmArgs::route_ids). Null: they wait.
  const int32_t* route_ids = nullptr;
  int64_t route_entries = 0;
  // make_tile_counters' buffer: the tma configs take work tiles in arrival order. Null: static shares.
  int32_t* tile_counters = nullptr;
};

// The weights of the four GEMM calls (shared1/shared2 null when cfg.num_shared == 0 or when the shared
// expert is not NVFP4: the caller runs it).
struct ExpertGemmWeights {
  const GroupedWeightsView* gemm1 = nullptr;
  const GroupedWeightsView* gemm2 = nullptr;
  const GroupedWeightsView* shared1 = nullptr;
  const GroupedWeightsView* shared2 = nullptr;
};

// GEMM1 (+ activation) and GEMM2 (x routing weight) of the routed experts and the shared expert.
// A shared expert of the routed experts' width (num_shared == 1) runs inside the routed launches.
// shared_gemm1_elsewhere: the caller launched the shared GEMM1 itself (run_shared_gemm1, on a second
// stream); join_before_shared: an event the shared GEMM2 waits for (that stream's end), its launch then
// without programmatic dependent launch (its predecessor is no longer one kernel).
void run_expert_gemm1(const MoeConfig& cfg, const ExpertGemmWeights& w, const ExpertGemmBuffers& b,
                      const MoeResolvedTileConfigs& tiles, cudaStream_t stream, bool shared_gemm1_elsewhere = false);
void run_expert_gemm2(const MoeConfig& cfg, const ExpertGemmWeights& w, const ExpertGemmBuffers& b,
                      const MoeResolvedTileConfigs& tiles, cudaStream_t stream, cudaEvent_t join_before_shared = nullptr);

// Whether the layer runs the shared expert's GEMM1 on a second stream, forked at the start of the call
// (it reads the layer's input in token order, nothing of the permutation) and joined before the shared
// GEMM2, instead of between the routed GEMM1 and the routed GEMM2. Only where the shared expert has
// launches of its own in both GEMMs and the routed GEMM1 claims its work tiles in arrival order (a tma
// config with tile counters), so that its CTAs may start on whichever SMs the shared GEMM1 leaves and
// take the tiles that remain (a statically split stream kernel would wait for its last CTA).
// What it buys, measured on an H200 (bench/NOTES.md, thirteenth session): not an overlap with the
// permutation. A tma CTA holds its SM's whole register file, so no other kernel's CTA runs beside it:
// where the shared GEMM1 starts first (the multi-kernel permutation, T * k > 4096) the permutation waits
// for its SMs (T = 4096: the scatter ~250 us) and the layer is level. Where the one-launch permutation
// runs first, the shared GEMM1 still runs in the routed GEMM1's tail, but the routed GEMM2 no longer
// waits for it (it is no longer the routed GEMM2's programmatic predecessor): the two share the SMs the
// routed GEMM1 leaves. Layer -1 to -5% at T = 384..1024 (GLM-5, Kimi-K2), level at 2048..4096.
bool fork_shared_gemm1(const MoeConfig& cfg, const ExpertGemmWeights& w, const ExpertGemmBuffers& b,
                       const MoeResolvedTileConfigs& tiles);
// The shared GEMM1 alone (not fused, no programmatic dependent launch: the first kernel of its stream).
void run_shared_gemm1(const MoeConfig& cfg, const ExpertGemmWeights& w, const ExpertGemmBuffers& b,
                      const MoeResolvedTileConfigs& tiles, cudaStream_t stream);

}  // namespace fp4moe::detail

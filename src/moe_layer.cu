// MoeLayer: host launch code of the whole MoE layer (moe_layer.hpp). Device code lives in
// include/fp4moe/kernels/{routing_topk,moe_permute,moe_combine}.cuh.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <utility>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/kernels/bf16_shared_swiglu.cuh"
#include "fp4moe/kernels/moe_combine.cuh"
#include "fp4moe/kernels/moe_permute.cuh"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/kernels/routing_topk.cuh"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/tuner.hpp"
#include "fp4moe/weight_padding.hpp"
#include "launch.hpp"
#include "moe_layer_internal.hpp"

namespace fp4moe {

static_assert(kernels::kPermuteChunk == kMoePermuteChunk,
              "the workspace layout (moe_layer_plan.cpp) sizes the chunk counts with kMoePermuteChunk");

namespace {

// cuBLAS's recommended user workspace on Hopper. Given explicitly so that the router GEMM allocates
// nothing while a CUDA graph is being captured.
constexpr size_t kCublasWorkspaceBytes = 32u << 20;

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

namespace detail {

OwnedDeviceBuffer copy_to_owned(const void* src, size_t bytes, cudaStream_t stream) {
  if (src == nullptr) return {};
  OwnedDeviceBuffer b(bytes, "a copy of the layer's weights");
  FP4MOE_CUDA_CHECK(cudaMemcpyAsync(b.get(), src, bytes, cudaMemcpyDeviceToDevice, stream));
  return b;
}

OwnedDeviceBuffer make_tile_counters(cudaStream_t stream) {
  OwnedDeviceBuffer b(static_cast<size_t>(kLayerTileCounters) * kTileCounterStride * sizeof(int32_t),
                      "the layer's GEMM tile counters");
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(b.get(), 0, b.bytes(), stream));
  return b;
}

void pad_copy_device(const PadCopy& c, const void* src, void* dst, cudaStream_t stream) {
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(dst, 0, c.dst_bytes, stream));
  FP4MOE_CUDA_CHECK(cudaMemcpy2DAsync(dst, c.dpitch, src, c.spitch, c.width, c.height, cudaMemcpyDeviceToDevice,
                                      stream));
}

RepackedGemm repack_gemm(const uint8_t* codes, const uint8_t* scales, const float* global,
                         const float* global_up, const float* bias, int num_experts, int64_t n, int64_t k,
                         bool gate_up, WeightFormat format, cudaStream_t stream, int64_t n_pad, int64_t k_pad) {
  if (n_pad == 0) n_pad = n;
  if (k_pad == 0) k_pad = k;
  if (n_pad != n || k_pad != k) {
    // Zero-padded copies of the caller's tensors (weight_padding.hpp), repacked like any others. They
    // must outlive the repack's reads, hence the synchronization before they go.
    const GemmPadPlan plan = gemm_pad_plan(num_experts, n, k, n_pad, k_pad, gate_up, format);
    OwnedDeviceBuffer pc(plan.codes.dst_bytes, "zero-padded expert codes");
    OwnedDeviceBuffer ps(plan.scales.dst_bytes, "zero-padded expert scales");
    OwnedDeviceBuffer pb(bias != nullptr ? plan.bias.dst_bytes : 0, "zero-padded expert biases");
    pad_copy_device(plan.codes, codes, pc.get(), stream);
    pad_copy_device(plan.scales, scales, ps.get(), stream);
    if (bias != nullptr) pad_copy_device(plan.bias, bias, pb.get(), stream);
    RepackedGemm g;
    try {
      g = repack_gemm(pc.as<uint8_t>(), ps.as<uint8_t>(), global, global_up, bias != nullptr ? pb.as<float>() : nullptr,
                      num_experts, n_pad, k_pad, gate_up, format, stream);
    } catch (const Error& e) {
      // A malformed scale is reported in the padded copy's coordinates; say how they map back.
      throw Error(fmt::format("{} [counted in the zero-padded copy of the expert weights: {} x {} padded to {} x {}{}]",
                              e.what(), n, k, n_pad, k_pad,
                              gate_up && n_pad != n ? fmt::format("; up-projection row r is padded row {} + r", n_pad / 2)
                                                    : std::string()));
    }
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    return g;
  }
  RepackedGemm g;
  g.codes = OwnedDeviceBuffer(num_experts * repacked_codes_bytes(n, k), "repacked expert weight codes");
  g.scales = OwnedDeviceBuffer(num_experts * repacked_scales_bytes(n, k), "repacked expert weight scales");
  if (format == WeightFormat::kMxfp4) {
    // the repack writes each expert's FP32 scale (its exponent offset) next to the scale bytes
    g.global = OwnedDeviceBuffer(num_experts * sizeof(float), "MXFP4 per-expert scales");
    repack_mxfp4_weights_device(codes, scales, num_experts, n, k, gate_up, g.codes.as<uint8_t>(),
                                g.scales.as<uint8_t>(), g.global.as<float>(), stream);
  } else {
    repack_nvfp4_weights_device(codes, scales, num_experts, n, k, gate_up, g.codes.as<uint8_t>(),
                                g.scales.as<uint8_t>(), stream);
    g.global = copy_to_owned(global, num_experts * sizeof(float), stream);
  }
  g.global_up = copy_to_owned(global_up, num_experts * sizeof(float), stream);
  g.bias = copy_to_owned(bias, static_cast<size_t>(num_experts * n) * sizeof(float), stream);
  g.view.num_experts = num_experts;
  g.view.n = n;
  g.view.k = k;
  g.view.gate_up_interleaved = gate_up;
  g.view.codes = g.codes.as<uint8_t>();
  g.view.scales = g.scales.as<uint8_t>();
  g.view.global_scale = g.global.as<float>();
  g.view.global_scale_up = g.global_up.as<float>();
  g.view.bias = g.bias.as<float>();
  g.view.format = format;
  return g;
}

LayerGemms repack_layer_gemms(const MoeConfig& c, const MoeLayerWeights& w, int E, cudaStream_t stream) {
  // I and Is as given, Ik and Isk as the kernels run them.
  const int64_t H = c.hidden, I = c.intermediate, Is = I * c.num_shared;
  const int64_t Ik = c.kernel_intermediate(), Isk = c.kernel_shared_intermediate();
  const WeightFormat f = c.format;
  LayerGemms g;
  g.gemm1 = repack_gemm(w.w13_codes, w.w13_scales, w.w13_global, w.w13_global_up, w.b13, E, 2 * I, H,
                        /*gate_up=*/true, f, stream, 2 * Ik, H);
  g.gemm2 = repack_gemm(w.w2_codes, w.w2_scales, w.w2_global, nullptr, w.b2, E, H, I, false, f, stream, H, Ik);
  if (c.num_shared > 0 && w.shared_w13_codes != nullptr) {
    g.shared1 = repack_gemm(w.shared_w13_codes, w.shared_w13_scales, w.shared_w13_global, w.shared_w13_global_up,
                            w.shared_b13, 1, 2 * Is, H, true, f, stream, 2 * Isk, H);
    g.shared2 = repack_gemm(w.shared_w2_codes, w.shared_w2_scales, w.shared_w2_global, nullptr, w.shared_b2, 1, H,
                            Is, false, f, stream, H, Isk);
  }
  return g;
}

}  // namespace detail

using detail::copy_to_owned;
using detail::pad_copy_device;
using detail::RepackedGemm;
using detail::repack_gemm;

namespace {

void launch_shared_swiglu(const float* gate_up, int64_t tokens, int64_t width, const MoeConfig& c,
                          void* out, cudaStream_t stream) {
  const int64_t n = tokens * width;
  const int threads = kernels::kSharedSwigluThreads;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 4096));
  kernels::bf16_shared_swiglu_kernel<<<blocks, threads, 0, stream>>>(
      gate_up, tokens, width, c.activation == Activation::kGptOssSwiGLU, c.swiglu_alpha, c.swiglu_limit,
      static_cast<__nv_bfloat16*>(out));
  FP4MOE_CUDA_CHECK_LAUNCH();
}

void launch_shared_offsets(int32_t* shared_offsets, int64_t tokens, cudaStream_t stream) {
  kernels::moe_shared_offsets_kernel<<<1, 32, 0, stream>>>(shared_offsets, static_cast<int32_t>(tokens));
  FP4MOE_CUDA_CHECK_LAUNCH();
}

template <int kPerLane>
void launch_routing(const kernels::RoutingParams& p, cudaStream_t stream) {
  const auto grid = static_cast<unsigned>((p.tokens + kernels::kRoutingWarps - 1) / kernels::kRoutingWarps);
  kernels::routing_topk_kernel<kPerLane><<<grid, kernels::kRoutingWarps * 32, 0, stream>>>(p);
  FP4MOE_CUDA_CHECK_LAUNCH();
}

template <int kPerLane>
void launch_routing_cta(const kernels::RoutingParams& p, cudaStream_t stream) {
  kernels::routing_topk_cta_kernel<kPerLane>
      <<<static_cast<unsigned>(p.tokens), kernels::kRoutingCtaWarps * 32, 0, stream>>>(p);
  FP4MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_route(const MoeConfig& cfg, const float* logits, const float* router_bias, int64_t tokens,
               int32_t* topk_ids, float* topk_weights, cudaStream_t stream, RoutingPath path) {
  validate_moe_layer_config(cfg);
  FP4MOE_REQUIRE(tokens >= 1, "moe_route: tokens = {} must be >= 1", tokens);
  FP4MOE_REQUIRE(logits != nullptr && topk_ids != nullptr && topk_weights != nullptr,
                 "moe_route: logits = {}, topk_ids = {}, topk_weights = {} must all be non-null",
                 static_cast<const void*>(logits), static_cast<const void*>(topk_ids),
                 static_cast<const void*>(topk_weights));
  FP4MOE_REQUIRE(cfg.router != RouterKind::kSoftmaxTopK || router_bias == nullptr,
                 "moe_route: config '{}' uses the softmax router, which takes no bias; router_bias must be null",
                 cfg.name);
  kernels::RoutingParams rp;
  rp.logits = logits;
  rp.bias = router_bias;
  rp.topk_ids = topk_ids;
  rp.topk_weights = topk_weights;
  rp.tokens = tokens;
  rp.num_experts = cfg.num_experts;
  rp.top_k = cfg.top_k;
  rp.n_group = cfg.router == RouterKind::kSigmoidGrouped ? cfg.n_group : 1;
  rp.topk_group = cfg.router == RouterKind::kSigmoidGrouped ? cfg.topk_group : 1;
  rp.renormalize = cfg.renormalize ? 1 : 0;
  rp.routed_scaling = cfg.routed_scaling;
  rp.kind = cfg.router;
  const int E = cfg.num_experts;
  // The CTA kernel's merge holds one candidate per lane (kRoutingCtaWarps x k <= 32).
  const bool cta_applies = kernels::kRoutingCtaWarps * rp.top_k <= 32;
  FP4MOE_REQUIRE(path != RoutingPath::kCtaPerToken || cta_applies,
                 "moe_route: path = kCtaPerToken needs top_k <= {} (config '{}': top_k = {})",
                 32 / kernels::kRoutingCtaWarps, cfg.name, rp.top_k);
  // Automatic only where the warp kernel holds 8 or more experts per lane: at 128 experts the CTA kernel
  // measured level (gpt-oss-120b) to 0.3 us slower (qwen3-30b's softmax, two barriers and the merge),
  // at 256 / 384 it took 2.9 / 3.1 us instead of 3.6 / 5.4 (H100, bench/NOTES.md, twenty-fifth session).
  // With grouped selection at any token count: the warp kernel's group pass (a butterfly per group, a
  // division per expert and group) took 11.8-12.4 us at DeepSeek-V3's 256 experts and 8 groups up to
  // T = 256, 15.6 at 1024 and 31.7 at 4096, the CTA kernel 4.6-5.1 / 8.3 / 22.8 (H100, twenty-sixth
  // session).
  const bool cta = path == RoutingPath::kCtaPerToken ||
                   (path == RoutingPath::kAuto && cta_applies && cfg.num_experts > kRoutingCtaMinExperts &&
                    (tokens <= kRoutingCtaMaxTokens || rp.n_group > 1));
  if (cta) {
    constexpr int kSpan = 32 * kernels::kRoutingCtaWarps;  // experts per lane-slot across the warps
    if (E <= kSpan) launch_routing_cta<1>(rp, stream);
    else if (E <= 2 * kSpan) launch_routing_cta<2>(rp, stream);
    else launch_routing_cta<4>(rp, stream);  // E <= kMaxExperts = 4 x kSpan
    return;
  }
  if (E <= 32) launch_routing<1>(rp, stream);
  else if (E <= 64) launch_routing<2>(rp, stream);
  else if (E <= 128) launch_routing<4>(rp, stream);
  else if (E <= 256) launch_routing<8>(rp, stream);
  else launch_routing<16>(rp, stream);
}

namespace {
void require_rows(const char* fn, const void* p, const char* name, int64_t hidden_size) {
  FP4MOE_REQUIRE(p != nullptr && aligned(p, 16), "{}: {} = {} must be a non-null, 16-byte aligned device pointer",
                 fn, name, p);
  FP4MOE_REQUIRE(hidden_size > 0 && hidden_size % 8 == 0,
                 "{}: hidden_size = {} must be a positive multiple of 8 (rows move as 16-byte vectors)", fn,
                 hidden_size);
}
// Blocks per token of the one-thread-per-16-byte-column kernels (gather, combine).
int row_slices(int64_t h8, int threads) { return static_cast<int>((h8 + threads - 1) / threads); }

void launch_gather(const void* hidden, int64_t tokens, int64_t h8, const int32_t* row_of, int top_k, void* sorted,
                   cudaStream_t stream, bool pdl = false) {
  const int slices = row_slices(h8, kernels::kGatherThreads);
  detail::launch(kernels::moe_gather_kernel, dim3(static_cast<unsigned>(tokens * slices)), dim3(kernels::kGatherThreads),
                 0, stream, pdl, static_cast<const uint4*>(hidden), h8, slices, row_of, top_k,
                 static_cast<int>(tokens * top_k), static_cast<uint4*>(sorted));
}
}  // namespace

namespace {
// moe_permute_gather, and the layer's own launch (hidden_before_wait: see moe_permute_small_kernel).
void permute_gather(int num_experts, int top_k, int64_t tokens, const int32_t* topk_ids, const float* topk_weights,
                    int32_t* chunk_counts, int32_t* expert_offsets, int32_t* row_of, float* row_scale,
                    int32_t* shared_offsets, const void* hidden, int64_t hidden_size, void* sorted,
                    cudaStream_t stream, PermutePath path, bool pdl, bool hidden_before_wait) {
  FP4MOE_REQUIRE(num_experts >= 1 && num_experts <= kMaxExperts, "moe_permute: num_experts = {} must be in [1, {}]",
                 num_experts, kMaxExperts);
  FP4MOE_REQUIRE(top_k >= 1 && top_k <= kMaxTopK, "moe_permute: top_k = {} must be in [1, {}]", top_k, kMaxTopK);
  FP4MOE_REQUIRE(tokens >= 1 && tokens * top_k <= INT32_MAX / 2,
                 "moe_permute: tokens = {} must be >= 1 and tokens * top_k = {} within the int32 row range", tokens,
                 tokens * top_k);
  FP4MOE_REQUIRE(topk_ids && topk_weights && chunk_counts && expert_offsets && row_of && row_scale,
                 "moe_permute: topk_ids, topk_weights, chunk_counts, expert_offsets, row_of and row_scale must all "
                 "be non-null");
  const bool gather = hidden != nullptr || sorted != nullptr;
  if (gather) {
    require_rows("moe_permute_gather", hidden, "hidden", hidden_size);
    require_rows("moe_permute_gather", sorted, "sorted", hidden_size);
  }
  const int64_t n = tokens * top_k;
  const bool small = path == PermutePath::kSmall ||
                     (path == PermutePath::kAuto && n <= kernels::kSmallPermuteMaxEntries);
  if (small) {
    FP4MOE_REQUIRE(n <= kernels::kSmallPermuteMaxEntries,
                   "moe_permute_gather: the one-launch path takes tokens * top_k <= {}; got {} * {} = {}",
                   kernels::kSmallPermuteMaxEntries, tokens, top_k, n);
    const int tpb = kernels::small_permute_tokens_per_block(tokens);
    const auto blocks = static_cast<unsigned>((tokens + tpb - 1) / tpb);
    const int64_t h8 = gather ? hidden_size / 8 : 0;
    if (gather) {
      // slices from the columns per slice, so that none is empty
      const int cols = kernels::small_permute_slice_cols(kernels::small_permute_slices(tpb, top_k, h8), h8);
      const auto slices = static_cast<unsigned>((h8 + cols - 1) / cols);
      // one slice: the kernel without the slice arithmetic (the code the layer ran before the slices)
      detail::launch(slices > 1 ? kernels::moe_permute_small_kernel<true, true> : kernels::moe_permute_small_kernel<true>,
                     dim3(blocks, slices), dim3(kernels::kSmallPermuteThreads), 0, stream, pdl, topk_ids,
                     topk_weights, static_cast<int>(tokens), top_k, num_experts, tpb, expert_offsets, row_of,
                     row_scale, shared_offsets, static_cast<const uint4*>(hidden), h8, static_cast<uint4*>(sorted),
                     hidden_before_wait ? 1 : 0, cols);
    } else {
      detail::launch(kernels::moe_permute_small_kernel<false>, dim3(blocks), dim3(kernels::kSmallPermuteThreads), 0,
                     stream, pdl, topk_ids, topk_weights, static_cast<int>(tokens), top_k, num_experts, tpb,
                     expert_offsets, row_of, row_scale, shared_offsets, nullptr, int64_t{0}, nullptr, 0, 0);
    }
    return;
  }
  const auto chunks = static_cast<unsigned>(moe_permute_chunks(n));
  detail::launch(kernels::moe_count_kernel, dim3(chunks), dim3(kernels::kPermuteWarps * 32), 0, stream, pdl,
                 topk_ids, n, num_experts, chunk_counts);
  detail::launch(kernels::moe_scan_kernel, dim3(1), dim3(kernels::kScanThreads), 0, stream, pdl, chunk_counts,
                 static_cast<int>(chunks), num_experts, expert_offsets, shared_offsets, static_cast<int32_t>(tokens));
  detail::launch(kernels::moe_scatter_kernel, dim3(chunks), dim3(kernels::kPermuteWarps * 32), 0, stream, pdl,
                 topk_ids, topk_weights, n, num_experts, chunk_counts, expert_offsets, row_of, row_scale);
  if (gather) launch_gather(hidden, tokens, hidden_size / 8, row_of, top_k, sorted, stream, pdl);
}
}  // namespace

void moe_permute_gather(int num_experts, int top_k, int64_t tokens, const int32_t* topk_ids,
                        const float* topk_weights, int32_t* chunk_counts, int32_t* expert_offsets, int32_t* row_of,
                        float* row_scale, int32_t* shared_offsets, const void* hidden, int64_t hidden_size,
                        void* sorted, cudaStream_t stream, PermutePath path, bool pdl) {
  permute_gather(num_experts, top_k, tokens, topk_ids, topk_weights, chunk_counts, expert_offsets, row_of, row_scale,
                 shared_offsets, hidden, hidden_size, sorted, stream, path, pdl, /*hidden_before_wait=*/false);
}

void moe_permute(int num_experts, int top_k, int64_t tokens, const int32_t* topk_ids, const float* topk_weights,
                 int32_t* chunk_counts, int32_t* expert_offsets, int32_t* row_of, float* row_scale,
                 int32_t* shared_offsets, cudaStream_t stream) {
  moe_permute_gather(num_experts, top_k, tokens, topk_ids, topk_weights, chunk_counts, expert_offsets, row_of,
                     row_scale, shared_offsets, nullptr, 0, nullptr, stream);
}

void moe_gather(const void* hidden, int64_t tokens, int64_t hidden_size, const int32_t* row_of, int top_k,
                void* sorted, cudaStream_t stream) {
  require_rows("moe_gather", hidden, "hidden", hidden_size);
  require_rows("moe_gather", sorted, "sorted", hidden_size);
  FP4MOE_REQUIRE(tokens >= 1 && top_k >= 1 && top_k <= kMaxTopK && row_of != nullptr,
                 "moe_gather: tokens = {} must be >= 1, top_k = {} in [1, {}], row_of non-null", tokens, top_k,
                 kMaxTopK);
  launch_gather(hidden, tokens, hidden_size / 8, row_of, top_k, sorted, stream);
}

namespace {
template <int kMaxK>
void launch_combine(const void* y, const void* shared_y, const int32_t* row_of, int top_k, int64_t tokens, int64_t h8,
                    void* out, cudaStream_t stream, bool pdl, bool rows_before_wait) {
  const int slices = row_slices(h8, kernels::kCombineThreads);
  detail::launch(kernels::moe_combine_kernel<kMaxK>, dim3(static_cast<unsigned>(tokens * slices)),
                 dim3(kernels::kCombineThreads), 0, stream, pdl, static_cast<const uint4*>(y),
                 static_cast<const uint4*>(shared_y), row_of, top_k, h8, slices, static_cast<uint4*>(out),
                 rows_before_wait ? 1 : 0);
}

// moe_combine, and the layer's own launch (rows_before_wait: see moe_combine_kernel).
void combine(const void* y, const void* shared_y, const int32_t* row_of, int top_k, int64_t tokens,
             int64_t hidden_size, void* out, cudaStream_t stream, bool pdl, bool rows_before_wait) {
  require_rows("moe_combine", y, "y", hidden_size);
  require_rows("moe_combine", out, "out", hidden_size);
  FP4MOE_REQUIRE(shared_y == nullptr || aligned(shared_y, 16), "moe_combine: shared_y = {} must be 16-byte aligned",
                 shared_y);
  FP4MOE_REQUIRE(tokens >= 1 && top_k >= 1 && top_k <= kMaxTopK && row_of != nullptr,
                 "moe_combine: tokens = {} must be >= 1, top_k = {} in [1, {}], row_of non-null", tokens, top_k,
                 kMaxTopK);
  const int64_t h8 = hidden_size / 8;
  // The smallest unrolled slot count >= k: registers hold kMaxK 16-byte vectors per thread.
  if (top_k <= 2) launch_combine<2>(y, shared_y, row_of, top_k, tokens, h8, out, stream, pdl, rows_before_wait);
  else if (top_k <= 4) launch_combine<4>(y, shared_y, row_of, top_k, tokens, h8, out, stream, pdl, rows_before_wait);
  else if (top_k <= 8) launch_combine<8>(y, shared_y, row_of, top_k, tokens, h8, out, stream, pdl, rows_before_wait);
  else launch_combine<16>(y, shared_y, row_of, top_k, tokens, h8, out, stream, pdl, rows_before_wait);
}
}  // namespace

void moe_combine(const void* y, const void* shared_y, const int32_t* row_of, int top_k, int64_t tokens,
                 int64_t hidden_size, void* out, cudaStream_t stream, bool pdl) {
  combine(y, shared_y, row_of, top_k, tokens, hidden_size, out, stream, pdl, /*rows_before_wait=*/false);
}

namespace detail {

std::vector<MoeResolvedTileConfigs> resolve_auto_tiles(const MoeConfig& cfg, int64_t max_tokens, const ArchInfo& arch,
                                                       bool shared_nvfp4) {
  MoeConfig c = cfg;
  if (!shared_nvfp4) c.num_shared = 0;  // the caller runs the shared expert itself
  std::vector<MoeResolvedTileConfigs> out;
  // at the resolution points 1, 2, 3, 4, 6, 8, 12, ..., 384, then quarter steps from 512 (tuner.hpp)
  for (int64_t t : layer_resolution_points(max_tokens)) out.push_back(moe_layer_tile_configs(c, t, arch));
  return out;
}

MoeResolvedTileConfigs pick_tiles(const std::vector<MoeResolvedTileConfigs>& auto_tiles,
                                  const MoeTileConfigs& overrides, int64_t tokens) {
  size_t b = 0;  // auto_tiles[b] holds the configs of the b-th resolution point
  for (int64_t t = 2; b + 1 < auto_tiles.size() && t <= tokens; t = next_layer_resolution_point(t)) ++b;
  MoeResolvedTileConfigs r = auto_tiles.at(b);
  if (overrides.gemm1) r.gemm1 = *overrides.gemm1;
  if (overrides.gemm2) r.gemm2 = *overrides.gemm2;
  if (overrides.shared_gemm1) r.shared_gemm1 = *overrides.shared_gemm1;
  if (overrides.shared_gemm2) r.shared_gemm2 = *overrides.shared_gemm2;
  return r;
}

// A shared expert of the routed experts' width runs inside the routed launch. With a stream config each
// of its token tiles streams the shared weights once more (no L2 reuse: rounds of one CTA), so beyond 8
// token tiles it gets launches of its own with its own config: GLM-5 at T = 128 with 8-token tiles
// made 16 passes (layer 0.70 of the read ceiling); separate launches at T = 32 cost ~60 us more than
// four passes (0.74 vs ~0.78). The tma configs follow the same rule: fused, every token tile of the
// routed tile width dequantizes the shared weights once more; beyond 8 tiles (GLM-5 from T = 512) the
// shared expert's own launch with its own, wider tile wins (same-machine A/B: GLM-5 / Kimi-K2 T = 1024
// -1 to -3%, T = 4096 -0 to -1.4%; separating it already at 8 tiles, T = 256, lost 2-3.5%;
// bench/NOTES.md). Pipeline configs run a wave's token tiles of one feature tile together (shared
// through L2) and always fuse.
bool fuse_shared_expert(const MoeConfig& c, bool shared, int64_t shared_rows, const TileConfig& routed) {
  const bool few_tiles = shared_rows <= 8 * static_cast<int64_t>(routed.bt);
  return c.num_shared == 1 && shared && (few_tiles || (routed.mma != 2 && routed.mma != 3));
}

static int32_t* tile_counter(const ExpertGemmBuffers& b, int launch) {
  return b.tile_counters != nullptr ? b.tile_counters + launch * kTileCounterStride : nullptr;
}

namespace {
// The two GEMM1 launches' arguments: routed (a) and shared (sa).
struct Gemm1Args {
  GroupedGemmArgs a, sa;
};
Gemm1Args gemm1_args(const MoeConfig& c, const ExpertGemmBuffers& b) {
  const GemmEpilogue act_epi =
      c.activation == Activation::kGptOssSwiGLU ? GemmEpilogue::kGptOssSwiGLU : GemmEpilogue::kSwiGLU;
  GroupedGemmArgs a;
  a.act = b.sorted;
  a.expert_offsets = b.expert_offsets;
  a.max_rows = b.rows;
  a.out = b.gemm1_out;
  a.programmatic_launch = b.programmatic_launch;
  a.epilogue = act_epi;
  a.swiglu_alpha = c.swiglu_alpha;
  a.swiglu_limit = c.swiglu_limit;
  GroupedGemmArgs sa = a;
  sa.act = b.shared_act;
  sa.expert_offsets = b.shared_offsets;
  sa.max_rows = b.shared_rows;
  sa.out = b.shared_gemm1_out;
  // The routed launch follows the permutation directly; a fused shared expert's rows are [0, shared_rows)
  a.route_ids = b.route_ids;
  a.route_entries = b.route_entries;
  a.tile_counter = tile_counter(b, 0);
  sa.tile_counter = tile_counter(b, 1);
  return {a, sa};
}
}  // namespace

void run_expert_gemm1(const MoeConfig& c, const ExpertGemmWeights& w, const ExpertGemmBuffers& b,
                      const MoeResolvedTileConfigs& tiles, cudaStream_t stream, bool shared_gemm1_elsewhere) {
  // A shared expert of the routed experts' width runs inside the routed GEMM launches (fused=true):
  // its few tiles would otherwise occupy a handful of SMs in a launch of their own (at T = 1, 32 CTAs
  // streaming 14 MB while 100 SMs idle). A wider shared expert (num_shared > 1) gets its own launches.
  // No shared views: none, or one the caller runs itself (a bf16 shared expert).
  const bool shared = c.num_shared > 0 && w.shared1 != nullptr;
  const bool fused_shared = fuse_shared_expert(c, shared, b.shared_rows, tiles.gemm1);
  FP4MOE_REQUIRE(!shared_gemm1_elsewhere || (shared && !fused_shared),
                 "run_expert_gemm1: the shared GEMM1 runs elsewhere only when it has a launch of its own");
  const Gemm1Args g = gemm1_args(c, b);
  if (fused_shared) {
    grouped_gemm_nvfp4(*w.gemm1, g.a, *w.shared1, g.sa, tiles.gemm1, stream);
  } else {
    grouped_gemm_nvfp4(*w.gemm1, g.a, tiles.gemm1, stream);
    if (shared && !shared_gemm1_elsewhere) grouped_gemm_nvfp4(*w.shared1, g.sa, tiles.shared_gemm1, stream);
  }
}

bool fork_shared_gemm1(const MoeConfig& c, const ExpertGemmWeights& w, const ExpertGemmBuffers& b,
                       const MoeResolvedTileConfigs& tiles) {
  const bool shared = c.num_shared > 0 && w.shared1 != nullptr && w.shared2 != nullptr;
  return shared && !fuse_shared_expert(c, shared, b.shared_rows, tiles.gemm1) &&
         !fuse_shared_expert(c, shared, b.shared_rows, tiles.gemm2) && tiles.gemm1.mma == 3 &&
         b.tile_counters != nullptr;
}

void run_shared_gemm1(const MoeConfig& c, const ExpertGemmWeights& w, const ExpertGemmBuffers& b,
                      const MoeResolvedTileConfigs& tiles, cudaStream_t stream) {
  FP4MOE_REQUIRE(fork_shared_gemm1(c, w, b, tiles), "run_shared_gemm1: the shared GEMM1 has no launch of its own here");
  GroupedGemmArgs sa = gemm1_args(c, b).sa;
  sa.programmatic_launch = false;  // the first kernel of its stream
  grouped_gemm_nvfp4(*w.shared1, sa, tiles.shared_gemm1, stream);
}

void run_expert_gemm2(const MoeConfig& c, const ExpertGemmWeights& w, const ExpertGemmBuffers& b,
                      const MoeResolvedTileConfigs& tiles, cudaStream_t stream, cudaEvent_t join_before_shared) {
  const bool shared = c.num_shared > 0 && w.shared2 != nullptr;
  const bool fused_shared = fuse_shared_expert(c, shared, b.shared_rows, tiles.gemm2);
  GroupedGemmArgs a;
  a.act = b.gemm1_out;
  a.expert_offsets = b.expert_offsets;
  a.max_rows = b.rows;
  a.programmatic_launch = b.programmatic_launch;
  a.offsets_ready_at_launch = true;  // GEMM1 read (and waited for) the same offsets
  a.row_scale = b.row_scale;
  a.out = b.gemm2_out;
  a.epilogue = GemmEpilogue::kPlain;
  GroupedGemmArgs sa = a;
  sa.act = b.shared_gemm1_out;
  sa.expert_offsets = b.shared_offsets;
  sa.max_rows = b.shared_rows;
  sa.row_scale = nullptr;
  sa.out = b.shared_gemm2_out;
  a.tile_counter = tile_counter(b, 2);
  sa.tile_counter = tile_counter(b, 3);
  FP4MOE_REQUIRE(join_before_shared == nullptr || (shared && !fused_shared),
                 "run_expert_gemm2: a join before the shared GEMM2 needs a launch of its own");
  if (fused_shared) {
    grouped_gemm_nvfp4(*w.gemm2, a, *w.shared2, sa, tiles.gemm2, stream);
  } else {
    grouped_gemm_nvfp4(*w.gemm2, a, tiles.gemm2, stream);
    if (shared) {
      if (join_before_shared != nullptr) {
        FP4MOE_CUDA_CHECK(cudaStreamWaitEvent(stream, join_before_shared, 0));
        // Its predecessors are now the routed GEMM2 and the other stream's last kernel: a launch that
        // waits for both in full (a programmatic edge is to one kernel).
        sa.programmatic_launch = false;
      }
      grouped_gemm_nvfp4(*w.shared2, sa, tiles.shared_gemm2, stream);
    }
  }
}

}  // namespace detail

struct MoeLayer::Impl {
  MoeConfig cfg;
  int64_t max_tokens = 0;
  int device = 0;
  int num_sms = 0;
  RepackedGemm gemm1, gemm2, shared1, shared2;
  OwnedDeviceBuffer router_bias, router_weight, cublas_workspace;
  OwnedDeviceBuffer shared_w13_bf16, shared_w2_bf16;  // a bf16 shared expert (cuBLAS GEMMs)
  // make_tile_counters: one forward() at a time per layer uses them (as it does the cuBLAS workspace)
  OwnedDeviceBuffer tile_counters;
  // The second stream of detail::fork_shared_gemm1 (the shared expert's GEMM1 at prefill) and its fork
  // and join events. One forward() at a time per layer, as above.
  cudaStream_t side_stream = nullptr;
  cudaEvent_t fork_event = nullptr, join_event = nullptr;
  cublasHandle_t cublas = nullptr;
  MoeTileConfigs tiles;
  // Automatic choices per token bucket [2^b, 2^(b+1)): tuner cache, else heuristic. Resolved once in
  // the constructor so forward() never reads the cache file.
  std::vector<MoeResolvedTileConfigs> auto_tiles;
  MoeWorkspaceLayout layout;
  // forward_routed's bad-id record (moe_routing_given.cuh): host memory mapped into the device, so the
  // host reads it without synchronizing. routing_error_dev is its device alias.
  unsigned long long* routing_error_host = nullptr;
  unsigned long long* routing_error_dev = nullptr;

  ~Impl() {
    if (cublas != nullptr) cublasDestroy(cublas);
    if (join_event != nullptr) cudaEventDestroy(join_event);
    if (fork_event != nullptr) cudaEventDestroy(fork_event);
    if (side_stream != nullptr) cudaStreamDestroy(side_stream);
    if (routing_error_host != nullptr) cudaFreeHost(routing_error_host);
  }
};

MoeLayer::MoeLayer(const MoeConfig& cfg, const MoeLayerWeights& w, int64_t max_tokens, cudaStream_t stream)
    : impl_(std::make_unique<Impl>()) {
  validate_moe_layer_config(cfg);
  validate_moe_layer_weights(cfg, w);
  FP4MOE_REQUIRE(max_tokens >= 1, "max_tokens = {} must be >= 1", max_tokens);
  Impl& m = *impl_;
  m.cfg = cfg;
  if (w.routed_only) m.cfg.num_shared = 0;  // the caller adds its own shared expert
  m.max_tokens = max_tokens;
  const bool shared_bf16 = m.cfg.num_shared > 0 && w.shared_w13_bf16 != nullptr;
  m.layout = moe_workspace_layout(m.cfg, max_tokens, w.router_weight != nullptr, shared_bf16);
  FP4MOE_CUDA_CHECK(cudaGetDevice(&m.device));
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&m.num_sms, cudaDevAttrMultiProcessorCount, m.device));

  const int E = cfg.num_experts;
  detail::LayerGemms g = detail::repack_layer_gemms(m.cfg, w, E, stream);
  m.gemm1 = std::move(g.gemm1);
  m.gemm2 = std::move(g.gemm2);
  m.shared1 = std::move(g.shared1);
  m.shared2 = std::move(g.shared2);
  if (shared_bf16) {
    // bf16 [2Is, H] (gate rows, up rows) and [H, Is], zero-padded like the NVFP4 experts (cuBLAS runs Isk).
    const int64_t H = cfg.hidden, Is = cfg.intermediate * m.cfg.num_shared, Isk = m.cfg.kernel_shared_intermediate();
    m.shared_w13_bf16 = OwnedDeviceBuffer(static_cast<size_t>(2 * Isk * H) * 2, "the bf16 shared expert's gate/up");
    m.shared_w2_bf16 = OwnedDeviceBuffer(static_cast<size_t>(H * Isk) * 2, "the bf16 shared expert's down projection");
    pad_copy_device(pad_rows(2, Is, Isk, H * 2), w.shared_w13_bf16, m.shared_w13_bf16.get(), stream);
    pad_copy_device(pad_cols(H, Is * 2, Isk * 2), w.shared_w2_bf16, m.shared_w2_bf16.get(), stream);
  }
  m.router_bias = copy_to_owned(w.router_bias, E * sizeof(float), stream);
  m.tile_counters = detail::make_tile_counters(stream);
  if (m.cfg.num_shared > 0 && !shared_bf16) {
    FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&m.side_stream, cudaStreamNonBlocking));
    FP4MOE_CUDA_CHECK(cudaEventCreateWithFlags(&m.fork_event, cudaEventDisableTiming));
    FP4MOE_CUDA_CHECK(cudaEventCreateWithFlags(&m.join_event, cudaEventDisableTiming));
  }
  if (w.router_weight != nullptr)
    m.router_weight = copy_to_owned(w.router_weight, static_cast<size_t>(E * cfg.hidden) * 2, stream);
  if (w.router_weight != nullptr || shared_bf16) {
    m.cublas_workspace = OwnedDeviceBuffer(kCublasWorkspaceBytes, "the layer's cuBLAS workspace");
    FP4MOE_CUBLAS_CHECK(cublasCreate(&m.cublas));
    FP4MOE_CUBLAS_CHECK(cublasSetWorkspace(m.cublas, m.cublas_workspace.get(), kCublasWorkspaceBytes));
  }
  m.auto_tiles = detail::resolve_auto_tiles(m.cfg, max_tokens, arch_from_device(m.device), /*shared_nvfp4=*/!shared_bf16);
  FP4MOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&m.routing_error_host), sizeof(unsigned long long),
                                  cudaHostAllocMapped));
  *m.routing_error_host = 0;
  FP4MOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&m.routing_error_dev), m.routing_error_host, 0));
  // The copies read the caller's buffers asynchronously; finishing here lets the caller free them.
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

MoeLayer::~MoeLayer() = default;
MoeLayer::MoeLayer(MoeLayer&&) noexcept = default;
MoeLayer& MoeLayer::operator=(MoeLayer&&) noexcept = default;

const MoeConfig& MoeLayer::config() const { return impl_->cfg; }
int64_t MoeLayer::max_tokens() const { return impl_->max_tokens; }
bool MoeLayer::has_router_weight() const { return impl_->router_weight.get() != nullptr; }
size_t MoeLayer::workspace_bytes() const { return impl_->layout.total; }
MoeWorkspaceLayout MoeLayer::workspace_layout() const { return impl_->layout; }
void MoeLayer::set_tile_configs(const MoeTileConfigs& tiles) { impl_->tiles = tiles; }

MoeResolvedTileConfigs MoeLayer::tile_configs(int64_t tokens) const {
  return detail::pick_tiles(impl_->auto_tiles, impl_->tiles, tokens);
}

MoeIntermediates MoeLayer::intermediates(void* workspace) const {
  const MoeWorkspaceLayout& l = impl_->layout;
  char* ws = static_cast<char*>(workspace);
  MoeIntermediates r;
  r.router_logits = has_router_weight() ? reinterpret_cast<float*>(ws + l.router_logits) : nullptr;
  r.topk_ids = reinterpret_cast<int32_t*>(ws + l.topk_ids);
  r.topk_weights = reinterpret_cast<float*>(ws + l.topk_weights);
  r.expert_offsets = reinterpret_cast<int32_t*>(ws + l.expert_offsets);
  r.row_of = reinterpret_cast<int32_t*>(ws + l.row_of);
  r.row_scale = reinterpret_cast<float*>(ws + l.row_scale);
  r.sorted_hidden = ws + l.sorted_hidden;
  r.gemm1_out = ws + l.gemm1_out;
  r.gemm2_out = ws + l.gemm2_out;
  r.shared_gemm2_out = impl_->cfg.num_shared > 0 ? ws + l.shared_gemm2_out : nullptr;
  return r;
}

void MoeLayer::forward(cudaStream_t stream, const void* hidden, int64_t tokens, const float* router_logits,
                       void* out, void* workspace, size_t workspace_size, const cudaEvent_t* stage_events) const {
  const Impl& m = *impl_;
  const MoeConfig& c = m.cfg;
  FP4MOE_REQUIRE(tokens >= 1 && tokens <= m.max_tokens,
                 "MoeLayer::forward: tokens = {} must be in [1, max_tokens = {}] (max_tokens is fixed at "
                 "construction; it sizes the workspace)", tokens, m.max_tokens);
  FP4MOE_REQUIRE(hidden != nullptr && aligned(hidden, 16),
                 "MoeLayer::forward: hidden = {} must be a non-null, 16-byte aligned bf16 [T, H] device pointer",
                 hidden);
  FP4MOE_REQUIRE(out != nullptr && aligned(out, 16),
                 "MoeLayer::forward: out = {} must be a non-null, 16-byte aligned bf16 [T, H] device pointer", out);
  FP4MOE_REQUIRE(router_logits != nullptr || has_router_weight(),
                 "MoeLayer::forward: router_logits is null and the layer has no router weight "
                 "(MoeLayerWeights::router_weight); pass fp32 [T, E] logits");
  FP4MOE_REQUIRE(router_logits == nullptr || aligned(router_logits, 4),
                 "MoeLayer::forward: router_logits = {} must be 4-byte aligned",
                 static_cast<const void*>(router_logits));
  FP4MOE_REQUIRE(workspace != nullptr && aligned(workspace, 16),
                 "MoeLayer::forward: workspace = {} must be a non-null, 16-byte aligned device pointer", workspace);
  FP4MOE_REQUIRE(workspace_size >= m.layout.total,
                 "MoeLayer::forward: workspace_size = {} bytes is less than workspace_bytes() = {} "
                 "(max_tokens = {})", workspace_size, m.layout.total, m.max_tokens);
  int device = -1;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  FP4MOE_REQUIRE(device == m.device,
                 "MoeLayer::forward: current device {} differs from device {} the layer was built on", device,
                 m.device);
  throw_pending_routing_error("MoeLayer::forward");

  const MoeIntermediates ws = intermediates(workspace);
  const int E = c.num_experts;
  const int64_t H = c.hidden;
  auto mark = [&](int i) {
    if (stage_events != nullptr)  // external: also an event node when the caller captures a graph
      detail::record_stage_event(stage_events[i], stream);
  };

  // ---- routing ----
  mark(0);
  const float* logits = router_logits;
  if (logits == nullptr) {
    // logits[T, E] (row-major) = hidden[T, H] . W[E, H]^T; in cuBLAS's column-major terms
    // C[E, T] = W^T (W is column-major [H, E]) times hidden (column-major [H, T]).
    const float one = 1.0f, zero = 0.0f;
    FP4MOE_CUBLAS_CHECK(cublasSetStream(m.cublas, stream));
    FP4MOE_CUBLAS_CHECK(cublasGemmEx(m.cublas, CUBLAS_OP_T, CUBLAS_OP_N, E, static_cast<int>(tokens),
                                     static_cast<int>(H), &one, m.router_weight.get(), CUDA_R_16BF,
                                     static_cast<int>(H), hidden, CUDA_R_16BF, static_cast<int>(H), &zero,
                                     ws.router_logits, CUDA_R_32F, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    logits = ws.router_logits;
  }
  moe_route(c, logits, m.router_bias.as<float>(), tokens, ws.topk_ids, ws.topk_weights, stream);
  mark(1);
  forward_experts(stream, hidden, tokens, ws.topk_ids, ws.topk_weights, out, workspace, stage_events);
}

void MoeLayer::forward_experts(cudaStream_t stream, const void* hidden, int64_t tokens, const int32_t* topk_ids,
                               const float* topk_weights, void* out, void* workspace,
                               const cudaEvent_t* stage_events) const {
  const Impl& m = *impl_;
  const MoeConfig& c = m.cfg;
  const MoeIntermediates ws = intermediates(workspace);
  char* base = static_cast<char*>(workspace);
  int32_t* chunk_counts = reinterpret_cast<int32_t*>(base + m.layout.chunk_counts);
  int32_t* shared_offsets = reinterpret_cast<int32_t*>(base + m.layout.shared_offsets);
  void* shared_gemm1_out = base + m.layout.shared_gemm1_out;
  const MoeResolvedTileConfigs tiles = tile_configs(tokens);
  const int E = c.num_experts, k = c.top_k;
  const int64_t H = c.hidden, n = tokens * k;
  auto mark = [&](int i) {
    if (stage_events != nullptr)  // external: also an event node when the caller captures a graph
      detail::record_stage_event(stage_events[i], stream);
  };

  const bool shared_bf16 = m.shared_w13_bf16.get() != nullptr;
  detail::ExpertGemmBuffers gb;
  gb.sorted = ws.sorted_hidden;
  gb.expert_offsets = ws.expert_offsets;
  gb.rows = n;
  gb.row_scale = ws.row_scale;
  gb.gemm1_out = ws.gemm1_out;
  gb.gemm2_out = ws.gemm2_out;
  gb.shared_act = hidden;  // the shared expert sees every token in order: no gather
  gb.shared_offsets = shared_offsets;
  gb.shared_rows = tokens;
  gb.shared_gemm1_out = shared_gemm1_out;
  gb.shared_gemm2_out = ws.shared_gemm2_out;
  gb.programmatic_launch = true;
  gb.tile_counters = m.tile_counters.as<int32_t>();
  // GEMM1's stream configs count the ids themselves (at most 16 KB, read by every CTA from L2) and start
  // streaming weights while the permutation runs, up to the one-launch permutation's size.
  if (n <= kMoeSmallPermuteMaxEntries) {
    gb.route_ids = topk_ids;
    gb.route_entries = n;
  }
  const detail::ExpertGemmWeights gw{&m.gemm1.view, &m.gemm2.view, shared_bf16 ? nullptr : &m.shared1.view,
                                     shared_bf16 ? nullptr : &m.shared2.view};

  // ---- the shared expert's GEMM1 on the second stream (prefill; detail::fork_shared_gemm1) ----
  // Forked here, joined before the shared GEMM2. Its offsets {0, T} come from a kernel of its own stream
  // (the permutation writes them otherwise). Event record / wait pairs are captured as graph edges, so
  // the call stays capturable.
  const bool fork = m.side_stream != nullptr && detail::fork_shared_gemm1(c, gw, gb, tiles);
  if (fork) {
    FP4MOE_CUDA_CHECK(cudaEventRecord(m.fork_event, stream));
    FP4MOE_CUDA_CHECK(cudaStreamWaitEvent(m.side_stream, m.fork_event, 0));
    launch_shared_offsets(shared_offsets, tokens, m.side_stream);
    detail::run_shared_gemm1(c, gw, gb, tiles, m.side_stream);
    FP4MOE_CUDA_CHECK(cudaEventRecord(m.join_event, m.side_stream));
  }

  // ---- permutation + gather ----
  // Every launch after routing uses programmatic dependent launch: each kernel's launch overlaps the
  // previous one's tail (at T = 1 five launches' latency is a fifth of the layer).
  // The hidden rows were final before routing (a launch without programmatic launch) began: the one-launch
  // permutation loads them before its wait (moe_permute_small_kernel).
  permute_gather(E, k, tokens, topk_ids, topk_weights, chunk_counts, ws.expert_offsets, ws.row_of, ws.row_scale,
                 c.num_shared > 0 && !fork ? shared_offsets : nullptr, hidden, H, ws.sorted_hidden, stream,
                 PermutePath::kAuto, /*pdl=*/true, /*hidden_before_wait=*/true);  // one launch when tokens * k <= 4096
  mark(2);

  // ---- GEMM1 (+ activation), GEMM2 (x routing weight) ----
  // A bf16 shared expert runs as two cuBLAS GEMMs around the SwiGLU kernel; an NVFP4 one inside the
  // routed launches or in its own (run_expert_gemm1/2).
  detail::run_expert_gemm1(c, gw, gb, tiles, stream, /*shared_gemm1_elsewhere=*/fork);
  if (shared_bf16) {
    // gate_up[T, 2Is] (fp32) = hidden[T, H] . W13[2Is, H]^T; column-major: C[2Is, T] = W13^T-view x hidden
    // (Is as the layer runs it: zero-padded to a multiple of 64, like the NVFP4 experts)
    const int64_t Is = c.kernel_shared_intermediate();
    float* gate_up = reinterpret_cast<float*>(base + m.layout.shared_gate_up);
    const float one = 1.0f, zero = 0.0f;
    FP4MOE_CUBLAS_CHECK(cublasSetStream(m.cublas, stream));
    FP4MOE_CUBLAS_CHECK(cublasGemmEx(m.cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(2 * Is),
                                     static_cast<int>(tokens), static_cast<int>(H), &one, m.shared_w13_bf16.get(),
                                     CUDA_R_16BF, static_cast<int>(H), hidden, CUDA_R_16BF, static_cast<int>(H), &zero,
                                     gate_up, CUDA_R_32F, static_cast<int>(2 * Is), CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
    launch_shared_swiglu(gate_up, tokens, Is, c, shared_gemm1_out, stream);
  }
  mark(3);
  detail::run_expert_gemm2(c, gw, gb, tiles, stream, fork ? m.join_event : nullptr);
  if (shared_bf16) {
    // out[T, H] (bf16) = act[T, Is] . W2[H, Is]^T
    const int64_t Is = c.kernel_shared_intermediate();
    const float one = 1.0f, zero = 0.0f;
    FP4MOE_CUBLAS_CHECK(cublasGemmEx(m.cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(H), static_cast<int>(tokens),
                                     static_cast<int>(Is), &one, m.shared_w2_bf16.get(), CUDA_R_16BF,
                                     static_cast<int>(Is), shared_gemm1_out, CUDA_R_16BF, static_cast<int>(Is), &zero,
                                     ws.shared_gemm2_out, CUDA_R_16BF, static_cast<int>(H), CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
  }
  mark(4);

  // ---- combine ----
  // row_of is the permutation's, from before GEMM1: its ids are read before the wait (moe_combine_kernel)
  combine(ws.gemm2_out, ws.shared_gemm2_out, ws.row_of, k, tokens, H, out, stream, /*pdl=*/true,
          /*rows_before_wait=*/true);
  mark(5);
}

void MoeLayer::throw_pending_routing_error(const char* fn) const {
  const std::string e = take_routing_error();
  FP4MOE_REQUIRE(e.empty(), "{}: {}", fn, e);
}

std::string MoeLayer::take_routing_error() const {
  const Impl& m = *impl_;
  // The device writes the record with a plain store; an atomic exchange on the host side reads and
  // clears it without losing a record written in between by a kernel still running.
  const unsigned long long r =
      std::atomic_ref<unsigned long long>(*m.routing_error_host).exchange(0, std::memory_order_acq_rel);
  return describe_routing_error(r, m.cfg.top_k, m.cfg.num_experts);
}

void MoeLayer::forward_routed(cudaStream_t stream, const void* hidden, int64_t tokens, const int32_t* topk_ids,
                              const float* topk_weights, void* out, void* workspace, size_t workspace_size,
                              const cudaEvent_t* stage_events) const {
  const Impl& m = *impl_;
  validate_moe_routed_args(m.cfg, m.max_tokens, m.layout.total, hidden, tokens, topk_ids, topk_weights, out,
                           workspace, workspace_size);
  int device = -1;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  FP4MOE_REQUIRE(device == m.device,
                 "MoeLayer::forward_routed: current device {} differs from device {} the layer was built on",
                 device, m.device);
  throw_pending_routing_error("MoeLayer::forward_routed");
  const MoeIntermediates ws = intermediates(workspace);
  if (stage_events != nullptr) detail::record_stage_event(stage_events[0], stream);
  moe_routing_given(m.cfg.num_experts, tokens * m.cfg.top_k, topk_ids, topk_weights, ws.topk_ids,
                    ws.topk_weights, m.routing_error_dev, stream);
  if (stage_events != nullptr) detail::record_stage_event(stage_events[1], stream);
  forward_experts(stream, hidden, tokens, ws.topk_ids, ws.topk_weights, out, workspace, stage_events);
}

void MoeLayer::route(cudaStream_t stream, const float* router_logits, int64_t tokens, int32_t* topk_ids,
                     float* topk_weights) const {
  const Impl& m = *impl_;
  FP4MOE_REQUIRE(tokens >= 1 && tokens <= m.max_tokens, "MoeLayer::route: tokens = {} must be in [1, max_tokens = {}]",
                 tokens, m.max_tokens);
  FP4MOE_REQUIRE(router_logits != nullptr && reinterpret_cast<uintptr_t>(router_logits) % 4 == 0,
                 "MoeLayer::route: router_logits = {} must be a non-null, 4-byte aligned fp32 [T, E] device pointer",
                 static_cast<const void*>(router_logits));
  moe_route(m.cfg, router_logits, m.router_bias.as<float>(), tokens, topk_ids, topk_weights, stream);
}

}  // namespace fp4moe

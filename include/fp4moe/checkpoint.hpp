// Real checkpoints: format detection, the model's MoE configuration from config.json, and one MoE
// layer's expert weights loaded into the layout MoeLayerWeights takes (moe_layer.hpp).
//
// Formats (docs/checkpoints.md has the details):
//   - ModelOpt NVFP4 (hf_quant_config.json quant_algo NVFP4, or MIXED_PRECISION with the experts NVFP4
//     in quantized_layers; config.json quantization_config.quant_method "modelopt"): per expert
//     {gate_proj, up_proj, down_proj} (Mixtral: w1, w3, w2) .weight U8 [N, K/2], .weight_scale F8_E4M3
//     [N, K/16], .weight_scale_2 F32 [] (the global dequantization scale).
//   - compressed-tensors "nvfp4-pack-quantized" (llm-compressor, NVFP4 and NVFP4A16): the same bytes as
//     .weight_packed, .weight_scale and .weight_global_scale = 1 / weight_scale_2 (a RECIPROCAL).
//   - gpt-oss MXFP4 (quantization_config.quant_method "mxfp4"): experts.gate_up_proj_blocks U8
//     [E, 2I, H/32, 16], _scales U8 (E8M0) [E, 2I, H/32], _bias BF16 [E, 2I], gate and up rows
//     INTERLEAVED (even rows gate); down_proj likewise; router mlp.router.{weight, bias}.
// Architectures: Qwen3-MoE, DeepSeek-V3 / Kimi-K2, GLM-4.5/4.6 (Glm4Moe), GLM-5, gpt-oss, Mixtral.
//
// Every error names the file (relative to the checkpoint directory) and the tensor or key.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "fp4moe/config.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe {

enum class CheckpointFormat { kModelOptNvfp4, kCompressedTensorsNvfp4, kGptOssMxfp4 };
std::string_view checkpoint_format_name(CheckpointFormat f);

enum class SharedExpertStorage { kNone, kQuantized, kBf16 };

struct CheckpointInfo {
  std::string dir;                 // as given
  std::string architecture;        // config.json architectures[0]
  std::string model_type;          // config.json model_type
  CheckpointFormat format = CheckpointFormat::kModelOptNvfp4;
  std::string format_detail;       // e.g. "quant_algo NVFP4, group_size 16, producer modelopt 0.47.0"
  int num_layers = 0;
  std::vector<int> moe_layers;     // decoder layers whose MLP is an MoE block
  MoeConfig moe;                   // every MoE layer's shapes and routing (name = the directory's basename)
  std::string layer_prefix_fmt;    // "model.layers.{}.mlp" or "model.layers.{}.block_sparse_moe"
  SharedExpertStorage shared = SharedExpertStorage::kNone;  // decided from the first MoE layer's tensors
  std::vector<std::string> unquantized;  // modules the quantization config keeps in bf16 (as listed there)
  bool activation_scales = false;  // input scales present (a W4A4 recipe); fp4moe keeps activations bf16
  // ModelOpt MIXED_PRECISION: module -> "quant_algo/group_size" from hf_quant_config.json's
  // quantized_layers; every expert projection loaded must be listed as NVFP4 with group size 16.
  std::map<std::string, std::string> quantized_layers;
  std::string layer_prefix(int layer) const;
};

// Reads config.json (+ hf_quant_config.json) and looks at the first MoE layer's tensors. Throws
// fp4moe::Error naming the file and the key for an unknown format or architecture.
CheckpointInfo inspect_checkpoint(const SafetensorsCheckpoint& ck);

// Host memory without the zero fill of std::vector (a 5 GB layer is written once, by the copy).
struct HostBytes {
  std::unique_ptr<uint8_t[]> p;
  size_t n = 0;
  HostBytes() = default;
  explicit HostBytes(size_t bytes);
  uint8_t* data() { return p.get(); }
  const uint8_t* data() const { return p.get(); }
  size_t size() const { return n; }
};

struct LoadOptions {
  // Routed experts only: the shared expert is not loaded and the layer's config has num_shared = 0;
  // the caller adds its own shared expert's output.
  bool routed_only = false;
  bool progress = true;  // a progress bar on stderr, only when stderr is a terminal
  int threads = 0;       // copy threads; 0 = min(8, hardware threads)
  // Where warnings go (e.g. a requantized gate/up pair); default: stderr.
  std::function<void(const std::string&)> warn;
};

// One MoE layer in host memory, in MoeLayerWeights' layout (moe_layer.hpp): experts stacked, gate rows
// then up rows in w13, NVFP4 global scales as dequantization multipliers (compressed-tensors'
// reciprocals inverted), gpt-oss rows de-interleaved and its biases in fp32.
struct HostMoeLayer {
  MoeConfig cfg;                       // format kNvfp4 or kMxfp4; num_shared = 0 when routed_only
  int layer = 0;
  HostBytes w13_codes, w13_scales;     // [E, 2I, H/2], [E, 2I, H/16] E4M3 | [E, 2I, H/32] E8M0
  HostBytes w2_codes, w2_scales;       // [E, H, I/2],  [E, H, I/16]       | [E, H, I/32]
  std::vector<float> w13_global, w2_global;  // [E] (NVFP4 only)
  std::vector<float> b13, b2;          // [E, 2I], [E, H] (gpt-oss only)
  std::vector<uint16_t> router_weight; // bf16 [E, H]
  std::vector<float> router_bias;      // [E] or empty
  SharedExpertStorage shared = SharedExpertStorage::kNone;
  // NVFP4 shared expert (one expert of width Is = I * num_shared)
  std::vector<uint8_t> shared_w13_codes, shared_w13_scales, shared_w2_codes, shared_w2_scales;
  float shared_w13_global = 1.0f, shared_w2_global = 1.0f;
  // bf16 shared expert: [2Is, H] (gate rows then up rows), [H, Is]
  std::vector<uint16_t> shared_w13_bf16, shared_w2_bf16;
  std::vector<std::string> warnings;
  size_t bytes() const;                // expert weight bytes held
};

// Loads decoder layer `layer` (one of info.moe_layers). Checks every tensor's dtype and shape, the
// global scales (finite, > 0), the E8M0 scales (no NaN); requantizes an expert's up projection to its
// gate's global scale when the two differ (with a warning).
HostMoeLayer load_moe_layer(const SafetensorsCheckpoint& ck, const CheckpointInfo& info, int layer,
                            const LoadOptions& opts = {});

// The CPU reference's view of a host layer (exact dequantization; shared expert as kSharedExpert).
class HostLayerExperts final : public ExpertProvider {
 public:
  explicit HostLayerExperts(const HostMoeLayer& layer) : l_(layer) {}
  std::shared_ptr<const ExpertWeights> expert(int e) const override;

 private:
  const HostMoeLayer& l_;
};

// The layer's router on the CPU: logits[t, e] = sum_h bf16(hidden[t, h]) * router_weight[e, h] in double,
// rounded to fp32. hidden: [tokens, H]. Feeding the same logits to the GPU layer and the CPU reference
// makes both route identically.
std::vector<float> host_router_logits(const HostMoeLayer& layer, std::span<const float> hidden, int64_t tokens);

// A layer uploaded to the GPU once: `weights` points into `buffers`.
struct DeviceMoeLayer {
  MoeConfig cfg;
  std::vector<OwnedDeviceBuffer> buffers;
  MoeLayerWeights weights;
};
DeviceMoeLayer upload_moe_layer(const HostMoeLayer& layer, cudaStream_t stream);

}  // namespace fp4moe

// One MoE layer from host memory to the GPU (checkpoint.hpp): each tensor copied once into a device
// buffer, MoeLayerWeights pointing into them. MoeLayer's constructor then repacks from these.
#include <cuda_runtime.h>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe {

DeviceMoeLayer upload_moe_layer(const HostMoeLayer& l, cudaStream_t stream) {
  DeviceMoeLayer d;
  d.cfg = l.cfg;
  // Copies that have landed when they return (the host layer may be freed as soon as this returns, and
  // `stream` may be a non-blocking stream, which is not ordered after a cudaMemcpy's DMA: copy_to_device).
  auto up = [&](const void* src, size_t bytes) -> const void* {
    if (bytes == 0) return nullptr;
    d.buffers.emplace_back(bytes);
    copy_to_device(d.buffers.back().get(), src, bytes);
    return d.buffers.back().get();
  };
  auto upf = [&](const std::vector<float>& v) {
    return static_cast<const float*>(up(v.data(), v.size() * sizeof(float)));
  };
  auto upb = [&](const auto& v) { return static_cast<const uint8_t*>(up(v.data(), v.size())); };
  MoeLayerWeights& w = d.weights;
  w.w13_codes = upb(l.w13_codes);
  w.w13_scales = upb(l.w13_scales);
  w.w2_codes = upb(l.w2_codes);
  w.w2_scales = upb(l.w2_scales);
  w.w13_global = upf(l.w13_global);  // empty (null) for MXFP4
  w.w2_global = upf(l.w2_global);
  w.b13 = upf(l.b13);
  w.b2 = upf(l.b2);
  w.router_weight = up(l.router_weight.data(), l.router_weight.size() * 2);
  w.router_bias = upf(l.router_bias);
  if (l.shared == SharedExpertStorage::kQuantized) {
    w.shared_w13_codes = upb(l.shared_w13_codes);
    w.shared_w13_scales = upb(l.shared_w13_scales);
    w.shared_w2_codes = upb(l.shared_w2_codes);
    w.shared_w2_scales = upb(l.shared_w2_scales);
    if (l.cfg.format == WeightFormat::kNvfp4) {
      w.shared_w13_global = upf({l.shared_w13_global});
      w.shared_w2_global = upf({l.shared_w2_global});
    }
  } else if (l.shared == SharedExpertStorage::kBf16) {
    w.shared_w13_bf16 = up(l.shared_w13_bf16.data(), l.shared_w13_bf16.size() * 2);
    w.shared_w2_bf16 = up(l.shared_w2_bf16.data(), l.shared_w2_bf16.size() * 2);
  }
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  validate_moe_layer_weights(d.cfg, w);
  return d;
}

}  // namespace fp4moe

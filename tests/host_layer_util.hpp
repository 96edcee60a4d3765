// A synthetic MoE layer in host memory (HostMoeLayer: MoeLayerWeights' stacked layout), built from
// the CPU reference's synthetic experts, for tests that run it through upload_moe_layer + MoeLayer (GPU)
// or HostLayerExperts + moe_reference (CPU). No CUDA: both test binaries include it.
#pragma once
#include <cstring>
#include <string>
#include <vector>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::test {

inline void put_bytes(HostBytes& dst, const std::vector<uint8_t>& v) {
  dst = HostBytes(v.size());
  std::memcpy(dst.data(), v.data(), v.size());
}

// A small layer of preset `base`'s router and activation with the given shapes (one expert group), for
// tests of intermediate sizes the presets do not have.
inline MoeConfig small_config(const char* base, int64_t hidden, int64_t intermediate, int experts, int top_k,
                              int num_shared) {
  MoeConfig c = preset(base);
  c.name = std::string(base) + "-padded";
  c.hidden = hidden;
  c.intermediate = intermediate;
  c.num_experts = experts;
  c.top_k = top_k;
  c.n_group = c.topk_group = 1;
  c.num_shared = num_shared;
  return c;
}

// Experts from make_synthetic_expert(cfg, seed, e) (NVFP4 or MXFP4 by cfg.format), stacked gate rows then
// up rows; the shared expert (cfg.num_shared > 0) quantized, or as bf16 values when bf16_shared; a bf16
// router weight [E, H] with small seeded values; the synthetic router bias.
inline HostMoeLayer stack_synthetic_layer(const MoeConfig& cfg, uint64_t seed, bool bf16_shared) {
  HostMoeLayer L;
  L.cfg = cfg;
  const bool mx = cfg.format == WeightFormat::kMxfp4;
  std::vector<uint8_t> c13, s13, c2, s2;
  auto app = [](std::vector<uint8_t>& v, const std::vector<uint8_t>& p) { v.insert(v.end(), p.begin(), p.end()); };
  for (int e = 0; e < cfg.num_experts; ++e) {
    const ExpertWeights x = make_synthetic_expert(cfg, seed, e);
    if (mx) {
      app(c13, x.mx_gate.codes), app(c13, x.mx_up.codes), app(s13, x.mx_gate.scales), app(s13, x.mx_up.scales);
      app(c2, x.mx_down.codes), app(s2, x.mx_down.scales);
    } else {
      app(c13, x.gate.codes), app(c13, x.up.codes), app(s13, x.gate.scales), app(s13, x.up.scales);
      app(c2, x.down.codes), app(s2, x.down.scales);
      L.w13_global.push_back(x.gate.global_scale);
      L.w2_global.push_back(x.down.global_scale);
    }
    if (cfg.expert_bias) {
      L.b13.insert(L.b13.end(), x.bias_gate.begin(), x.bias_gate.end());
      L.b13.insert(L.b13.end(), x.bias_up.begin(), x.bias_up.end());
      L.b2.insert(L.b2.end(), x.bias_down.begin(), x.bias_down.end());
    }
  }
  put_bytes(L.w13_codes, c13), put_bytes(L.w13_scales, s13), put_bytes(L.w2_codes, c2), put_bytes(L.w2_scales, s2);
  L.router_bias = make_synthetic_router_bias(cfg, seed);
  L.router_weight.resize(static_cast<size_t>(cfg.num_experts * cfg.hidden));
  uint64_t st = seed * 0x9e3779b97f4a7c15ull + 1;
  for (uint16_t& w : L.router_weight) {
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    const float u = static_cast<float>(st >> 40) / static_cast<float>(1ull << 24) - 0.5f;  // [-0.5, 0.5)
    w = float_to_bf16_bits(u * 0.2f);
  }
  if (cfg.num_shared > 0) {
    const ExpertWeights x = make_synthetic_expert(cfg, seed, kSharedExpert);
    if (bf16_shared) {
      L.shared = SharedExpertStorage::kBf16;
      auto bf = [](const Nvfp4Tensor& t, std::vector<uint16_t>& out) {
        for (int64_t r = 0; r < t.rows; ++r)
          for (int64_t k = 0; k < t.cols; ++k) out.push_back(float_to_bf16_bits(t.at(r, k) * 1.37f));
      };
      bf(x.gate, L.shared_w13_bf16), bf(x.up, L.shared_w13_bf16), bf(x.down, L.shared_w2_bf16);
    } else {
      L.shared = SharedExpertStorage::kQuantized;
      L.shared_w13_codes = x.gate.codes;
      app(L.shared_w13_codes, x.up.codes);
      L.shared_w13_scales = x.gate.scales;
      app(L.shared_w13_scales, x.up.scales);
      L.shared_w2_codes = x.down.codes;
      L.shared_w2_scales = x.down.scales;
      L.shared_w13_global = x.gate.global_scale;
      L.shared_w2_global = x.down.global_scale;
    }
  }
  return L;
}

}  // namespace fp4moe::test

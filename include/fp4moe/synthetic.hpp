// Seeded synthetic tensors for tests, `fp4moe run` and `fp4moe bench`.
// Written with exact integer hashing and exactly representable float arithmetic only (no libm, no
// fused multiply-add opportunities), so the host and the device produce bit-identical values and a
// GPU-generated expert can be checked against a CPU-generated one.
#pragma once
#include <cstdint>

#include "fp4moe/format_math.hpp"

namespace fp4moe {

// Tensor ids for the synthetic generator (part of the hash key).
enum class SynthTensor : uint32_t {
  kW1Gate = 1, kW1Up = 2, kW2 = 3, kHidden = 4, kRouterLogits = 5, kRouterBias = 6,
  kBias1 = 7, kBias2 = 8, kSharedGate = 9, kSharedUp = 10, kSharedDown = 11, kRouterWeight = 12,
};

FP4MOE_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

FP4MOE_HD uint64_t synth_key(uint64_t seed, uint32_t tensor, uint32_t expert, uint64_t row, uint64_t col) {
  uint64_t h = splitmix64(seed ^ (static_cast<uint64_t>(tensor) << 56) ^ (static_cast<uint64_t>(expert) << 40));
  h = splitmix64(h ^ row);
  return splitmix64(h ^ (col * 0x9e3779b97f4a7c15ull));
}

// Approximately standard normal: (sum of four 16-bit uniforms - 2) * sqrt(3); every step is exact in
// fp32 except the final multiply, which is one correctly rounded IEEE multiply on host and device.
FP4MOE_HD float synth_normal(uint64_t h) {
  const uint32_t a = static_cast<uint32_t>(h & 0xffffu), b = static_cast<uint32_t>((h >> 16) & 0xffffu);
  const uint32_t c = static_cast<uint32_t>((h >> 32) & 0xffffu), d = static_cast<uint32_t>(h >> 48);
  const float s = static_cast<float>(static_cast<int32_t>(a + b + c + d) - 131070) * (1.0f / 65536.0f);
  return s * 1.7320508f;
}

// Weight-like values: normal * row scale, where the row scale (a power of two times a short mantissa,
// exact in fp32) varies by up to 4x across rows, and one element in 4096 is a 4-8x outlier, so block
// and tensor scales see realistic spreads.
FP4MOE_HD float synth_weight(uint64_t seed, SynthTensor t, uint32_t expert, uint64_t row, uint64_t col, float std) {
  const uint64_t hr = synth_key(seed, static_cast<uint32_t>(t), expert, row, 0xffffffffull);
  const float row_scale = 0.5f + static_cast<float>(hr & 0x7u) * 0.25f;  // 0.5 .. 2.25, exact
  const uint64_t h = synth_key(seed, static_cast<uint32_t>(t), expert, row, col);
  float v = synth_normal(h);
  if (((h >> 20) & 0xfffu) == 0) v = v * (4.0f + static_cast<float>((h >> 32) & 3u));
  return v * (row_scale * std);
}

// Activation-like values rounded to bf16 (the GPU consumes bf16 activations).
FP4MOE_HD float synth_activation(uint64_t seed, SynthTensor t, uint64_t row, uint64_t col, float std) {
  return round_to_bf16(synth_normal(synth_key(seed, static_cast<uint32_t>(t), 0, row, col)) * std);
}

}  // namespace fp4moe

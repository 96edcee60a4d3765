// The expert activation between GEMM1 and GEMM2, one definition for every kernel that applies it: the
// grouped GEMM epilogue (sm80_nvfp4_grouped_gemm.cuh) and the bf16 shared expert's kernel
// (bf16_shared_swiglu.cuh), so both round the same fp32 value to bf16. Device code only.
//
// The hardware exp2 and reciprocal (__expf, __fdividef: ~2 ulp in fp32, then a bf16 rounding of 2^-8):
// IEEE expf and division took ~25 instructions and a slow-path branch per output, at every tile end of
// the grouped GEMM (bench/NOTES.md). A large negative gate gives exp = inf and a quotient of 0, silu's
// limit. The CPU reference (reference.cpp) computes the same formulas in float with std::exp.
#pragma once

namespace fp4moe::kernels {

// silu(gate) * up
__device__ __forceinline__ float swiglu_act(float gate, float up) {
  return __fdividef(gate, 1.0f + __expf(-gate)) * up;
}

// gpt-oss: gate clamped above at limit, up to [-limit, limit]; (up + 1) * gate * sigmoid(alpha * gate)
__device__ __forceinline__ float gptoss_swiglu_act(float gate, float up, float alpha, float limit) {
  gate = fminf(gate, limit);
  up = fminf(fmaxf(up, -limit), limit);
  return (up + 1.0f) * __fdividef(gate, 1.0f + __expf(-alpha * gate));
}

}  // namespace fp4moe::kernels

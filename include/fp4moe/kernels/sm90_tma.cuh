// sm_90 building blocks of the TMA-fed kernel: shared-memory mbarriers, TMA tensor copies that complete
// on them, L2 cache policies and setmaxnreg. Device code only; the tensor maps are encoded on the host
// (src/sm90_tensor_maps.cu).
#pragma once
#include <cstdint>

#include <cuda.h>  // CUtensorMap (a 128-byte opaque descriptor)

#include "fp4moe/kernels/sm90_asm.cuh"

namespace fp4moe::kernels {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  FP4MOE_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialized barriers visible to the async proxy (TMA completes on them).
__device__ __forceinline__ void mbar_fence_init() {
  FP4MOE_SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also announces `bytes` of TMA transactions for the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  FP4MOE_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// An arrival by the threads with pred set (a predicated instruction, no branch).
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool pred) {
  FP4MOE_SM90_ASM(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %1, 0;\n"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
      "}\n" ::"r"(bar),
      "r"(static_cast<uint32_t>(pred))
      : "memory");
}
// An arrival of `count` by the threads with pred set (count 1..2^20-1; a predicated instruction, no branch).
__device__ __forceinline__ void mbar_arrive_count_if(uint32_t bar, bool pred, uint32_t count) {
  FP4MOE_SM90_ASM(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %1, 0;\n"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0], %2;\n"
      "}\n" ::"r"(bar),
      "r"(static_cast<uint32_t>(pred)), "r"(count)
      : "memory");
}
// Blocks until the barrier's phase with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  FP4MOE_SM90_ASM(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// L2 policies: weights are read once per call (evict first); activation rows are re-read by every
// feature tile of their expert (evict last).
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t p = 0;
  FP4MOE_SM90_ASM("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t p = 0;
  FP4MOE_SM90_ASM("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

// 2-D TMA tile copy global -> shared, completing `bytes` on the mbarrier (box size from the map).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar,
                                            uint64_t policy) {
  FP4MOE_SM90_ASM(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
      : "memory");
}
// A line of global memory into L1 (no register, no wait): for values read much later.
__device__ __forceinline__ void prefetch_l1(const void* ptr) {
  FP4MOE_SM90_ASM("prefetch.global.L1 [%0];\n" ::"l"(reinterpret_cast<uint64_t>(ptr)) : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  FP4MOE_SM90_ASM("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// A 32-bit store to shared memory by its shared-window address (no 64-bit generic pointer held: the
// tma kernel's producer has 24 registers).
__device__ __forceinline__ void st_shared_s32(uint32_t addr, int32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// Four 32-bit values, and two floats, to shared memory in one access by its shared-window address (the
// producer's stores of a claimed tile's slot and scale pair, TmaTileRing; the consumers read them through
// a plain pointer).
__device__ __forceinline__ void st_shared_v4_s32(uint32_t addr, int32_t a, int32_t b, int32_t c, int32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ void st_shared_v2_f32(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

// A named barrier (id 1..15) for `threads` threads, a multiple of 32: a subset of the CTA. The
// non-aligned barrier.sync: the roles arrive from different call sites, which the aligned bar.sync
// does not allow (compute-sanitizer synccheck: "divergent thread(s) in block").
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  __syncwarp();
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Register reallocation between warpgroups (all warps of a warpgroup execute it).
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
  FP4MOE_SM90_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
  FP4MOE_SM90_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

}  // namespace fp4moe::kernels

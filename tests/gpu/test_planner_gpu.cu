// On a GPU: the planner's shared-memory bytes are exactly what each compiled config needs and can get,
// and the register estimate is compared with the compiled kernel's numRegs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "fp4moe/arch.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/planner.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe {
namespace {

TEST(PlannerGpu, DeviceOverridesTable) {
  if (!fp4moe::gpu_available()) GTEST_SKIP() << "no CUDA GPU";
  const ArchInfo a = arch_from_device(0);
  cudaDeviceProp p{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  EXPECT_TRUE(a.from_device);
  EXPECT_EQ(a.smem_optin_per_block, p.sharedMemPerBlockOptin);
  EXPECT_EQ(a.num_sms, p.multiProcessorCount);
  // The table's figures for this cc agree with the device (a table error would mislead explain).
  const ArchInfo t = arch_from_name("sm_" + std::to_string(p.major * 10 + p.minor));
  EXPECT_EQ(t.smem_optin_per_block, p.sharedMemPerBlockOptin) << t.name;
  EXPECT_EQ(t.smem_per_sm, p.sharedMemPerMultiprocessor) << t.name;
  EXPECT_EQ(t.reserved_smem_per_block, p.reservedSharedMemPerBlock) << t.name;
  EXPECT_EQ(t.max_threads_per_sm, p.maxThreadsPerMultiProcessor) << t.name;
  EXPECT_EQ(t.max_ctas_per_sm, p.maxBlocksPerMultiProcessor) << t.name;
  EXPECT_EQ(t.regs_per_sm, p.regsPerMultiprocessor) << t.name;
}

// For every config and epilogue: planner dynamic bytes + the kernel's static bytes fit the device, the
// launch with exactly the planner's bytes succeeds, and registers are within the stated tolerance:
// |numRegs - expected| <= max(24, 30% of expected), where expected = min(estimate, launch-bounds cap).
TEST(PlannerGpu, EveryConfigFitsAndLaunchesWithPlannerBytes) {
  if (!fp4moe::gpu_available()) GTEST_SKIP() << "no CUDA GPU";
  const ArchInfo arch = arch_from_device(0);
  // A tiny valid problem: E = 2 experts, N = 256, K = 256 (a multiple of every bk), 3 rows in expert 0.
  const int E = 2;
  const int64_t N = 256, K = 256, rows = 3;
  uint8_t *codes, *scales, *raw_codes, *raw_scales;
  float* gs;
  void *act, *out;
  int32_t* offs;
  const size_t cb = E * repacked_codes_bytes(N, K), sb = E * repacked_scales_bytes(N, K);
  FP4MOE_CUDA_CHECK(cudaMalloc(&codes, cb));
  FP4MOE_CUDA_CHECK(cudaMalloc(&scales, sb));
  FP4MOE_CUDA_CHECK(cudaMalloc(&raw_codes, cb));
  FP4MOE_CUDA_CHECK(cudaMalloc(&raw_scales, sb));
  FP4MOE_CUDA_CHECK(cudaMemset(raw_codes, 0x21, cb));
  FP4MOE_CUDA_CHECK(cudaMemset(raw_scales, 0x38, sb));
  FP4MOE_CUDA_CHECK(cudaMalloc(&gs, E * sizeof(float)));
  const float h_gs[E] = {1.0f, 1.0f};
  copy_to_device(gs, h_gs, sizeof(h_gs));
  FP4MOE_CUDA_CHECK(cudaMalloc(&act, rows * K * 2));
  FP4MOE_CUDA_CHECK(cudaMemset(act, 0, rows * K * 2));
  FP4MOE_CUDA_CHECK(cudaMalloc(&out, rows * N * 2));
  FP4MOE_CUDA_CHECK(cudaMalloc(&offs, (E + 1) * sizeof(int32_t)));
  const int32_t h_offs[E + 1] = {0, 3, 3};
  copy_to_device(offs, h_offs, sizeof(h_offs));

  for (GemmEpilogue epi : {GemmEpilogue::kPlain, GemmEpilogue::kSwiGLU}) {
    const bool swiglu = epi != GemmEpilogue::kPlain;
    repack_nvfp4_weights_device(raw_codes, raw_scales, E, N, K, swiglu, codes, scales, nullptr);
    for (const TileConfig& c : kGemmConfigs) {
      // stream configs' activation rows span K: planned for this problem's K
      const int64_t pk = c.mma == 2 ? K : 0;
      const Sm80Plan plan = plan_sm80(c, arch, 0, pk);
      const cudaFuncAttributes attr = grouped_gemm_kernel_attributes(c, epi);
      const size_t need = plan.smem.total_bytes + attr.sharedSizeBytes;
      const Sm80Plan with_static = plan_sm80(c, arch, attr.sharedSizeBytes, pk);
      std::printf("%-24s %-6s smem %zu + static %zu = %zu of %zu; regs measured %d, estimate %d, expected %d, "
                  "local %zu B; planner %s\n",
                  c.name().c_str(), swiglu ? "swiglu" : "plain", plan.smem.total_bytes,
                  static_cast<size_t>(attr.sharedSizeBytes), need, arch.smem_optin_per_block, attr.numRegs,
                  plan.regs.estimate, plan.regs.expected, static_cast<size_t>(attr.localSizeBytes),
                  with_static.verdict.valid ? "valid" : with_static.verdict.reason.c_str());
      if (!with_static.verdict.valid) {
        // The planner rejects it: the launcher must refuse it as a ResourceError, not crash.
        EXPECT_GT(need, arch.smem_optin_per_block) << c.name() << ": " << with_static.verdict.reason;
        continue;
      }
      EXPECT_LE(need, arch.smem_optin_per_block) << c.name();
      EXPECT_LE(static_cast<size_t>(attr.maxDynamicSharedSizeBytes) + attr.sharedSizeBytes, arch.smem_optin_per_block);
      // Registers: the static estimate is only a planning aid (printed above). What must hold is that the
      // compiled kernel respects the launch-bounds cap the planner assumes, and that the planner's
      // occupancy arithmetic, fed the measured registers, agrees with the CUDA occupancy calculator.
      EXPECT_LE(attr.numRegs, plan.regs.launch_bounds_cap) << c.name();
      if (c.mma == 2)  // the stream kernel's cold paths are calls: their frames save registers (bytes, once
                       // per m-tile or round); the hot loop itself must not spill (bench/NOTES.md, SASS)
        EXPECT_LE(attr.localSizeBytes, 128u) << c.name() << ": more local memory than the call frames need";
      else
        EXPECT_EQ(attr.localSizeBytes, 0u) << c.name() << ": the kernel spills to local memory";
      const Occupancy occ = occupancy(arch, c.threads(), attr.numRegs, plan.smem.total_bytes, attr.sharedSizeBytes);
      EXPECT_EQ(occ.ctas_per_sm, grouped_gemm_max_active_ctas(c, epi, K))
          << c.name() << ": planner occupancy (limited by " << occ.limiter << ") differs from the CUDA calculator";
      // The library launches with gemm_smem_layout's bytes; the planner's equal them (CPU test), and
      // after the launch the kernel's max dynamic smem attribute is exactly the planner's count.
      GroupedWeightsView w;
      w.num_experts = E;
      w.n = N;
      w.k = K;
      w.gate_up_interleaved = swiglu;
      w.codes = codes;
      w.scales = scales;
      w.global_scale = gs;
      GroupedGemmArgs a;
      a.act = act;
      a.expert_offsets = offs;
      a.max_rows = rows;
      a.out = out;
      a.epilogue = epi;
      grouped_gemm_nvfp4(w, a, c, nullptr);
      FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
      const cudaFuncAttributes after = grouped_gemm_kernel_attributes(c, epi);
      if (c.mma == 2)  // the limit only grows: earlier launches of this kernel may have had a larger K
        EXPECT_GE(static_cast<size_t>(after.maxDynamicSharedSizeBytes), plan.smem.total_bytes) << c.name();
      else
        EXPECT_EQ(static_cast<size_t>(after.maxDynamicSharedSizeBytes), plan.smem.total_bytes) << c.name();
    }
  }
  cudaFree(codes);
  cudaFree(scales);
  cudaFree(raw_codes);
  cudaFree(raw_scales);
  cudaFree(gs);
  cudaFree(act);
  cudaFree(out);
  cudaFree(offs);
}

}  // namespace
}  // namespace fp4moe

// Inline PTX that exists on sm_90a only (wgmma, TMA, mbarrier transaction counts, setmaxnreg). Its callers
// are compiled for sm_90a only and trap elsewhere, so in other device passes (a multi-architecture build)
// the statement compiles to nothing.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
#define FP4MOE_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define FP4MOE_SM90_ASM(...) \
  do {                       \
  } while (0)
#endif

// Programmatic dependent launch (sm_90+): the layer's kernels are launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, so each may start while its predecessor drains;
// each first waits for the predecessor's results (griddepcontrol.wait), then lets its own dependent
// start launching. Launched without the attribute (or before sm_90), both are no-ops.
#pragma once

namespace fp4moe::kernels {

// Blocks until the preceding kernel in the stream has completed and its writes are visible. Every
// read of data a predecessor produced must come after this.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel in the stream begin its launch (its CTAs still wait in pdl_wait for this grid
// to finish). Called early: the dependent's launch latency then overlaps this kernel's work.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace fp4moe::kernels

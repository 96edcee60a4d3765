// Kernel launches with an optional programmatic-dependent-launch attribute (kernels/pdl.cuh). Host
// code only; internal to the library.
#pragma once
#include <cuda_runtime.h>

#include "fp4moe/cuda_check.hpp"

namespace fp4moe::detail {

// True on devices that support programmatic dependent launch (sm_90 and newer), cached per device.
bool pdl_supported();

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic stream serialization attribute
// when `pdl` is set and the device supports it: the kernel may then start before its predecessor in
// the stream has finished, and must pdl_wait() before reading what the predecessor wrote.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
            Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (pdl && pdl_supported()) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  FP4MOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...));
}

// Records a stage event on `stream`. Inside a stream capture it is recorded as an external event (an
// event node of the graph: a plain record there only orders the capture and is never recorded when the
// graph runs); outside a capture, where the external flag is refused, a plain record.
void record_stage_event(cudaEvent_t event, cudaStream_t stream);

}  // namespace fp4moe::detail

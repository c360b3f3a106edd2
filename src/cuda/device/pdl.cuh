// Programmatic dependent launch (sm_90; EXPERTQMM_CHAINED_LAUNCH): a kernel launched with the
// programmatic-serialization attribute may start before the kernel ahead of it on the stream has
// finished, once every CTA of that kernel has called pdl_launch_dependents (or exited). It must call
// pdl_wait before it reads anything that kernel writes, and before it ends (so that the kernels after
// it, launched the usual way, still find the earlier one complete). Both are no-ops before sm_90 and
// in a kernel launched without the attribute.
#pragma once

namespace expertqmm::cuda::device {

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace expertqmm::cuda::device

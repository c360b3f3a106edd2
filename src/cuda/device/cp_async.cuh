// Asynchronous global -> shared copies (cp.async, sm_80 and up) with zero fill.
#pragma once
#include <cstdint>

namespace expertqmm::cuda::device {

// Copies 16 bytes, bypassing L1 (.cg); when !valid nothing is read and the 16 bytes are zeroed.
// Both addresses must be 16-byte aligned; gmem must be a valid address even when !valid.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes)
               : "memory");
}

// Copies 4 bytes of which the first src_bytes (0, 2 or 4) are read and the rest zeroed (.ca: the
// small scale/bias words are re-read by neighbouring tiles, so they may stay in L1).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, int src_bytes) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes)
               : "memory");
}

// Asks the L2 to fetch [p, p + bytes) from global memory, without waiting and without a
// destination (sm_90: one bulk prefetch by the copy engine; earlier architectures: nothing).
// p 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `kPending` committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace expertqmm::cuda::device

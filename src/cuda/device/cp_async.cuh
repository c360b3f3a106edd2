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

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `kPending` committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace expertqmm::cuda::device

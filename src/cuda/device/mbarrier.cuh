// Shared-memory mbarriers and the other pieces of a warp-specialized CTA (sm_90): a producer
// warpgroup that issues copies and consumers that wait for them, each side with its own register
// budget (setmaxnreg) and its own named barrier.
//
// Phases: a barrier initialised with count n completes a phase after n arrivals; the phases alternate
// parity 0, 1, 0, ... A ring of stages uses one `full` barrier per stage (the producer's arrivals)
// and one `empty` barrier (the consumers' arrivals): use u = 0, 1, ... of a stage waits for parity
// u % 2 of `full`, and the producer's refill for use u >= 1 waits for parity (u - 1) % 2 of `empty`.
#pragma once
#include <cstdint>

namespace expertqmm::cuda::device {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count) : "memory");
}

// Makes the initialisations visible to the other threads (and the async proxy) before first use.
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(shared_address(bar))
               : "memory");
}

// Spins until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

// One arrival on `bar` once every cp.async this thread has issued so far has landed (.noinc: the
// arrival is one of the count the barrier was initialised with).
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(bar)) : "memory");
}

// Adds `bytes` to the transactions the current phase of `bar` waits for (bulk copies completing on
// it), without an arrival: the phase completes after its arrivals and those bytes.
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory by the
// bulk copy engine, one instruction for the whole piece; completes as transactions on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   shared_address(smem)),
               "l"(gmem), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

// Shared memory written through the generic proxy (cp.async, st.shared) made visible to the async
// proxy (wgmma's shared-memory operands, TMA) for the executing thread's later operations.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// A warpgroup's register budget: every warp of the warpgroup executes it. sm_90a only (a no-op
// elsewhere, where the kernels using it are never run).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  static_assert(kId > 0 && kId < 16 && kThreads % 32 == 0, "a named barrier over whole warps");
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

}  // namespace expertqmm::cuda::device

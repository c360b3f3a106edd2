// Shared CUDA runtime pieces: the current stream, the device fault record, launch helpers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "core/route_counters.h"
#include "cuda/check.cuh"
#include "expertqmm/backend.h"

namespace expertqmm::cuda {

inline cudaStream_t current_stream() { return static_cast<cudaStream_t>(expertqmm::cuda_stream()); }

// Faults recorded by kernels instead of reading out of bounds; reported by cuda_check().
// (3,) uint32 in device memory: [code, offending value, limit]; code 0 = none.
enum FaultCode : uint32_t { kFaultNone = 0, kFaultExpertOutOfRange = 1, kFaultRowOutOfRange = 2 };
uint32_t* device_faults();

// Record a fault once (first writer wins); kernels then skip the offending work.
__device__ __forceinline__ void record_fault(uint32_t* faults, uint32_t code, uint32_t value, uint32_t limit) {
  if (atomicCAS(faults, 0u, code) == 0u) {
    faults[1] = value;
    faults[2] = limit;
  }
}

// The device count of tile plans found retracted by primitive p's GEMM kernels (each had been
// counted as a hit); folded into diagnostics::snapshot() through a reader registered on first use.
unsigned long long* retraction_counter(detail::Primitive p);
// That count as it stands (synchronizes the stream): also the retractions of launches the selector
// did not count as hits (test routes, bench probes), which snapshot() leaves out.
uint64_t device_retractions(detail::Primitive p);

// Output element idx = (row r, column n) of a gathered matmul in a simt kernel: its batch element
// b = r / M, row m = r % M, and the expert (rhs) and x matrix (lhs) of b, range-checked (a bad id is
// recorded as a fault and the element skipped: false). A: any argument struct with N, M, E,
// x_batch, lhs, rhs and faults.
struct GatheredElement {
  int64_t r, n, m, expert, xb;
};
template <class A>
__device__ __forceinline__ bool gathered_element(const A& a, int64_t idx, GatheredElement& el) {
  el.r = idx / a.N;
  el.n = idx - el.r * a.N;
  const int64_t b = el.r / a.M;
  el.m = el.r - b * a.M;
  el.expert = a.rhs ? static_cast<int64_t>(a.rhs[b]) : b;
  if (el.expert < 0 || el.expert >= a.E) {
    record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(el.expert), static_cast<uint32_t>(a.E));
    return false;
  }
  el.xb = a.lhs ? static_cast<int64_t>(a.lhs[b]) : b;
  if (el.xb < 0 || el.xb >= a.x_batch) {
    record_fault(a.faults, kFaultRowOutOfRange, static_cast<uint32_t>(el.xb), static_cast<uint32_t>(a.x_batch));
    return false;
  }
  return true;
}

inline unsigned ceil_div(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// Whether the current device takes programmatic dependent launches (compute capability 9.0 and up).
bool chained_launch_available();

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch when `chained`
// and the device takes it (device/pdl.cuh says what the kernel must then do).
template <class... Params, class... Args>
void launch_maybe_chained(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool chained, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  if (chained && chained_launch_available()) {
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  EXPERTQMM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace expertqmm::cuda

// Sums across a warp and across a CTA, and the RMS norm's scale, in one fixed order (so that every
// kernel that normalises a row gets the same bits from the same partial sums).
#pragma once
#include <cstdint>

namespace expertqmm::cuda::device {

// The warp's 32 values added by xor shuffles; every lane gets the sum.
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Every thread's v summed over the CTA: warp_sum, then thread 0 adds the warps in order; every
// thread gets the result. warp_sums: one shared float per warp; result: one shared float. Two
// barriers, so every thread of the CTA must call it.
__device__ __forceinline__ float cta_sum(float v, float* warp_sums, float* result) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += warp_sums[w];
    *result = total;
  }
  __syncthreads();
  return *result;
}

// 1 / sqrt(mean of squares + eps) of a row of `dim` values whose squares sum to sum_sq.
__device__ __forceinline__ float inv_rms(float sum_sq, int64_t dim, float eps) {
  return 1.f / sqrtf(sum_sq / static_cast<float>(dim) + eps);
}

}  // namespace expertqmm::cuda::device

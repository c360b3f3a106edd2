// gemv: the decode-size route of gather_mm (16-bit experts, at most kGemvMaxRows rows, any order of
// ids). At these sizes every weight byte is read about once, so the route is a bandwidth problem:
// 16-byte loads of the weight rows, many in flight per lane, and no shared-memory staging.
//
// Operands: x (x_batch, M, K) T, rows K apart; w (E, N, K) T with K contiguous (mlx-lm's layout),
// matrix e at e * w_batch_stride, row n at n * w_row_stride; out (B * M, N) T.
//
// Work split. One CTA of 4 warps per (problem row, column block); grid (ceil(N / cols), rows).
// A warp owns 4 consecutive columns ("column group") and walks K in 16-byte chunks (8 values): lane
// l takes chunks l, l + 32 * kSplit, ... of its K slice, loads the x chunk and the 4 weight chunks
// (5 independent 16-byte loads) and adds 8 products to each of its 4 fp32 sums; the warp then sums
// its lanes with shuffles. kSplit = 1: the 4 warps own 4 column groups (16 columns per CTA).
// kSplit = 4, used when the unsplit grid would leave the GPU idle (fewer than 2 CTAs per SM): the
// 4 warps share one column group and take interleaved quarters of K; their sums meet in shared
// memory and are added in warp order (deterministic). Every output is rounded once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/device/elem.cuh"
#include "cuda/gather_mm.h"
#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

namespace {

using device::Elem;

struct MmGemvArgs {
  const void* x;
  const void* w;
  const int32_t* lhs;  // (B,) or nullptr (identity)
  const int32_t* rhs;  // (B,) or nullptr (identity)
  void* out;
  uint32_t* faults;
  int64_t x_batch, x_batch_stride;
  int64_t w_batch_stride, w_row_stride;
  int M, N, K, E;
};

constexpr int kWarps = 4, kThreads = 32 * kWarps, kColsPerWarp = 4;

// Two 16-bit values of one 32-bit word as floats (low half first).
template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// acc += dot(x, w) over the 8 values of two 16-byte chunks.
template <class T>
__device__ __forceinline__ float dot8(const uint4& x, const uint4& w, float acc) {
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 xv = unpack2<T>(xs[i]), wv = unpack2<T>(ws[i]);
    acc = fmaf(xv.x, wv.x, acc);
    acc = fmaf(xv.y, wv.y, acc);
  }
  return acc;
}

template <class T, int kSplit>
__global__ void __launch_bounds__(kThreads) mm_gemv_kernel(MmGemvArgs a) {
  constexpr int kGroups = kWarps / kSplit;  // column groups per CTA
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = warp / kSplit, slice = warp % kSplit;
  const int64_t r = blockIdx.y;
  const int64_t b = r / a.M, m = r - b * a.M;
  const int64_t expert = a.rhs ? static_cast<int64_t>(a.rhs[b]) : b;
  const int64_t xb = a.lhs ? static_cast<int64_t>(a.lhs[b]) : b;
  if (expert < 0 || expert >= a.E) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
      record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(expert), static_cast<uint32_t>(a.E));
    return;  // uniform across the CTA
  }
  if (xb < 0 || xb >= a.x_batch) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
      record_fault(a.faults, kFaultRowOutOfRange, static_cast<uint32_t>(xb), static_cast<uint32_t>(a.x_batch));
    return;
  }
  const int n0 = (blockIdx.x * kGroups + group) * kColsPerWarp;
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + xb * a.x_batch_stride + m * a.K);
  const T* w_expert = static_cast<const T*>(a.w) + expert * a.w_batch_stride;
  const uint4* w[kColsPerWarp];
#pragma unroll
  for (int j = 0; j < kColsPerWarp; ++j) {
    const int n = min(n0 + j, a.N - 1);  // columns past N re-read the last row and are not stored
    w[j] = reinterpret_cast<const uint4*>(w_expert + static_cast<int64_t>(n) * a.w_row_stride);
  }
  float acc[kColsPerWarp] = {};
  const int chunks = a.K / 8;
#pragma unroll 2
  for (int c = slice * 32 + lane; c < chunks; c += 32 * kSplit) {
    const uint4 xv = x[c];
    uint4 wv[kColsPerWarp];
#pragma unroll
    for (int j = 0; j < kColsPerWarp; ++j) wv[j] = w[j][c];
#pragma unroll
    for (int j = 0; j < kColsPerWarp; ++j) acc[j] = dot8<T>(xv, wv[j], acc[j]);
  }
#pragma unroll
  for (int j = 0; j < kColsPerWarp; ++j)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);

  T* out = static_cast<T*>(a.out) + r * a.N;
  if constexpr (kSplit == 1) {
    if (lane < kColsPerWarp && n0 + lane < a.N) {
      float v = acc[0];
#pragma unroll
      for (int j = 1; j < kColsPerWarp; ++j) v = lane == j ? acc[j] : v;
      out[n0 + lane] = Elem<T>::from_float(v);
    }
  } else {
    __shared__ float partial[kWarps][kColsPerWarp];
    if (lane == 0)
#pragma unroll
      for (int j = 0; j < kColsPerWarp; ++j) partial[warp][j] = acc[j];
    __syncthreads();
    if (threadIdx.x < kGroups * kColsPerWarp) {
      const int g = threadIdx.x / kColsPerWarp, j = threadIdx.x % kColsPerWarp;
      const int n = (blockIdx.x * kGroups + g) * kColsPerWarp + j;
      float v = 0.f;
      for (int s = 0; s < kSplit; ++s) v += partial[g * kSplit + s][j];
      if (n < a.N) out[n] = Elem<T>::from_float(v);
    }
  }
}

enum class GemvSplit { automatic, split, unsplit };

template <class T, int kSplit>
void launch_mm_gemv(const MmGemvArgs& a, int64_t rows) {
  constexpr int kCols = kWarps / kSplit * kColsPerWarp;
  const dim3 grid(ceil_div(a.N, kCols), static_cast<unsigned>(rows));
  mm_gemv_kernel<T, kSplit><<<grid, kThreads, 0, current_stream()>>>(a);
  EXPERTQMM_CUDA_CHECK_LAUNCH("mm_gemv_kernel");
}

void run_mm_gemv(const detail::GatherMmProblem& p, void* out, GemvSplit split) {
  const RouteSupport s = supports_mm_gemv(p);
  EXPERTQMM_CHECK(s.ok, "gather_mm", "gemv does not support ", p.describe(), " (", fallback_name(s.reason), ")");
  MmGemvArgs a{};
  a.x = p.x.data();
  a.w = p.w.data();
  a.lhs = p.lhs_is_identity ? nullptr : p.lhs.data_as<const int32_t>();
  a.rhs = p.rhs_is_identity ? nullptr : p.rhs.data_as<const int32_t>();
  a.out = out;
  a.faults = device_faults();
  a.x_batch = p.x_batch;
  a.x_batch_stride = p.x_batch_stride;
  a.w_batch_stride = p.w_batch_stride;
  a.w_row_stride = p.w_stride_n;
  a.M = static_cast<int>(p.M);
  a.N = static_cast<int>(p.N);
  a.K = static_cast<int>(p.K);
  a.E = static_cast<int>(p.w_batch);
  const int64_t rows = p.B * p.M;
  if (split == GemvSplit::automatic) {
    const int64_t unsplit_ctas = ceil_div(p.N, kWarps * kColsPerWarp) * rows;
    split = unsplit_ctas < 2 * device_sm_count() ? GemvSplit::split : GemvSplit::unsplit;
  }
  const bool bf16 = p.dtype == DType::bf16;
  if (split == GemvSplit::split) bf16 ? launch_mm_gemv<__nv_bfloat16, 4>(a, rows) : launch_mm_gemv<__half, 4>(a, rows);
  else bf16 ? launch_mm_gemv<__nv_bfloat16, 1>(a, rows) : launch_mm_gemv<__half, 1>(a, rows);
}

}  // namespace

RouteSupport supports_mm_gemv(const detail::GatherMmProblem& p) {
  const RouteSupport operands = supports_mm_operands(p);
  if (!operands.ok) return operands;
  if (p.B * p.M > kGemvMaxRows) return route_miss(Fallback::shape);
  return route_ok();
}

void call_mm_gemv(const detail::GatherMmProblem& p, void* out, Workspace*) { run_mm_gemv(p, out, GemvSplit::automatic); }
void call_mm_gemv_split(const detail::GatherMmProblem& p, void* out, Workspace*) {
  run_mm_gemv(p, out, GemvSplit::split);
}
void call_mm_gemv_unsplit(const detail::GatherMmProblem& p, void* out, Workspace*) {
  run_mm_gemv(p, out, GemvSplit::unsplit);
}

}  // namespace expertqmm::cuda

// The Gemma 4 block's norms and residual in two kernels instead of seven (gemma4_ffn.cu):
//   entry: x1 = rms_norm(h, pre_ff), x2 = rms_norm(h, pre_ff_2)            (the two inputs)
//   exit:  out = (h + rms_norm(rms_norm(d, post_ff_1) + rms_norm(m, post_ff_2), post_ff)) * scalar
// Each intermediate is rounded to the activation dtype where launch_rms_norm / launch_add /
// launch_add_scaled in sequence (norm.cu) would store it; the sums of squares are fp32 as there,
// in another order (docs/numerics.md: summation order only).
//
// Work split: one CTA per token row, one thread per two 8-value units of the row (Gemma 4 26B,
// H = 2816: 352 units, 192 threads), at most 1024 threads (H <= 16384). Why this shape: at decode
// the block runs these on one to eight rows, so each kernel is a chain of memory latencies, not a
// stream; every load of the row (activations in 16-byte units, weights) is issued before the first
// use, so that a pass costs one round trip instead of one per strided element (the strided
// rms_norm_kernel took 14 us for one row, cold, at T = 1). The exit kernel keeps d, m and h in
// registers through its three reductions (d and m; then s = h1 + h2), one more barrier each.
#include "cuda/moe_internal.h"
#include "cuda/norm.h"

#include <initializer_list>

#include "cuda/device/reduce.cuh"
#include "cuda/device/staging.cuh"

namespace expertqmm::cuda {

namespace {

constexpr int kUnits = 2;         // 8-value units per thread
constexpr int kMaxThreads = 1024;
constexpr int64_t kMaxHidden = int64_t{8} * kUnits * kMaxThreads;

using device::cta_sum;
using device::inv_rms;

// Unit u (values 8u .. 8u+7, those < H) of an activation row in D, as floats: one 16-byte load when
// `vec` (16-bit D, H % 8 == 0 and 16-byte aligned rows), else element by element; missing values are 0.
template <DType D>
__device__ __forceinline__ void load_row_unit(const void* row, int64_t u, int64_t H, bool vec, float (&v)[8]) {
  using S = typename Elem<D>::storage;
  const S* p = static_cast<const S*>(row) + 8 * u;
  if constexpr (sizeof(S) == 2) {
    if (vec) {
      device::load8<D>(p, v);
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = 8 * u + e < H ? Elem<D>::load(p[e]) : 0.f;
}

template <DType D>
__device__ __forceinline__ void store_row_unit(void* row, int64_t u, int64_t H, bool vec, const float (&v)[8]) {
  using S = typename Elem<D>::storage;
  S* p = static_cast<S*>(row) + 8 * u;
  if constexpr (sizeof(S) == 2) {
    if (vec) {
      uint4 raw;
      S* e = reinterpret_cast<S*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) e[i] = Elem<D>::store(v[i]);
      *reinterpret_cast<uint4*>(p) = raw;
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (8 * u + e < H) p[e] = Elem<D>::store(v[e]);
}

// Unit u of a weight vector of any float dtype (a run-time dtype: the branch is uniform).
__device__ __forceinline__ void load_weight_unit(const void* w, DType dtype, int64_t u, int64_t H, float (&v)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = 8 * u + e < H ? load_any(w, dtype, 8 * u + e) : 0.f;
}

// h, x1, x2: (T, H) row-major in D.
template <DType D>
__global__ void __launch_bounds__(kMaxThreads) ffn_entry_norms_kernel(Gemma4NormArgs a, bool vec) {
  __shared__ float warp_sums[kMaxThreads / 32];
  __shared__ float total;
  const int64_t H = a.H, U = (H + 7) / 8, row = blockIdx.x;
  constexpr int64_t kBytes = sizeof(typename Elem<D>::storage);
  const char* hr = static_cast<const char*>(a.h) + row * H * kBytes;
  float hv[kUnits][8], w1[kUnits][8], w2[kUnits][8];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) {
      load_row_unit<D>(hr, u, H, vec, hv[j]);
      load_weight_unit(a.pre_ff, a.pre_ff_dtype, u, H, w1[j]);
      load_weight_unit(a.pre_ff_2, a.pre_ff_2_dtype, u, H, w2[j]);
    }
  }
  float sum_sq = 0.f;
#pragma unroll
  for (int j = 0; j < kUnits; ++j)
    if (threadIdx.x + static_cast<int64_t>(j) * blockDim.x < U)
#pragma unroll
      for (int e = 0; e < 8; ++e) sum_sq += hv[j][e] * hv[j][e];
  const float inv = inv_rms(cta_sum(sum_sq, warp_sums, &total), H, a.eps);
  char* x1 = static_cast<char*>(a.x1) + row * H * kBytes;
  char* x2 = static_cast<char*>(a.x2) + row * H * kBytes;
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u >= U) continue;
    float o1[8], o2[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = hv[j][e] * inv;
      o1[e] = v * w1[j][e];
      o2[e] = v * w2[j][e];
    }
    store_row_unit<D>(x1, u, H, vec, o1);
    store_row_unit<D>(x2, u, H, vec, o2);
  }
}

// d, m, h, out: (T, H) row-major in D.
template <DType D>
__global__ void __launch_bounds__(kMaxThreads) ffn_exit_kernel(Gemma4NormArgs a, bool vec) {
  __shared__ float warp_sums[kMaxThreads / 32];
  __shared__ float total;
  const int64_t H = a.H, U = (H + 7) / 8, row = blockIdx.x;
  const int64_t off = row * H * static_cast<int64_t>(sizeof(typename Elem<D>::storage));  // bytes
  float dv[kUnits][8], mv[kUnits][8], hv[kUnits][8];
  float w1[kUnits][8], w2[kUnits][8], w3[kUnits][8];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) {
      load_row_unit<D>(static_cast<const char*>(a.d) + off, u, H, vec, dv[j]);
      load_row_unit<D>(static_cast<const char*>(a.m) + off, u, H, vec, mv[j]);
      load_row_unit<D>(static_cast<const char*>(a.h) + off, u, H, vec, hv[j]);
      load_weight_unit(a.post_ff_1, a.post_ff_1_dtype, u, H, w1[j]);
      load_weight_unit(a.post_ff_2, a.post_ff_2_dtype, u, H, w2[j]);
      load_weight_unit(a.post_ff, a.post_ff_dtype, u, H, w3[j]);
    }
  }
  const float scalar = load_any(a.layer_scalar, a.layer_scalar_dtype, 0);
  float ss_d = 0.f, ss_m = 0.f;
#pragma unroll
  for (int j = 0; j < kUnits; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) {  // values past H (or units past U) are loaded as 0 or never used
      if (threadIdx.x + static_cast<int64_t>(j) * blockDim.x >= U) continue;
      ss_d += dv[j][e] * dv[j][e];
      ss_m += mv[j][e] * mv[j][e];
    }
  const float inv_d = inv_rms(cta_sum(ss_d, warp_sums, &total), H, a.eps);
  const float inv_m = inv_rms(cta_sum(ss_m, warp_sums, &total), H, a.eps);
  // s = round(round(d * inv_d * w1) + round(m * inv_m * w2)): two rms_norms, then add; kept in dv.
  float ss_s = 0.f;
#pragma unroll
  for (int j = 0; j < kUnits; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (threadIdx.x + static_cast<int64_t>(j) * blockDim.x >= U) continue;
      const float h1 = round_to<D>(dv[j][e] * inv_d * w1[j][e]);
      const float h2 = round_to<D>(mv[j][e] * inv_m * w2[j][e]);
      dv[j][e] = round_to<D>(h1 + h2);
      ss_s += dv[j][e] * dv[j][e];
    }
  const float inv_s = inv_rms(cta_sum(ss_s, warp_sums, &total), H, a.eps);
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u >= U) continue;
    float o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float f = round_to<D>(dv[j][e] * inv_s * w3[j][e]);
      o[e] = round_to<D>(hv[j][e] + f) * scalar;  // add_scaled: the sum rounded before the multiply
    }
    store_row_unit<D>(static_cast<char*>(a.out) + off, u, H, vec, o);
  }
}

// Threads per CTA for H (a warp multiple, two units each) and whether every row is read in 16-byte
// units.
unsigned threads_for(int64_t H) {
  const int64_t units = (H + 7) / 8;
  const int64_t threads = ((units + kUnits - 1) / kUnits + 31) / 32 * 32;
  return static_cast<unsigned>(threads < 32 ? 32 : threads);
}

bool rows_in_units(DType dtype, const Gemma4NormArgs& a, std::initializer_list<const void*> rows) {
  if (dtype_size(dtype) != 2 || a.H % 8 != 0) return false;  // a unit of 8 values is 16 bytes
  for (const void* p : rows)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

void check_shape(const Gemma4NormArgs& a) {
  EXPERTQMM_CHECK(a.T <= INT32_MAX && a.H <= kMaxHidden, "gemma4_ffn", "the CUDA block takes T <= 2^31 - 1 rows of H <= ",
                  kMaxHidden, " values (one CTA per row, ", kUnits, " units of 8 per thread), got T=", a.T, " H=", a.H);
}

}  // namespace

void launch_gemma4_entry_norms(DType dtype, const Gemma4NormArgs& a) {
  if (a.T == 0 || a.H == 0) return;
  check_shape(a);
  const bool vec = rows_in_units(dtype, a, {a.h, a.x1, a.x2});
  dispatch_float(dtype, "gemma4_ffn", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    ffn_entry_norms_kernel<D><<<static_cast<unsigned>(a.T), threads_for(a.H), 0, current_stream()>>>(a, vec);
    EXPERTQMM_CUDA_CHECK_LAUNCH(ffn_entry_norms_kernel);
  });
}

void launch_gemma4_exit(DType dtype, const Gemma4NormArgs& a) {
  if (a.T == 0 || a.H == 0) return;
  check_shape(a);
  const bool vec = rows_in_units(dtype, a, {a.d, a.m, a.h, a.out});
  dispatch_float(dtype, "gemma4_ffn", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    ffn_exit_kernel<D><<<static_cast<unsigned>(a.T), threads_for(a.H), 0, current_stream()>>>(a, vec);
    EXPERTQMM_CUDA_CHECK_LAUNCH(ffn_exit_kernel);
  });
}

}  // namespace expertqmm::cuda

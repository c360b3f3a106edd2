// The Gemma 4 block's norms and residual in two kernels instead of seven (gemma4_ffn.cu):
//   entry: x1 = rms_norm(h, pre_ff), x2 = rms_norm(h, pre_ff_2)            (the two inputs)
//   exit:  out = (h + rms_norm(rms_norm(d, post_ff_1) + rms_norm(m, post_ff_2), post_ff)) * scalar
// Each intermediate is rounded to the activation dtype where launch_rms_norm / launch_add /
// launch_add_scaled in sequence (norm.cu) would store it; the sums of squares are fp32 as there,
// in another order (docs/numerics.md: summation order only).
//
// Work split: one CTA per token row, kUnits 8-value units per thread (2 while H <= 4096: Gemma 4
// 26B, H = 2816, is 352 units on 192 threads; 4 or 8 above, so that a CTA stays at <= 256 threads
// and every value of the row in registers). Why this shape: at decode the block runs these on one
// to eight rows, so each kernel is a chain of memory latencies, not a stream. Every load of the row
// (activations and weights, 16-byte units where aligned) is issued as raw bits before the first use
// and converted after the last one is in flight: a use inside the loop (a dtype switch per element,
// a conversion per unit) made each load wait for the previous one (ncu, T = 1, cold L2: exit 15.9
// us, entry 7.0 us for one 5.6 KB row; 48 and 32 dependent loads per thread). The exit kernel keeps
// d, m and h in registers through its three reductions (d and m; then s = h1 + h2), one more
// barrier each.
#include "cuda/moe_internal.h"
#include "cuda/norm.h"

#include <initializer_list>
#include <type_traits>

#include "cuda/device/reduce.cuh"
#include "cuda/device/staging.cuh"

namespace expertqmm::cuda {

namespace {

constexpr int kThreadsMax = 256;
constexpr int kUnitsMax = 8;  // 8-value units per thread at the largest H
constexpr int64_t kMaxHidden = int64_t{8} * kUnitsMax * kThreadsMax;

using device::cta_sum;
using device::inv_rms;

// 8 values of a float row of a run-time dtype as raw bits, loaded without being used. `vec` (16-byte
// aligned rows, H % 8 == 0): one 16-byte load (16-bit dtypes, lo) or two (f32, lo and hi); else one
// load per element into the eight words (zero-extended; 0 past H).
struct RawUnit {
  uint4 lo, hi;
};

__device__ __forceinline__ void load_raw_unit(const void* row, DType dt, int64_t u, int64_t H, bool vec, RawUnit& r) {
  if (vec) {
    if (dt == DType::f32) {
      const uint4* q = static_cast<const uint4*>(row) + 2 * u;
      r.lo = __ldg(q);
      r.hi = __ldg(q + 1);
    } else {
      r.lo = __ldg(static_cast<const uint4*>(row) + u);
    }
    return;
  }
  uint32_t e[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t idx = 8 * u + i;
    e[i] = idx < H ? load_raw_any(row, dt, idx) : 0u;
  }
  r.lo = make_uint4(e[0], e[1], e[2], e[3]);
  r.hi = make_uint4(e[4], e[5], e[6], e[7]);
}

// The 8 values of a RawUnit as floats (0 past H: their bits are 0 on the element path, and on the
// 16-byte path H % 8 == 0).
__device__ __forceinline__ void unit_floats(const RawUnit& r, DType dt, bool vec, float (&v)[8]) {
  const uint32_t w[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
  if (vec && dt != DType::f32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = raw_any_to_float(w[i] & 0xffffu, dt);
      v[2 * i + 1] = raw_any_to_float(w[i] >> 16, dt);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = raw_any_to_float(w[i], dt);
  }
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

// h, x1, x2: (T, H) row-major in D. vec: the rows in 16-byte units; wvec: the weights likewise.
template <DType D, int kUnits>
__global__ void __launch_bounds__(kThreadsMax) ffn_entry_norms_kernel(Gemma4NormArgs a, bool vec, bool wvec) {
  __shared__ float warp_sums[kThreadsMax / 32];
  __shared__ float total;
  const int64_t H = a.H, U = (H + 7) / 8, row = blockIdx.x;
  constexpr int64_t kBytes = sizeof(typename Elem<D>::storage);
  const char* hr = static_cast<const char*>(a.h) + row * H * kBytes;
  RawUnit rh[kUnits], r1[kUnits], r2[kUnits];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) {
      load_raw_unit(hr, D, u, H, vec, rh[j]);
      load_raw_unit(a.pre_ff, a.pre_ff_dtype, u, H, wvec, r1[j]);
      load_raw_unit(a.pre_ff_2, a.pre_ff_2_dtype, u, H, wvec, r2[j]);
    }
  }
  float hv[kUnits][8];
  float sum_sq = 0.f;
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    if (threadIdx.x + static_cast<int64_t>(j) * blockDim.x >= U) continue;
    unit_floats(rh[j], D, vec, hv[j]);
#pragma unroll
    for (int e = 0; e < 8; ++e) sum_sq += hv[j][e] * hv[j][e];
  }
  const float inv = inv_rms(cta_sum(sum_sq, warp_sums, &total), H, a.eps);
  char* x1 = static_cast<char*>(a.x1) + row * H * kBytes;
  char* x2 = static_cast<char*>(a.x2) + row * H * kBytes;
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u >= U) continue;
    float w1[8], w2[8], o1[8], o2[8];
    unit_floats(r1[j], a.pre_ff_dtype, wvec, w1);
    unit_floats(r2[j], a.pre_ff_2_dtype, wvec, w2);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = hv[j][e] * inv;
      o1[e] = v * w1[e];
      o2[e] = v * w2[e];
    }
    store_row_unit<D>(x1, u, H, vec, o1);
    store_row_unit<D>(x2, u, H, vec, o2);
  }
}

// d, m, h, out: (T, H) row-major in D. vec / wvec as in the entry kernel.
template <DType D, int kUnits>
__global__ void __launch_bounds__(kThreadsMax) ffn_exit_kernel(Gemma4NormArgs a, bool vec, bool wvec) {
  __shared__ float warp_sums[kThreadsMax / 32];
  __shared__ float total;
  const int64_t H = a.H, U = (H + 7) / 8, row = blockIdx.x;
  const int64_t off = row * H * static_cast<int64_t>(sizeof(typename Elem<D>::storage));  // bytes
  RawUnit rd[kUnits], rm[kUnits], rh[kUnits], r1[kUnits], r2[kUnits], r3[kUnits];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) {
      load_raw_unit(static_cast<const char*>(a.d) + off, D, u, H, vec, rd[j]);
      load_raw_unit(static_cast<const char*>(a.m) + off, D, u, H, vec, rm[j]);
      load_raw_unit(static_cast<const char*>(a.h) + off, D, u, H, vec, rh[j]);
      load_raw_unit(a.post_ff_1, a.post_ff_1_dtype, u, H, wvec, r1[j]);
      load_raw_unit(a.post_ff_2, a.post_ff_2_dtype, u, H, wvec, r2[j]);
      load_raw_unit(a.post_ff, a.post_ff_dtype, u, H, wvec, r3[j]);
    }
  }
  const uint32_t scalar_bits = load_raw_any(a.layer_scalar, a.layer_scalar_dtype, 0);
  float dv[kUnits][8], mv[kUnits][8];
  float ss_d = 0.f, ss_m = 0.f;
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    if (threadIdx.x + static_cast<int64_t>(j) * blockDim.x >= U) continue;  // its units are never used
    unit_floats(rd[j], D, vec, dv[j]);
    unit_floats(rm[j], D, vec, mv[j]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      ss_d += dv[j][e] * dv[j][e];
      ss_m += mv[j][e] * mv[j][e];
    }
  }
  const float inv_d = inv_rms(cta_sum(ss_d, warp_sums, &total), H, a.eps);
  const float inv_m = inv_rms(cta_sum(ss_m, warp_sums, &total), H, a.eps);
  // s = round(round(d * inv_d * w1) + round(m * inv_m * w2)): two rms_norms, then add; kept in dv.
  float ss_s = 0.f;
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    if (threadIdx.x + static_cast<int64_t>(j) * blockDim.x >= U) continue;
    float w1[8], w2[8];
    unit_floats(r1[j], a.post_ff_1_dtype, wvec, w1);
    unit_floats(r2[j], a.post_ff_2_dtype, wvec, w2);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float h1 = round_to<D>(dv[j][e] * inv_d * w1[e]);
      const float h2 = round_to<D>(mv[j][e] * inv_m * w2[e]);
      dv[j][e] = round_to<D>(h1 + h2);
      ss_s += dv[j][e] * dv[j][e];
    }
  }
  const float inv_s = inv_rms(cta_sum(ss_s, warp_sums, &total), H, a.eps);
  const float scalar = raw_any_to_float(scalar_bits, a.layer_scalar_dtype);
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u >= U) continue;
    float w3[8], hv[8], o[8];
    unit_floats(r3[j], a.post_ff_dtype, wvec, w3);
    unit_floats(rh[j], D, vec, hv);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float f = round_to<D>(dv[j][e] * inv_s * w3[e]);
      o[e] = round_to<D>(hv[e] + f) * scalar;  // add_scaled: the sum rounded before the multiply
    }
    store_row_unit<D>(static_cast<char*>(a.out) + off, u, H, vec, o);
  }
}

// 8-value units per thread for H: 2 up to 512 units, then 4, then 8 (<= 256 threads per CTA).
int units_for(int64_t H) {
  const int64_t units = (H + 7) / 8;
  return units <= 2 * kThreadsMax ? 2 : units <= 4 * kThreadsMax ? 4 : 8;
}

// Threads per CTA for H (a warp multiple).
unsigned threads_for(int64_t H) {
  const int64_t units = (H + 7) / 8, per_thread = units_for(H);
  const int64_t threads = ((units + per_thread - 1) / per_thread + 31) / 32 * 32;
  return static_cast<unsigned>(threads < 32 ? 32 : threads);
}

// Whether every row (activations in `dtype`: 16-bit only, stored in 16-byte units too) is read in
// 16-byte units.
bool rows_in_units(DType dtype, const Gemma4NormArgs& a, std::initializer_list<const void*> rows) {
  if (dtype_size(dtype) != 2 || a.H % 8 != 0) return false;  // a unit of 8 values is 16 bytes
  for (const void* p : rows)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Whether every norm weight (any float dtype, loads only) is read in 16-byte units.
bool weights_in_units(const Gemma4NormArgs& a, std::initializer_list<const void*> weights) {
  if (a.H % 8 != 0) return false;
  for (const void* p : weights)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

void check_shape(const Gemma4NormArgs& a) {
  EXPERTQMM_CHECK(a.T <= INT32_MAX && a.H <= kMaxHidden, "gemma4_ffn", "the CUDA block takes T <= 2^31 - 1 rows of H <= ",
                  kMaxHidden, " values (one CTA per row, at most ", kThreadsMax, " threads of ", kUnitsMax,
                  " units of 8), got T=", a.T, " H=", a.H);
}

// Calls f(std::integral_constant<int, units>) for units_for(H).
template <class F>
void with_units(int64_t H, F&& f) {
  switch (units_for(H)) {
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, kUnitsMax>{}); break;
  }
}

}  // namespace

void launch_gemma4_entry_norms(DType dtype, const Gemma4NormArgs& a) {
  if (a.T == 0 || a.H == 0) return;
  check_shape(a);
  const bool vec = rows_in_units(dtype, a, {a.h, a.x1, a.x2});
  const bool wvec = weights_in_units(a, {a.pre_ff, a.pre_ff_2});
  dispatch_float(dtype, "gemma4_ffn", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    with_units(a.H, [&](auto units) {
      ffn_entry_norms_kernel<D, decltype(units)::value>
          <<<static_cast<unsigned>(a.T), threads_for(a.H), 0, current_stream()>>>(a, vec, wvec);
      EXPERTQMM_CUDA_CHECK_LAUNCH(ffn_entry_norms_kernel);
    });
  });
}

void launch_gemma4_exit(DType dtype, const Gemma4NormArgs& a) {
  if (a.T == 0 || a.H == 0) return;
  check_shape(a);
  const bool vec = rows_in_units(dtype, a, {a.d, a.m, a.h, a.out});
  const bool wvec = weights_in_units(a, {a.post_ff_1, a.post_ff_2, a.post_ff});
  dispatch_float(dtype, "gemma4_ffn", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    with_units(a.H, [&](auto units) {
      ffn_exit_kernel<D, decltype(units)::value>
          <<<static_cast<unsigned>(a.T), threads_for(a.H), 0, current_stream()>>>(a, vec, wvec);
      EXPERTQMM_CUDA_CHECK_LAUNCH(ffn_exit_kernel);
    });
  });
}

}  // namespace expertqmm::cuda

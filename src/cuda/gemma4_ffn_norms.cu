// The Gemma 4 block's norms and residual in two kernels instead of seven (gemma4_ffn.cu):
//   entry: x1 = rms_norm(h, pre_ff), x2 = rms_norm(h, pre_ff_2)            (the two inputs)
//   exit:  out = (h + rms_norm(rms_norm(d, post_ff_1) + rms_norm(m, post_ff_2), post_ff)) * scalar
// Each intermediate is rounded to the activation dtype where launch_rms_norm / launch_add /
// launch_add_scaled in sequence (norm.cu) would store it; the sums of squares are fp32 as there,
// in another order (docs/numerics.md: summation order only).
//
// Work split: one CTA per token row. Two kinds of instance (launch_norm_kernel picks):
//   16-byte: rows in 16-byte units and every norm weight in the activation dtype (what MLX
//     checkpoints hold), one 8-value unit per thread (Gemma 4 26B, H = 2816: 352 threads), H <= 8192;
//     the dtypes and the unit layout are template parameters, so the code holds one path;
//   generic: any weight dtype and alignment, 2 / 4 / 8 units per thread by H (<= 256 threads, every
//     value of the row in registers).
// Why this shape: at decode the block runs these on one to eight rows, so each kernel is a chain of
// latencies, not a stream. Every load of the row is issued as raw bits before the first use and
// converted after the last one is in flight (a conversion inside a dtype switch per element made each
// load wait for the one before: entry 7.0 -> 5.1 us, ncu T = 1). And the code is small: these
// kernels' code is fetched cold at every layer (the weights stream 45 MB through the L2 between two
// calls), and the exit kernel's 86-103 KB of SASS with every path unrolled cost 15.9 us for one 5.6 KB
// row (bench/NOTES.md step 17). The exit kernel keeps d, m and h in registers through its three
// reductions (d and m; then s = h1 + h2), one more barrier each.
#include "cuda/moe_internal.h"
#include "cuda/norm.h"

#include <initializer_list>
#include <type_traits>

#include "cuda/device/pdl.cuh"
#include "cuda/device/reduce.cuh"
#include "cuda/device/row_units.cuh"
#include "cuda/device/staging.cuh"

namespace expertqmm::cuda {

namespace {

constexpr int kThreadsMax = 256;     // the generic instances: units per thread grow with H
constexpr int kUnitsMax = 8;         // 8-value units per thread at the largest H
constexpr int kFastThreadsMax = 1024;  // the 16-byte instances: one unit per thread
constexpr int64_t kMaxHidden = int64_t{8} * kUnitsMax * kThreadsMax;

using device::cta_sum;
using device::inv_rms;

using device::in_units;
using device::load_unit;
using device::RawUnit;
using device::unit_values;
using device::Units16;
using device::UnitsAny;

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

// h, x1, x2: (T, H) row-major in D. Rows: how h, x1, x2 are read and written (Units16<D> or UnitsAny);
// Weights: how the norm weights are read.
template <DType D, int kUnits, class Rows, class Weights>
__global__ void __launch_bounds__(kUnits == 1 ? kFastThreadsMax : kThreadsMax)
    ffn_entry_norms_kernel(Gemma4NormArgs a, Rows rows, Weights weights) {
  device::pdl_launch_dependents();  // the router may start now: it reads h, not x1 / x2
  const bool vec = in_units(rows);  // rows stored in 16-byte units too
  __shared__ float warp_sums[kFastThreadsMax / 32];
  __shared__ float total;
  const int64_t H = a.H, U = (H + 7) / 8, row = blockIdx.x;
  constexpr int64_t kBytes = sizeof(typename Elem<D>::storage);
  const char* hr = static_cast<const char*>(a.h) + row * H * kBytes;
  RawUnit rh[kUnits], r1[kUnits], r2[kUnits];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) {
      load_unit(rows, hr, D, u, H, rh[j]);
      load_unit(weights, a.pre_ff, a.pre_ff_dtype, u, H, r1[j]);
      load_unit(weights, a.pre_ff_2, a.pre_ff_2_dtype, u, H, r2[j]);
    }
  }
  float hv[kUnits][8];
  float sum_sq = 0.f;
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    if (threadIdx.x + static_cast<int64_t>(j) * blockDim.x >= U) continue;
    unit_values(rows, rh[j], D, hv[j]);
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
    unit_values(weights, r1[j], a.pre_ff_dtype, w1);
    unit_values(weights, r2[j], a.pre_ff_2_dtype, w2);
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

// d, m, h, out: (T, H) row-major in D. Rows / Weights as in the entry kernel.
template <DType D, int kUnits, class Rows, class Weights>
__global__ void __launch_bounds__(kUnits == 1 ? kFastThreadsMax : kThreadsMax)
    ffn_exit_kernel(Gemma4NormArgs a, Rows rows, Weights weights) {
  const bool vec = in_units(rows);
  __shared__ float warp_sums[kFastThreadsMax / 32];
  __shared__ float total;
  const int64_t H = a.H, U = (H + 7) / 8, row = blockIdx.x;
  const int64_t off = row * H * static_cast<int64_t>(sizeof(typename Elem<D>::storage));  // bytes
  RawUnit rd[kUnits], rm[kUnits], rh[kUnits], r1[kUnits], r2[kUnits], r3[kUnits];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) {
      load_unit(rows, static_cast<const char*>(a.d) + off, D, u, H, rd[j]);
      load_unit(rows, static_cast<const char*>(a.h) + off, D, u, H, rh[j]);
      load_unit(weights, a.post_ff_1, a.post_ff_1_dtype, u, H, r1[j]);
      load_unit(weights, a.post_ff_2, a.post_ff_2_dtype, u, H, r2[j]);
      load_unit(weights, a.post_ff, a.post_ff_dtype, u, H, r3[j]);
    }
  }
  // m, the experts' output, last: a chained launch (EXPERTQMM_CHAINED_LAUNCH) starts while the
  // kernel that writes it still runs (d is the dense branch's, joined before this launch).
  device::pdl_wait();
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int64_t u = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (u < U) load_unit(rows, static_cast<const char*>(a.m) + off, D, u, H, rm[j]);
  }
  const uint32_t scalar_bits = load_raw_any(a.layer_scalar, a.layer_scalar_dtype, 0);
  float dv[kUnits][8], mv[kUnits][8];
  float ss_d = 0.f, ss_m = 0.f;
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    if (threadIdx.x + static_cast<int64_t>(j) * blockDim.x >= U) continue;  // its units are never used
    unit_values(rows, rd[j], D, dv[j]);
    unit_values(rows, rm[j], D, mv[j]);
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
    unit_values(weights, r1[j], a.post_ff_1_dtype, w1);
    unit_values(weights, r2[j], a.post_ff_2_dtype, w2);
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
    unit_values(weights, r3[j], a.post_ff_dtype, w3);
    unit_values(rows, rh[j], D, hv);
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

// Whether every array (a norm weight of any float dtype: loads only) is read in 16-byte units.
bool weights_in_units(const Gemma4NormArgs& a, std::initializer_list<const void*> weights) {
  if (a.H % 8 != 0) return false;  // a unit of 8 values is 16 bytes (32 for f32)
  for (const void* p : weights)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Whether every activation row (in `dtype`, also stored in 16-byte units: 16-bit only) is.
bool rows_in_units(DType dtype, const Gemma4NormArgs& a, std::initializer_list<const void*> rows) {
  return dtype_size(dtype) == 2 && weights_in_units(a, rows);
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

// Launches kernel<D, units, Rows, Weights> for the row: the 16-byte instance (one unit per thread,
// Units16<D> for rows and weights) when the rows are in 16-byte units, every norm weight is in D and
// 16-byte aligned and H <= 8 * 1024; else the generic one (run-time weight dtypes, element loads
// where unaligned, units per thread by H).
template <template <DType, int, class, class> class Kernel>
void launch_norm_kernel(DType dtype, const Gemma4NormArgs& a, bool rows_vec, bool weights_vec,
                        std::initializer_list<DType> weight_dtypes, bool chained = false) {
  bool fast = rows_vec && weights_vec && (a.H + 7) / 8 <= kFastThreadsMax;
  for (DType w : weight_dtypes) fast = fast && w == dtype;
  dispatch_float(dtype, "gemma4_ffn", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    const unsigned grid = static_cast<unsigned>(a.T);
    if constexpr (sizeof(typename Elem<D>::storage) == 2) {
      if (fast) {
        const unsigned threads = static_cast<unsigned>(((a.H + 7) / 8 + 31) / 32 * 32);
        Kernel<D, 1, Units16<D>, Units16<D>>::launch(grid, threads, a, Units16<D>{}, Units16<D>{}, chained);
        return;
      }
    }
    with_units(a.H, [&](auto units) {
      Kernel<D, decltype(units)::value, UnitsAny, UnitsAny>::launch(grid, threads_for(a.H), a, UnitsAny{rows_vec},
                                                                    UnitsAny{weights_vec}, chained);
    });
  });
}

// The kernels as class templates, so that launch_norm_kernel picks the instance.
// (chained: a programmatic dependent launch, runtime.cuh launch_maybe_chained.)
template <DType D, int kUnits, class Rows, class Weights>
struct EntryNorms {
  static void launch(unsigned grid, unsigned threads, const Gemma4NormArgs& a, Rows rows, Weights weights, bool chained) {
    launch_maybe_chained(ffn_entry_norms_kernel<D, kUnits, Rows, Weights>, grid, threads, 0, current_stream(), chained,
                         a, rows, weights);
  }
};
template <DType D, int kUnits, class Rows, class Weights>
struct Exit {
  static void launch(unsigned grid, unsigned threads, const Gemma4NormArgs& a, Rows rows, Weights weights, bool chained) {
    launch_maybe_chained(ffn_exit_kernel<D, kUnits, Rows, Weights>, grid, threads, 0, current_stream(), chained, a,
                         rows, weights);
  }
};

}  // namespace

void launch_gemma4_entry_norms(DType dtype, const Gemma4NormArgs& a) {
  if (a.T == 0 || a.H == 0) return;
  check_shape(a);
  launch_norm_kernel<EntryNorms>(dtype, a, rows_in_units(dtype, a, {a.h, a.x1, a.x2}),
                                 weights_in_units(a, {a.pre_ff, a.pre_ff_2}), {a.pre_ff_dtype, a.pre_ff_2_dtype});
}

void launch_gemma4_exit(DType dtype, const Gemma4NormArgs& a, bool chained) {
  if (a.T == 0 || a.H == 0) return;
  check_shape(a);
  launch_norm_kernel<Exit>(dtype, a, rows_in_units(dtype, a, {a.d, a.m, a.h, a.out}),
                           weights_in_units(a, {a.post_ff_1, a.post_ff_2, a.post_ff}),
                           {a.post_ff_1_dtype, a.post_ff_2_dtype, a.post_ff_dtype}, chained);
}

}  // namespace expertqmm::cuda

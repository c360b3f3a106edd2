// simt: the CUDA-core route of gather_qmm that takes every MLX combination the tensor-core and
// decode routes do not (bits 2..8 including the 3/5/6-bit streams, transpose=false, f32
// activations, any K, the fp modes mxfp4 / mxfp8 / nvfp4). Simple on purpose: fp32 dequantization
// (s*q + b, or the fp value times its decoded scale, exact) and fp32 accumulation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/device/dequant.cuh"
#include "cuda/gather_qmm_routes.h"
#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

namespace {

using device::Elem;
using device::extract_code;
using device::load_param;

struct SimtArgs {
  const void* x;       // x_batch matrices of (M, K) T, x_batch_stride elements apart
  // transpose: (E, N, K*bits/32) codes, (E, N, K/gs) scales and biases; else (E, K, N*bits/32) and
  // (E, K, N/gs); scales and biases in T (any float dtype: read through load_param<T>).
  device::QuantView q;
  const int32_t* lhs;  // (B,) or nullptr (identity)
  const int32_t* rhs;  // (B,) or nullptr (identity)
  void* out;           // (B*M, N) T
  uint32_t* faults;
  int64_t rows, x_batch, x_batch_stride;
  int64_t M, N, K, E;
  int bits;
  bool transpose;
};

// Kernel: a 1-D grid-stride loop, one thread per output element (r, n) at a time, n fastest so a
// warp writes consecutive outputs and, for transpose=false, reads consecutive codes of a w row.
// The thread walks k = 0..K-1: code of W[expert] at (n, k) (transpose) or (k, n), dequantized in
// fp32 with its group's scale and bias, times x[k], accumulated in fp32; one rounding to T.
template <class T>
__global__ void simt_kernel(SimtArgs a) {
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  const int64_t total = a.rows * a.N;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    GatheredElement el;
    if (!gathered_element(a, idx, el)) continue;
    const int64_t n = el.n, expert = el.expert;
    const T* xrow = x + el.xb * a.x_batch_stride + el.m * a.K;
    float acc = 0.f;
    // Weight (row, i) of W[expert]: row runs over N (transpose) or K, i over the other.
    auto weight = [&](int64_t wrow, int64_t i) {
      const uint32_t* codes = a.q.w + wrow * a.q.words_per_row;
      const int64_t pi = wrow * a.q.groups_per_row + (i >> a.q.group_shift);
      if (a.q.fp_mode != 0) return device::fp_weight(a.q.fp_mode, codes, i, a.q.fp_scales[pi]);
      return fmaf(load_param<T>(a.q.scales, pi), static_cast<float>(extract_code(codes, i, a.bits)),
                  load_param<T>(a.q.biases, pi));
    };
    if (a.transpose) {
      const int64_t wrow = expert * a.N + n;  // row of (E*N, K) codes
      for (int64_t k = 0; k < a.K; ++k) acc = fmaf(Elem<T>::to_float(xrow[k]), weight(wrow, k), acc);
    } else {
      for (int64_t k = 0; k < a.K; ++k)  // row k of (E*K, N) codes
        acc = fmaf(Elem<T>::to_float(xrow[k]), weight(expert * a.K + k, n), acc);
    }
    out[idx] = Elem<T>::from_float(acc);
  }
}

template <class T>
void launch_simt(const SimtArgs& a) {
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((a.rows * a.N + kThreads - 1) / kThreads,
                                           static_cast<int64_t>(device_sm_count()) * 16);
  simt_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, current_stream()>>>(a);
  EXPERTQMM_CUDA_CHECK_LAUNCH("simt_kernel");
}

struct SimtVariant {
  DType dtype;
  void (*launch)(const SimtArgs&);
};
const SimtVariant kSimtVariants[] = {
    {DType::bf16, launch_simt<__nv_bfloat16>},
    {DType::f16, launch_simt<__half>},
    {DType::f32, launch_simt<float>},
};

}  // namespace

RouteSupport supports_simt(const detail::GatherQmmProblem& p) {
  if (!is_floating(p.dtype)) return route_miss(Fallback::dtype);
  if (p.bits < 1 || p.bits > 8) return route_miss(Fallback::quantization);
  if (p.group_size <= 0 || (p.group_size & (p.group_size - 1)) != 0) return route_miss(Fallback::quantization);
  if (p.N < 0 || p.K < 0 || p.M <= 0) return route_miss(Fallback::shape);
  if (!fits_int32(p.w_row_words()) || !fits_int32(p.groups_per_row())) return route_miss(Fallback::shape);
  return route_ok();
}

void call_simt(const detail::GatherQmmProblem& p, void* out, Workspace*) {
  const RouteSupport s = supports_simt(p);
  EXPERTQMM_CHECK(s.ok, "gather_qmm", "simt does not support ", p.describe(), " (", fallback_name(s.reason), ")");
  SimtArgs a{};
  a.x = p.x.data();
  a.q = quant_view(p);  // simt reads scales/biases of any float dtype through load_param<T>, or fp codes
  a.lhs = p.lhs_is_identity ? nullptr : static_cast<const int32_t*>(p.lhs.data());
  a.rhs = p.rhs_is_identity ? nullptr : static_cast<const int32_t*>(p.rhs.data());
  a.out = out;
  a.faults = device_faults();
  a.rows = p.B * p.M;
  a.x_batch = p.x_batch;
  a.x_batch_stride = p.x_batch_stride;
  a.M = p.M;
  a.N = p.N;
  a.K = p.K;
  a.E = p.w_batch;
  a.bits = p.bits;
  a.transpose = p.transpose;
  if (a.rows * a.N == 0) return;
  for (const SimtVariant& v : kSimtVariants) {
    if (v.dtype != p.dtype) continue;
    v.launch(a);
    return;
  }
  throw Error("gather_qmm", detail::cat("simt has no kernel for dtype=", dtype_name(p.dtype)));
}

}  // namespace expertqmm::cuda

// simt: the CUDA-core route of gather_mm that takes every valid problem the tensor-core and GEMV
// routes do not: f32 outputs, a weight dtype other than the output's (MLX widens it), any weight
// strides (e.g. a plain [E, K, N] weight, or mlx-lm's [E, N, K] with unaligned rows). Simple on
// purpose: each weight element widened to fp32, fp32 accumulation in increasing k, one rounding.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/device/elem.cuh"
#include "cuda/gather_mm.h"
#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

namespace {

using device::Elem;

struct MmSimtArgs {
  const void* x;       // x_batch matrices of (M, K) T, x_batch_stride elements apart, rows K apart
  const void* w;       // W elements: matrix e, element (k, n) at e * w_batch + k * w_k + n * w_n
  const int32_t* lhs;  // (B,) or nullptr (identity)
  const int32_t* rhs;  // (B,) or nullptr (identity)
  void* out;           // (B*M, N) T
  uint32_t* faults;
  int64_t rows, x_batch, x_batch_stride;
  int64_t M, N, K, E;
  int64_t w_batch, w_k, w_n;
};

// A 1-D grid-stride loop, one thread per output element (r, n), n fastest so that a warp writes
// consecutive outputs (and, for [E, K, N] weights, reads consecutive weights at each k).
template <class T, class W>
__global__ void mm_simt_kernel(MmSimtArgs a) {
  const T* x = static_cast<const T*>(a.x);
  const W* w = static_cast<const W*>(a.w);
  T* out = static_cast<T*>(a.out);
  const int64_t total = a.rows * a.N;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    GatheredElement el;
    if (!gathered_element(a, idx, el)) continue;
    const T* xrow = x + el.xb * a.x_batch_stride + el.m * a.K;
    const W* wcol = w + el.expert * a.w_batch + el.n * a.w_n;
    float acc = 0.f;
    for (int64_t k = 0; k < a.K; ++k) acc = fmaf(Elem<T>::to_float(xrow[k]), Elem<W>::to_float(wcol[k * a.w_k]), acc);
    out[idx] = Elem<T>::from_float(acc);
  }
}

template <class T, class W>
void launch_mm_simt(const MmSimtArgs& a) {
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((a.rows * a.N + kThreads - 1) / kThreads,
                                           static_cast<int64_t>(device_sm_count()) * 16);
  mm_simt_kernel<T, W><<<static_cast<unsigned>(blocks), kThreads, 0, current_stream()>>>(a);
  EXPERTQMM_CUDA_CHECK_LAUNCH("mm_simt_kernel");
}

struct MmSimtVariant {
  DType dtype, w_dtype;
  void (*launch)(const MmSimtArgs&);
};
const MmSimtVariant kMmSimtVariants[] = {
    {DType::bf16, DType::bf16, launch_mm_simt<__nv_bfloat16, __nv_bfloat16>},
    {DType::f16, DType::f16, launch_mm_simt<__half, __half>},
    {DType::f32, DType::f32, launch_mm_simt<float, float>},
    {DType::f32, DType::bf16, launch_mm_simt<float, __nv_bfloat16>},
    {DType::f32, DType::f16, launch_mm_simt<float, __half>},
};

}  // namespace

RouteSupport supports_mm_simt(const detail::GatherMmProblem& p) {
  if (!is_floating(p.dtype) || !is_floating(p.w.dtype())) return route_miss(Fallback::dtype);
  // The output is promote(x, w): a 16-bit output only ever meets its own weight dtype.
  if (p.dtype != DType::f32 && p.w.dtype() != p.dtype) return route_miss(Fallback::dtype);
  if (p.N < 0 || p.K < 0 || p.M <= 0) return route_miss(Fallback::shape);
  return route_ok();
}

void call_mm_simt(const detail::GatherMmProblem& p, void* out, Workspace*) {
  MmSimtArgs a{};
  a.x = p.x.data();
  a.w = p.w.data();
  a.lhs = p.lhs_is_identity ? nullptr : p.lhs.data_as<const int32_t>();
  a.rhs = p.rhs_is_identity ? nullptr : p.rhs.data_as<const int32_t>();
  a.out = out;
  a.faults = device_faults();
  a.rows = p.B * p.M;
  a.x_batch = p.x_batch;
  a.x_batch_stride = p.x_batch_stride;
  a.M = p.M;
  a.N = p.N;
  a.K = p.K;
  a.E = p.w_batch;
  a.w_batch = p.w_batch_stride;
  a.w_k = p.w_stride_k;
  a.w_n = p.w_stride_n;
  if (a.rows * a.N == 0) return;
  for (const MmSimtVariant& v : kMmSimtVariants) {
    if (v.dtype != p.dtype || v.w_dtype != p.w.dtype()) continue;
    v.launch(a);
    return;
  }
  throw Error("gather_mm", detail::cat("simt has no kernel for ", p.describe()));
}

}  // namespace expertqmm::cuda

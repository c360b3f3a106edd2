// RMSNorm, add and add-then-scale on the GPU (include/expertqmm/gemma4.h; the dense linear: dense_linear.cu).
// fp32 math on the widened inputs, one rounding to the output dtype per MLX op, as src/cpu/norm.cpp.
#include "cuda/norm.h"
#include "cuda/moe_internal.h"
#include "cuda/device/reduce.cuh"

namespace expertqmm::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

unsigned grid_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 1048576 ? 1048576 : blocks));
}

using device::cta_sum;

// x, out: (rows, D) row-major in D; weight: (D,) in W.
// Work split: one CTA of 256 threads per row. Threads stride over the row (coalesced), sum x^2 in
// fp32, reduce through warp shuffles and one shared slot per warp; then every thread writes its
// strided elements x * inv_rms * weight.
template <DType D, DType W>
__global__ void rms_norm_kernel(const typename Elem<D>::storage* __restrict__ x,
                                const typename Elem<W>::storage* __restrict__ weight, float eps, int64_t dim,
                                typename Elem<D>::storage* __restrict__ out) {
  __shared__ float warp_sums[kWarps];
  __shared__ float total;
  const int64_t row = blockIdx.x;
  const typename Elem<D>::storage* xr = x + row * dim;
  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = Elem<D>::load(xr[i]);
    sum_sq += v * v;
  }
  const float inv = device::inv_rms(cta_sum(sum_sq, warp_sums, &total), dim, eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    out[row * dim + i] = Elem<D>::store(Elem<D>::load(xr[i]) * inv * Elem<W>::load(weight[i]));
}

// a, b, out: (n,) contiguous. Work split: one thread per value, grid-stride.
template <DType D>
__global__ void add_kernel(const typename Elem<D>::storage* __restrict__ a,
                           const typename Elem<D>::storage* __restrict__ b, int64_t n,
                           typename Elem<D>::storage* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = Elem<D>::store(Elem<D>::load(a[i]) + Elem<D>::load(b[i]));
}

// a, b, out: (n,) contiguous; scalar: (1,) in S, read on the device (no host copy, graph-safe).
// Work split: one thread per value, grid-stride. The sum is rounded to D before the multiply.
template <DType D, DType S>
__global__ void add_scaled_kernel(const typename Elem<D>::storage* __restrict__ a,
                                  const typename Elem<D>::storage* __restrict__ b, int64_t n,
                                  const typename Elem<S>::storage* __restrict__ scalar,
                                  typename Elem<D>::storage* __restrict__ out) {
  const float s = Elem<S>::load(scalar[0]);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = Elem<D>::store(round_to<D>(Elem<D>::load(a[i]) + Elem<D>::load(b[i])) * s);
}

template <DType D>
using Ptr = const typename Elem<D>::storage*;
template <DType D>
using MutPtr = typename Elem<D>::storage*;

}  // namespace

void launch_rms_norm(DType dtype, const void* x, int64_t rows, int64_t D, DType w_dtype, const void* weight,
                     float eps, void* out) {
  if (rows == 0 || D == 0) return;
  EXPERTQMM_CHECK(rows <= INT32_MAX, "rms_norm", "rows=", rows, " exceed the grid limit");
  dispatch_float(dtype, "rms_norm", [&](auto xtag) {
    constexpr DType XD = decltype(xtag)::value;
    dispatch_float(w_dtype, "rms_norm", [&](auto wtag) {
      constexpr DType WD = decltype(wtag)::value;
      rms_norm_kernel<XD, WD><<<static_cast<unsigned>(rows), kThreads, 0, current_stream()>>>(
          static_cast<Ptr<XD>>(x), static_cast<Ptr<WD>>(weight), eps, D, static_cast<MutPtr<XD>>(out));
      EXPERTQMM_CUDA_CHECK_LAUNCH(rms_norm_kernel);
    });
  });
}

void launch_add(DType dtype, const void* a, const void* b, int64_t n, void* out) {
  if (n == 0) return;
  dispatch_float(dtype, "add", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    add_kernel<D><<<grid_for(n), kThreads, 0, current_stream()>>>(static_cast<Ptr<D>>(a), static_cast<Ptr<D>>(b), n,
                                                                   static_cast<MutPtr<D>>(out));
    EXPERTQMM_CUDA_CHECK_LAUNCH(add_kernel);
  });
}

void launch_add_scaled(DType dtype, const void* a, const void* b, int64_t n, DType s_dtype, const void* scalar,
                       void* out) {
  if (n == 0) return;
  dispatch_float(dtype, "add_scaled", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    dispatch_float(s_dtype, "add_scaled", [&](auto stag) {
      constexpr DType S = decltype(stag)::value;
      add_scaled_kernel<D, S><<<grid_for(n), kThreads, 0, current_stream()>>>(
          static_cast<Ptr<D>>(a), static_cast<Ptr<D>>(b), n, static_cast<Ptr<S>>(scalar),
          static_cast<MutPtr<D>>(out));
      EXPERTQMM_CUDA_CHECK_LAUNCH(add_scaled_kernel);
    });
  });
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps) {
  const Tensor xc = x.contiguous(), wc = weight.contiguous();
  Tensor out = Tensor::empty(xc.shape(), xc.dtype(), Device::cuda);
  const int64_t D = xc.size(-1);
  launch_rms_norm(xc.dtype(), xc.data(), D ? xc.numel() / D : 0, D, wc.dtype(), wc.data(), eps, out.data());
  return out;
}

Tensor add(const Tensor& a, const Tensor& b) {
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  Tensor out = Tensor::empty(ac.shape(), ac.dtype(), Device::cuda);
  launch_add(ac.dtype(), ac.data(), bc.data(), ac.numel(), out.data());
  return out;
}

Tensor add_scaled(const Tensor& a, const Tensor& b, const Tensor& scalar) {
  const Tensor ac = a.contiguous(), bc = b.contiguous(), sc = scalar.contiguous();
  Tensor out = Tensor::empty(ac.shape(), ac.dtype(), Device::cuda);
  launch_add_scaled(ac.dtype(), ac.data(), bc.data(), ac.numel(), sc.dtype(), sc.data(), out.data());
  return out;
}

}  // namespace expertqmm::cuda

// The routers on the GPU (include/expertqmm/moe.h RouterKind), mirroring the CPU reference
// (src/cpu/router.cpp). RouterKind::softmax_topk (Qwen3-MoE) skips the norm (the projection reads
// h), then softmax over all E in fp32 rounded to the logit dtype -> top-k by probability ->
// weights p (divided by their sum, rounded, when norm_topk_prob). RouterKind::gemma4:
//   r      = h * rsqrt(mean(h^2) + eps) * (scale * H^-0.5)     fp32, rounded once to h's dtype
//   logits = r @ proj^T                                        rounded to promote(r, proj) dtype
//   idx    = top_k experts by descending logit                 NaN first, ties -> higher expert id (MLX)
//   w      = softmax(logits[idx]) * per_expert_scale[idx]      fp32, rounded once to h's dtype
// Differences from the CPU are summation order only (the mean of squares is a tree sum here, the
// logits come from a tiled GEMM), so indices agree except where two logits are within rounding of
// each other at the top-k boundary.
#include <cmath>

#include "cuda/cuda_backend.h"
#include "cuda/dense_linear.h"
#include "cuda/device/route_topk.cuh"
#include "cuda/gather_qmm.h"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

namespace {

constexpr int kNormThreads = 256;
constexpr int kWarpsPerCta = 8;

// r[t, i] = T(h[t, i] * inv_rms(t) * (scale[i] * root_size)), inv_rms = 1 / sqrt(sum(h^2)/H + eps).
//   h      (T, H) of D, rows h_row_stride apart;  scale (H) of S;  r (T, H) of D contiguous
// Work split: one CTA of 256 threads per token; thread i owns elements i, i + 256, ... of the row.
// Latency is the cost at decode (one token, 2816 values), so a thread issues the loads of up to
// kNormBatch elements (h and scale) before using any, squares and sums them in index order, warps
// reduce by shuffles and the 8 warp sums meet in shared memory; then the thread writes its
// elements of r from the same registers (rows longer than 256 * kNormBatch reload per batch).
constexpr int kNormBatch = 16;

template <DType D, DType S>
__global__ void router_rms_norm_kernel(const typename Elem<D>::storage* __restrict__ h, int64_t h_row_stride,
                                       int64_t H, const typename Elem<S>::storage* __restrict__ scale,
                                       float root_size, float eps, typename Elem<D>::storage* __restrict__ r) {
  __shared__ float warp_sums[kNormThreads / 32];
  const int64_t t = blockIdx.x;
  const typename Elem<D>::storage* row = h + t * h_row_stride;
  constexpr int64_t kBatchSpan = static_cast<int64_t>(kNormThreads) * kNormBatch;
  float x[kNormBatch], w[kNormBatch];
  // Loads one batch of this thread's elements (i = base + threadIdx.x + 256 u); 0 past the row.
  auto load_batch = [&](int64_t base) {
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(kNormThreads) * u;
      x[u] = i < H ? Elem<D>::load(row[i]) : 0.0f;
      w[u] = i < H ? Elem<S>::load(scale[i]) : 0.0f;
    }
  };
  float sum_sq = 0.0f;
  for (int64_t base = 0; base < H; base += kBatchSpan) {
    load_batch(base);
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u)
      if (base + threadIdx.x + static_cast<int64_t>(kNormThreads) * u < H) sum_sq = __fadd_rn(sum_sq, __fmul_rn(x[u], x[u]));
  }
  for (int off = 16; off > 0; off >>= 1) sum_sq = __fadd_rn(sum_sq, __shfl_xor_sync(0xffffffffu, sum_sq, off));
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum_sq;
  __syncthreads();
  float total = 0.0f;
  for (int wi = 0; wi < kNormThreads / 32; ++wi) total = __fadd_rn(total, warp_sums[wi]);
  const float inv_rms =
      __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(H)), eps)));
  const bool one_batch = H <= kBatchSpan;  // the registers still hold the whole slice
  for (int64_t base = 0; base < H; base += kBatchSpan) {
    if (!one_batch) load_batch(base);
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(kNormThreads) * u;
      if (i < H) r[t * H + i] = Elem<D>::store(__fmul_rn(__fmul_rn(x[u], inv_rms), __fmul_rn(w[u], root_size)));
    }
  }
}

// Top-k over each token's logits, softmax over the k, times per_expert_scale.
//   logits (T, E) of L;  per_expert_scale (E) of pes_dtype
//   indices (T, k) int32, best first;  weights (T, k) of W
// Work split: one warp per token (8 per CTA); the warp's work is device::warp_topk_softmax
// (device/route_topk.cuh, shared with the decode layer so both route alike).
template <DType L, DType W>
__global__ void router_topk_softmax_kernel(const typename Elem<L>::storage* __restrict__ logits, int64_t T, int64_t E,
                                           int k, const void* __restrict__ per_expert_scale, DType pes_dtype,
                                           int32_t* __restrict__ indices, typename Elem<W>::storage* __restrict__ weights) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (t >= T) return;  // uniform per warp
  const typename Elem<L>::storage* row = logits + t * E;
  typename Elem<W>::storage* wrow = weights + t * k;
  device::warp_topk_softmax([&](int64_t e) { return Elem<L>::load(row[e]); }, E, k,
                            [&](int64_t e) { return load_any(per_expert_scale, pes_dtype, e); }, indices + t * k,
                            [&](int slot, float w) { wrow[slot] = Elem<W>::store(w); });
}

// Qwen3-MoE's top-k: softmax over each token's E logits, rounded to L, top-k by probability,
// weights p[idx] (renormalised when asked).
//   logits (T, E) of L;  indices (T, k) int32, best first;  weights (T, k) of W
// Work split: one warp per token (8 per CTA); the warp's work is device::warp_softmax_topk
// (device/route_topk.cuh, shared with the decode layer's router).
template <DType L, DType W>
__global__ void router_softmax_topk_kernel(const typename Elem<L>::storage* __restrict__ logits, int64_t T,
                                           int64_t E, int k, bool renormalize, int32_t* __restrict__ indices,
                                           typename Elem<W>::storage* __restrict__ weights) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (t >= T) return;  // uniform per warp
  const typename Elem<L>::storage* row = logits + t * E;
  typename Elem<W>::storage* wrow = weights + t * k;
  device::warp_softmax_topk([&](int64_t e) { return Elem<L>::load(row[e]); }, E, k, renormalize,
                            [](float v) { return Elem<L>::load(Elem<L>::store(v)); }, indices + t * k,
                            [&](int slot, float w) { wrow[slot] = Elem<W>::store(w); });
}

unsigned ctas_for(int64_t items, int per_cta) { return static_cast<unsigned>((items + per_cta - 1) / per_cta); }

}  // namespace

void route_into(const Tensor& h, const RouterWeights& router, int32_t* indices, void* weights, Workspace& ws) {
  const char* op = "route";
  EXPERTQMM_CHECK(h.device() == Device::cuda && h.ndim() == 2 && (h.size(1) <= 1 || h.stride(1) == 1), op,
                  "h must be a [T, H] device tensor with contiguous rows, got ", h.describe());
  const int64_t T = h.size(0), H = h.size(1);
  const bool quantized = router.proj.defined();
  const int64_t E = quantized ? router.proj.w.size(0) : router.proj_dense.size(0);
  const int k = router.top_k;
  EXPERTQMM_CHECK(k >= 1 && k <= E && T <= INT32_MAX, op, "top_k=", k, " must be in [1, E=", E, "] (T=", T, ")");
  if (T == 0) return;
  const DType h_dtype = h.dtype();
  // The projection runs in promote(r, proj) (r is rounded to h's dtype first, as on the CPU).
  // (An fp-mode proj has uint8 scales and computes in r's dtype, as MLX's gather_qmm.)
  const bool fp_proj = quantized && router.proj.mode != QuantMode::affine;
  const DType proj_dtype = fp_proj ? h_dtype : quantized ? router.proj.scales.dtype() : router.proj_dense.dtype();
  const DType logit_dtype = promote_floating(h_dtype, proj_dtype);
  const bool gemma4 = router.kind == RouterKind::gemma4;
  // softmax_topk projects h itself, which must then be a dense [T, H] block.
  EXPERTQMM_CHECK(gemma4 || T <= 1 || h.stride(0) == H, op, "a softmax_topk router needs contiguous h, got ",
                  h.describe());

  ArenaLayout layout;
  const size_t r_off = gemma4 ? layout.reserve(static_cast<size_t>(T * H) * dtype_size(h_dtype)) : 0;
  const bool cast_r = quantized && logit_dtype != h_dtype;  // gather_qmm wants x in its dtype
  const size_t r_cast_off = cast_r ? layout.reserve(static_cast<size_t>(T * H) * dtype_size(logit_dtype)) : 0;
  const bool cast_scales = quantized && !fp_proj && proj_dtype != logit_dtype;
  const int64_t proj_groups = quantized ? router.proj.scales.numel() : 0;
  const size_t scales_off = cast_scales ? layout.reserve(static_cast<size_t>(proj_groups) * dtype_size(logit_dtype)) : 0;
  const size_t biases_off = cast_scales ? layout.reserve(static_cast<size_t>(proj_groups) * dtype_size(logit_dtype)) : 0;
  const size_t logits_off = layout.reserve(static_cast<size_t>(T * E) * dtype_size(logit_dtype));
  // The projection's split-K slices (rhs_tiles at many tokens) live here too: the router's arena
  // is reused later by the MoE layer's larger combine accumulator, so they cost no peak memory.
  const size_t split_bytes = quantized ? gather_qmm_split_k_bytes(T, E, H) : 0;
  const size_t split_off = split_bytes ? layout.reserve(split_bytes) : 0;
  void* base = ws.get(detail::kSlotRouterArena, layout.bytes());
  void* r = gemma4 ? arena_at(base, r_off) : const_cast<void*>(h.data());
  void* logits = arena_at(base, logits_off);
  cudaStream_t stream = current_stream();
  const float root_size = 1.0f / std::sqrt(static_cast<float>(H));

  if (gemma4) dispatch_float(h_dtype, op, [&](auto tag) {
    const Tensor scale = router.scale.contiguous();
    constexpr DType D = decltype(tag)::value;
    dispatch_float(scale.dtype(), op, [&](auto stag) {
      constexpr DType S = decltype(stag)::value;
      using HS = typename Elem<D>::storage;
      router_rms_norm_kernel<D, S><<<static_cast<unsigned>(T), kNormThreads, 0, stream>>>(
          h.data_as<const HS>(), h.stride(0), H, scale.data_as<const typename Elem<S>::storage>(), root_size,
          router.eps, static_cast<HS*>(r));
      EXPERTQMM_CUDA_CHECK_LAUNCH(router_rms_norm_kernel);
    });
  });
  void* r_in_logit_dtype = r;
  if (cast_r) {
    r_in_logit_dtype = arena_at(base, r_cast_off);
    launch_cast(h_dtype, r, logit_dtype, r_in_logit_dtype, T * H, stream);
  }

  if (quantized) {
    // One weight matrix, no indices: x [T, H] is a single batch of M = T rows (B = 1).
    const QuantizedWeight& q = router.proj;
    Tensor scales, biases;  // q's own unless they must be cast to the logit dtype
    if (cast_scales) {
      void* s = arena_at(base, scales_off);
      void* b = arena_at(base, biases_off);
      const Tensor qs = q.scales.contiguous(), qb = q.biases.contiguous();
      launch_cast(proj_dtype, qs.data(), logit_dtype, s, proj_groups, stream);
      launch_cast(proj_dtype, qb.data(), logit_dtype, b, proj_groups, stream);
      scales = Tensor::view(s, q.scales.shape(), logit_dtype, Device::cuda);
      biases = Tensor::view(b, q.biases.shape(), logit_dtype, Device::cuda);
    }
    detail::GatherQmmProblem p = single_matrix_problem(r_in_logit_dtype, T, H, logit_dtype, q, scales, biases);
    if (split_bytes) p.split_k_scratch = arena_at(base, split_off);
    gather_qmm_into(p, logits, &ws);
  } else {
    // A 16-bit (or f32) projection: the dense linear's gather_mm routes (tiles at prefill, gemv at
    // decode sizes), r widened to the logit dtype there when they differ.
    dense_linear_into(r, h_dtype, T, router.proj_dense, logit_dtype, logits, ws);
  }

  dispatch_float(logit_dtype, op, [&](auto ltag) {
    constexpr DType L = decltype(ltag)::value;
    dispatch_float(h_dtype, op, [&](auto wtag) {
      constexpr DType W = decltype(wtag)::value;
      if (!gemma4) {
        router_softmax_topk_kernel<L, W><<<ctas_for(T, kWarpsPerCta), kWarpsPerCta * 32, 0, stream>>>(
            static_cast<const typename Elem<L>::storage*>(logits), T, E, k, router.norm_topk_prob, indices,
            static_cast<typename Elem<W>::storage*>(weights));
        EXPERTQMM_CUDA_CHECK_LAUNCH(router_softmax_topk_kernel);
        return;
      }
      const Tensor per_expert_scale = router.per_expert_scale.contiguous();
      router_topk_softmax_kernel<L, W><<<ctas_for(T, kWarpsPerCta), kWarpsPerCta * 32, 0, stream>>>(
          static_cast<const typename Elem<L>::storage*>(logits), T, E, k, per_expert_scale.data(),
          per_expert_scale.dtype(), indices, static_cast<typename Elem<W>::storage*>(weights));
      EXPERTQMM_CUDA_CHECK_LAUNCH(router_topk_softmax_kernel);
    });
  });
}

Routing route(const Tensor& h, const RouterWeights& router) {
  const int64_t T = h.size(0);
  const int k = router.top_k;
  Routing out;
  out.indices = Tensor::empty({T, k}, DType::i32, Device::cuda);
  out.weights = Tensor::empty({T, k}, h.dtype(), Device::cuda);
  Workspace ws;  // the allocating public path: scratch lives for this call only
  route_into(h, router, out.indices.data_as<int32_t>(), out.weights.data(), ws);
  return out;
}

}  // namespace expertqmm::cuda

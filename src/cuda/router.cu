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

// The same r for 16-bit h and scale with H % 8 == 0, H <= 32 * 8 * kWarpNormUnits, 16-byte aligned
// rows: one warp per token, 8 tokens per CTA (many tokens: the one-CTA-per-token kernel above issued
// 2-byte loads from 256 threads per row and ran at ~1.4 TB/s at 2048 tokens, bench/NOTES.md step 57).
// Lane l owns the 8-value units u = l, l + 32, ... (16-byte loads, all in flight before the math);
// per unit the squares are summed in index order, the units in u order, the lanes by xor shuffles;
// then r = D(h * inv_rms * (scale * root_size)) per value, stored as one 16-byte unit.
constexpr int kWarpNormUnits = 16;  // units per lane: H <= 4096

template <DType D, DType S>
__global__ void router_rms_norm_warp_kernel(const typename Elem<D>::storage* __restrict__ h, int64_t h_row_stride,
                                            int64_t T, int64_t H, const typename Elem<S>::storage* __restrict__ scale,
                                            float root_size, float eps, typename Elem<D>::storage* __restrict__ r) {
  static_assert(sizeof(typename Elem<D>::storage) == 2 && sizeof(typename Elem<S>::storage) == 2, "16-bit h and scale");
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + (threadIdx.x >> 5);
  if (t >= T) return;  // uniform per warp
  const int lane = threadIdx.x & 31;
  const int units = static_cast<int>(H / 8);
  const uint4* row = reinterpret_cast<const uint4*>(h + t * h_row_stride);
  uint4 hv[kWarpNormUnits];
#pragma unroll
  for (int j = 0; j < kWarpNormUnits; ++j)
    if (lane + 32 * j < units) hv[j] = row[lane + 32 * j];
  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kWarpNormUnits; ++j) {
    if (lane + 32 * j >= units) break;
    const uint16_t* v = reinterpret_cast<const uint16_t*>(&hv[j]);
    float unit_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x = Elem<D>::load(v[i]);
      unit_sq = __fadd_rn(unit_sq, __fmul_rn(x, x));
    }
    sum_sq = __fadd_rn(sum_sq, unit_sq);
  }
  for (int off = 16; off > 0; off >>= 1) sum_sq = __fadd_rn(sum_sq, __shfl_xor_sync(0xffffffffu, sum_sq, off));
  const float inv_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, static_cast<float>(H)), eps)));
  const uint4* scale_units = reinterpret_cast<const uint4*>(scale);
  uint4* out = reinterpret_cast<uint4*>(r + t * H);
#pragma unroll
  for (int j = 0; j < kWarpNormUnits; ++j) {
    const int u = lane + 32 * j;
    if (u >= units) break;
    const uint4 sv = scale_units[u];
    const uint16_t* x = reinterpret_cast<const uint16_t*>(&hv[j]);
    const uint16_t* w = reinterpret_cast<const uint16_t*>(&sv);
    uint4 o;
    uint16_t* ov = reinterpret_cast<uint16_t*>(&o);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      ov[i] = Elem<D>::store(
          __fmul_rn(__fmul_rn(Elem<D>::load(x[i]), inv_rms), __fmul_rn(Elem<S>::load(w[i]), root_size)));
    out[u] = o;
  }
}

// Whether the warp kernel takes the norm: 16-bit h and scale, whole 16-byte units, aligned rows.
bool warp_norm_fits(const Tensor& h, const Tensor& scale, const void* r) {
  const int64_t H = h.size(1);
  return dtype_size(h.dtype()) == 2 && dtype_size(scale.dtype()) == 2 && H % 8 == 0 &&
         H <= 32 * 8 * kWarpNormUnits && (h.size(0) <= 1 || h.stride(0) % 8 == 0) && is_aligned(h.data(), 16) &&
         is_aligned(scale.data(), 16) && is_aligned(r, 16);
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


// What route_into computes from its problem before it launches anything: the dtypes, the forms and
// the scratch layout (offsets into workspace slot kSlotRouterArena). Throws on a bad problem.
struct RouterScratch {
  int64_t T = 0, H = 0, E = 0;
  int k = 0;
  bool quantized = false, fp_proj = false, gemma4 = false, cast_r = false, cast_scales = false;
  DType h_dtype = DType::bf16, proj_dtype = DType::bf16, logit_dtype = DType::bf16;
  int64_t proj_groups = 0;
  size_t r_off = 0, r_cast_off = 0, scales_off = 0, biases_off = 0, logits_off = 0, split_off = 0, split_bytes = 0;
  size_t bytes = 0;
};

RouterScratch router_scratch(const Tensor& h, const RouterWeights& router) {
  const char* op = "route";
  EXPERTQMM_CHECK(h.device() == Device::cuda && h.ndim() == 2 && (h.size(1) <= 1 || h.stride(1) == 1), op,
                  "h must be a [T, H] device tensor with contiguous rows, got ", h.describe());
  RouterScratch r;
  r.T = h.size(0);
  r.H = h.size(1);
  const int64_t T = r.T, H = r.H;
  r.quantized = router.proj.defined();
  r.E = r.quantized ? router.proj.w.size(0) : router.proj_dense.size(0);
  r.k = router.top_k;
  EXPERTQMM_CHECK(r.k >= 1 && r.k <= r.E && T <= INT32_MAX, op, "top_k=", r.k, " must be in [1, E=", r.E, "] (T=", T,
                  ")");
  r.h_dtype = h.dtype();
  // The projection runs in promote(r, proj) (r is rounded to h's dtype first, as on the CPU).
  // (An fp-mode proj has uint8 scales and computes in r's dtype, as MLX's gather_qmm.)
  r.fp_proj = r.quantized && router.proj.mode != QuantMode::affine;
  r.proj_dtype = r.fp_proj ? r.h_dtype : r.quantized ? router.proj.scales.dtype() : router.proj_dense.dtype();
  r.logit_dtype = promote_floating(r.h_dtype, r.proj_dtype);
  r.gemma4 = router.kind == RouterKind::gemma4;
  // softmax_topk projects h itself, which must then be a dense [T, H] block.
  EXPERTQMM_CHECK(r.gemma4 || T <= 1 || h.stride(0) == H, op, "a softmax_topk router needs contiguous h, got ",
                  h.describe());

  ArenaLayout layout;
  if (r.gemma4) r.r_off = layout.reserve(static_cast<size_t>(T * H) * dtype_size(r.h_dtype));
  r.cast_r = r.quantized && r.logit_dtype != r.h_dtype;  // gather_qmm wants x in its dtype
  if (r.cast_r) r.r_cast_off = layout.reserve(static_cast<size_t>(T * H) * dtype_size(r.logit_dtype));
  r.cast_scales = r.quantized && !r.fp_proj && r.proj_dtype != r.logit_dtype;
  r.proj_groups = r.quantized ? router.proj.scales.numel() : 0;
  if (r.cast_scales) {
    r.scales_off = layout.reserve(static_cast<size_t>(r.proj_groups) * dtype_size(r.logit_dtype));
    r.biases_off = layout.reserve(static_cast<size_t>(r.proj_groups) * dtype_size(r.logit_dtype));
  }
  r.logits_off = layout.reserve(static_cast<size_t>(T * r.E) * dtype_size(r.logit_dtype));
  // The projection's split-K slices (rhs_tiles at many tokens) live here too: the MoE layer reuses
  // the slot once routed (its down output), so they cost no peak
  // memory.
  r.split_bytes = r.quantized ? gather_qmm_split_k_bytes(T, r.E, H) : 0;
  if (r.split_bytes) r.split_off = layout.reserve(r.split_bytes);
  r.bytes = layout.bytes();
  return r;
}

}  // namespace

size_t route_scratch_bytes(const Tensor& h, const RouterWeights& router) {
  return h.size(0) == 0 ? 0 : router_scratch(h, router).bytes;
}

void route_into(const Tensor& h, const RouterWeights& router, int32_t* indices, void* weights, Workspace& ws) {
  const char* op = "route";
  const RouterScratch rs = router_scratch(h, router);
  const int64_t T = rs.T, H = rs.H, E = rs.E;
  const int k = rs.k;
  if (T == 0) return;
  void* base = ws.get(detail::kSlotRouterArena, rs.bytes);
  void* r = rs.gemma4 ? arena_at(base, rs.r_off) : const_cast<void*>(h.data());
  void* logits = arena_at(base, rs.logits_off);
  cudaStream_t stream = current_stream();
  const float root_size = 1.0f / std::sqrt(static_cast<float>(H));

  if (rs.gemma4) dispatch_float(rs.h_dtype, op, [&](auto tag) {
    const Tensor scale = router.scale.contiguous();
    constexpr DType D = decltype(tag)::value;
    const bool warp_norm = warp_norm_fits(h, scale, r);
    dispatch_float(scale.dtype(), op, [&](auto stag) {
      constexpr DType S = decltype(stag)::value;
      using HS = typename Elem<D>::storage;
      using SS = typename Elem<S>::storage;
      if constexpr (sizeof(HS) == 2 && sizeof(SS) == 2) {
        if (warp_norm) {
          router_rms_norm_warp_kernel<D, S><<<ctas_for(T, kWarpsPerCta), kWarpsPerCta * 32, 0, stream>>>(
              h.data_as<const HS>(), h.stride(0), T, H, scale.data_as<const SS>(), root_size, router.eps,
              static_cast<HS*>(r));
          EXPERTQMM_CUDA_CHECK_LAUNCH(router_rms_norm_warp_kernel);
          return;
        }
      }
      router_rms_norm_kernel<D, S><<<static_cast<unsigned>(T), kNormThreads, 0, stream>>>(
          h.data_as<const HS>(), h.stride(0), H, scale.data_as<const SS>(), root_size, router.eps,
          static_cast<HS*>(r));
      EXPERTQMM_CUDA_CHECK_LAUNCH(router_rms_norm_kernel);
    });
  });
  void* r_in_logit_dtype = r;
  if (rs.cast_r) {
    r_in_logit_dtype = arena_at(base, rs.r_cast_off);
    launch_cast(rs.h_dtype, r, rs.logit_dtype, r_in_logit_dtype, T * H, stream);
  }

  if (rs.quantized) {
    // One weight matrix, no indices: x [T, H] is a single batch of M = T rows (B = 1).
    const QuantizedWeight& q = router.proj;
    Tensor scales, biases;  // q's own unless they must be cast to the logit dtype
    if (rs.cast_scales) {
      void* s = arena_at(base, rs.scales_off);
      void* b = arena_at(base, rs.biases_off);
      const Tensor qs = q.scales.contiguous(), qb = q.biases.contiguous();
      launch_cast(rs.proj_dtype, qs.data(), rs.logit_dtype, s, rs.proj_groups, stream);
      launch_cast(rs.proj_dtype, qb.data(), rs.logit_dtype, b, rs.proj_groups, stream);
      scales = Tensor::view(s, q.scales.shape(), rs.logit_dtype, Device::cuda);
      biases = Tensor::view(b, q.biases.shape(), rs.logit_dtype, Device::cuda);
    }
    detail::GatherQmmProblem p = single_matrix_problem(r_in_logit_dtype, T, H, rs.logit_dtype, q, scales, biases);
    if (rs.split_bytes) p.split_k_scratch = arena_at(base, rs.split_off);
    gather_qmm_into(p, logits, &ws);
  } else {
    // A 16-bit (or f32) projection: the dense linear's gather_mm routes (tiles at prefill, gemv at
    // decode sizes), r widened to the logit dtype there when they differ.
    dense_linear_into(r, rs.h_dtype, T, router.proj_dense, rs.logit_dtype, logits, ws);
  }

  dispatch_float(rs.logit_dtype, op, [&](auto ltag) {
    constexpr DType L = decltype(ltag)::value;
    dispatch_float(rs.h_dtype, op, [&](auto wtag) {
      constexpr DType W = decltype(wtag)::value;
      if (!rs.gemma4) {
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

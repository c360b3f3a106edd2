// The decode MoE layer: moe_layer_into for small T (T*k <= kDecodeMaxRows) in three kernels, so
// that a CUDA graph of the layer holds three dependent nodes instead of nine:
//   1. decode_router_kernel        RMS norm of h -> router projection -> (last CTA) top-k + softmax
//                                   and a plan that groups the T*k (token, slot) rows by expert
//   2. decode_gate_up_glu_kernel   per (expert group, column block): gate and up for every row
//                                   routed to the expert, then the GLU product -> hidden [n, I]
//   3. decode_down_combine_kernel  per (token, column block): the k slots' down GEMVs, weighted and
//                                   summed in slot order in fp32, one rounding -> out [T, H]
// Kernels 2 and 3 exist twice: scalar (8-bit experts) and on tensor cores (4-bit experts, the
// Gemma layer: decode_gate_up_glu_mma_kernel, decode_down_combine_mma_kernel).
// Numerics are the general path's (src/cuda/moe.cu): the router rounds r and the logits to h's
// dtype and routes with device/route_topk.cuh (the same code as route_into); gate and up are
// qmv dot products (MLX gather_qmv: sum over groups or chunks of s * sum(x * q) + b * sum(x) in
// fp32, the dequantized weight never rounded), rounded to the activation dtype before the GLU (as the fused
// product of launch_glu_product); the down outputs stay fp32 into the combine (one rounding, where
// the general path rounds y to the dtype first), summed in slot order as launch_weighted_combine.
// Only summation orders differ, so routing agrees with route_into except at logit near-ties.
//
// supports_decode_layer takes: T <= 8, k <= 8, T*k <= 64; bf16 or f16 activations with the same
// dtype for h, x, out and every scale/bias; 4- or 8-bit experts with group 32/64/128 (separate or
// fused gate_up); a router that is 4/8-bit with group 32/64/128 or dense, in the activation dtype;
// 16-byte aligned rows. Everything else goes to the general path (one Fallback class per miss,
// counted under Primitive::moe_decode_layer).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <mutex>
#include <type_traits>
#include <unordered_set>

#include "core/route_counters.h"
#include "cuda/cuda_backend.h"
#include "cuda/device/cp_async.cuh"
#include "cuda/device/dequant.cuh"
#include "cuda/device/glu.cuh"
#include "cuda/device/mma.cuh"
#include "cuda/device/route_topk.cuh"
#include "cuda/gather_qmm_routes.h"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

namespace {

using device::small_uint_to_float;
using device::word_dot;
using device::word_x;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kDecodeMaxTokens = 8;  // T: the router stages every token's r in shared memory
constexpr int kDecodeMaxTopK = 8;    // k: one warp per slot in the down/combine kernel
constexpr size_t kDecodeMaxSmem = 160 * 1024;  // dynamic shared memory of any decode kernel (sm_80: 163 KB)

// The expert-group plan that the router's last CTA leaves for the gate/up kernel: the n = T*k flat
// rows (t*k + j) sorted by expert (stable), one group per distinct expert in increasing id order.
struct DecodePlan {
  int32_t groups;                    // distinct experts
  int32_t expert[kDecodeMaxRows];    // [g] expert id of group g
  int32_t begin[kDecodeMaxRows];     // [g] first entry of group g in row[]
  int32_t count[kDecodeMaxRows];     // [g] rows routed to the expert
  int32_t row[kDecodeMaxRows];       // flat rows ordered by (expert, row)
};

// ---------------------------------------------------------------------------------------------
// Staged activations of the scalar (8-bit) kernels. A row of K values lives in shared memory as
// floats, with 4 floats of padding after every 32 (lanes reading consecutive 16-byte weight chunks
// start in different bank groups, as in qmv), followed by the plain sum of each unit of 8 values:
//   xs    padded(K) floats
//   usum  K / 8 floats, at round_up4(padded(K))
__host__ __device__ constexpr int padded(int i) { return i + ((i >> 5) << 2); }
__host__ __device__ constexpr int round_up4(int v) { return (v + 3) & ~3; }
__host__ __device__ constexpr int staged_floats(int K) { return round_up4(padded(K)) + round_up4(K / 8); }

// Writes unit u (values 8u .. 8u+7, given in v) of a staged row: the plain fp32 sum in index order
// (qmv's unit sums), then the values.
__device__ __forceinline__ void stage_unit(float* row, int K, int u, const float (&v)[8]) {
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += v[i];
  float4* dst = reinterpret_cast<float4*>(row + padded(8 * u));  // 8u is 8-aligned: one 32-block
  dst[0] = make_float4(v[0], v[1], v[2], v[3]);
  dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  row[round_up4(padded(K)) + u] = sum;
}

// Eight activations of D from one 16-byte load.
template <DType D>
__device__ __forceinline__ void load8(const typename Elem<D>::storage* src, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const typename Elem<D>::storage* e = reinterpret_cast<const typename Elem<D>::storage*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = Elem<D>::load(e[i]);
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The code dots of one 16-byte chunk against R weight chunks: dot[r] = sum_q x[q] * code_r[q] over
// the chunk's values, x read once from the staged row for all R (scale and bias applied by the caller).
template <int kBits, int R>
__device__ __forceinline__ void chunk_dots(const float* xc, const uint4 (&w)[R], float (&dot)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) dot[r] = 0.f;
#pragma unroll
  for (int wi = 0; wi < 4; ++wi) {
    float xv[32 / kBits];
    word_x<kBits>(xc, wi, xv);
#pragma unroll
    for (int r = 0; r < R; ++r) dot[r] = word_dot<kBits>(word_of(w[r], wi), xv, dot[r]);
  }
}

// sum(x) over chunk c (kVals values = kVals / 8 units) of a staged row.
__device__ __forceinline__ float chunk_sum(const float* row, int K, int c, int kVals) {
  const float* usum = row + round_up4(padded(K));
  float s = 0.f;
  for (int u = 0; u < kVals / 8; ++u) s += usum[c * (kVals / 8) + u];
  return s;
}

__device__ __forceinline__ float load_any(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

template <DType D>
__device__ __forceinline__ float raw_param(uint16_t v) {
  return Elem<D>::load(v);
}

// ---------------------------------------------------------------------------------------------
// Kernel 1: router.
struct RouterArgs {
  const uint16_t* h;  // (T, H) of D, rows h_stride elements apart
  int64_t h_stride;
  const void* scale;  // (H) of scale_dtype: the RMS norm weight
  DType scale_dtype;
  float root_size, eps;
  const void* proj;          // quantized: (E, H*bits/32) uint32 codes; dense: (E, H) of D
  const uint16_t* proj_scales;  // (E, H/group) of D (quantized only)
  const uint16_t* proj_biases;
  int groups_per_row, group_shift;
  const void* per_expert_scale;  // (E) of pes_dtype
  DType pes_dtype;
  int T, H, E, k;
  float* logits;       // (T, E) scratch: the logits, already rounded to D
  unsigned* counter;   // CTAs done; 0 between calls (the last CTA resets it)
  int32_t* indices;    // (T, k) out
  uint16_t* weights;   // (T, k) of D out
  DecodePlan* plan;    // out
};

constexpr int kRouterThreads = 256;
constexpr int kRouterWarps = kRouterThreads / 32;
constexpr int kRouterChunks = 2;      // 16-byte weight chunks per thread per batch (c = tid + 256 i)
constexpr int kRouterUnits = 12;      // 16-byte h units per thread per staging batch
constexpr int kRouterScaleUnits = 2;  // norm-weight units (8 values) per thread per staging batch
constexpr int kRouterCachedScales = kRouterThreads;  // per_expert_scale prefetched for e < 256

// 8 norm-weight values of unit u as float (bf16/f16: one 16-byte load, f32: two).
struct ScaleUnit {
  uint4 lo, hi;
};
__device__ __forceinline__ void load_scale_unit(const void* p, DType dt, int u, ScaleUnit& s) {
  if (dt == DType::f32) {
    const uint4* q = static_cast<const uint4*>(p) + 2 * u;
    s.lo = __ldg(q);
    s.hi = __ldg(q + 1);
  } else {
    s.lo = __ldg(static_cast<const uint4*>(p) + u);
    s.hi = make_uint4(0u, 0u, 0u, 0u);
  }
}
__device__ __forceinline__ void scale_unit_floats(const ScaleUnit& s, DType dt, float (&v)[8]) {
  if (dt == DType::f32) {
    const float* f0 = reinterpret_cast<const float*>(&s.lo);
    const float* f1 = reinterpret_cast<const float*>(&s.hi);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = f0[i];
      v[4 + i] = f1[i];
    }
  } else {
    const uint16_t* e = reinterpret_cast<const uint16_t*>(&s.lo);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = dt == DType::bf16 ? bf16_to_float(e[i]) : f16_to_float(e[i]);
  }
}

// Work split: grid E CTAs (one per expert: 128 for Gemma, one wave on 132 SMs), 256 threads.
// Thread i owns the weight chunks i, i + 256, ... (16 bytes each) of its CTA's expert row: the
// 8-bit Gemma row of 2816 values is 176 chunks, so threads 0..175 hold one chunk each and the
// whole 383 KB projection is requested by the first instructions of all 128 CTAs at once (~3 KB
// per SM: one DRAM round trip, not bandwidth). Order, for latency:
//   1. the chunk loads (with their scale and bias), and per_expert_scale[tid] (for the top-k);
//   2. the RMS-norm inputs, issued as one batch: norm weight units (8 values, 16 B) u = tid,
//      tid + 256, and h units (flat index t*U + u, U = H/8) tid + 256 j, j < 12 (T=8: 2816 units,
//      11 per thread: one batch); h is written to shared memory as raw floats, scale * root_size
//      likewise, and each thread sums the squares of its units per token (registers, index order);
//   3. sums of squares: shuffles, then warp 0..T-1 partials summed in warp order -> inv_rms[t];
//   4. per chunk and token, r = D(h * inv_rms * (scale * root_size)) computed in registers from
//      shared memory (route_into's formula; no staged r, no extra barrier), its 8-value unit sums
//      in index order, and the qmv dot (word_dot); acc[t] += s * dot + b * sum(x);
//   5. shuffles, then the 8 warps' partials in warp order -> logits[t, e], rounded to D.
// Each CTA then bumps a device counter (after __threadfence); the CTA that finishes last does the
// top-k (warp t = token t, device::warp_topk_softmax, indices into shared memory, per_expert_scale
// from the prefetched copy), writes indices and weights, resets the counter, and builds the
// DecodePlan from the shared indices: thread b < n counts the rows with a smaller expert id and the
// earlier rows with the same id, which is row b's place in the stably sorted order; first rows of
// an expert name groups.
// Occupancy (ptxas, sm_90a): 119-121 registers, no spills; 1 CTA (8 warps) per SM is all it needs:
// grid E = 128 <= 132 SMs, one wave. Dynamic shared memory (T + 1) * 3168 floats at H = 2816:
// 25 KB at T=1, 114 KB at T=8. In flight per SM: the expert row (2.8 KB + 88 B of scales/biases)
// beside the norm inputs (norm weight 5.6 KB + h 5.6 KB per token: ~14 KB at T=1, ~53 KB at T=8,
// L2 hits after the first CTA) in one round trip; then the counter atomic, one L2 read of the
// logits and the top-k in the last CTA (T=8: the 8 tokens on the 8 warps at once).
template <DType D, int kProj>
__global__ void __launch_bounds__(kRouterThreads) decode_router_kernel(RouterArgs a) {
  using S = typename Elem<D>::storage;
  constexpr bool kQuant = kProj != 0;
  constexpr int kVals = kQuant ? 128 / kProj : 8;  // values per 16-byte chunk
  constexpr int kUnitsPerChunk = kVals / 8;
  extern __shared__ __align__(16) float smem[];    // scale*root_size row, then T raw h rows (padded)
  __shared__ float red[kRouterWarps][kDecodeMaxTokens];
  __shared__ float inv_rms[kDecodeMaxTokens];
  __shared__ float pes_s[kRouterCachedScales];
  __shared__ int is_last;
  __shared__ int32_t ids[kDecodeMaxRows];
  __shared__ int first_of_expert[kDecodeMaxRows];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int e = blockIdx.x;
  const int Q = a.H / kVals;
  const int row_floats = round_up4(padded(a.H));
  float* sr = smem;                // (H) padded: scale * root_size
  float* hs = smem + row_floats;   // (T, H) padded: raw h
  const uint4* wrow = static_cast<const uint4*>(a.proj) + static_cast<int64_t>(e) * Q;
  const uint16_t* srow = kQuant ? a.proj_scales + static_cast<int64_t>(e) * a.groups_per_row : nullptr;
  const uint16_t* brow = kQuant ? a.proj_biases + static_cast<int64_t>(e) * a.groups_per_row : nullptr;

  // 1. Weight loads first.
  uint4 wv[kRouterChunks];
  float ws[kRouterChunks], wb[kRouterChunks];
  auto load_batch = [&](int c0) {
#pragma unroll
    for (int i = 0; i < kRouterChunks; ++i) {
      const int c = c0 + kRouterThreads * i;
      if (c < Q) {
        wv[i] = __ldg(wrow + c);
        if constexpr (kQuant) {
          const int g = (c * kVals) >> a.group_shift;
          ws[i] = raw_param<D>(__ldg(srow + g));
          wb[i] = raw_param<D>(__ldg(brow + g));
        }
      } else {
        wv[i] = make_uint4(0u, 0u, 0u, 0u);
        ws[i] = 0.f;
        wb[i] = 0.f;
      }
    }
  };
  load_batch(tid);
  const float pes_mine = tid < a.E ? load_any(a.per_expert_scale, a.pes_dtype, tid) : 0.f;

  // 2. Norm inputs, batched: the norm weight's units and h's units, all loads before any use.
  const int U = a.H / 8;
  const int TU = a.T * U;
  float sq[kDecodeMaxTokens];
#pragma unroll
  for (int t = 0; t < kDecodeMaxTokens; ++t) sq[t] = 0.f;
  for (int base = 0, sbase = 0; base < TU || sbase < U;
       base += kRouterThreads * kRouterUnits, sbase += kRouterThreads * kRouterScaleUnits) {
    ScaleUnit su[kRouterScaleUnits];
#pragma unroll
    for (int j = 0; j < kRouterScaleUnits; ++j) {
      const int u = sbase + tid + kRouterThreads * j;
      if (u < U) load_scale_unit(a.scale, a.scale_dtype, u, su[j]);
    }
    uint4 hv[kRouterUnits];
#pragma unroll
    for (int j = 0; j < kRouterUnits; ++j) {
      const int idx = base + tid + kRouterThreads * j;
      if (idx < TU) {
        const int t = idx / U, u = idx - t * U;
        hv[j] = *reinterpret_cast<const uint4*>(a.h + t * a.h_stride + 8 * u);
      }
    }
#pragma unroll
    for (int j = 0; j < kRouterScaleUnits; ++j) {
      const int u = sbase + tid + kRouterThreads * j;
      if (u < U) {
        float v[8];
        scale_unit_floats(su[j], a.scale_dtype, v);
        float4* dst = reinterpret_cast<float4*>(sr + padded(8 * u));
        dst[0] = make_float4(__fmul_rn(v[0], a.root_size), __fmul_rn(v[1], a.root_size),
                             __fmul_rn(v[2], a.root_size), __fmul_rn(v[3], a.root_size));
        dst[1] = make_float4(__fmul_rn(v[4], a.root_size), __fmul_rn(v[5], a.root_size),
                             __fmul_rn(v[6], a.root_size), __fmul_rn(v[7], a.root_size));
      }
    }
#pragma unroll
    for (int j = 0; j < kRouterUnits; ++j) {
      const int idx = base + tid + kRouterThreads * j;
      if (idx < TU) {
        const int t = idx / U, u = idx - t * U;
        const S* hvals = reinterpret_cast<const S*>(&hv[j]);
        float v[8];
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          v[i] = Elem<D>::load(hvals[i]);
          s = __fadd_rn(s, __fmul_rn(v[i], v[i]));
        }
#pragma unroll
        for (int tt = 0; tt < kDecodeMaxTokens; ++tt)
          if (tt == t) sq[tt] = __fadd_rn(sq[tt], s);
        float4* dst = reinterpret_cast<float4*>(hs + t * row_floats + padded(8 * u));
        dst[0] = make_float4(v[0], v[1], v[2], v[3]);
        dst[1] = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
  }
  // 3. inv_rms per token.
#pragma unroll
  for (int t = 0; t < kDecodeMaxTokens; ++t) {
    for (int off = 16; off > 0; off >>= 1) sq[t] = __fadd_rn(sq[t], __shfl_xor_sync(0xffffffffu, sq[t], off));
    if (lane == 0) red[warp][t] = sq[t];
  }
  __syncthreads();
  if (tid < a.T) {
    float total = 0.f;
    for (int w = 0; w < kRouterWarps; ++w) total = __fadd_rn(total, red[w][tid]);
    inv_rms[tid] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(a.H)), a.eps)));
  }
  if (tid < kRouterCachedScales) pes_s[tid] = pes_mine;
  __syncthreads();

  // 4. The expert's logit, token by token (a runtime loop, so the dot code exists once: the kernel
  //    is fetched cold by every SM), r computed per chunk from shared memory; then lanes reduce by
  //    shuffles and the warps' partials are summed in warp order.
  const bool one_batch = Q <= kRouterThreads * kRouterChunks;  // the row stays in registers
  for (int t = 0; t < a.T; ++t) {
    const float inv = inv_rms[t];
    const float* hrow = hs + t * row_floats;
    float acc = 0.f;
    for (int c0 = tid;;) {
      if (!one_batch && !(t == 0 && c0 == tid)) load_batch(c0);
#pragma unroll
      for (int i = 0; i < kRouterChunks; ++i) {
        const int c = c0 + kRouterThreads * i;
        if (c >= Q) break;
        float dot = 0.f, sx = 0.f;
#pragma unroll
        for (int q = 0; q < kUnitsPerChunk; ++q) {
          const int i0 = padded(c * kVals + 8 * q);  // 8 values inside one 32-block
          const float4 h0 = *reinterpret_cast<const float4*>(hrow + i0);
          const float4 h1 = *reinterpret_cast<const float4*>(hrow + i0 + 4);
          const float4 s0 = *reinterpret_cast<const float4*>(sr + i0);
          const float4 s1 = *reinterpret_cast<const float4*>(sr + i0 + 4);
          const float hv8[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
          const float sv8[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
          float x[8];
          float usum = 0.f;
#pragma unroll
          for (int v = 0; v < 8; ++v) {
            x[v] = round_to<D>(__fmul_rn(__fmul_rn(hv8[v], inv), sv8[v]));
            usum += x[v];
          }
          sx += usum;
          if constexpr (kProj == 4) {
#pragma unroll
            for (int v = 0; v < 8; ++v) x[v] *= 1.0f / static_cast<float>(1 << (4 * (v & 3)));
            dot = word_dot<4>(word_of(wv[i], q), x, dot);
          } else if constexpr (kProj == 8) {
            dot = word_dot<8>(word_of(wv[i], 2 * q), x, dot);
            dot = word_dot<8>(word_of(wv[i], 2 * q + 1), x + 4, dot);
          } else {
            const S* pv = reinterpret_cast<const S*>(&wv[i]);
#pragma unroll
            for (int v = 0; v < 8; ++v) dot += x[v] * Elem<D>::load(pv[v]);
          }
        }
        if constexpr (kQuant) acc += ws[i] * dot + wb[i] * sx;
        else acc += dot;
      }
      c0 += kRouterThreads * kRouterChunks;
      if (c0 - tid >= Q) break;  // CTA-uniform
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) red[warp][t] = acc;  // red's sums of squares were consumed before the last barrier
  }
  __syncthreads();
  if (tid < a.T) {
    float total = 0.f;
    for (int w = 0; w < kRouterWarps; ++w) total += red[w][tid];
    a.logits[tid * a.E + e] = round_to<D>(total);
  }

  // The last CTA to finish routes.
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (tid == 0) atomicExch(a.counter, 0u);  // ready for the next call (graph replays)
  for (int t = warp; t < a.T; t += kRouterWarps) {
    const float* lrow = a.logits + t * a.E;
    uint16_t* wrow_out = a.weights + t * a.k;
    device::warp_topk_softmax(
        [&](int64_t x) { return __ldcg(lrow + x); }, a.E, a.k,
        [&](int64_t x) { return x < kRouterCachedScales ? pes_s[x] : load_any(a.per_expert_scale, a.pes_dtype, x); },
        ids + t * a.k, [&](int slot, float w) { wrow_out[slot] = Elem<D>::store(w); });
  }
  __syncthreads();

  // The plan: rows grouped by expert (stable counting sort over n <= 64 rows).
  const int n = a.T * a.k;
  int32_t mine = -1;
  int less = 0, before = 0, same = 0;
  if (tid < n) {
    mine = ids[tid];
    a.indices[tid] = mine;
    for (int b = 0; b < n; ++b) {
      const int32_t other = ids[b];
      less += other < mine;
      if (other == mine) {
        ++same;
        before += b < tid;
      }
    }
    first_of_expert[tid] = before == 0;
    a.plan->row[less + before] = tid;
  }
  const int groups = __syncthreads_count(tid < n && before == 0);
  if (tid < n && before == 0) {
    int g = 0;
    for (int b = 0; b < n; ++b) g += first_of_expert[b] && ids[b] < mine;
    a.plan->expert[g] = mine;
    a.plan->begin[g] = less;
    a.plan->count[g] = same;
  }
  if (tid == 0) a.plan->groups = groups;
}

// ---------------------------------------------------------------------------------------------
// Kernel 2: gate, up and the GLU product.
struct GateUpArgs {
  const uint16_t* x;  // (T, H) of D, rows x_stride elements apart
  int64_t x_stride;
  // gate and up weight rows: expert e, column n is row e * rows_per_expert + row0 + n of
  // w (rows of H*bits/32 uint32) and of scales/biases (rows of H/group of D). Separate tensors:
  // rows_per_expert = I, row0 = 0; one fused gate_up: 2I, gate row0 = 0, up row0 = I.
  const uint32_t* gate_w;
  const uint16_t* gate_s;
  const uint16_t* gate_b;
  const uint32_t* up_w;
  const uint16_t* up_s;
  const uint16_t* up_b;
  int64_t gate_rows_per_expert, up_rows_per_expert;
  int gate_row0, up_row0;
  int groups_per_row, group_shift;
  int H, I, E, k;
  int rows_per_pass;  // activation rows staged at once: min(kGuRowsPerPass, T) (an expert has <= T rows)
  const DecodePlan* plan;
  uint16_t* hidden;  // (n, I) of D: row t*k + j = act(gate) * up of slot (t, j)
  uint32_t* faults;
};

constexpr int kGuWarpCols = 2;                 // output columns per warp
constexpr int kGuWeightRows = 2 * kGuWarpCols;  // weight rows per warp: gate, up of each column
constexpr int kGuCols = kWarps * kGuWarpCols;  // output columns per CTA
constexpr int kGuRowsPerPass = 2;              // activation rows staged at once (at most)
constexpr int kGuChunks = 3;                   // 16-byte chunks per weight row a lane loads at once
constexpr int kGuStageUnits = 2;               // 16-byte x units per thread per staging batch

// Scalar gate/up, for 8-bit experts (4-bit ones run on decode_gate_up_glu_mma_kernel below).
// Work split: grid (ceil(I / 16), min(n, E)), 256 threads, 2 CTAs per SM (__launch_bounds__(256,
// 2): <= 128 registers). CTA (x, g) takes expert group g of the plan (CTAs past the plan's group
// count exit at once) and output columns [16x, 16x + 16): warp w owns columns 16x + 2w and
// 16x + 2w + 1, i.e. four weight rows (gate and up of each), and lane l takes chunks l, l+32, l+64
// of all four: 12 x 16 bytes issued right after the plan's expert id, before anything else (48 KB
// per CTA, 96 KB per SM in flight; Gemma's 8-bit row of 2816 values is 176 chunks: two batches,
// the second loaded per row pass). Only then the group's
// token ids are read and the x rows staged (rows_per_pass at a time, staged_floats(H) floats each;
// a thread's 16-byte x loads go out two at a time: a whole 2816-value row per batch). Each chunk's words are dotted with
// each staged row (x read once from shared memory for the four weight rows), lanes reduce by
// shuffles, and lane 0 writes hidden[row, col] = D(act(D(gate)) * D(up)). Every weight byte of an
// expert's column block is read once per layer, however many tokens chose it; a one-batch block
// stays in registers across passes; the staged rows are dotted one at a time (a runtime loop: two
// rows interleaved cost ~40 more registers and spilled).
// Occupancy (ptxas, sm_90a): 124 registers, no spills: 2 CTAs (16 warps) per SM, dynamic shared
// memory staged_floats(2816) * 4 = 14 KB per staged row (T=1: 14 KB, T>=2: 28 KB); grid at H=2816,
// I=704: 44 column blocks x min(n, E) groups (the extra rows of the grid exit at once).
template <DType D, Activation A>
__global__ void __launch_bounds__(kThreads, 2) decode_gate_up_glu_kernel(GateUpArgs a) {
  constexpr int kBits = 8;
  constexpr int kVals = 128 / kBits;  // values per chunk
  extern __shared__ __align__(16) float smem[];  // (rows_per_pass, staged_floats(H)) floats
  const DecodePlan& plan = *a.plan;
  const int g = blockIdx.y;
  if (g >= plan.groups) return;  // uniform
  const int e = plan.expert[g];
  if (e < 0 || e >= a.E) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
      record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(e), static_cast<uint32_t>(a.E));
    return;
  }
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int Q = a.H / kVals;
  const int row_floats = staged_floats(a.H);
  const int col0 = blockIdx.x * kGuCols + warp * kGuWarpCols;
  // Row indices (into w in chunks of Q, into scales/biases in groups) of the warp's weight rows:
  // r = 2j: gate of column col0 + j, r = 2j + 1: its up. Columns past I read nothing.
  int64_t wr[kGuWeightRows];
  bool valid[kGuWarpCols];
#pragma unroll
  for (int j = 0; j < kGuWarpCols; ++j) {
    valid[j] = col0 + j < a.I;
    wr[2 * j] = valid[j] ? e * a.gate_rows_per_expert + a.gate_row0 + col0 + j : 0;
    wr[2 * j + 1] = valid[j] ? e * a.up_rows_per_expert + a.up_row0 + col0 + j : 0;
  }

  // Codes, and each chunk's raw scale (low half) and bias (high half) in one register.
  uint4 wv[kGuChunks][kGuWeightRows];
  uint32_t wsb[kGuChunks][kGuWeightRows];
  auto load_batch = [&](int c0) {
#pragma unroll
    for (int i = 0; i < kGuChunks; ++i) {
      const int c = c0 + 32 * i;
      const int grp = (c * kVals) >> a.group_shift;
#pragma unroll
      for (int r = 0; r < kGuWeightRows; ++r) {
        const bool gate = (r & 1) == 0;
        if (valid[r >> 1] && c < Q) {
          const uint4* wbase = reinterpret_cast<const uint4*>(gate ? a.gate_w : a.up_w);
          const uint16_t* sbase = gate ? a.gate_s : a.up_s;
          const uint16_t* bbase = gate ? a.gate_b : a.up_b;
          wv[i][r] = __ldg(wbase + wr[r] * Q + c);
          wsb[i][r] = __byte_perm(__ldg(sbase + wr[r] * a.groups_per_row + grp),
                                  __ldg(bbase + wr[r] * a.groups_per_row + grp), 0x5410u);
        } else {
          wv[i][r] = make_uint4(0u, 0u, 0u, 0u);
          wsb[i][r] = 0u;  // scale and bias +0
        }
      }
    }
  };
  load_batch(lane);
  const bool one_batch = Q <= 32 * kGuChunks;  // the whole row is in registers: keep it across passes
  const int begin = plan.begin[g], count = plan.count[g];

  const int U = a.H / 8;
  const int per_pass = a.rows_per_pass;
  for (int pass = 0; pass * per_pass < count; ++pass) {
    const int rows = min(per_pass, count - pass * per_pass);
    const int row0 = begin + pass * per_pass;
    int64_t token[kGuRowsPerPass];
#pragma unroll
    for (int r = 0; r < kGuRowsPerPass; ++r) token[r] = r < rows ? plan.row[row0 + r] / a.k : 0;
    if (pass > 0) __syncthreads();  // every warp is done with the previous pass's rows
    const int RU = rows * U;
    for (int base = 0; base < RU; base += kThreads * kGuStageUnits) {
      uint4 xv[kGuStageUnits];
#pragma unroll
      for (int j = 0; j < kGuStageUnits; ++j) {
        const int idx = base + tid + kThreads * j;
        if (idx < RU) {
          const int r = idx / U, u = idx - r * U;
          int64_t tok = token[0];
#pragma unroll
          for (int rr = 1; rr < kGuRowsPerPass; ++rr)
            if (r == rr) tok = token[rr];
          xv[j] = *reinterpret_cast<const uint4*>(a.x + tok * a.x_stride + 8 * u);
        }
      }
#pragma unroll
      for (int j = 0; j < kGuStageUnits; ++j) {
        const int idx = base + tid + kThreads * j;
        if (idx < RU) {
          const int r = idx / U, u = idx - r * U;
          const typename Elem<D>::storage* ev = reinterpret_cast<const typename Elem<D>::storage*>(&xv[j]);
          float v[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = Elem<D>::load(ev[i]);
          stage_unit(smem + r * row_floats, a.H, u, v);
        }
      }
    }
    __syncthreads();

    // One staged row at a time (a runtime loop: the rows' math interleaved would need more registers).
#pragma unroll 1
    for (int r = 0; r < rows; ++r) {
      const float* row = smem + r * row_floats;
      float acc[kGuWeightRows];
#pragma unroll
      for (int j = 0; j < kGuWeightRows; ++j) acc[j] = 0.f;
      for (int c0 = lane;;) {
        if (!one_batch && !(pass == 0 && r == 0 && c0 == lane)) load_batch(c0);
#pragma unroll
        for (int i = 0; i < kGuChunks; ++i) {
          const int c = c0 + 32 * i;
          if (c >= Q) break;
          const float* xc = row + padded(c * kVals);
          float dot[kGuWeightRows];
          chunk_dots<kBits>(xc, wv[i], dot);
          const float sx = chunk_sum(row, a.H, c, kVals);
#pragma unroll
          for (int j = 0; j < kGuWeightRows; ++j)
            acc[j] += raw_param<D>(static_cast<uint16_t>(wsb[i][j])) * dot[j] +
                      raw_param<D>(static_cast<uint16_t>(wsb[i][j] >> 16)) * sx;
        }
        c0 += 32 * kGuChunks;
        if (c0 - lane >= Q) break;  // warp-uniform
      }
#pragma unroll
      for (int j = 0; j < kGuWeightRows; ++j)
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
      if (lane == 0) {
        const int64_t out_row = plan.row[row0 + r];
#pragma unroll
        for (int j = 0; j < kGuWarpCols; ++j) {
          if (!valid[j]) continue;
          const float gate = round_to<D>(acc[2 * j]);
          const float up = round_to<D>(acc[2 * j + 1]);
          a.hidden[out_row * a.I + col0 + j] = Elem<D>::store(device::glu<A>(gate, up));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Kernel 3: down and the weighted combine.
struct DownArgs {
  const uint16_t* hidden;  // (n, I) of D
  const uint32_t* w;       // (E, H, I*bits/32) codes
  const uint16_t* s;       // (E, H, I/group) of D
  const uint16_t* b;
  int groups_per_row, group_shift;
  const int32_t* indices;   // (T, k)
  const uint16_t* weights;  // (T, k) of D
  int H, I, E, k;
  uint16_t* out;  // (T, H) of D
  uint32_t* faults;
};

// The slot bookkeeping both down kernels end with. Lane 0 of slot warp j records the slot's weight
// and whether its expert id is valid (an invalid one is a fault, and the slot is skipped).
__device__ __forceinline__ void record_slot(const DownArgs& a, float (&weight)[kWarps], int (&ok)[kWarps], int j,
                                            float w, bool valid, int e) {
  weight[j] = w;
  ok[j] = valid;
  if (!valid) record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(e), static_cast<uint32_t>(a.E));
}

// Thread c < kCols of CTA (t, column block col0), after the barrier: out[t, col0 + c] = the slots'
// partials times their weights, added in slot order in fp32, one rounding (launch_weighted_combine's
// arithmetic).
template <DType D, int kCols>
__device__ __forceinline__ void store_slot_sum(const DownArgs& a, int t, int col0, int c,
                                               const float (&partial)[kWarps][kCols], const float (&weight)[kWarps],
                                               const int (&ok)[kWarps]) {
  if (c < kCols && col0 + c < a.H) {
    float sum = 0.f;
    for (int j = 0; j < a.k; ++j)
      if (ok[j]) sum = __fadd_rn(sum, __fmul_rn(weight[j], partial[j][c]));
    a.out[static_cast<int64_t>(t) * a.H + col0 + c] = Elem<D>::store(sum);
  }
}

constexpr int kDnLanesPerRow = 8;                      // lanes sharing one weight row (split K)
constexpr int kDnRowSets = 32 / kDnLanesPerRow;        // weight rows a warp works on at once (4)
constexpr int kDnColSets = 3;                          // rows per lane group: columns q, q+4, q+8
constexpr int kDnCols = kDnRowSets * kDnColSets;       // output columns per CTA (12)
constexpr int kDnChunks = 3;                           // chunks per weight row a lane loads at once
constexpr int kDnStageUnits = 3;                       // 16-byte hidden units per lane per batch

// Scalar down + combine, for 8-bit experts (4-bit ones run on decode_down_combine_mma_kernel below).
// Work split: grid (T, ceil(H / 12)), 256 threads, 2 CTAs per SM (<= 128 registers). Tokens vary
// fastest, so the CTAs reading one expert's column block for different tokens run close together
// (L2 reuse). CTA (t, y) computes out[t, 12y .. 12y+12): warp j < k takes slot j (row t*k + j,
// expert indices[t*k + j]); its lanes form 4 groups of 8: group q owns columns 12y + q, q + 4,
// q + 8 (three down rows of the slot's expert) and lane s of the group takes chunks s, s+8, s+16 of
// each (Gemma's 8-bit row of 704 values is 44 chunks: two batches of a group's 24 chunk slots).
// That is 9 x 16 bytes per lane per batch, the first issued right after the expert id (the hidden
// row's loads go out beside the id, as they do not depend on it): 36 KB per CTA, 72 KB per SM.
// Then the warp stages its slot's hidden row (staged_floats(I) floats, its own region of shared
// memory), dots, and reduces within each 8-lane group by shuffles into partial[j][c]. After one
// barrier, thread c < 12 sums w[t, j] * partial[j][c] over j in slot order in fp32 and rounds once
// (launch_weighted_combine's arithmetic). A slot whose expert id is out of range is recorded as a
// fault and skipped.
// Occupancy (ptxas, sm_90a): 122 registers, no spills: 2 CTAs (16 warps) per SM, dynamic shared
// memory k * staged_floats(704) * 4 = 28 KB (Gemma, k = 8); grid T x 235 at H = 2816.
template <DType D>
__global__ void __launch_bounds__(kThreads, 2) decode_down_combine_kernel(DownArgs a) {
  constexpr int kBits = 8;
  constexpr int kVals = 128 / kBits;
  extern __shared__ __align__(16) float smem[];  // (k, staged_floats(I)) floats
  __shared__ float partial[kWarps][kDnCols];
  __shared__ float slot_weight[kWarps];
  __shared__ int slot_ok[kWarps];
  const int t = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int q = lane / kDnLanesPerRow, sub = lane % kDnLanesPerRow;
  const int col0 = blockIdx.y * kDnCols;
  if (warp < a.k) {
    const int64_t b = static_cast<int64_t>(t) * a.k + warp;
    const int e = a.indices[b];
    const float wj = Elem<D>::load(a.weights[b]);
    const int U = a.I / 8;
    // The hidden row's first units: independent of the expert id, so they load beside it.
    uint4 hv[kDnStageUnits];
#pragma unroll
    for (int j = 0; j < kDnStageUnits; ++j) {
      const int u = lane + 32 * j;
      if (u < U) hv[j] = *reinterpret_cast<const uint4*>(a.hidden + b * a.I + 8 * u);
    }
    const bool ok = e >= 0 && e < a.E;
    const int Q = a.I / kVals;
    // Row m of the lane's group: column col0 + q + 4m, row (e, column) of w / scales / biases.
    int64_t wr[kDnColSets];
    bool live[kDnColSets];
#pragma unroll
    for (int m = 0; m < kDnColSets; ++m) {
      const int col = col0 + q + kDnRowSets * m;
      live[m] = ok && col < a.H;
      wr[m] = live[m] ? static_cast<int64_t>(e) * a.H + col : 0;
    }
    const uint4* wbase = reinterpret_cast<const uint4*>(a.w);
    uint4 wv[kDnChunks][kDnColSets];
    float ws[kDnChunks][kDnColSets], wb[kDnChunks][kDnColSets];
    auto load_batch = [&](int c0) {
#pragma unroll
      for (int i = 0; i < kDnChunks; ++i) {
        const int c = c0 + kDnLanesPerRow * i;
        const int grp = (c * kVals) >> a.group_shift;
#pragma unroll
        for (int m = 0; m < kDnColSets; ++m) {
          if (live[m] && c < Q) {
            wv[i][m] = __ldg(wbase + wr[m] * Q + c);
            ws[i][m] = raw_param<D>(__ldg(a.s + wr[m] * a.groups_per_row + grp));
            wb[i][m] = raw_param<D>(__ldg(a.b + wr[m] * a.groups_per_row + grp));
          } else {
            wv[i][m] = make_uint4(0u, 0u, 0u, 0u);
            ws[i][m] = 0.f;
            wb[i][m] = 0.f;
          }
        }
      }
    };
    load_batch(sub);
    float* row = smem + warp * staged_floats(a.I);
    for (int ubase = 0; ubase < U; ubase += 32 * kDnStageUnits) {
      if (ubase > 0) {
#pragma unroll
        for (int j = 0; j < kDnStageUnits; ++j) {
          const int u = ubase + lane + 32 * j;
          if (u < U) hv[j] = *reinterpret_cast<const uint4*>(a.hidden + b * a.I + 8 * u);
        }
      }
#pragma unroll
      for (int j = 0; j < kDnStageUnits; ++j) {
        const int u = ubase + lane + 32 * j;
        if (u < U) {
          const typename Elem<D>::storage* ev = reinterpret_cast<const typename Elem<D>::storage*>(&hv[j]);
          float v[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = Elem<D>::load(ev[i]);
          stage_unit(row, a.I, u, v);
        }
      }
    }
    __syncwarp();
    float acc[kDnColSets];
#pragma unroll
    for (int m = 0; m < kDnColSets; ++m) acc[m] = 0.f;
    for (int c0 = sub;;) {
#pragma unroll
      for (int i = 0; i < kDnChunks; ++i) {
        const int c = c0 + kDnLanesPerRow * i;
        if (c >= Q) break;
        const float* xc = row + padded(c * kVals);
        float dot[kDnColSets];
        chunk_dots<kBits>(xc, wv[i], dot);
        const float sx = chunk_sum(row, a.I, c, kVals);
#pragma unroll
        for (int m = 0; m < kDnColSets; ++m) acc[m] += ws[i][m] * dot[m] + wb[i][m] * sx;
      }
      c0 += kDnLanesPerRow * kDnChunks;
      if (c0 - sub >= Q) break;  // warp-uniform
      load_batch(c0);
    }
#pragma unroll
    for (int m = 0; m < kDnColSets; ++m)
#pragma unroll
      for (int off = kDnLanesPerRow / 2; off > 0; off >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
    if (sub == 0) {
#pragma unroll
      for (int m = 0; m < kDnColSets; ++m) partial[warp][q + kDnRowSets * m] = acc[m];
    }
    if (lane == 0) record_slot(a, slot_weight, slot_ok, warp, wj, ok, e);
  }
  __syncthreads();
  store_slot_sum<D, kDnCols>(a, t, col0, tid, partial, slot_weight, slot_ok);
}

// ---------------------------------------------------------------------------------------------
// Kernels 2 and 3 on tensor cores, for 4-bit experts (the Gemma layer; 8-bit experts use the
// kernels above).
//
// Why: the kernels above spend ~4.4 instructions per weight value and activation row (mask, magic,
// subtract, fma; ncu at T=1: 7.3M warp instructions for 17.8 MB, issue-bound behind a 1.33-wave
// latency chain). Here mma.sync m16n8k16 does the multiply-adds: A (16 x 16) holds the biased codes
// M + q of 16 weight rows (exact in D: M = 128 for bf16, 1024 for f16), B (16 x 8) up to 8
// activation rows, C fp32; a weight value costs ~1 instruction (shift and mask-or per pair) however
// many rows use it.
//
// k order. A dot product may sum k in any order, so inside each quantization group of G values
// lane t of a quad takes k in [t G/4, (t + 1) G/4) (G/32 whole code words) and the mma steps take
// them in the order biased_code_pairs produces: word w gives the pairs (0,4) (1,5) (2,6) (3,7);
// step 2w has a0/a1 (k slots 2t, 2t+1, rows g / g+8) <- pair (0,4) and a2/a3 (slots 2t+8, 2t+9)
// <- (1,5), step 2w+1 (2,6) and (3,7). Activations are staged in the same order (every 8 values as
// 0,4,1,5,2,6,3,7: packed_x_order), so B of steps 2w and 2w+1 is one 16-byte shared load at the
// lane's word (b0 b1, then b2 b3). A group's G/16 steps see only its own codes, so the mma yields
// c = sum(x (M + q)) per (weight row, activation row), and the group's scale and bias are applied in
// fp32 as acc += s * c + (b - M s) * sum(x) = s * sum(x q) + b * sum(x), MLX's qmv formula (the
// dequantized weight is never rounded; M * s * sum(x) cancels in fp32, ~2^-19 relative for bf16);
// the group sums of x come from the staging.
template <DType D>
using MmaType = std::conditional_t<D == DType::bf16, __nv_bfloat16, __half>;

constexpr int kTcRows = 16;       // weight rows per mma tile
constexpr int kTcMaxN = 8;        // activation rows per mma (T <= 8)
constexpr int kTcRowPad = 32;     // bytes after each staged code row (bank spread, 16-byte aligned)

__host__ __device__ constexpr int tc_code_row_bytes(int K) { return K / 2 + kTcRowPad; }
__host__ __device__ constexpr int tc_x_row_elems(int K) { return K + 8; }  // +16 bytes: rows in other banks

// Eight activations (one 16-byte unit) reordered to 0,4,1,5,2,6,3,7 (the mma k order above).
__device__ __forceinline__ uint4 packed_x_order(const uint4& v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410u), __byte_perm(v.x, v.z, 0x7632u),
                    __byte_perm(v.y, v.w, 0x5410u), __byte_perm(v.y, v.w, 0x7632u));
}

// Stages unit u (values 8u .. 8u+7) of an activation row: the reordered unit into xs_row, and its
// group's sum of x into sx_row[u / (G/8)] (fp32, the unit sums added by shuffles over the G/8 lanes
// holding one group: every lane of the warp must call this, live == false contributing nothing).
template <DType D, int G>
__device__ __forceinline__ void stage_tc_unit(uint16_t* xs_row, float* sx_row, int u, bool live, const uint4& v) {
  float sum = 0.f;
  if (live) {
    const typename Elem<D>::storage* e = reinterpret_cast<const typename Elem<D>::storage*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += Elem<D>::load(e[i]);
    *reinterpret_cast<uint4*>(xs_row + 8 * u) = packed_x_order(v);
  }
#pragma unroll
  for (int off = G / 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (live && (u & (G / 8 - 1)) == 0) sx_row[u / (G / 8)] = sum;
}

// The G/32 code words of lane t in group grp of a staged code row.
template <int G>
__device__ __forceinline__ void tc_words(const unsigned char* row, int grp, int t, uint32_t (&w)[G / 32]) {
  const unsigned char* p = row + grp * (G / 2) + t * (G / 8);
  if constexpr (G == 128) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (G == 64) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
}

// sum(x q) of one group for a 16-row tile: rows g, g+8 of the staged code rows `lo` / `hi` against
// the activation rows of xb (B registers, word by word), into c (zeroed by the caller).
template <DType D, int G>
__device__ __forceinline__ void tc_group_dot(const unsigned char* lo, const unsigned char* hi, int grp, int t,
                                             const uint4 (&xb)[G / 32], float (&c)[4]) {
  using T = MmaType<D>;
  uint32_t wl[G / 32], wh[G / 32];
  tc_words<G>(lo, grp, t, wl);
  tc_words<G>(hi, grp, t, wh);
#pragma unroll
  for (int w = 0; w < G / 32; ++w) {
    uint32_t pl[4], ph[4];
    device::biased_code_pairs<T>(wl[w], pl);
    device::biased_code_pairs<T>(wh[w], ph);
    const uint32_t a0[4] = {pl[0], ph[0], pl[1], ph[1]};
    device::Mma<T>::run(c, a0, xb[w].x, xb[w].y);
    const uint32_t a1[4] = {pl[2], ph[2], pl[3], ph[3]};
    device::Mma<T>::run(c, a1, xb[w].z, xb[w].w);
  }
}

// Shared memory of the tensor-core gate/up kernel (bytes), with its region offsets.
struct GateUpTcLayout {
  int code_row, groups;
  size_t codes, scales, biases, total;
  __host__ __device__ GateUpTcLayout(int H, int G) {
    code_row = tc_code_row_bytes(H);
    groups = H / G;
    const size_t code_bytes = static_cast<size_t>(2 * kTcRows) * code_row;
    const size_t red_bytes = static_cast<size_t>(kWarps) * 2 * kTcRows * kTcMaxN * sizeof(float);
    codes = 0;
    scales = code_bytes > red_bytes ? code_bytes : red_bytes;  // the reduction reuses the codes' space
    biases = scales + static_cast<size_t>(2 * kTcRows) * groups * sizeof(uint16_t);
    total = biases + static_cast<size_t>(2 * kTcRows) * groups * sizeof(uint16_t);
  }
};

// The 16-bit value 1 in both halves of a register (the A operand of the sum-of-x mma).
template <DType D>
constexpr uint32_t kTcOnePair = D == DType::bf16 ? 0x3F803F80u : 0x3C003C00u;

// Work split: grid (ceil(I / 16), min(n, E)), 256 threads, __launch_bounds__(256, 2). CTA (x, g)
// takes expert group g of the plan (CTAs past the plan's group count exit at once) and output
// columns [16x, 16x + 16): two 16-row mma tiles, gate rows (staged rows 0..15) and up rows
// (16..31) of those columns, times the group's activation rows (<= 8: the mma's n).
//   1. plan entry (one L2 round trip), then everything the CTA needs is requested at once: the 32
//      code rows by cp.async into shared memory in two commit groups (the first and second half
//      of the K groups; 8 threads per row, 16-byte chunks) with the scales and biases (raw, by
//      cp.async in the first group: the contiguous 16-row spans). Gemma: 45 KB of codes per CTA.
//   2. K is split across the warps: warp w takes groups w, w+8, ... of the first half as soon as
//      it has landed, then of the second half. B is read straight from global memory (the T <= 8
//      activation rows are shared by every CTA: L1/L2 hits), the lane's 16-byte unit per code word
//      reordered in registers, one group ahead (the first before the wait for the codes); B column
//      n is the group's row n. Per group: both tiles' G/16 mma steps, and G/16 more with A = 1 for
//      sum(x) of each column (the bias term), so no activation staging and no barrier for it.
//   3. the 8 warps' fp32 partials go through shared memory (the codes' space) and thread i < 16n
//      sums them in warp order for (column i % 16, row i / 16): gate and up rounded to D, then the
//      GLU, one rounding, into hidden[row, column].
// Occupancy (Gemma, bf16, G=64): shared memory 46 KB codes + 5.6 KB scales/biases, 72 registers:
// 3 CTAs (24 warps) per SM at any T; T=1: the 352 CTAs are one wave.
template <DType D, int G, Activation A>
__global__ void __launch_bounds__(kThreads, 2) decode_gate_up_glu_mma_kernel(GateUpArgs a) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const DecodePlan& plan = *a.plan;
  const int g_idx = blockIdx.y;
  if (g_idx >= plan.groups) return;  // uniform
  const int e = plan.expert[g_idx];
  const int begin = plan.begin[g_idx];
  int count = plan.count[g_idx];
  if (e < 0 || e >= a.E) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
      record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(e), static_cast<uint32_t>(a.E));
    return;
  }
  count = min(count, kTcMaxN);  // a plan group holds <= T <= 8 rows: the mma's n
  constexpr float kBias = device::kCodeBias<MmaType<D>>;
  const GateUpTcLayout L(a.H, G);
  unsigned char* codes = tc_smem + L.codes;
  uint16_t* sc = reinterpret_cast<uint16_t*>(tc_smem + L.scales);  // raw D, (32 staged rows, groups)
  uint16_t* bi = reinterpret_cast<uint16_t*>(tc_smem + L.biases);
  const int col0 = blockIdx.x * kTcRows;
  const int chunks = a.H / 32;                             // 16-byte chunks per code row
  const int half_groups = L.groups / 2;
  const int half_chunks = half_groups * (G / 32);

  // 1a. codes: thread (r = tid / 8, j = tid % 8) copies chunks j, j + 8, ... of staged row r (r < 16:
  //     gate, else up), the first half of the K groups as one commit group, the second as another.
  //     Column blocks are whole: I is a multiple of 32 for 4-bit experts (down's K).
  const int64_t gate_first = static_cast<int64_t>(e) * a.gate_rows_per_expert + a.gate_row0 + col0;
  const int64_t up_first = static_cast<int64_t>(e) * a.up_rows_per_expert + a.up_row0 + col0;
  {
    constexpr int kPerRow = kThreads / (2 * kTcRows);  // 8 threads per staged row
    const int r = tid / kPerRow, j = tid % kPerRow;
    const uint4* src = reinterpret_cast<const uint4*>(r < kTcRows ? a.gate_w : a.up_w) +
                       ((r < kTcRows ? gate_first : up_first) + r % kTcRows) * chunks;
    unsigned char* dst = codes + r * L.code_row;
    for (int c = j; c < half_chunks; c += kPerRow) device::cp_async_16(dst + 16 * c, src + c, true);
    // 1b. the scales and biases of the two 16-row spans (contiguous, 32 * groups bytes each, 16-byte
    //     aligned: supports_decode_layer), raw, with the first half.
    const int span_chunks = 2 * L.groups;
    for (int i = tid; i < 4 * span_chunks; i += kThreads) {
      const int which = i / span_chunks, c = i - which * span_chunks;  // which: gate s, gate b, up s, up b
      const uint16_t* base = which == 0 ? a.gate_s : which == 1 ? a.gate_b : which == 2 ? a.up_s : a.up_b;
      const int64_t first = (which < 2 ? gate_first : up_first) * L.groups;
      uint16_t* to = (which & 1 ? bi : sc) + (which >> 1) * kTcRows * L.groups;
      device::cp_async_16(to + 8 * c, base + first + 8 * c, true);
    }
    device::cp_async_commit();
    for (int c = half_chunks + j; c < chunks; c += kPerRow) device::cp_async_16(dst + 16 * c, src + c, true);
    device::cp_async_commit();
  }
  // 1c. the lane's activation row: B column g is the group's row g (token tok); units of 8 values,
  //     the lane's first unit of group grp is grp * G/8 + t * G/32.
  const bool live_n = g < count;
  const int64_t tok = live_n ? plan.row[begin + g] / a.k : 0;
  const uint4* xg = reinterpret_cast<const uint4*>(a.x + tok * a.x_stride) + t * (G / 32);
  auto load_x = [&](int grp, uint4 (&xb)[G / 32]) {
#pragma unroll
    for (int w = 0; w < G / 32; ++w)
      xb[w] = live_n ? packed_x_order(__ldg(xg + grp * (G / 8) + w)) : make_uint4(0u, 0u, 0u, 0u);
  };
  const uint32_t ones[4] = {kTcOnePair<D>, kTcOnePair<D>, kTcOnePair<D>, kTcOnePair<D>};

  // 2. K split across warps; each half as soon as it has landed.
  float acc[2][4] = {};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int grp_begin = (h == 0 ? 0 : half_groups) + warp, grp_end = h == 0 ? half_groups : L.groups;
    uint4 xb[G / 32];
    if (grp_begin < grp_end) load_x(grp_begin, xb);  // in flight while the codes land
    if (h == 0) device::cp_async_wait<1>();
    else device::cp_async_wait<0>();
    __syncthreads();
    for (int grp = grp_begin; grp < grp_end; grp += kWarps) {
      uint4 xn[G / 32];
      if (grp + kWarps < grp_end) load_x(grp + kWarps, xn);
      float xsum[4] = {0.f, 0.f, 0.f, 0.f};  // sum(x) of columns 2t, 2t+1 (c0, c1)
#pragma unroll
      for (int w = 0; w < G / 32; ++w) {
        device::Mma<MmaType<D>>::run(xsum, ones, xb[w].x, xb[w].y);
        device::Mma<MmaType<D>>::run(xsum, ones, xb[w].z, xb[w].w);
      }
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
        const int r = tile * kTcRows + g;
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        tc_group_dot<D, G>(codes + r * L.code_row, codes + (r + 8) * L.code_row, grp, t, xb, c);
        const float s0 = raw_param<D>(sc[r * L.groups + grp]), s1 = raw_param<D>(sc[(r + 8) * L.groups + grp]);
        const float b0 = fmaf(-kBias, s0, raw_param<D>(bi[r * L.groups + grp]));  // b - M s: c holds sum(x (M + q))
        const float b1 = fmaf(-kBias, s1, raw_param<D>(bi[(r + 8) * L.groups + grp]));
        acc[tile][0] = fmaf(s0, c[0], fmaf(b0, xsum[0], acc[tile][0]));
        acc[tile][1] = fmaf(s0, c[1], fmaf(b0, xsum[1], acc[tile][1]));
        acc[tile][2] = fmaf(s1, c[2], fmaf(b1, xsum[0], acc[tile][2]));
        acc[tile][3] = fmaf(s1, c[3], fmaf(b1, xsum[1], acc[tile][3]));
      }
#pragma unroll
      for (int w = 0; w < G / 32; ++w) xb[w] = xn[w];
    }
  }

  // 3. partials (warp, staged row, activation row) in the codes' space, summed in warp order.
  __syncthreads();
  float* red = reinterpret_cast<float*>(codes);  // [kWarps][32 staged rows][kTcMaxN]
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
    float* rw = red + (warp * 2 * kTcRows + tile * kTcRows + g) * kTcMaxN + 2 * t;
    rw[0] = acc[tile][0];
    rw[1] = acc[tile][1];
    rw[8 * kTcMaxN] = acc[tile][2];
    rw[8 * kTcMaxN + 1] = acc[tile][3];
  }
  __syncthreads();
  for (int i = tid; i < kTcRows * count; i += kThreads) {
    const int j = i % kTcRows, n = i / kTcRows;
    float gate = 0.f, up = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      gate += red[(w * 2 * kTcRows + j) * kTcMaxN + n];
      up += red[(w * 2 * kTcRows + kTcRows + j) * kTcMaxN + n];
    }
    const int64_t out_row = plan.row[begin + n];
    a.hidden[out_row * a.I + col0 + j] = Elem<D>::store(device::glu<A>(round_to<D>(gate), round_to<D>(up)));
  }
}

// Shared memory of the tensor-core down kernel per slot warp (bytes), with its region offsets.
struct DownTcLayout {
  int code_row, groups;
  size_t codes, scales, biases, xs, sx, per_warp;
  __host__ __device__ DownTcLayout(int I, int G) {
    code_row = tc_code_row_bytes(I);
    groups = I / G;
    codes = 0;
    scales = static_cast<size_t>(kTcRows) * code_row;
    biases = scales + static_cast<size_t>(kTcRows) * groups * sizeof(uint16_t);
    xs = biases + static_cast<size_t>(kTcRows) * groups * sizeof(uint16_t);
    sx = xs + (static_cast<size_t>(tc_x_row_elems(I)) * sizeof(uint16_t) + 15) / 16 * 16;
    per_warp = (sx + groups * sizeof(float) + 15) / 16 * 16;
  }
};

// Work split: grid (T, ceil(H / 16)), 256 threads, __launch_bounds__(256, 2); tokens vary fastest
// so CTAs reading one expert's rows run close together (L2 reuse). CTA (t, y) computes
// out[t, 16y .. 16y+16): warp j < k takes slot j (row t*k + j, expert indices[t*k + j]) with its
// own shared region: the slot's hidden row (requested first: it does not depend on the expert id)
// reordered with its group sums, the 16 down rows of the expert by cp.async (4 lanes per row,
// 16-byte chunks), their scales and biases (raw, cp.async); then one 16-row mma tile over K = I with
// the hidden row as activation row 0 of B (lanes 0..3 load it, the other rows are zero; the mma's
// unused n is free, the dequantization is the cost). Lanes with t == 0 hold rows g and g+8 of
// activation row 0 (c0, c2) and write partial[j][.]; after one barrier thread c < 16 sums
// w[t, j] * partial[j][c] over j in slot order in fp32 and rounds once (launch_weighted_combine's
// arithmetic). A slot whose expert id is out of range is recorded as a fault and skipped.
// Occupancy (Gemma, G=64): 9 KB of shared memory per slot, 72 KB per CTA (3 CTAs per SM); T=1:
// 176 CTAs in one wave, 45 KB of codes each.
template <DType D, int G>
__global__ void __launch_bounds__(kThreads, 2) decode_down_combine_mma_kernel(DownArgs a) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  __shared__ float partial[kWarps][kTcRows];
  __shared__ float slot_weight[kWarps];
  __shared__ int slot_ok[kWarps];
  const int tok = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int col0 = blockIdx.y * kTcRows;
  constexpr float kBias = device::kCodeBias<MmaType<D>>;
  if (warp < a.k) {
    const DownTcLayout L(a.I, G);
    unsigned char* base = tc_smem + warp * L.per_warp;
    unsigned char* codes = base + L.codes;
    uint16_t* sc = reinterpret_cast<uint16_t*>(base + L.scales);  // raw D, (16 rows, groups)
    uint16_t* bi = reinterpret_cast<uint16_t*>(base + L.biases);
    uint16_t* xs = reinterpret_cast<uint16_t*>(base + L.xs);
    float* sx = reinterpret_cast<float*>(base + L.sx);
    const int64_t b = static_cast<int64_t>(tok) * a.k + warp;
    const int U = a.I / 8;
    // The hidden row first: independent of the expert id.
    constexpr int kUnits = 4;  // units per lane per batch (Gemma: 88 units, one batch)
    uint4 hv[kUnits];
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const int u = lane + 32 * i;
      hv[i] = u < U ? *reinterpret_cast<const uint4*>(a.hidden + b * a.I + 8 * u) : make_uint4(0u, 0u, 0u, 0u);
    }
    const int e = a.indices[b];
    const float wj = Elem<D>::load(a.weights[b]);
    const bool ok = e >= 0 && e < a.E;
    const int chunks = a.I / 32;
    const int64_t first = static_cast<int64_t>(ok ? e : 0) * a.H + col0;  // whole blocks: H % 32 == 0
    // Lane (r = lane / 4, j = lane % 4) copies chunks j, j + 4, ... of rows r and r + 8.
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int r = lane / 4 + 8 * p;
      const uint4* src = reinterpret_cast<const uint4*>(a.w) + (first + r) * chunks;
      unsigned char* dst = codes + r * L.code_row;
      for (int c = lane % 4; c < chunks; c += 4) device::cp_async_16(dst + 16 * c, src + c, ok);
    }
    // The rows' scales and biases: two contiguous spans of 32 * groups bytes (16-byte aligned), raw.
    const int span_chunks = 2 * L.groups;
    for (int i = lane; i < 2 * span_chunks; i += 32) {
      const bool bias = i >= span_chunks;
      const int c = i - (bias ? span_chunks : 0);
      device::cp_async_16((bias ? bi : sc) + 8 * c, (bias ? a.b : a.s) + first * L.groups + 8 * c, ok);
    }
    device::cp_async_commit();
    for (int ubase = 0; ubase < U; ubase += 32 * kUnits) {
#pragma unroll
      for (int i = 0; i < kUnits; ++i) {
        const int u = ubase + lane + 32 * i;
        if (ubase > 0) hv[i] = u < U ? *reinterpret_cast<const uint4*>(a.hidden + b * a.I + 8 * u) : hv[i];
        stage_tc_unit<D, G>(xs, sx, u, u < U, hv[i]);
      }
    }
    device::cp_async_wait<0>();
    __syncwarp();
    const bool live_n = g == 0;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int grp = 0; grp < L.groups; ++grp) {
      uint4 xb[G / 32];
#pragma unroll
      for (int w = 0; w < G / 32; ++w)
        xb[w] = live_n ? *reinterpret_cast<const uint4*>(xs + grp * G + t * (G / 4) + 8 * w)
                       : make_uint4(0u, 0u, 0u, 0u);
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      tc_group_dot<D, G>(codes + g * L.code_row, codes + (g + 8) * L.code_row, grp, t, xb, c);
      const float x0 = sx[grp];
      const float s0 = raw_param<D>(sc[g * L.groups + grp]), s1 = raw_param<D>(sc[(g + 8) * L.groups + grp]);
      const float b0 = fmaf(-kBias, s0, raw_param<D>(bi[g * L.groups + grp]));  // b - M s, as in gate/up
      const float b1 = fmaf(-kBias, s1, raw_param<D>(bi[(g + 8) * L.groups + grp]));
      acc[0] = fmaf(s0, c[0], fmaf(b0, x0, acc[0]));
      acc[2] = fmaf(s1, c[2], fmaf(b1, x0, acc[2]));
    }
    if (t == 0) {
      partial[warp][g] = acc[0];
      partial[warp][g + 8] = acc[2];
    }
    if (lane == 0) record_slot(a, slot_weight, slot_ok, warp, wj, ok, e);
  }
  __syncthreads();
  store_slot_sum<D, kTcRows>(a, tok, col0, tid, partial, slot_weight, slot_ok);
}

// ---------------------------------------------------------------------------------------------
// Host side.

size_t router_smem(int64_t T, int64_t H) {
  return static_cast<size_t>((T + 1) * round_up4(padded(static_cast<int>(H)))) * 4;  // scale row + T h rows
}
// 4-bit experts run on the tensor-core kernels, 8-bit ones on the scalar kernels.
bool tensor_core_experts(int bits) { return bits == 4; }
// Activation rows the scalar gate/up kernel stages at once (the tensor-core one stages none).
int gate_up_rows_per_pass(int64_t T) { return static_cast<int>(std::min<int64_t>(kGuRowsPerPass, T)); }
size_t gate_up_smem(int64_t T, int64_t H, int bits, int group) {
  if (tensor_core_experts(bits)) return GateUpTcLayout(static_cast<int>(H), group).total;
  return static_cast<size_t>(gate_up_rows_per_pass(T) * staged_floats(static_cast<int>(H))) * 4;
}
size_t down_smem(int64_t k, int64_t I, int bits, int group) {
  if (tensor_core_experts(bits)) return static_cast<size_t>(k) * DownTcLayout(static_cast<int>(I), group).per_warp;
  return static_cast<size_t>(k * staged_floats(static_cast<int>(I))) * 4;
}

// Lets `kernel` take up to kDecodeMaxSmem of dynamic shared memory (once per kernel).
void allow_smem(const void* kernel) {
  static std::mutex mu;
  static std::unordered_set<const void*> done;
  std::lock_guard<std::mutex> lock(mu);
  if (!done.insert(kernel).second) return;
  EXPERTQMM_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kDecodeMaxSmem)));
}

bool rows_aligned(const Tensor& t) {
  return is_aligned(t.data(), 16) && (t.size(0) <= 1 || t.stride(0) % 8 == 0);
}

// A quantized weight [E, N, K*bits/32] that the decode kernels can read: 4/8-bit, group 32/64/128,
// scales and biases in `dtype`, contiguous, 16-byte aligned rows.
RouteSupport check_weight(const QuantizedWeight& q, int64_t E, int64_t N, int64_t K, DType dtype) {
  if (!q.defined() || !q.scales.defined() || !q.biases.defined()) return route_miss(Fallback::quantization);
  if (q.bits != 4 && q.bits != 8) return route_miss(Fallback::quantization);
  if (q.group_size != 32 && q.group_size != 64 && q.group_size != 128) return route_miss(Fallback::quantization);
  if (q.scales.dtype() != dtype || q.biases.dtype() != dtype) return route_miss(Fallback::dtype);
  if (q.w.dtype() != DType::u32 && q.w.dtype() != DType::i32) return route_miss(Fallback::quantization);
  const bool batched = E > 0;
  const int64_t dims = batched ? 3 : 2;
  if (q.w.ndim() != dims || q.scales.ndim() != dims || q.biases.ndim() != dims) return route_miss(Fallback::topology);
  if (batched && (q.w.size(0) != E || q.scales.size(0) != E)) return route_miss(Fallback::topology);
  if (q.w.size(-2) != N || q.w.size(-1) * 32 != K * q.bits) return route_miss(Fallback::topology);
  if (K % q.group_size != 0 || q.scales.size(-1) != K / q.group_size || q.biases.shape() != q.scales.shape() ||
      q.scales.size(-2) != N)
    return route_miss(Fallback::topology);
  if (!q.w.is_contiguous() || !q.scales.is_contiguous() || !q.biases.is_contiguous())
    return route_miss(Fallback::alignment);
  if (K % (128 / q.bits) != 0 || !is_aligned(q.w.data(), 16)) return route_miss(Fallback::alignment);
  return route_ok();
}

}  // namespace

RouteSupport supports_decode_layer(const Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& w) {
  const RouterWeights& rt = w.router;
  const SwitchGLUWeights& ex = w.experts;
  const int64_t T = x.size(0), H = x.size(1);
  const int64_t k = rt.top_k;
  if (T < 1 || T > kDecodeMaxTokens || k < 1 || k > kDecodeMaxTopK || T * k > kDecodeMaxRows)
    return route_miss(Fallback::shape);
  const DType D = x.dtype();
  if (D != DType::bf16 && D != DType::f16) return route_miss(Fallback::dtype);
  if (h.dtype() != D || out.dtype() != D) return route_miss(Fallback::dtype);
  if (h.ndim() != 2 || h.size(0) != T || h.size(1) != H || (H > 1 && (h.stride(1) != 1 || x.stride(1) != 1)))
    return route_miss(Fallback::topology);
  if (H % 32 != 0 || H > INT32_MAX / 4) return route_miss(Fallback::shape);
  if (!rows_aligned(h) || !rows_aligned(x) || !is_aligned(out.data(), 16)) return route_miss(Fallback::alignment);

  // Experts.
  const QuantizedWeight& first = ex.fused() ? ex.gate_up : ex.gate;
  if (!first.defined() || first.w.ndim() != 3) return route_miss(Fallback::topology);
  const int64_t E = first.w.size(0);
  const int64_t I = ex.fused() ? first.w.size(1) / 2 : first.w.size(1);
  if (E < 1 || E > INT32_MAX || I < 1 || I > INT32_MAX / 8 || k > E) return route_miss(Fallback::shape);
  RouteSupport s;
  if (ex.fused()) {
    if (first.w.size(1) != 2 * I) return route_miss(Fallback::topology);
    if (!(s = check_weight(ex.gate_up, E, 2 * I, H, D)).ok) return s;
  } else {
    if (!(s = check_weight(ex.gate, E, I, H, D)).ok) return s;
    if (!(s = check_weight(ex.up, E, I, H, D)).ok) return s;
    if (ex.gate.bits != ex.up.bits || ex.gate.group_size != ex.up.group_size) return route_miss(Fallback::quantization);
  }
  if (!(s = check_weight(ex.down, E, H, I, D)).ok) return s;
  // 4-bit experts run on the tensor-core kernels, which copy scale and bias spans in 16-byte units.
  for (const QuantizedWeight* q : {&first, &ex.up, &ex.down})
    if (q->defined() && q->bits == 4 && (!is_aligned(q->scales.data(), 16) || !is_aligned(q->biases.data(), 16)))
      return route_miss(Fallback::alignment);
  if (I % 8 != 0) return route_miss(Fallback::alignment);
  if (ex.activation != Activation::geglu && ex.activation != Activation::swiglu) return route_miss(Fallback::topology);

  // Router.
  if (!rt.scale.defined() || !is_floating(rt.scale.dtype()) || rt.scale.numel() != H || !rt.scale.is_contiguous())
    return route_miss(Fallback::dtype);
  if (!is_aligned(rt.scale.data(), 16)) return route_miss(Fallback::alignment);  // read in 16-byte units
  if (!rt.per_expert_scale.defined() || !is_floating(rt.per_expert_scale.dtype()) ||
      rt.per_expert_scale.numel() != E || !rt.per_expert_scale.is_contiguous())
    return route_miss(Fallback::dtype);
  if (rt.proj.defined()) {
    if (!(s = check_weight(rt.proj, 0, E, H, D)).ok) return s;
  } else {
    const Tensor& p = rt.proj_dense;
    if (!p.defined() || p.dtype() != D) return route_miss(Fallback::dtype);
    if (p.ndim() != 2 || p.size(0) != E || p.size(1) != H) return route_miss(Fallback::topology);
    if (!p.is_contiguous() || !is_aligned(p.data(), 16)) return route_miss(Fallback::alignment);
  }

  if (router_smem(T, H) > kDecodeMaxSmem || gate_up_smem(T, H, first.bits, first.group_size) > kDecodeMaxSmem ||
      down_smem(k, I, ex.down.bits, ex.down.group_size) > kDecodeMaxSmem)
    return route_miss(Fallback::shape);
  return route_ok();
}

bool use_decode_layer(const Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& w) {
  const bool requested = decode_layer_setting() != RouteSwitch::off;
  const RouteSupport s = supports_decode_layer(out, h, x, w);
  const bool hit = requested && s.ok;
  detail::record_selection(detail::Primitive::moe_decode_layer, requested, s.ok, hit,
                           !requested ? Fallback::disabled : s.reason);
  return hit;
}

void call_decode_layer(Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& w, Workspace& ws) {
  const RouteSupport support = supports_decode_layer(out, h, x, w);
  EXPERTQMM_CHECK(support.ok, "moe_layer_into", "the decode layer does not support this call (",
                  fallback_name(support.reason), ")");
  const RouterWeights& rt = w.router;
  const SwitchGLUWeights& ex = w.experts;
  const int T = static_cast<int>(x.size(0)), H = static_cast<int>(x.size(1)), k = rt.top_k;
  const int n = T * k;
  const QuantizedWeight& gate = ex.fused() ? ex.gate_up : ex.gate;
  const QuantizedWeight& up = ex.fused() ? ex.gate_up : ex.up;
  const int E = static_cast<int>(gate.w.size(0));
  const int I = static_cast<int>(ex.fused() ? gate.w.size(1) / 2 : gate.w.size(1));
  const DType D = x.dtype();

  ArenaLayout layout;
  const size_t logits_off = layout.reserve(static_cast<size_t>(T) * E * sizeof(float));
  const size_t indices_off = layout.reserve(static_cast<size_t>(n) * sizeof(int32_t));
  const size_t weights_off = layout.reserve(static_cast<size_t>(n) * sizeof(uint16_t));
  const size_t plan_off = layout.reserve(sizeof(DecodePlan));
  const size_t hidden_off = layout.reserve(static_cast<size_t>(n) * I * sizeof(uint16_t));
  void* base = ws.get(detail::kSlotLayerArena, layout.bytes());
  // Kernel 1's count of finished CTAs: zero when a call starts (the last CTA resets it), one per
  // workspace (a workspace serves one call at a time, as its arena does).
  auto* counter = static_cast<unsigned*>(ws.get_zeroed(detail::kSlotCounters, sizeof(unsigned)));
  cudaStream_t stream = current_stream();
  auto* plan = static_cast<DecodePlan*>(arena_at(base, plan_off));

  RouterArgs ra{};
  ra.h = h.data_as<const uint16_t>();
  ra.h_stride = T > 1 ? h.stride(0) : H;
  ra.scale = rt.scale.data();
  ra.scale_dtype = rt.scale.dtype();
  ra.root_size = 1.0f / std::sqrt(static_cast<float>(H));
  ra.eps = rt.eps;
  const bool quantized = rt.proj.defined();
  ra.proj = quantized ? rt.proj.w.data() : rt.proj_dense.data();
  if (quantized) {
    ra.proj_scales = rt.proj.scales.data_as<const uint16_t>();
    ra.proj_biases = rt.proj.biases.data_as<const uint16_t>();
    ra.groups_per_row = H / rt.proj.group_size;
    ra.group_shift = log2_of(rt.proj.group_size);
  }
  ra.per_expert_scale = rt.per_expert_scale.data();
  ra.pes_dtype = rt.per_expert_scale.dtype();
  ra.T = T;
  ra.H = H;
  ra.E = E;
  ra.k = k;
  ra.logits = static_cast<float*>(arena_at(base, logits_off));
  ra.counter = counter;
  ra.indices = static_cast<int32_t*>(arena_at(base, indices_off));
  ra.weights = static_cast<uint16_t*>(arena_at(base, weights_off));
  ra.plan = plan;

  GateUpArgs ga{};
  ga.x = x.data_as<const uint16_t>();
  ga.x_stride = T > 1 ? x.stride(0) : H;
  ga.gate_w = gate.w.data_as<const uint32_t>();
  ga.gate_s = gate.scales.data_as<const uint16_t>();
  ga.gate_b = gate.biases.data_as<const uint16_t>();
  ga.up_w = up.w.data_as<const uint32_t>();
  ga.up_s = up.scales.data_as<const uint16_t>();
  ga.up_b = up.biases.data_as<const uint16_t>();
  ga.gate_rows_per_expert = gate.w.size(1);
  ga.up_rows_per_expert = up.w.size(1);
  ga.gate_row0 = 0;
  ga.up_row0 = ex.fused() ? I : 0;
  ga.groups_per_row = H / gate.group_size;
  ga.group_shift = log2_of(gate.group_size);
  ga.H = H;
  ga.I = I;
  ga.E = E;
  ga.k = k;
  ga.rows_per_pass = gate_up_rows_per_pass(T);  // scalar kernel only
  ga.plan = plan;
  ga.hidden = static_cast<uint16_t*>(arena_at(base, hidden_off));
  ga.faults = device_faults();

  DownArgs da{};
  da.hidden = ga.hidden;
  da.w = ex.down.w.data_as<const uint32_t>();
  da.s = ex.down.scales.data_as<const uint16_t>();
  da.b = ex.down.biases.data_as<const uint16_t>();
  da.groups_per_row = I / ex.down.group_size;
  da.group_shift = log2_of(ex.down.group_size);
  da.indices = ra.indices;
  da.weights = ra.weights;
  da.H = H;
  da.I = I;
  da.E = E;
  da.k = k;
  da.out = out.data_as<uint16_t>();
  da.faults = ga.faults;

  const bool gu_tc = tensor_core_experts(gate.bits), down_tc = tensor_core_experts(ex.down.bits);
  const size_t smem1 = router_smem(T, H), smem2 = gate_up_smem(T, H, gate.bits, gate.group_size),
               smem3 = down_smem(k, I, ex.down.bits, ex.down.group_size);
  const dim3 grid1(static_cast<unsigned>(E));
  const dim3 grid2(ceil_div(I, gu_tc ? kTcRows : kGuCols), static_cast<unsigned>(std::min(n, E)));
  const dim3 grid3(static_cast<unsigned>(T), ceil_div(H, down_tc ? kTcRows : kDnCols));
  const int proj_kind = quantized ? rt.proj.bits : 0;
  const bool geglu = ex.activation == Activation::geglu;

  auto launch_all = [&](auto dtag) {
    constexpr DType DT = decltype(dtag)::value;
    // 1. router
    auto router = [&](auto kernel) {
      allow_smem(reinterpret_cast<const void*>(kernel));
      kernel<<<grid1, kRouterThreads, smem1, stream>>>(ra);
      EXPERTQMM_CUDA_CHECK_LAUNCH(decode_router_kernel);
    };
    if (proj_kind == 0) router(decode_router_kernel<DT, 0>);
    else if (proj_kind == 4) router(decode_router_kernel<DT, 4>);
    else router(decode_router_kernel<DT, 8>);
    // 2. gate/up/GLU
    auto gate_up = [&](auto kernel) {
      allow_smem(reinterpret_cast<const void*>(kernel));
      kernel<<<grid2, kThreads, smem2, stream>>>(ga);
      EXPERTQMM_CUDA_CHECK_LAUNCH(decode_gate_up_glu_kernel);
    };
    auto gate_up_tc = [&](auto group) {
      constexpr int G = decltype(group)::value;
      if (geglu) gate_up(decode_gate_up_glu_mma_kernel<DT, G, Activation::geglu>);
      else gate_up(decode_gate_up_glu_mma_kernel<DT, G, Activation::swiglu>);
    };
    if (gu_tc && gate.group_size == 32) gate_up_tc(std::integral_constant<int, 32>{});
    else if (gu_tc && gate.group_size == 64) gate_up_tc(std::integral_constant<int, 64>{});
    else if (gu_tc) gate_up_tc(std::integral_constant<int, 128>{});
    else if (geglu) gate_up(decode_gate_up_glu_kernel<DT, Activation::geglu>);
    else gate_up(decode_gate_up_glu_kernel<DT, Activation::swiglu>);
    // 3. down + combine
    auto down = [&](auto kernel) {
      allow_smem(reinterpret_cast<const void*>(kernel));
      kernel<<<grid3, kThreads, smem3, stream>>>(da);
      EXPERTQMM_CUDA_CHECK_LAUNCH(decode_down_combine_kernel);
    };
    if (down_tc && ex.down.group_size == 32) down(decode_down_combine_mma_kernel<DT, 32>);
    else if (down_tc && ex.down.group_size == 64) down(decode_down_combine_mma_kernel<DT, 64>);
    else if (down_tc) down(decode_down_combine_mma_kernel<DT, 128>);
    else down(decode_down_combine_kernel<DT>);
  };
  if (D == DType::bf16) launch_all(DTypeTag<DType::bf16>{});
  else launch_all(DTypeTag<DType::f16>{});
}

}  // namespace expertqmm::cuda

// The decode MoE layer: moe_layer_into for small T (T*k <= kDecodeMaxRows) in three kernels, so
// that a CUDA graph of the layer holds three dependent nodes instead of nine:
//   1. decode_router_kernel        RMS norm of h -> router projection -> (last CTA) top-k + softmax
//                                   and a plan that groups the T*k (token, slot) rows by expert
//   2. decode_gate_up_glu_kernel   per (expert group, column block): gate and up for every row
//                                   routed to the expert, then the GLU product -> hidden [n, I]
//   3. decode_down_combine_kernel  per (token, column block): the k slots' down GEMVs, weighted and
//                                   summed in slot order in fp32, one rounding -> out [T, H]
// Numerics are the general path's (src/cuda/moe.cu): the router rounds r and the logits to h's
// dtype and routes with device/route_topk.cuh (the same code as route_into); gate and up are
// qmv dot products (MLX gather_qmv: sum over chunks of s * sum(x * q) + b * sum(x) in fp32, the
// dequantized weight never rounded), rounded to the activation dtype before the GLU (as the fused
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
#include <unordered_map>
#include <unordered_set>

#include "core/route_counters.h"
#include "cuda/cuda_backend.h"
#include "cuda/device/dequant.cuh"
#include "cuda/device/glu.cuh"
#include "cuda/device/route_topk.cuh"
#include "cuda/gather_qmm_routes.h"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

namespace {

using device::small_uint_to_float;

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
// Staged activations. A row of K values lives in shared memory as floats, with 4 floats of padding
// after every 32 (lanes reading consecutive 16-byte weight chunks start in different bank groups,
// as in qmv), followed by the plain sum of each unit of 8 values:
//   xs    padded(K) floats; for 4-bit weights value i is pre-divided by 16^(i % 4) (word_dot)
//   usum  K / 8 floats, at round_up4(padded(K))
__host__ __device__ constexpr int padded(int i) { return i + ((i >> 5) << 2); }
__host__ __device__ constexpr int round_up4(int v) { return (v + 3) & ~3; }
__host__ __device__ constexpr int staged_floats(int K) { return round_up4(padded(K)) + round_up4(K / 8); }

// Writes unit u (values 8u .. 8u+7, given in v) of a staged row: the plain fp32 sum in index order
// (qmv's unit sums), then the values, pre-divided for 4-bit weights.
template <bool kPreDivide>
__device__ __forceinline__ void stage_unit(float* row, int K, int u, const float (&v)[8]) {
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += v[i];
  float o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = kPreDivide ? v[i] * (1.0f / static_cast<float>(1 << (4 * (i & 3)))) : v[i];
  float4* dst = reinterpret_cast<float4*>(row + padded(8 * u));  // 8u is 8-aligned: one 32-block
  dst[0] = make_float4(o[0], o[1], o[2], o[3]);
  dst[1] = make_float4(o[4], o[5], o[6], o[7]);
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

// sum_i x[i] * q[i] over one word of codes (qmv's word_dot): 4-bit nibbles read masked in place
// against x pre-divided by 16^(i % 4); 8-bit bytes moved under the float exponent 2^23. Exact
// products of codes; only the fp32 sums round.
template <int kBits>
__device__ __forceinline__ float word_dot(uint32_t w, const float* xv, float dot) {
  if constexpr (kBits == 4) {
    const uint32_t hi = w >> 16;
#pragma unroll
    for (int j = 0; j < 4; ++j) dot += xv[j] * small_uint_to_float(w & (0xFu << (4 * j)));
#pragma unroll
    for (int j = 0; j < 4; ++j) dot += xv[4 + j] * small_uint_to_float(hi & (0xFu << (4 * j)));
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) dot += xv[j] * (__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | j)) - 8388608.0f);
  }
  return dot;
}

// The x values of word wi of a chunk (8 floats for 4-bit, 4 for 8-bit) from a staged row.
template <int kBits>
__device__ __forceinline__ void word_x(const float* xc, int wi, float (&xv)[32 / kBits]) {
  constexpr int kPerWord = 32 / kBits;
#pragma unroll
  for (int q = 0; q < kPerWord / 4; ++q) {
    const float4 f = reinterpret_cast<const float4*>(xc + wi * kPerWord)[q];
    xv[4 * q] = f.x;
    xv[4 * q + 1] = f.y;
    xv[4 * q + 2] = f.z;
    xv[4 * q + 3] = f.w;
  }
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
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

constexpr int kRouterChunks = 6;  // 16-byte weight chunks a lane loads before any math

// Work split: grid ceil(E / 8) CTAs of 256 threads; warp w of CTA c owns expert 8c + w and computes
// its logit for all T tokens. Order, for latency: each lane first issues the loads of its chunks
// (lane l: chunks l, l+32, ... of the expert's row, 16 bytes each, with their scales and biases:
// the whole 8-bit Gemma row of 2816 values is 176 chunks, so one batch of 6 per lane); then all
// 256 threads recompute the RMS norm of the T rows of h (thread i: units of 8 values i, i+256, ...,
// one 16-byte load each, squares summed in index order, shuffles then shared memory across warps),
// writing r rounded to D into shared memory, staged (T, staged_floats(H)) floats; then each lane
// dots its chunks with every token's r and the warp reduces by shuffles. Each CTA then bumps a
// device counter (after __threadfence); the CTA that finishes last does the top-k (one warp per
// token, device::warp_topk_softmax), writes indices and weights, resets the counter, and builds the
// DecodePlan: thread b < n counts the rows with a smaller expert id and the earlier rows with the
// same id, which is row b's place in the stably sorted order; first rows of an expert name groups.
template <DType D, int kProj>
__global__ void __launch_bounds__(kThreads) decode_router_kernel(RouterArgs a) {
  using S = typename Elem<D>::storage;
  constexpr bool kQuant = kProj != 0;
  constexpr int kVals = kQuant ? 128 / kProj : 8;  // values per 16-byte chunk
  extern __shared__ __align__(16) float smem[];    // (T, staged_floats(H)) floats
  __shared__ float red[kWarps][kDecodeMaxTokens];
  __shared__ float inv_rms[kDecodeMaxTokens];
  __shared__ int is_last;
  __shared__ int32_t ids[kDecodeMaxRows];
  __shared__ int first_of_expert[kDecodeMaxRows];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int e = blockIdx.x * kWarps + warp;
  const bool live = e < a.E;  // warp-uniform
  const int Q = a.H / kVals;
  const int row_floats = staged_floats(a.H);
  const uint4* wrow = static_cast<const uint4*>(a.proj) + static_cast<int64_t>(live ? e : 0) * Q;
  const uint16_t* srow = kQuant ? a.proj_scales + static_cast<int64_t>(live ? e : 0) * a.groups_per_row : nullptr;
  const uint16_t* brow = kQuant ? a.proj_biases + static_cast<int64_t>(live ? e : 0) * a.groups_per_row : nullptr;

  uint4 wv[kRouterChunks];
  float ws[kRouterChunks], wb[kRouterChunks];
  auto load_batch = [&](int c0) {
#pragma unroll
    for (int i = 0; i < kRouterChunks; ++i) {
      const int c = c0 + 32 * i;
      if (live && c < Q) {
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
  load_batch(lane);

  // RMS norm, pass 1: h into shared memory (raw values), sums of squares.
  const int U = a.H / 8;
  float sq[kDecodeMaxTokens];
#pragma unroll
  for (int t = 0; t < kDecodeMaxTokens; ++t) {
    sq[t] = 0.f;
    if (t >= a.T) continue;
    float* row = smem + t * row_floats;
    for (int u = tid; u < U; u += kThreads) {
      float v[8];
      load8<D>(a.h + t * a.h_stride + 8 * u, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) sq[t] = __fadd_rn(sq[t], __fmul_rn(v[i], v[i]));
      float4* dst = reinterpret_cast<float4*>(row + padded(8 * u));
      dst[0] = make_float4(v[0], v[1], v[2], v[3]);
      dst[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  }
#pragma unroll
  for (int t = 0; t < kDecodeMaxTokens; ++t) {
    for (int off = 16; off > 0; off >>= 1) sq[t] = __fadd_rn(sq[t], __shfl_xor_sync(0xffffffffu, sq[t], off));
    if (lane == 0) red[warp][t] = sq[t];
  }
  __syncthreads();
  if (tid < a.T) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total = __fadd_rn(total, red[w][tid]);
    inv_rms[tid] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(a.H)), a.eps)));
  }
  __syncthreads();
  // Pass 2: r = D(h * inv_rms * (scale * root_size)) staged in place (route_into's formula).
  for (int t = 0; t < a.T; ++t) {
    float* row = smem + t * row_floats;
    const float inv = inv_rms[t];
    for (int u = tid; u < U; u += kThreads) {
      const float* src = row + padded(8 * u);
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        v[i] = round_to<D>(
            __fmul_rn(__fmul_rn(src[i], inv), __fmul_rn(load_any(a.scale, a.scale_dtype, 8 * u + i), a.root_size)));
      stage_unit<kProj == 4>(row, a.H, u, v);
    }
  }
  __syncthreads();

  // Logits of the warp's expert for every token.
  float acc[kDecodeMaxTokens];
#pragma unroll
  for (int t = 0; t < kDecodeMaxTokens; ++t) acc[t] = 0.f;
  for (int c0 = lane;;) {
#pragma unroll
    for (int i = 0; i < kRouterChunks; ++i) {
      const int c = c0 + 32 * i;
      if (c >= Q) break;
#pragma unroll
      for (int t = 0; t < kDecodeMaxTokens; ++t) {
        if (t >= a.T) break;
        const float* row = smem + t * row_floats;
        const float* xc = row + padded(c * kVals);
        if constexpr (kQuant) {
          float dot = 0.f;
#pragma unroll
          for (int wi = 0; wi < 4; ++wi) {
            float xv[32 / kProj];
            word_x<kProj>(xc, wi, xv);
            dot = word_dot<kProj>(word_of(wv[i], wi), xv, dot);
          }
          acc[t] += ws[i] * dot + wb[i] * chunk_sum(row, a.H, c, kVals);
        } else {
          const S* pv = reinterpret_cast<const S*>(&wv[i]);
          float dot = 0.f;
#pragma unroll
          for (int j = 0; j < 8; ++j) dot += xc[j] * Elem<D>::load(pv[j]);
          acc[t] += dot;
        }
      }
    }
    c0 += 32 * kRouterChunks;
    if (c0 - lane >= Q) break;  // warp-uniform
    load_batch(c0);
  }
#pragma unroll
  for (int t = 0; t < kDecodeMaxTokens; ++t) {
    for (int off = 16; off > 0; off >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], off);
    if (live && lane == 0 && t < a.T) a.logits[t * a.E + e] = round_to<D>(acc[t]);
  }

  // The last CTA to finish routes.
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (tid == 0) atomicExch(a.counter, 0u);  // ready for the next call (graph replays)
  for (int t = warp; t < a.T; t += kWarps) {
    const float* lrow = a.logits + t * a.E;
    uint16_t* wrow_out = a.weights + t * a.k;
    device::warp_topk_softmax([&](int64_t x) { return __ldcg(lrow + x); }, a.E, a.k,
                              [&](int64_t x) { return load_any(a.per_expert_scale, a.pes_dtype, x); },
                              a.indices + t * a.k, [&](int slot, float w) { wrow_out[slot] = Elem<D>::store(w); });
  }
  __syncthreads();

  // The plan: rows grouped by expert (stable counting sort over n <= 64 rows).
  const int n = a.T * a.k;
  if (tid < n) ids[tid] = a.indices[tid];
  __syncthreads();
  int32_t mine = -1;
  int less = 0, before = 0, same = 0;
  if (tid < n) {
    mine = ids[tid];
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

constexpr int kGuCols = kWarps;       // output columns per CTA: one per warp (its gate row and up row)
constexpr int kGuWeightRows = 2;      // weight rows per warp: gate, up
constexpr int kGuRowsPerPass = 4;     // activation rows staged at once (at most)
constexpr int kGuChunks = 3;          // 16-byte chunks per weight row a lane loads at once

// Work split: grid (ceil(I / 8), min(n, E)), 256 threads, up to 3 CTAs per SM. CTA (x, g) takes
// expert group g of the plan (CTAs past the plan's group count exit at once) and output columns
// [8x, 8x + 8): warp w owns column 8x + w, i.e. two weight rows (its gate row and its up row), and
// lane l takes chunks l, l+32, l+64 of both (6 x 16 bytes in flight per lane, issued before the
// activations are staged: Gemma's 4-bit row of 2816 values is 88 chunks, one batch). So every
// weight byte of an expert's column block is read once per layer, however many tokens chose it.
// The group's rows are staged rows_per_pass at a time (x row of token row / k, staged_floats(H)
// floats each); each chunk's words are dotted with each staged row (x read once per row for both
// weight rows), lanes reduce by shuffles and lane 0 writes hidden[row, col] = D(act(D(gate)) * D(up)).
template <DType D, int kBits, Activation A>
__global__ void __launch_bounds__(kThreads, 2) decode_gate_up_glu_kernel(GateUpArgs a) {
  constexpr int kVals = 128 / kBits;  // values per chunk
  extern __shared__ __align__(16) float smem[];  // (rows_per_pass, staged_floats(H)) floats
  const DecodePlan& plan = *a.plan;
  const int g = blockIdx.y;
  if (g >= plan.groups) return;  // uniform
  const int e = plan.expert[g], begin = plan.begin[g], count = plan.count[g];
  if (e < 0 || e >= a.E) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
      record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(e), static_cast<uint32_t>(a.E));
    return;
  }
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int Q = a.H / kVals;
  const int row_floats = staged_floats(a.H);
  const int col = blockIdx.x * kGuCols + warp;
  const bool valid = col < a.I;  // warp-uniform
  // Row indices (into w in chunks of Q, into scales/biases in groups) of the gate and up rows.
  const int64_t wr[kGuWeightRows] = {valid ? e * a.gate_rows_per_expert + a.gate_row0 + col : 0,
                                     valid ? e * a.up_rows_per_expert + a.up_row0 + col : 0};
  const uint4* wbase[kGuWeightRows] = {reinterpret_cast<const uint4*>(a.gate_w), reinterpret_cast<const uint4*>(a.up_w)};
  const uint16_t* sbase[kGuWeightRows] = {a.gate_s, a.up_s};
  const uint16_t* bbase[kGuWeightRows] = {a.gate_b, a.up_b};

  uint4 wv[kGuChunks][kGuWeightRows];
  float ws[kGuChunks][kGuWeightRows], wb[kGuChunks][kGuWeightRows];
  auto load_batch = [&](int c0) {
#pragma unroll
    for (int i = 0; i < kGuChunks; ++i) {
      const int c = c0 + 32 * i;
      const int grp = (c * kVals) >> a.group_shift;
#pragma unroll
      for (int r = 0; r < kGuWeightRows; ++r) {
        if (valid && c < Q) {
          wv[i][r] = __ldg(wbase[r] + wr[r] * Q + c);
          ws[i][r] = raw_param<D>(__ldg(sbase[r] + wr[r] * a.groups_per_row + grp));
          wb[i][r] = raw_param<D>(__ldg(bbase[r] + wr[r] * a.groups_per_row + grp));
        } else {
          wv[i][r] = make_uint4(0u, 0u, 0u, 0u);
          ws[i][r] = 0.f;
          wb[i][r] = 0.f;
        }
      }
    }
  };
  load_batch(lane);
  bool loaded = true;

  const int U = a.H / 8;
  const int per_pass = a.rows_per_pass;
  for (int pass = 0; pass * per_pass < count; ++pass) {
    const int rows = min(per_pass, count - pass * per_pass);
    if (pass > 0) __syncthreads();  // every warp is done with the previous pass's rows
    for (int r = 0; r < rows; ++r) {
      const int64_t token = plan.row[begin + pass * per_pass + r] / a.k;
      float* row = smem + r * row_floats;
      for (int u = tid; u < U; u += kThreads) {
        float v[8];
        load8<D>(a.x + token * a.x_stride + 8 * u, v);
        stage_unit<kBits == 4>(row, a.H, u, v);
      }
    }
    __syncthreads();

    float acc[kGuRowsPerPass][kGuWeightRows];
#pragma unroll
    for (int r = 0; r < kGuRowsPerPass; ++r)
#pragma unroll
      for (int j = 0; j < kGuWeightRows; ++j) acc[r][j] = 0.f;
    for (int c0 = lane;;) {
      if (!loaded) load_batch(c0);
      loaded = false;
#pragma unroll
      for (int i = 0; i < kGuChunks; ++i) {
        const int c = c0 + 32 * i;
        if (c >= Q) break;
#pragma unroll
        for (int r = 0; r < kGuRowsPerPass; ++r) {
          if (r >= rows) break;
          const float* row = smem + r * row_floats;
          const float* xc = row + padded(c * kVals);
          float dot[kGuWeightRows];
#pragma unroll
          for (int j = 0; j < kGuWeightRows; ++j) dot[j] = 0.f;
#pragma unroll
          for (int wi = 0; wi < 4; ++wi) {
            float xv[32 / kBits];
            word_x<kBits>(xc, wi, xv);
#pragma unroll
            for (int j = 0; j < kGuWeightRows; ++j) dot[j] = word_dot<kBits>(word_of(wv[i][j], wi), xv, dot[j]);
          }
          const float sx = chunk_sum(row, a.H, c, kVals);
#pragma unroll
          for (int j = 0; j < kGuWeightRows; ++j) acc[r][j] += ws[i][j] * dot[j] + wb[i][j] * sx;
        }
      }
      c0 += 32 * kGuChunks;
      if (c0 - lane >= Q) break;  // warp-uniform
    }
#pragma unroll
    for (int r = 0; r < kGuRowsPerPass; ++r)
#pragma unroll
      for (int j = 0; j < kGuWeightRows; ++j)
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r][j] += __shfl_xor_sync(0xffffffffu, acc[r][j], off);
    if (lane == 0 && valid) {
#pragma unroll
      for (int r = 0; r < kGuRowsPerPass; ++r) {
        if (r >= rows) break;
        const int64_t out_row = plan.row[begin + pass * per_pass + r];
        const float gate = round_to<D>(acc[r][0]);
        const float up = round_to<D>(acc[r][1]);
        a.hidden[out_row * a.I + col] = Elem<D>::store(device::glu<A>(gate, up));
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

constexpr int kDnCols = 8;    // output columns per CTA
constexpr int kDnChunks = 1;  // 16-byte chunks per weight row a lane loads at once

// Work split: grid (T, ceil(H / 8)), 256 threads, up to 3 CTAs per SM; tokens vary fastest, so the CTAs reading one
// expert's column block for different tokens run close together (L2 reuse). CTA (t, y) computes
// out[t, 8y .. 8y+8): warp j < k takes slot j (row t*k + j, expert indices[t*k + j]) and the 8
// columns' down rows of that expert: lane l loads chunk l (and l + 32, ... in later batches) of
// each of the 8 rows (8 x 16 bytes in flight: Gemma's 4-bit row of 704 values is 22 chunks), then
// stages its slot's hidden row (staged_floats(I) floats, its own region of shared memory), dots and
// reduces by shuffles into partial[j][c]. After one barrier, thread c < 8 sums
// w[t, j] * partial[j][c] over j in slot order in fp32 and rounds once (launch_weighted_combine's
// arithmetic). A slot whose expert id is out of range is recorded as a fault and skipped.
template <DType D, int kBits>
__global__ void __launch_bounds__(kThreads, 2) decode_down_combine_kernel(DownArgs a) {
  constexpr int kVals = 128 / kBits;
  extern __shared__ __align__(16) float smem[];  // (k, staged_floats(I)) floats
  __shared__ float partial[kWarps][kDnCols];
  __shared__ float slot_weight[kWarps];
  __shared__ int slot_ok[kWarps];
  const int t = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int col0 = blockIdx.y * kDnCols;
  if (warp < a.k) {
    const int64_t b = static_cast<int64_t>(t) * a.k + warp;
    const int e = a.indices[b];
    const bool ok = e >= 0 && e < a.E;
    const int Q = a.I / kVals;
    // Row (e, col0 + c) of w (chunks of Q) and of scales/biases (groups) is wr0 + c.
    const int64_t wr0 = ok ? static_cast<int64_t>(e) * a.H + col0 : 0;
    const uint4* wbase = reinterpret_cast<const uint4*>(a.w);
    uint4 wv[kDnChunks][kDnCols];
    float ws[kDnChunks][kDnCols], wb[kDnChunks][kDnCols];
    auto load_batch = [&](int c0) {
#pragma unroll
      for (int i = 0; i < kDnChunks; ++i) {
        const int c = c0 + 32 * i;
        const int grp = (c * kVals) >> a.group_shift;
#pragma unroll
        for (int r = 0; r < kDnCols; ++r) {
          if (ok && col0 + r < a.H && c < Q) {
            wv[i][r] = __ldg(wbase + (wr0 + r) * Q + c);
            ws[i][r] = raw_param<D>(__ldg(a.s + (wr0 + r) * a.groups_per_row + grp));
            wb[i][r] = raw_param<D>(__ldg(a.b + (wr0 + r) * a.groups_per_row + grp));
          } else {
            wv[i][r] = make_uint4(0u, 0u, 0u, 0u);
            ws[i][r] = 0.f;
            wb[i][r] = 0.f;
          }
        }
      }
    };
    load_batch(lane);
    const float wj = Elem<D>::load(a.weights[b]);
    float* row = smem + warp * staged_floats(a.I);
    for (int u = lane; u < a.I / 8; u += 32) {
      float v[8];
      load8<D>(a.hidden + b * a.I + 8 * u, v);
      stage_unit<kBits == 4>(row, a.I, u, v);
    }
    __syncwarp();
    float acc[kDnCols];
#pragma unroll
    for (int c = 0; c < kDnCols; ++c) acc[c] = 0.f;
    for (int c0 = lane;;) {
#pragma unroll
      for (int i = 0; i < kDnChunks; ++i) {
        const int c = c0 + 32 * i;
        if (c >= Q) break;
        const float* xc = row + padded(c * kVals);
        float dot[kDnCols];
#pragma unroll
        for (int j = 0; j < kDnCols; ++j) dot[j] = 0.f;
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) {
          float xv[32 / kBits];
          word_x<kBits>(xc, wi, xv);
#pragma unroll
          for (int j = 0; j < kDnCols; ++j) dot[j] = word_dot<kBits>(word_of(wv[i][j], wi), xv, dot[j]);
        }
        const float sx = chunk_sum(row, a.I, c, kVals);
#pragma unroll
        for (int j = 0; j < kDnCols; ++j) acc[j] += ws[i][j] * dot[j] + wb[i][j] * sx;
      }
      c0 += 32 * kDnChunks;
      if (c0 - lane >= Q) break;  // warp-uniform
      load_batch(c0);
    }
#pragma unroll
    for (int c = 0; c < kDnCols; ++c)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], off);
    if (lane == 0) {
#pragma unroll
      for (int c = 0; c < kDnCols; ++c) partial[warp][c] = acc[c];
      slot_weight[warp] = wj;
      slot_ok[warp] = ok;
      if (!ok) record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(e), static_cast<uint32_t>(a.E));
    }
  }
  __syncthreads();
  if (tid < kDnCols && col0 + tid < a.H) {
    float sum = 0.f;
    for (int j = 0; j < a.k; ++j)
      if (slot_ok[j]) sum = __fadd_rn(sum, __fmul_rn(slot_weight[j], partial[j][tid]));
    a.out[static_cast<int64_t>(t) * a.H + col0 + tid] = Elem<D>::store(sum);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The counter of kernel 1 must be zero when a call starts; kernels leave it zero. One counter per
// Workspace (a workspace serves one call at a time, as its arena does), from a pool zeroed once.
constexpr int kCounterPool = 1024;
unsigned* decode_counter(const Workspace& ws) {
  static unsigned* pool = [] {
    unsigned* p = nullptr;
    EXPERTQMM_CUDA_CHECK(cudaMalloc(&p, kCounterPool * sizeof(unsigned)));
    EXPERTQMM_CUDA_CHECK(cudaMemset(p, 0, kCounterPool * sizeof(unsigned)));
    return p;
  }();
  static std::mutex mu;
  static std::unordered_map<const Workspace*, int> slot_of;
  std::lock_guard<std::mutex> lock(mu);
  auto it = slot_of.find(&ws);
  if (it == slot_of.end()) it = slot_of.emplace(&ws, static_cast<int>(slot_of.size() % kCounterPool)).first;
  return pool + it->second;
}

size_t router_smem(int64_t T, int64_t H) { return static_cast<size_t>(T * staged_floats(static_cast<int>(H))) * 4; }
int gate_up_rows_per_pass(int64_t T) { return static_cast<int>(std::min<int64_t>(kGuRowsPerPass, T)); }
size_t gate_up_smem(int64_t T, int64_t H) {
  return static_cast<size_t>(gate_up_rows_per_pass(T) * staged_floats(static_cast<int>(H))) * 4;
}
size_t down_smem(int64_t k, int64_t I) { return static_cast<size_t>(k * staged_floats(static_cast<int>(I))) * 4; }

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
  if (I % 8 != 0) return route_miss(Fallback::alignment);
  if (ex.activation != Activation::geglu && ex.activation != Activation::swiglu) return route_miss(Fallback::topology);

  // Router.
  if (!rt.scale.defined() || !is_floating(rt.scale.dtype()) || rt.scale.numel() != H || !rt.scale.is_contiguous())
    return route_miss(Fallback::dtype);
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

  if (router_smem(T, H) > kDecodeMaxSmem || gate_up_smem(T, H) > kDecodeMaxSmem || down_smem(k, I) > kDecodeMaxSmem)
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
  void* base = ws.get(kMoeArenaSlot, layout.bytes());
  unsigned* counter = decode_counter(ws);
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
  ga.rows_per_pass = gate_up_rows_per_pass(T);
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

  const size_t smem1 = router_smem(T, H), smem2 = gate_up_smem(T, H), smem3 = down_smem(k, I);
  const dim3 grid1(ceil_div(E, kWarps));
  const dim3 grid2(ceil_div(I, kGuCols), static_cast<unsigned>(std::min(n, E)));
  const dim3 grid3(static_cast<unsigned>(T), ceil_div(H, kDnCols));
  const int proj_kind = quantized ? rt.proj.bits : 0;
  const int gu_bits = gate.bits, down_bits = ex.down.bits;
  const bool geglu = ex.activation == Activation::geglu;

  auto launch_all = [&](auto dtag) {
    constexpr DType DT = decltype(dtag)::value;
    // 1. router
    auto router = [&](auto kernel) {
      allow_smem(reinterpret_cast<const void*>(kernel));
      kernel<<<grid1, kThreads, smem1, stream>>>(ra);
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
    if (gu_bits == 4 && geglu) gate_up(decode_gate_up_glu_kernel<DT, 4, Activation::geglu>);
    else if (gu_bits == 4) gate_up(decode_gate_up_glu_kernel<DT, 4, Activation::swiglu>);
    else if (geglu) gate_up(decode_gate_up_glu_kernel<DT, 8, Activation::geglu>);
    else gate_up(decode_gate_up_glu_kernel<DT, 8, Activation::swiglu>);
    // 3. down + combine
    auto down = [&](auto kernel) {
      allow_smem(reinterpret_cast<const void*>(kernel));
      kernel<<<grid3, kThreads, smem3, stream>>>(da);
      EXPERTQMM_CUDA_CHECK_LAUNCH(decode_down_combine_kernel);
    };
    if (down_bits == 4) down(decode_down_combine_kernel<DT, 4>);
    else down(decode_down_combine_kernel<DT, 8>);
  };
  if (D == DType::bf16) launch_all(DTypeTag<DType::bf16>{});
  else launch_all(DTypeTag<DType::f16>{});
}

}  // namespace expertqmm::cuda

// Kernel 1 of the decode layer (moe_decode.h): the router with top-k, softmax and the expert plan.
#include "cuda/moe_decode.h"
#include "cuda/device/pdl.cuh"
#include "cuda/device/route_topk.cuh"
#include "cuda/device/row_units.cuh"

namespace expertqmm::cuda::decode {

namespace {

constexpr int kRouterThreads = 256;
constexpr int kRouterWarps = kRouterThreads / 32;
constexpr int kRouterChunks = 2;      // 16-byte weight chunks per thread per batch (c = tid + 256 i)
constexpr int kRouterUnits = 12;      // 16-byte h units per thread per staging batch
constexpr int kRouterScaleUnits = 2;  // norm-weight units (8 values) per thread per staging batch
constexpr int kRouterCachedScales = kRouterThreads;  // per_expert_scale prefetched for e < 256
constexpr int kRouterSmallT = 8;  // kMaxT of the instances for T <= 8 (kDecodeMaxTokens beyond)

// softmax_topk (Qwen3-MoE): the same kernel with the norm made the identity (inv_rms = 1, the scale
// row 1 and root_size 1, so r = D(h) = h) and the last CTA routing by device::warp_softmax_topk.
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
// top-k (Gemma at T = 1, E <= 256: device::cta_rank_topk, one key per thread, then warp 0 the
// weights; else warp t = token t, device::warp_topk_softmax; indices into shared memory,
// per_expert_scale from the prefetched copy), writes indices and weights, resets the counter, and
// builds the DecodePlan from the shared indices: thread b < n counts the rows with a smaller expert id and the
// earlier rows with the same id, which is row b's place in the stably sorted order; an expert's 0th,
// 8th, ... rows start groups, and every row writes its token into its group's token list.
// Occupancy (ptxas, sm_90a): 93-113 registers, no spills; 1 CTA (8 warps) per SM is all it needs:
// grid E = 128 <= 132 SMs, one wave. Dynamic shared memory (T + 1) * 3168 floats at H = 2816:
// 25 KiB at T=1, 111 KiB at T=8, 210 KiB at T=16 (decode_max_smem: 219 KiB on sm_90, 155 KiB on sm_80,
// where T <= 11 fits). In flight per SM: the expert row (2.8 KB + 88 B of scales/biases)
// beside the norm inputs (norm weight 5.6 KB + h 5.6 KB per token: ~14 KB at T=1, ~53 KB at T=8,
// L2 hits after the first CTA) in one round trip; then the counter atomic, one L2 read of the
// logits and the top-k in the last CTA (T=8: the 8 tokens on the 8 warps at once).
// kFp (an fp-mode projection: mxfp4 / nvfp4 with kProj 4, mxfp8 with 8; bf16): a chunk's two halves
// (16 4-bit or 8 8-bit values) each lie in one group of 16 or 32, so ws / wb hold the decoded
// scales of the low and high half instead of scale and bias, and acc[t] += s_lo * dot_lo + s_hi *
// dot_hi with fp_word_dot's E2M1 / E4M3 values (qmv's fp arithmetic: s * sum(x * v) per group part).
// kSoftmaxTopk: the router kind (RouterArgs::softmax_topk) as a template parameter, so that each
// instance holds one top-k's code (the kernel's code is fetched cold by every SM at every layer:
// bench/NOTES.md step 17). kMaxT: the most tokens the instance takes (its per-token registers).
template <DType D, int kProj, bool kFp, bool kSoftmaxTopk, int kMaxT>
__global__ void __launch_bounds__(kRouterThreads) decode_router_kernel(RouterArgs a) {
  using S = typename Elem<D>::storage;
  constexpr bool kQuant = kProj != 0;
  constexpr int kVals = kQuant ? 128 / kProj : 8;  // values per 16-byte chunk
  constexpr int kUnitsPerChunk = kVals / 8;
  extern __shared__ __align__(16) float smem[];    // scale*root_size row, then T raw h rows (padded)
  __shared__ float red[kRouterWarps][kMaxT];
  __shared__ float inv_rms[kMaxT];
  __shared__ float pes_s[kRouterCachedScales];
  __shared__ int is_last;
  __shared__ int32_t ids[kDecodeMaxRows];
  __shared__ int starts_group[kDecodeMaxRows];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int e = blockIdx.x;
  const int Q = a.H / kVals;
  const int row_floats = round_up4(padded(a.H));
  float* sr = smem;                // (H) padded: scale * root_size
  float* hs = smem + row_floats;   // (T, H) padded: raw h
  const uint4* wrow = static_cast<const uint4*>(kQuant ? static_cast<const void*>(a.proj.w) : a.proj_dense) + static_cast<int64_t>(e) * Q;
  const uint16_t* srow = kQuant ? a.proj.scales + static_cast<int64_t>(e) * a.proj.groups_per_row : nullptr;
  const uint16_t* brow = kQuant ? a.proj.biases + static_cast<int64_t>(e) * a.proj.groups_per_row : nullptr;

  // 1. Weight loads first, as raw bits: a conversion inside the `c < Q` branch would make the next
  //    load wait for this one (the scale and bias are converted where the dot uses them).
  uint4 wv[kRouterChunks];
  uint32_t ws_raw[kRouterChunks], wb_raw[kRouterChunks];  // kFp: the low and high half's scale codes
  auto load_batch = [&](int c0) {
#pragma unroll
    for (int i = 0; i < kRouterChunks; ++i) {
      const int c = c0 + kRouterThreads * i;
      ws_raw[i] = 0u;
      wb_raw[i] = 0u;
      if (c < Q) {
        wv[i] = __ldg(wrow + c);
        if constexpr (kFp) {
          const uint8_t* codes = a.proj.fp_scales + static_cast<int64_t>(e) * a.proj.groups_per_row;
          ws_raw[i] = __ldg(codes + ((c * kVals) >> a.proj.group_shift));
          wb_raw[i] = __ldg(codes + ((c * kVals + kVals / 2) >> a.proj.group_shift));
        } else if constexpr (kQuant) {
          const int g = (c * kVals) >> a.proj.group_shift;
          ws_raw[i] = __ldg(srow + g);
          wb_raw[i] = __ldg(brow + g);
        }
      } else {
        wv[i] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  // Chunk i's scale and bias (kFp: the two halves' scales) as floats.
  auto chunk_params = [&](int i, float& s_lo, float& s_hi) {
    if constexpr (kFp) {
      const bool e4m3 = a.proj.fp_mode == static_cast<int>(QuantMode::nvfp4);
      s_lo = e4m3 ? e4m3_value(static_cast<uint8_t>(ws_raw[i])) : e8m0_value(static_cast<uint8_t>(ws_raw[i]));
      s_hi = e4m3 ? e4m3_value(static_cast<uint8_t>(wb_raw[i])) : e8m0_value(static_cast<uint8_t>(wb_raw[i]));
    } else {
      s_lo = raw_param<D>(static_cast<uint16_t>(ws_raw[i]));
      s_hi = raw_param<D>(static_cast<uint16_t>(wb_raw[i]));
    }
  };
  load_batch(tid);
  constexpr bool norm = !kSoftmaxTopk;  // softmax_topk: r = h (inv_rms and the scale row are 1)
  const uint32_t pes_raw = norm && tid < a.E ? load_raw_any(a.per_expert_scale, a.pes_dtype, tid) : 0u;

  // 2. Norm inputs, batched: the norm weight's units and h's units, all loads before any use.
  const int U = a.H / 8;
  const int TU = a.T * U;
  float sq[kMaxT];
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) sq[t] = 0.f;
  for (int base = 0, sbase = 0; base < TU || sbase < U;
       base += kRouterThreads * kRouterUnits, sbase += kRouterThreads * kRouterScaleUnits) {
    device::RawUnit su[kRouterScaleUnits];  // the norm weight in 16-byte units (supports_decode_layer)
#pragma unroll
    for (int j = 0; j < kRouterScaleUnits; ++j) {
      const int u = sbase + tid + kRouterThreads * j;
      if (norm && u < U) device::load_unit(device::UnitsAny{true}, a.scale, a.scale_dtype, u, a.H, su[j]);
    }
    uint4 hv[kRouterUnits];
    // Units past T * U are skipped as a CTA (a uniform exit: T = 1 stages 2 of the 12 units per
    // thread, and the per-unit branches were ~100 of the router's ~880 instructions per warp). Not
    // in the loads of the dense softmax_topk build, where ptxas then spills 40 bytes.
    constexpr bool kLoadsExit = kQuant || !kSoftmaxTopk;
#pragma unroll
    for (int j = 0; j < kRouterUnits; ++j) {
      if constexpr (kLoadsExit) {
        if (base + kRouterThreads * j >= TU) break;  // uniform
      }
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
        float v[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
        if (norm) device::unit_values(device::UnitsAny{true}, su[j], a.scale_dtype, v);
        float4* dst = reinterpret_cast<float4*>(sr + padded(8 * u));
        dst[0] = make_float4(__fmul_rn(v[0], a.root_size), __fmul_rn(v[1], a.root_size),
                             __fmul_rn(v[2], a.root_size), __fmul_rn(v[3], a.root_size));
        dst[1] = make_float4(__fmul_rn(v[4], a.root_size), __fmul_rn(v[5], a.root_size),
                             __fmul_rn(v[6], a.root_size), __fmul_rn(v[7], a.root_size));
      }
    }
#pragma unroll
    for (int j = 0; j < kRouterUnits; ++j) {
      if (base + kRouterThreads * j >= TU) break;  // uniform
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
        for (int tt = 0; tt < kMaxT; ++tt)
          if (tt == t) sq[tt] = __fadd_rn(sq[tt], s);
        float4* dst = reinterpret_cast<float4*>(hs + t * row_floats + padded(8 * u));
        dst[0] = make_float4(v[0], v[1], v[2], v[3]);
        dst[1] = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
  }
  // 3. inv_rms per token.
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) {
    if (t >= a.T) break;  // uniform: only the call's tokens are reduced
    for (int off = 16; off > 0; off >>= 1) sq[t] = __fadd_rn(sq[t], __shfl_xor_sync(0xffffffffu, sq[t], off));
    if (lane == 0) red[warp][t] = sq[t];
  }
  __syncthreads();
  if (tid < a.T) {
    float total = 0.f;
    for (int w = 0; w < kRouterWarps; ++w) total = __fadd_rn(total, red[w][tid]);
    inv_rms[tid] = norm ? __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(a.H)), a.eps)))
                        : 1.0f;
  }
  if (tid < kRouterCachedScales) pes_s[tid] = norm && tid < a.E ? raw_any_to_float(pes_raw, a.pes_dtype) : 0.f;
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
        float dot = 0.f, sx = 0.f, dot_hi = 0.f;  // kFp: dot holds the low half's
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
          if constexpr (kFp) {
            float& d = q < kUnitsPerChunk / 2 ? dot : dot_hi;
            if constexpr (kProj == 4) {
              d = device::fp_word_dot<4>(word_of(wv[i], q), x, d);
            } else {
              d = device::fp_word_dot<8>(word_of(wv[i], 2 * q), x, d);
              d = device::fp_word_dot<8>(word_of(wv[i], 2 * q + 1), x + 4, d);
            }
          } else if constexpr (kProj == 4) {
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
        if constexpr (kQuant) {
          float s_lo, s_hi;  // affine: scale, bias; kFp: the halves' scales
          chunk_params(i, s_lo, s_hi);
          acc += kFp ? s_lo * dot + s_hi * dot_hi : s_lo * dot + s_hi * sx;
        } else {
          acc += dot;
        }
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

  // One token with EXPERTQMM_DECODE_ROUTE_IN_GATE_UP: the gate/up CTAs rank these logits themselves
  // (the next launch sees them), so no ticket, top-k or plan here.
  if (a.route_in_gate_up) {
    device::pdl_wait();
    return;
  }
  // The last CTA to finish routes.
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
  __syncthreads();
  // A chained launch (EXPERTQMM_CHAINED_LAUNCH) started beside the kernel ahead of it, which wrote
  // nothing this one reads; wait for it before ending, so the kernels after this one find it done.
  if (!is_last) {
    device::pdl_wait();
    return;
  }
  __threadfence();
  if (tid == 0) atomicExch(a.counter, 0u);  // ready for the next call (graph replays)
  auto expert_scale = [&](int64_t x) {
    return x < kRouterCachedScales ? pes_s[x] : load_any(a.per_expert_scale, a.pes_dtype, x);
  };
  if (!kSoftmaxTopk && a.T == 1 && a.E <= kRouterThreads && a.k <= kDecodeMaxTopK) {
    // One token (E <= 256): every expert's key ranked at once, one per thread (device::key_rank: the
    // same order as the warp's k passes below, whose shuffle chains were this CTA's serial tail), then
    // warp 0 the weights from the k slot keys. At T = 2 the two warps' passes ran in parallel and the
    // rank lost (bench/NOTES.md step 29: layer -2.3% at T = 1, +1.2% at T = 2).
    __shared__ uint32_t key_hi[kRouterThreads];             // (E) routing keys' high words
    __shared__ unsigned long long slot_key[kDecodeMaxTopK];  // (k) the key of each slot
    device::cta_rank_topk([&](int i) { return __ldcg(a.logits + i); }, a.E, a.k, key_hi, slot_key);
    if (warp == 0) {
      const unsigned long long mine = lane < a.k ? slot_key[lane] : 0ull;
      device::warp_topk_softmax_of_slots(mine, a.k, expert_scale, ids,
                                         [&](int slot, float w) { a.weights[slot] = Elem<D>::store(w); });
    }
  } else {
    for (int t = warp; t < a.T; t += kRouterWarps) {
      const float* lrow = a.logits + t * a.E;
      uint16_t* wrow_out = a.weights + t * a.k;
      auto store = [&](int slot, float w) { wrow_out[slot] = Elem<D>::store(w); };
      if constexpr (kSoftmaxTopk)
        device::warp_softmax_topk([&](int64_t x) { return __ldcg(lrow + x); }, a.E, a.k, a.renormalize,
                                  [](float v) { return round_to<D>(v); }, ids + t * a.k, store);
      else
        device::warp_topk_softmax([&](int64_t x) { return __ldcg(lrow + x); }, a.E, a.k, expert_scale, ids + t * a.k,
                                  store);
    }
  }
  __syncthreads();

  // The plan: rows grouped by expert (stable counting sort over n <= 128 rows), an expert's rows in
  // groups of kPlanGroupRows (T > 8 only can give an expert more): row b starts a group when it is
  // its expert's 0th, 8th, ... row.
  const int n = a.T * a.k;
  int32_t mine = -1;
  int less = 0, before = 0, same = 0;
  if (tid < n) {
    mine = ids[tid];
    a.indices[tid] = mine;
#pragma unroll 1
    for (int b = 0; b < n; ++b) {
      const int32_t other = ids[b];
      less += other < mine;
      if (other == mine) {
        ++same;
        before += b < tid;
      }
    }
    starts_group[tid] = before % kPlanGroupRows == 0;
    a.plan->row[less + before] = tid;
  }
  const int groups = __syncthreads_count(tid < n && before % kPlanGroupRows == 0);
  if (tid < n) {
    int g = before / kPlanGroupRows;  // the row's group: the groups of smaller expert ids, then its own
#pragma unroll 1
    for (int b = 0; b < n; ++b) g += starts_group[b] && ids[b] < mine;
    a.plan->token[g][before % kPlanGroupRows] = tid / a.k;  // an expert takes a token's row at most once
    a.plan->flat[g][before % kPlanGroupRows] = tid;
    if (before % kPlanGroupRows == 0) {
      a.plan->expert[g] = mine;
      a.plan->begin[g] = less + before;
      a.plan->count[g] = min(same - before, kPlanGroupRows);
    }
  }
  if (tid == 0) a.plan->groups = groups;
  device::pdl_wait();
}


}  // namespace

size_t router_smem(int64_t T, int64_t H) {
  return static_cast<size_t>((T + 1) * round_up4(padded(static_cast<int>(H)))) * 4;  // scale row + T h rows
}

void launch_router(DType dtype, int proj_bits, const RouterArgs& a, size_t smem, cudaStream_t stream, bool fp,
                   bool chained) {
  auto launch = [&](auto kernel) {
    allow_smem(reinterpret_cast<const void*>(kernel));
    launch_maybe_chained(kernel, static_cast<unsigned>(a.E), kRouterThreads, smem, stream, chained, a);
  };
  const bool bf16 = dtype == DType::bf16;
  auto with_kind = [&](auto dtag, auto ptag, auto fptag) {
    constexpr DType DT = decltype(dtag)::value;
    constexpr int P = decltype(ptag)::value;
    constexpr bool F = decltype(fptag)::value;
    // The per-token registers and reductions sized for 8 tokens up to T = 8, for 16 beyond: the code
    // every SM fetches cold at each layer stays as it was (one 16-token build for every T grew it
    // 12%, and the layer measured ~2% slower at T = 2-8: bench/NOTES.md step 43).
    if (a.T <= kRouterSmallT) {
      if (a.softmax_topk) launch(decode_router_kernel<DT, P, F, true, kRouterSmallT>);
      else launch(decode_router_kernel<DT, P, F, false, kRouterSmallT>);
    } else {
      if (a.softmax_topk) launch(decode_router_kernel<DT, P, F, true, kDecodeMaxTokens>);
      else launch(decode_router_kernel<DT, P, F, false, kDecodeMaxTokens>);
    }
  };
  using BF16 = std::integral_constant<DType, DType::bf16>;
  using F16 = std::integral_constant<DType, DType::f16>;
  using Affine = std::false_type;
  auto with_bits = [&](auto dtag, auto fptag) {
    if (proj_bits == 0) with_kind(dtag, std::integral_constant<int, 0>{}, fptag);
    else if (proj_bits == 4) with_kind(dtag, std::integral_constant<int, 4>{}, fptag);
    else with_kind(dtag, std::integral_constant<int, 8>{}, fptag);
  };
  if (fp) {  // bf16, 4- or 8-bit codes (supports_decode_layer)
    if (proj_bits == 4) with_kind(BF16{}, std::integral_constant<int, 4>{}, std::true_type{});
    else with_kind(BF16{}, std::integral_constant<int, 8>{}, std::true_type{});
  } else if (bf16) {
    with_bits(BF16{}, Affine{});
  } else {
    with_bits(F16{}, Affine{});
  }
}

}  // namespace expertqmm::cuda::decode

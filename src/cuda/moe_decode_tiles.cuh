// The decode layer's tensor-core tiles (moe_decode.h has the layer's story) as device functions of
// one CTA: the gate/up + GLU tile, the down + combine tile (per token) and the down-groups tile.
// Their kernels (moe_decode_gate_up.cu, moe_decode_down.cu) call them with the CTA's grid coordinates.
#pragma once
#include "cuda/moe_decode.h"
#include "cuda/device/cp_async.cuh"
#include "cuda/device/glu.cuh"
#include "cuda/device/route_topk.cuh"

namespace expertqmm::cuda::decode {

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


// A gate/up CTA's expert group at one token when it routes itself (GateUpArgs::logits; bench/NOTES.md
// step 33): thread i < E ranks expert i's routing key against the E keys (device::key_rank: the
// router's order, ties to the higher id), rank r < k is slot r; the k chosen experts in increasing
// id order are the plan's groups (one row each: T = 1 picks k distinct experts), so group g is the
// g-th smallest chosen id and its row the slot that chose it. The key: Gemma's router, the logit;
// softmax_topk's, the rounded probability, from warp 0's max and 1 / sum (device::warp_softmax_stats,
// the router's own reductions). write_routing (CTA (0, 0)): warp 0 also writes the k indices and
// weights with the router's arithmetic from the slot keys (warp_topk_softmax_of_slots /
// warp_softmax_topk_of_slots), for the down kernel. Called by every thread of the CTA (two or three
// barriers) before anything else. kSoftmax: the router kind (GateUpArgs::softmax_topk) at compile
// time, so that each instance holds one ranking's code.
struct RankedGroup {
  int expert, row;
};
template <DType D, bool kSoftmax>
__device__ __forceinline__ RankedGroup rank_group(const GateUpArgs& a, int g, bool write_routing) {
  __shared__ uint32_t key_hi[kThreads];                 // (E) the keys' high words
  __shared__ unsigned long long slot_key[kDecodeMaxTopK];  // (k) the key of each slot
  __shared__ float softmax_stats[2];                    // softmax_topk: max logit, 1 / sum
  const int tid = threadIdx.x;
  auto logit = [&](int64_t e) { return __ldcg(a.logits + e); };  // written by another grid or CTA
  auto round_p = [](float v) { return round_to<D>(v); };
  if constexpr (kSoftmax) {
    if (tid < 32) {
      float max_logit, inv_sum;
      device::warp_softmax_stats(logit, a.E, max_logit, inv_sum);
      if (tid == 0) {
        softmax_stats[0] = max_logit;
        softmax_stats[1] = inv_sum;
      }
    }
    __syncthreads();
    device::cta_rank_topk(
        [&](int e) { return device::softmax_topk_score(round_p, logit(e), softmax_stats[0], softmax_stats[1]); }, a.E,
        a.k, key_hi, slot_key);
  } else {
    device::cta_rank_topk(logit, a.E, a.k, key_hi, slot_key);
  }
  RankedGroup r{-1, 0};
  for (int s = 0; s < a.k; ++s) {
    const int e = device::key_expert(slot_key[s]);
    int order = 0;
    for (int o = 0; o < a.k; ++o) order += device::key_expert(slot_key[o]) < e;
    if (order == g) r = {e, s};
  }
  if (write_routing && tid < 32) {
    const unsigned long long mine = tid < a.k ? slot_key[tid] : 0ull;
    auto store = [&](int slot, float w) { a.weights[slot] = Elem<D>::store(w); };
    if constexpr (kSoftmax)
      device::warp_softmax_topk_of_slots(mine, a.k, a.renormalize, round_p, a.indices, store);
    else
      device::warp_topk_softmax_of_slots(
          mine, a.k, [&](int64_t e) { return load_any(a.per_expert_scale, a.pes_dtype, e); }, a.indices, store);
  }
  return r;
}

// One warp's copy of 16 down weight rows from row `first` (codes, and scales and biases raw; kFp the
// scale codes) into its staging, by cp.async in one commit group; `ok` false copies zeros. Lane
// (r = lane / 4, j = lane % 4) copies chunks j, j + 4, ... of rows r and r + 8. The rows' scales and
// biases are two contiguous spans of 32 * groups bytes, kFp's codes one span of 16 * fp_groups bytes
// (16-byte aligned: first % 16 == 0, H % 32 == 0).
template <bool kFp>
__device__ __forceinline__ void copy_down_rows(const device::QuantView& down, int64_t first, int I, int groups,
                                               int code_row, int lane, bool ok, unsigned char* codes, uint16_t* sc,
                                               uint16_t* bi) {
  const int chunks = I / 32;
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const int r = lane / 4 + 8 * p;
    const uint4* src = reinterpret_cast<const uint4*>(down.w) + (first + r) * chunks;
    unsigned char* dst = codes + r * code_row;
    for (int c = lane % 4; c < chunks; c += 4) device::cp_async_16(dst + 16 * c, src + c, ok);
  }
  if constexpr (kFp) {
    const int fp_groups = I >> down.group_shift;
    for (int c = lane; c < fp_groups; c += 32)
      device::cp_async_16(reinterpret_cast<unsigned char*>(sc) + 16 * c, down.fp_scales + first * fp_groups + 16 * c, ok);
  } else {
    const int span_chunks = 2 * groups;
    for (int i = lane; i < 2 * span_chunks; i += 32) {
      const bool bias = i >= span_chunks;
      const int c = i - (bias ? span_chunks : 0);
      device::cp_async_16((bias ? bi : sc) + 8 * c, (bias ? down.biases : down.scales) + first * groups + 8 * c, ok);
    }
  }
  device::cp_async_commit();
}

// Shared memory of a down tile's staging (bytes, regions 16-byte aligned): `rows` code rows (padded,
// tc_code_row_bytes), their scales and biases raw (kFp: the scale codes, within the same bytes), then
// `x_rows` activation rows in the mma k order (stage_tc_unit) and their group sums. The per-token
// tile stages 16 rows and its one hidden row per slot warp, the down-groups tile 128 rows (one 16-row
// tile per warp) and the group's <= 8 hidden rows per CTA.
struct DownStageLayout {
  int code_row, groups, x_row;
  size_t codes, scales, biases, xs, sx, total;
  __host__ __device__ DownStageLayout(int I, int G, int rows, int x_rows) {
    code_row = tc_code_row_bytes(I);
    groups = I / G;
    x_row = tc_x_row_elems(I);
    codes = 0;
    scales = static_cast<size_t>(rows) * code_row;
    biases = scales + static_cast<size_t>(rows) * groups * sizeof(uint16_t);
    xs = biases + static_cast<size_t>(rows) * groups * sizeof(uint16_t);
    sx = xs + (static_cast<size_t>(x_rows) * x_row * sizeof(uint16_t) + 15) / 16 * 16;
    total = (sx + static_cast<size_t>(x_rows) * groups * sizeof(float) + 15) / 16 * 16;
  }
};

// Work split: grid (ceil(I / 16), decode_group_rows(T, k, E)), 256 threads, __launch_bounds__(256, 2). CTA (x, g)
// (col_block, g_idx below: the CTA's coordinates in that grid; tc_smem: its dynamic shared memory)
// takes expert group g of the plan (CTAs past the plan's group count exit at once) and output
// columns [16x, 16x + 16): two 16-row mma tiles, gate rows (staged rows 0..15) and up rows
// (16..31) of those columns, times the group's activation rows (<= 8: the mma's n).
//   1. plan entry with the lane's token (plan_group: one L2 round trip, every field read before
//      the group count is checked), then everything the CTA needs is requested at once: the 32
//      code rows by cp.async into shared memory in two commit groups (the first and second half
//      of the K groups; 8 threads per row, 16-byte chunks) with the scales and biases (raw, by
//      cp.async in the first group: the contiguous 16-row spans). Gemma: 45 KB of codes per CTA.
//   2. K is split across the warps: warp w takes groups w, w+8, ... of the first half as soon as
//      it has landed, then of the second half. B is read straight from global memory (the T <= 16
//      activation rows are shared by every CTA: L1/L2 hits), the lane's 16-byte unit per code word
//      reordered in registers, one group ahead (the first before the wait for the codes); B column
//      n is the group's row n. Per group: both tiles' G/16 mma steps, and G/16 more with A = 1 for
//      sum(x) of each column (the bias term), so no activation staging and no barrier for it.
//   3. the 8 warps' fp32 partials go through shared memory (the codes' space) and thread i < 16n
//      sums them in warp order for (column i % 16, row i / 16): gate and up rounded to D, then the
//      GLU, one rounding, into hidden[row, column].
// Occupancy (Gemma, bf16, G=64): shared memory 46 KB codes + 5.6 KB scales/biases, 72 registers
// in every instance (plan or ranking): 3 CTAs (24 warps) per SM at any T; T=1: the 352 CTAs are one wave.
// kFp (mxfp4 / nvfp4, bf16; G = kTcFpLayoutGroup): the scale codes are staged raw in the scales
// region (32 rows of K / group bytes: at most the affine layout's 32 * K / 32 * 2), A holds value *
// scale (tc_fp4_block_dot) and no sum-of-x mma or bias term follows.
// Where a gate/up CTA learns its expert group: the plan, or (a.logits set) ranking the router's
// logits itself (rank_group), as Gemma's router ranks them or as the softmax top-k one does. A
// compile-time choice, so that each instance holds one way's code: the plan-reading instances' hot
// loop was rescheduled (+3.9% at T = 2 / 8) while both rankings shared their body (NOTES steps 37-38).
enum class GroupSource { plan, rank_logits, rank_softmax };
template <DType D, int G, Activation A, bool kFp, GroupSource kSource>
__device__ __forceinline__ void gate_up_glu_mma_tile(const GateUpArgs& a, int col_block, int g_idx, unsigned char* tc_smem) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  PlanGroup pg;
  constexpr bool kRanked = kSource != GroupSource::plan;
  int routed_row = 0;  // kRanked: the CTA's one row (rank_group)
  if constexpr (kRanked) {
    const RankedGroup rg =
        rank_group<D, kSource == GroupSource::rank_softmax>(a, g_idx, col_block == 0 && g_idx == 0);
    pg = {a.k, rg.expert, g_idx, 1, 0};  // one token
    routed_row = rg.row;
  } else {
    pg = plan_group(a, g_idx, g);  // with the token of the lane's activation row g
  }
  auto row_of = [&](int i) { return kRanked ? routed_row : plan_row(a, i); };  // entry i of the row order
  if (g_idx >= pg.groups) return;  // uniform
  const int e = pg.expert;
  const int begin = pg.begin;
  int count = pg.count;
  if (e < 0 || e >= a.E) {
    if (threadIdx.x == 0 && col_block == 0)
      record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(e), static_cast<uint32_t>(a.E));
    return;
  }
  count = min(count, kTcMaxN);  // a plan group holds <= kPlanGroupRows rows: the mma's n
  constexpr float kBias = device::kCodeBias<MmaType<D>>;
  const GateUpTcLayout L(a.H, G);
  unsigned char* codes = tc_smem + L.codes;
  uint16_t* sc = reinterpret_cast<uint16_t*>(tc_smem + L.scales);  // raw D, (32 staged rows, groups)
  uint16_t* bi = reinterpret_cast<uint16_t*>(tc_smem + L.biases);
  const int col0 = col_block * kTcRows;
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
    const uint4* src = reinterpret_cast<const uint4*>(r < kTcRows ? a.gate.w : a.up.w) +
                       ((r < kTcRows ? gate_first : up_first) + r % kTcRows) * chunks;
    unsigned char* dst = codes + r * L.code_row;
    for (int c = j; c < half_chunks; c += kPerRow) device::cp_async_16(dst + 16 * c, src + c, true);
    // 1b. the scales and biases of the two 16-row spans (contiguous, 32 * groups bytes each, 16-byte
    //     aligned: supports_decode_layer), raw, with the first half. kFp: the two spans of scale
    //     codes (16 * fp_groups bytes each, 16-byte aligned: supports_decode_layer).
    if constexpr (kFp) {
      const int fp_groups = a.H >> a.gate.group_shift;
      unsigned char* to = reinterpret_cast<unsigned char*>(sc);
      for (int i = tid; i < 2 * fp_groups; i += kThreads) {
        const int which = i / fp_groups, c = i - which * fp_groups;  // which: gate, up
        const uint8_t* from = (which == 0 ? a.gate.fp_scales : a.up.fp_scales) + (which == 0 ? gate_first : up_first) * fp_groups;
        device::cp_async_16(to + which * kTcRows * fp_groups + 16 * c, from + 16 * c, true);
      }
    } else {
      const int span_chunks = 2 * L.groups;
      for (int i = tid; i < 4 * span_chunks; i += kThreads) {
        const int which = i / span_chunks, c = i - which * span_chunks;  // which: gate s, gate b, up s, up b
        const uint16_t* base = which == 0 ? a.gate.scales : which == 1 ? a.gate.biases : which == 2 ? a.up.scales : a.up.biases;
        const int64_t first = (which < 2 ? gate_first : up_first) * L.groups;
        uint16_t* to = (which & 1 ? bi : sc) + (which >> 1) * kTcRows * L.groups;
        device::cp_async_16(to + 8 * c, base + first + 8 * c, true);
      }
    }
    device::cp_async_commit();
    for (int c = half_chunks + j; c < chunks; c += kPerRow) device::cp_async_16(dst + 16 * c, src + c, true);
    device::cp_async_commit();
  }
  // 1c. the lane's activation row: B column g is the group's row g (token tok); units of 8 values,
  //     the lane's first unit of group grp is grp * G/8 + t * G/32.
  const bool live_n = g < count;
  const int64_t tok = live_n ? pg.token : 0;
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
      if constexpr (kFp) {
        const int fp_groups = a.H >> a.gate.group_shift, si = fp_scale_index(grp, t, a.gate.group_shift);
        const bool e4m3 = a.gate.fp_mode == static_cast<int>(QuantMode::nvfp4);
        const uint8_t* codes8 = reinterpret_cast<const uint8_t*>(sc);
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {
          const int r = tile * kTcRows + g;
          const uint32_t s_lo = device::FpDequantBf16::scale_pair(codes8[r * fp_groups + si], e4m3);
          const uint32_t s_hi = device::FpDequantBf16::scale_pair(codes8[(r + 8) * fp_groups + si], e4m3);
          tc_fp4_block_dot(codes + r * L.code_row, codes + (r + 8) * L.code_row, grp, t, xb[0], s_lo, s_hi, acc[tile]);
        }
        xb[0] = xn[0];
        continue;
      }
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
    const int64_t out_row = row_of(begin + n);
    a.hidden[out_row * a.I + col0 + j] = Elem<D>::store(device::glu<A>(round_to<D>(gate), round_to<D>(up)));
  }
}

// Work split: grid (T, ceil(H / 16)), 256 threads, __launch_bounds__(256, 2) (tok, col_block: the CTA's
// coordinates in that grid); tokens vary fastest
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
// kFp (mxfp4 / nvfp4, bf16; G = kTcFpLayoutGroup): the scale codes staged raw in the scales region
// (16 rows of I / group bytes), A holds value * scale (tc_fp4_block_dot), no bias term.
template <DType D, int G, bool kFp>
__device__ __forceinline__ void down_combine_mma_tile(const DownArgs& a, int tok, int col_block, unsigned char* tc_smem) {
  __shared__ float partial[kWarps][kTcRows];
  __shared__ float slot_weight[kWarps];
  __shared__ int slot_ok[kWarps];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int col0 = col_block * kTcRows;
  constexpr float kBias = device::kCodeBias<MmaType<D>>;
  const bool slot_warp = warp < a.k;
  const DownStageLayout L(a.I, G, kTcRows, 1);
  unsigned char* base = tc_smem + warp * L.total;
  unsigned char* codes = base + L.codes;
  uint16_t* sc = reinterpret_cast<uint16_t*>(base + L.scales);  // raw D, (16 rows, groups)
  uint16_t* bi = reinterpret_cast<uint16_t*>(base + L.biases);
  uint16_t* xs = reinterpret_cast<uint16_t*>(base + L.xs);
  float* sx = reinterpret_cast<float*>(base + L.sx);
  const int64_t b = static_cast<int64_t>(tok) * a.k + (slot_warp ? warp : 0);
  const int U = a.I / 8;
  constexpr int kUnits = 4;  // units per lane per batch (Gemma: 88 units, one batch)
  uint4 hv[kUnits];
  // The hidden row's first batch, ahead of the expert id (the gate/up kernel has finished).
  auto load_hidden = [&](int u) { return *reinterpret_cast<const uint4*>(a.hidden + b * a.I + 8 * u); };
  if (slot_warp) {
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const int u = lane + 32 * i;
      hv[i] = u < U ? load_hidden(u) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  int e = 0;
  float wj = 0.f;
  bool ok = false;
  if (slot_warp) {
    e = a.indices[b];
    wj = Elem<D>::load(a.weights[b]);
    ok = e >= 0 && e < a.E;
    const int64_t first = static_cast<int64_t>(ok ? e : 0) * a.H + col0;  // whole blocks: H % 32 == 0
    copy_down_rows<kFp>(a.down, first, a.I, L.groups, L.code_row, lane, ok, codes, sc, bi);
  }
  if (slot_warp) {
    for (int ubase = 0; ubase < U; ubase += 32 * kUnits) {
#pragma unroll
      for (int i = 0; i < kUnits; ++i) {
        const int u = ubase + lane + 32 * i;
        if (ubase > 0) hv[i] = u < U ? load_hidden(u) : hv[i];
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
      if constexpr (kFp) {
        const int fp_groups = a.I >> a.down.group_shift, si = fp_scale_index(grp, t, a.down.group_shift);
        const bool e4m3 = a.down.fp_mode == static_cast<int>(QuantMode::nvfp4);
        const uint8_t* codes8 = reinterpret_cast<const uint8_t*>(sc);
        const uint32_t s_lo = device::FpDequantBf16::scale_pair(codes8[g * fp_groups + si], e4m3);
        const uint32_t s_hi = device::FpDequantBf16::scale_pair(codes8[(g + 8) * fp_groups + si], e4m3);
        tc_fp4_block_dot(codes + g * L.code_row, codes + (g + 8) * L.code_row, grp, t, xb[0], s_lo, s_hi, acc);
        continue;
      }
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

// The down groups (EXPERTQMM_DECODE_DOWN_GROUPS): each expert's down rows are read and dequantized
// once per plan group (<= 8 rows) instead of once per (token, slot) as down_combine_mma_tile does.
// Work split: grid (ceil(H / 128), decode_group_rows(T, k, E)), 256 threads, 3 CTAs per SM where the
// shared memory allows (Gemma and Qwen3 at group 64: 65 / 71 KB, 45 / 49 KB of it codes, as a gate/up
// CTA; Qwen3 at group 32 77 KB: 2). CTA (x, g) takes plan group g (CTAs past
// the plan's group count exit at once) and down rows (output columns) [128x, 128x + 128): warp w
// the 16-row mma tile 128x + 16w .. + 15 over the whole of K = I, so no sum crosses warps.
//   1. the plan entry (group count, expert, rows, the lane's two flat rows) in one round trip, then
//      each warp requests its 16 code rows and their scales and biases (copy_down_rows);
//   2. the CTA stages the group's hidden rows (their flat rows' GLU products; the flat rows a second
//      plan read, L1 / L2 hits under the code copies) meanwhile, one barrier;
//   3. per K group: tc_group_dot with B column n = the group's row n, then acc += s c + (b - M s)
//      sum(x): per (down row, hidden row) the per-token kernel's arithmetic, operation for operation;
//   4. lane (g, t) writes its four fp32 sums (down rows g and g + 8 for the group's rows 2t and
//      2t + 1) to partials[flat row, column]; decode_slot_combine_kernel weights and sums them.
template <DType D, int G, bool kFp>
__device__ __forceinline__ void down_groups_mma_tile(const DownGroupArgs& a, int col_block, int g_idx,
                                                     unsigned char* smem) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  constexpr float kBias = device::kCodeBias<MmaType<D>>;
  const DecodePlan& p = *a.plan;
  // g_idx < kDecodeMaxRows (grid rows <= n), so every field is read before the count check.
  const int groups = p.groups, expert = p.expert[g_idx];
  const int count = min(p.count[g_idx], kTcMaxN);  // <= kPlanGroupRows by the router; xs holds 8 rows
  const int flat_lo = p.flat[g_idx][2 * t], flat_hi = p.flat[g_idx][2 * t + 1];
  if (g_idx >= groups) return;  // uniform
  if (expert < 0 || expert >= a.E) {  // never from the router; the combine skips the slots
    if (tid == 0 && col_block == 0)
      record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(expert), static_cast<uint32_t>(a.E));
    return;
  }

  const DownStageLayout L(a.I, G, kWarps * kTcRows, kTcMaxN);
  const int row0 = (col_block * kWarps + warp) * kTcRows;  // the warp's first down row
  const bool live_warp = row0 < a.H;                       // H % 32 == 0: whole 16-row tiles
  unsigned char* codes = smem + L.codes + static_cast<size_t>(warp) * kTcRows * L.code_row;
  uint16_t* sc = reinterpret_cast<uint16_t*>(smem + L.scales) + warp * kTcRows * L.groups;
  uint16_t* bi = reinterpret_cast<uint16_t*>(smem + L.biases) + warp * kTcRows * L.groups;
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem + L.xs);
  float* sx = reinterpret_cast<float*>(smem + L.sx);

  // 1. The warp's code rows, scales and biases.
  if (live_warp)
    copy_down_rows<kFp>(a.down, static_cast<int64_t>(expert) * a.H + row0, a.I, L.groups, L.code_row, lane, true, codes,
                        sc, bi);

  // 2. The group's hidden rows: unit idx = j * U + u of row j; the G / 8 lanes of a K group are
  //    consecutive and all live or all not (U % (G / 8) == 0), as stage_tc_unit's shuffles need.
  const int U = a.I / 8, units = count * U;
  constexpr int kUnits = 4;  // per thread per batch (Gemma: 704 units, one batch)
  for (int base = 0; base < units; base += kThreads * kUnits) {  // uniform
    uint4 v[kUnits];
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const int idx = base + tid + kThreads * i, j = idx / U;
      v[i] = idx < units ? *reinterpret_cast<const uint4*>(a.hidden + static_cast<int64_t>(p.flat[g_idx][j]) * a.I + 8 * (idx - j * U))
                         : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const int idx = base + tid + kThreads * i, j = idx < units ? idx / U : 0;
      stage_tc_unit<D, G>(xs + j * L.x_row, sx + j * L.groups, idx - j * U, idx < units, v[i]);
    }
  }
  device::cp_async_wait<0>();
  __syncthreads();
  if (!live_warp) return;

  // 3. The warp's 16 x (<= 8) products over K.
  const bool live_n = g < count;  // B column n = g: the group's row g
  const uint16_t* xrow = xs + g * L.x_row;
  const bool live_lo = 2 * t < count, live_hi = 2 * t + 1 < count;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int grp = 0; grp < L.groups; ++grp) {
    uint4 xb[G / 32];
#pragma unroll
    for (int w = 0; w < G / 32; ++w)
      xb[w] = live_n ? *reinterpret_cast<const uint4*>(xrow + grp * G + t * (G / 4) + 8 * w) : make_uint4(0u, 0u, 0u, 0u);
    if constexpr (kFp) {
      const int fp_groups = a.I >> a.down.group_shift, si = fp_scale_index(grp, t, a.down.group_shift);
        const bool e4m3 = a.down.fp_mode == static_cast<int>(QuantMode::nvfp4);
        const uint8_t* codes8 = reinterpret_cast<const uint8_t*>(sc);
        const uint32_t s_lo = device::FpDequantBf16::scale_pair(codes8[g * fp_groups + si], e4m3);
        const uint32_t s_hi = device::FpDequantBf16::scale_pair(codes8[(g + 8) * fp_groups + si], e4m3);
        tc_fp4_block_dot(codes + g * L.code_row, codes + (g + 8) * L.code_row, grp, t, xb[0], s_lo, s_hi, acc);
      continue;
    }
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    tc_group_dot<D, G>(codes + g * L.code_row, codes + (g + 8) * L.code_row, grp, t, xb, c);
    const float x0 = live_lo ? sx[2 * t * L.groups + grp] : 0.f;
    const float x1 = live_hi ? sx[(2 * t + 1) * L.groups + grp] : 0.f;
    const float s0 = raw_param<D>(sc[g * L.groups + grp]), s1 = raw_param<D>(sc[(g + 8) * L.groups + grp]);
    const float b0 = fmaf(-kBias, s0, raw_param<D>(bi[g * L.groups + grp]));  // b - M s, as in gate/up
    const float b1 = fmaf(-kBias, s1, raw_param<D>(bi[(g + 8) * L.groups + grp]));
    acc[0] = fmaf(s0, c[0], fmaf(b0, x0, acc[0]));
    acc[1] = fmaf(s0, c[1], fmaf(b0, x1, acc[1]));
    acc[2] = fmaf(s1, c[2], fmaf(b1, x0, acc[2]));
    acc[3] = fmaf(s1, c[3], fmaf(b1, x1, acc[3]));
  }

  // 4. Down rows g, g + 8 of the tile for the group's rows 2t, 2t + 1.
  if (live_lo) {
    float* out = a.partials + static_cast<int64_t>(flat_lo) * a.H + row0;
    out[g] = acc[0];
    out[g + 8] = acc[2];
  }
  if (live_hi) {
    float* out = a.partials + static_cast<int64_t>(flat_hi) * a.H + row0;
    out[g] = acc[1];
    out[g + 8] = acc[3];
  }
}

}  // namespace expertqmm::cuda::decode

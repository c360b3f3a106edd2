// The decode MoE layer: moe_layer_into for small T (T*k <= kDecodeMaxRows) in three kernels, so
// that a CUDA graph of the layer holds three dependent nodes instead of nine:
//   1. decode_router_kernel        RMS norm of h -> router projection -> (last CTA) top-k + softmax
//                                   (Qwen3-MoE's router: no norm; softmax over all E -> top-k)
//                                   and a plan that groups the T*k (token, slot) rows by expert
//   2. decode_gate_up_glu_kernel   per (expert group, column block): gate and up for every row
//                                   routed to the expert, then the GLU product -> hidden [n, I]
//   3. decode_down_combine_kernel  per (token, column block): the k slots' down GEMVs, weighted and
//                                   summed in slot order in fp32, one rounding -> out [T, H]
//      (or the down groups, by default from 12 tokens (decode_down_groups), two kernels:
//      decode_down_groups_kernel per (expert group, 128 columns) -> fp32 partials [n, H], then
//      decode_slot_combine_kernel -> out [T, H]: the same bytes)
// Kernels 2 and 3 exist twice: on tensor cores for 4-bit experts (the Gemma layer) and scalar for
// 8-bit experts (8-bit MLX checkpoints, bench preset gemma4-26b-a4b-q8).
// The tensor-core kernels 2 and 3 are tile functions (moe_decode_tiles.cuh).
// Files: this header (the arguments, the plan and what the kernels share), moe_decode_router.cu,
// moe_decode_tiles.cuh with moe_decode_gate_up.cu and moe_decode_down.cu (tensor cores),
// moe_decode_scalar.cu (8-bit), and moe_decode_layer.cu (the host: support check and launches).
// Numerics are the general path's (src/cuda/moe.cu): the router rounds r and the logits to h's
// dtype and routes with device/route_topk.cuh (the same code as route_into); gate and up are
// qmv dot products (MLX gather_qmv: sum over groups or chunks of s * sum(x * q) + b * sum(x) in
// fp32, the dequantized weight never rounded), rounded to the activation dtype before the GLU (as the fused
// product of launch_glu_product); the down outputs stay fp32 into the combine (one rounding, where
// the general path rounds y to the dtype first), summed in slot order as launch_weighted_combine.
// Only summation orders differ, so routing agrees with route_into except at logit near-ties.
//
// supports_decode_layer takes: T <= 16 (T <= 8 with 8-bit experts; the router's staged h within
// decode_max_smem), k <= 8, T*k <= 128; bf16 or f16 activations with the same
// dtype for h, x, out and every scale/bias; 4- or 8-bit experts with group 32/64/128 (separate or
// fused gate_up), or mxfp4 / nvfp4 experts under bf16 (the tensor-core kernels' kFp form; mxfp8
// has no decode kernel); a router that is affine 4/8-bit with group 32/64/128, in any fp mode
// under bf16, or dense, in the activation dtype;
// 16-byte aligned rows. Everything else goes to the general path (one Fallback class per miss,
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/device/dequant.cuh"
#include "cuda/device/elem.cuh"
#include "cuda/device/mma.cuh"
#include "cuda/device/quant_view.cuh"
#include "cuda/device/staging.cuh"
#include "cuda/moe_internal.h"
#include "cuda/runtime.cuh"
#include "expertqmm/ops.h"

namespace expertqmm::cuda::decode {

// The staging and GEMV helpers every decode kernel uses (device/staging.cuh, device/dequant.cuh).
using device::chunk_dots;
using device::chunk_sum;
using device::load8;
using device::padded;
using device::raw_param;
using device::round_up4;
using device::small_uint_to_float;
using device::stage_unit;
using device::staged_floats;
using device::word_dot;
using device::word_of;
using device::word_x;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kDecodeMaxTokens = 16;  // T: the router stages every token's h in shared memory
constexpr int kDecodeMaxTopK = 8;     // k: one warp per slot in the down/combine kernel
constexpr int kPlanGroupRows = 8;     // rows of one plan group: the tensor-core gate/up mma's n
constexpr int kScalarMaxTokens = 8;   // T of the scalar (8-bit) kernels: measured and tested up to 8
static_assert(static_cast<int64_t>(kDecodeMaxTokens) * kDecodeMaxTopK <= kDecodeMaxRows, "the plan holds T*k rows");
// Dynamic shared memory of any decode kernel: the device's opt-in limit per block (device_smem_optin,
// asked once: H100 / H200 227 KiB, sm_80 163 KiB) less kDecodeStaticSmem, which covers every decode
// kernel's static shared memory (the router's: ~3.7 KB). The router needs (T + 1) * 12.4 KB at
// H = 2816: 215 KB at T = 16.
constexpr size_t kDecodeStaticSmem = 8 * 1024;
size_t decode_max_smem();

// The expert-group plan that the router's last CTA leaves for the gate/up kernel (and the down
// groups): the n = T*k flat
// rows (t*k + j) sorted by expert (stable), in increasing expert id order; an expert's rows form
// groups of at most kPlanGroupRows (the mma's n: more than 8 rows only from T = 9).
struct DecodePlan {
  // [g][j] the token (row / k) of group g's j-th row, j < count[g]: a gate/up CTA learns its
  // activation rows in the same round trip as its group (plan_group). First, so that each group's
  // 32 bytes are one sector.
  int32_t token[kDecodeMaxRows][kPlanGroupRows];
  int32_t groups;                    // groups (distinct experts up to T = 8)
  int32_t expert[kDecodeMaxRows];    // [g] expert id of group g
  int32_t begin[kDecodeMaxRows];     // [g] first entry of group g in row[]
  int32_t count[kDecodeMaxRows];     // [g] rows of the group, <= kPlanGroupRows
  int32_t row[kDecodeMaxRows];       // flat rows ordered by (expert, row)
  // [g][j] the flat row (t*k + slot) of group g's j-th row: the down groups' activation rows (the
  // hidden rows). Last, so that the fields above keep their offsets.
  int32_t flat[kDecodeMaxRows][kPlanGroupRows];
};


// ---------------------------------------------------------------------------------------------
// Kernel 1: router.
// softmax_topk (Qwen3-MoE, RouterKind::softmax_topk): the projection reads h itself (no norm: scale
// and per_expert_scale are null, the kernel uses 1 for both) and the last CTA routes with
// device::warp_softmax_topk; else Gemma 4's norm, top-k and softmax over the k.
struct RouterArgs {
  const uint16_t* h;  // (T, H) of D, rows h_stride elements apart
  int64_t h_stride;
  const void* scale;  // (H) of scale_dtype: the RMS norm weight (null: softmax_topk)
  DType scale_dtype;
  float root_size, eps;
  device::QuantView proj;  // quantized: (E, H*bits/32) codes, (E, H/group) scales and biases of D
  const void* proj_dense;  // dense: (E, H) of D
  const void* per_expert_scale;  // (E) of pes_dtype (null: softmax_topk)
  DType pes_dtype;
  bool softmax_topk, renormalize;
  int T, H, E, k;
  float* logits;       // (T, E) scratch: the logits, already rounded to D
  unsigned* counter;   // CTAs done; 0 between calls (the last CTA resets it)
  int32_t* indices;    // (T, k) out
  uint16_t* weights;   // (T, k) of D out
  DecodePlan* plan;    // out
  bool route_in_gate_up;  // T = 1: end at the logits; the gate/up CTAs route (GateUpArgs::logits)
};


// ---------------------------------------------------------------------------------------------
// Kernel 2: gate, up and the GLU product.
struct GateUpArgs {
  const uint16_t* x;  // (T, H) of D, rows x_stride elements apart
  int64_t x_stride;
  // gate and up weight rows: expert e, column n is row e * rows_per_expert + row0 + n of
  // w (rows of H*bits/32 uint32) and of scales/biases (rows of H/group of D). Separate tensors:
  // rows_per_expert = I, row0 = 0; one fused gate_up: 2I, gate row0 = 0, up row0 = I.
  device::QuantView gate, up;  // the same bits and group size
  int64_t gate_rows_per_expert, up_rows_per_expert;
  int gate_row0, up_row0;
  int H, I, E, k;
  int rows_per_pass;  // activation rows staged at once: min(kGuRowsPerPass, T) (an expert has <= T rows)
  const DecodePlan* plan;  // null: the identity plan of identity_rows rows (plan_group below)
  int identity_rows;
  int group_rows;  // the tensor-core kernel's expert group rows (grid rows): decode_group_rows
  uint16_t* hidden;  // (n, I) of D: row t*k + j = act(gate) * up of slot (t, j)
  uint32_t* faults;
  // One token routed by the CTAs themselves (EXPERTQMM_DECODE_ROUTE_IN_GATE_UP; rank_group in
  // moe_decode_tiles.cuh): the router's (1, E) logits (E <= kThreads) instead of the plan; CTA (0, 0)
  // writes the k indices and weights (of D; Gemma: per_expert_scale of pes_dtype; softmax_topk:
  // renormalize) for the down kernel.
  const float* logits;  // null: the plan
  const void* per_expert_scale;
  DType pes_dtype;
  bool softmax_topk, renormalize;  // the router's kind (RouterArgs)
  int32_t* indices;
  uint16_t* weights;
};


// The expert group g of a gate/up CTA: the router's plan, or without one (a.plan null) the identity
// plan of a dense MLP run as one always-chosen expert (E = 1, k = 1: the Gemma 4 block's dense
// branch, gemma4_ffn.cu): one group of expert 0 holding rows 0 .. identity_rows - 1 in order.
// token: the token of the group's row j (the calling lane's activation row), read with the rest.
struct PlanGroup {
  int groups, expert, begin, count, token;
};
// g < kDecodeMaxRows (the gate/up grid has decode_group_rows <= n <= kDecodeMaxRows group rows), so every field
// is read at once, before groups is known: one L2 round trip, where a check of groups first made
// it two (and the token, through row[], a third; bench/NOTES.md step 39).
__device__ __forceinline__ PlanGroup plan_group(const GateUpArgs& a, int g, int j) {
  if (!a.plan) return {1, 0, 0, a.identity_rows, j};  // identity: row j is token j (k = 1)
  const DecodePlan& p = *a.plan;
  const int groups = p.groups, expert = p.expert[g], begin = p.begin[g], count = p.count[g];
  const int token = p.token[g][j];
  const bool live = g < groups;  // selects, not a branch the loads would sink into
  return {groups, live ? expert : 0, live ? begin : 0, live ? count : 0, live ? token : 0};
}
// Entry i of the plan's row order (a flat row t*k + j).
__device__ __forceinline__ int plan_row(const GateUpArgs& a, int i) { return a.plan ? a.plan->row[i] : i; }


// ---------------------------------------------------------------------------------------------
// Kernel 3: down and the weighted combine.
struct DownArgs {
  const uint16_t* hidden;  // (n, I) of D
  device::QuantView down;  // (E, H, I*bits/32) codes, (E, H, I/group) scales and biases of D
  const int32_t* indices;   // (T, k)
  const uint16_t* weights;  // (T, k) of D
  int H, I, E, k;
  uint16_t* out;  // (T, H) of D
  uint32_t* faults;
};

// Kernel 3 as the down groups (EXPERTQMM_DECODE_DOWN_GROUPS): per (plan group, 128 output columns),
// each expert's down rows read once per group instead of once per (token, slot).
struct DownGroupArgs {
  const uint16_t* hidden;  // (n, I) of D: row t*k + j is slot (t, j)'s GLU product
  device::QuantView down;  // as DownArgs::down
  const DecodePlan* plan;  // the router's: groups, expert, count and flat rows of each group
  int H, I, E;
  float* partials;  // (n, H) fp32 out: row t*k + j = slot (t, j)'s down product, unweighted
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
constexpr int kTcMaxN = kPlanGroupRows;  // activation rows per mma: one plan group's
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


// MLX's fp4 modes (mxfp4, nvfp4; bf16 only), the kernels' kFp form: A holds the weights themselves,
// each E2M1 value times its group's scale, exact in bf16 (device::FpDequantBf16), so the mma sums
// x * w and there is no per-group term after it (the CPU spec's sum of x * (value * scale); qmv's s *
// sum(x * value) differs by summation order only). The k order is the G = 32 layout's (lane t owns
// code word 4 grp + t of each 32-value block grp), whatever the mode's group: a word's 8 values lie
// in one group for groups of 16 and 32, so each lane reads one scale code per row and block
// (fp_scale_index). Scale codes are staged raw (uint8, row-major, groups per row = K / group).
constexpr int kTcFpLayoutGroup = 32;
__device__ __forceinline__ int fp_scale_index(int grp, int t, int group_shift) {
  return (grp * kTcFpLayoutGroup + 8 * t) >> group_shift;
}

// c += x * w over block grp for the 16-row tile of staged code rows lo / hi (rows g, g+8), whose
// scales are s_lo / s_hi (bf16 pairs: FpDequantBf16::scale_pair).
__device__ __forceinline__ void tc_fp4_block_dot(const unsigned char* lo, const unsigned char* hi, int grp, int t,
                                                 const uint4& xb, uint32_t s_lo, uint32_t s_hi, float (&c)[4]) {
  uint32_t wl[1], wh[1];
  tc_words<kTcFpLayoutGroup>(lo, grp, t, wl);
  tc_words<kTcFpLayoutGroup>(hi, grp, t, wh);
  uint32_t pl[4], ph[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    pl[j] = device::FpDequantBf16::e2m1_pair(wl[0] >> (4 * j), s_lo);
    ph[j] = device::FpDequantBf16::e2m1_pair(wh[0] >> (4 * j), s_hi);
  }
  const uint32_t a0[4] = {pl[0], ph[0], pl[1], ph[1]};
  device::Mma<__nv_bfloat16>::run(c, a0, xb.x, xb.y);
  const uint32_t a1[4] = {pl[2], ph[2], pl[3], ph[3]};
  device::Mma<__nv_bfloat16>::run(c, a1, xb.z, xb.w);
}

// The 16-bit value 1 in both halves of a register (the A operand of the sum-of-x mma).
template <DType D>
constexpr uint32_t kTcOnePair = D == DType::bf16 ? 0x3F803F80u : 0x3C003C00u;

// ---------------------------------------------------------------------------------------------
// The kernels' launches (grid and shared memory from the arguments; on `stream`) and the dynamic
// shared memory each needs (the layer checks these against decode_max_smem() before it picks the path).

// Kernel 1 (moe_decode_router.cu); proj_bits 0: a dense projection in D, else 4 or 8; fp: an fp
// mode's projection (mxfp4 / nvfp4 4-bit, mxfp8 8-bit; bf16).
size_t router_smem(int64_t T, int64_t H);
// chained: a programmatic dependent launch (the kernel ahead of it on the stream writes nothing the
// router reads; the router waits for it before it ends).
void launch_router(DType dtype, int proj_bits, const RouterArgs& a, size_t smem, cudaStream_t stream, bool fp = false,
                   bool chained = false);
// Kernel 2 on tensor cores, 4-bit experts, group G in {32, 64, 128} (moe_decode_gate_up.cu); its grid
// has a.group_rows expert group rows.
// fp: an fp4 mode's codes (mxfp4 / nvfp4, bf16; G is then the mode's group: 32 or 16).
size_t gate_up_mma_smem(int64_t H, int G, bool fp = false);
void launch_gate_up_mma(DType dtype, int G, Activation act, const GateUpArgs& a, size_t smem, cudaStream_t stream,
                        bool fp = false);
// Kernel 3 on tensor cores, 4-bit experts (moe_decode_down.cu).
size_t down_mma_smem(int64_t k, int64_t I, int G, bool fp = false);
void launch_down_mma(DType dtype, int G, const DownArgs& a, int T, size_t smem, cudaStream_t stream, bool fp = false);
// Kernel 3 as the down groups (EXPERTQMM_DECODE_DOWN_GROUPS; moe_decode_down.cu): grid
// (ceil(H / 128), group_rows) into a.partials, then the slot-order combine of the partials into out
// (grid (T, ceil(H / 256))).
size_t down_groups_smem(int64_t I, int G, bool fp = false);
void launch_down_groups(DType dtype, int G, const DownGroupArgs& a, int group_rows, size_t smem, cudaStream_t stream,
                        bool fp = false);
void launch_slot_combine(DType dtype, const DownArgs& a, const float* partials, int T, cudaStream_t stream);
// Kernels 2 and 3 for 8-bit experts (moe_decode_scalar.cu).
int gate_up_scalar_rows_per_pass(int64_t T);  // GateUpArgs::rows_per_pass
size_t gate_up_scalar_smem(int64_t T, int64_t H);
void launch_gate_up_scalar(DType dtype, Activation act, const GateUpArgs& a, size_t smem, cudaStream_t stream);
size_t down_scalar_smem(int64_t k, int64_t I);
void launch_down_scalar(DType dtype, const DownArgs& a, int T, size_t smem, cudaStream_t stream);

// Lets `kernel` take up to decode_max_smem() of dynamic shared memory (once per kernel).
void allow_smem(const void* kernel);

}  // namespace expertqmm::cuda::decode

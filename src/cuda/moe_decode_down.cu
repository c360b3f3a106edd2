// Kernel 3 of the decode layer (moe_decode.h) on tensor cores, for 4-bit experts: each token's k
// down GEMVs, weighted and summed in slot order.
#include "cuda/moe_decode.h"
#include "cuda/device/cp_async.cuh"

namespace expertqmm::cuda::decode {

namespace {

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
// kFp (mxfp4 / nvfp4, bf16; G = kTcFpLayoutGroup): the scale codes staged raw in the scales region
// (16 rows of I / group bytes), A holds value * scale (tc_fp4_block_dot), no bias term.
template <DType D, int G, bool kFp = false>
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
      const uint4* src = reinterpret_cast<const uint4*>(a.down.w) + (first + r) * chunks;
      unsigned char* dst = codes + r * L.code_row;
      for (int c = lane % 4; c < chunks; c += 4) device::cp_async_16(dst + 16 * c, src + c, ok);
    }
    // The rows' scales and biases: two contiguous spans of 32 * groups bytes (16-byte aligned), raw.
    // kFp: one span of 16 * fp_groups bytes of scale codes (16-byte aligned: H % 32 == 0).
    if constexpr (kFp) {
      const int fp_groups = a.I >> a.down.group_shift;
      for (int c = lane; c < fp_groups; c += 32)
        device::cp_async_16(reinterpret_cast<unsigned char*>(sc) + 16 * c, a.down.fp_scales + first * fp_groups + 16 * c, ok);
    } else {
      const int span_chunks = 2 * L.groups;
      for (int i = lane; i < 2 * span_chunks; i += 32) {
        const bool bias = i >= span_chunks;
        const int c = i - (bias ? span_chunks : 0);
        device::cp_async_16((bias ? bi : sc) + 8 * c, (bias ? a.down.biases : a.down.scales) + first * L.groups + 8 * c, ok);
      }
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


}  // namespace

size_t down_mma_smem(int64_t k, int64_t I, int G, bool fp) {
  return static_cast<size_t>(k) * DownTcLayout(static_cast<int>(I), fp ? kTcFpLayoutGroup : G).per_warp;
}

void launch_down_mma(DType dtype, int G, const DownArgs& a, int T, size_t smem, cudaStream_t stream, bool fp) {
  const dim3 grid(static_cast<unsigned>(T), ceil_div(a.H, kTcRows));
  auto launch = [&](auto kernel) {
    allow_smem(reinterpret_cast<const void*>(kernel));
    kernel<<<grid, kThreads, smem, stream>>>(a);
    EXPERTQMM_CUDA_CHECK_LAUNCH(decode_down_combine_mma_kernel);
  };
  const bool bf16 = dtype == DType::bf16;
  if (fp) launch(decode_down_combine_mma_kernel<DType::bf16, kTcFpLayoutGroup, true>);  // the mode's group at run time
  else if (G == 32) launch(bf16 ? decode_down_combine_mma_kernel<DType::bf16, 32> : decode_down_combine_mma_kernel<DType::f16, 32>);
  else if (G == 64) launch(bf16 ? decode_down_combine_mma_kernel<DType::bf16, 64> : decode_down_combine_mma_kernel<DType::f16, 64>);
  else launch(bf16 ? decode_down_combine_mma_kernel<DType::bf16, 128> : decode_down_combine_mma_kernel<DType::f16, 128>);
}

}  // namespace expertqmm::cuda::decode

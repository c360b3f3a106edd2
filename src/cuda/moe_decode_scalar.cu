// Kernels 2 and 3 of the decode layer (moe_decode.h) for 8-bit experts: scalar GEMVs over staged
// activations (4-bit experts run on the tensor-core kernels of moe_decode_gate_up.cu / _down.cu).
#include "cuda/moe_decode.h"
#include "cuda/device/glu.cuh"

namespace expertqmm::cuda::decode {

namespace {

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
  const int g = blockIdx.y;
  const PlanGroup pg = plan_group(a, g, 0);  // its token is not needed here
  if (g >= pg.groups) return;  // uniform
  const int e = pg.expert;
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
      const int grp = (c * kVals) >> a.gate.group_shift;
#pragma unroll
      for (int r = 0; r < kGuWeightRows; ++r) {
        const bool gate = (r & 1) == 0;
        if (valid[r >> 1] && c < Q) {
          const uint4* wbase = reinterpret_cast<const uint4*>(gate ? a.gate.w : a.up.w);
          const uint16_t* sbase = gate ? a.gate.scales : a.up.scales;
          const uint16_t* bbase = gate ? a.gate.biases : a.up.biases;
          wv[i][r] = __ldg(wbase + wr[r] * Q + c);
          wsb[i][r] = __byte_perm(__ldg(sbase + wr[r] * a.gate.groups_per_row + grp),
                                  __ldg(bbase + wr[r] * a.gate.groups_per_row + grp), 0x5410u);
        } else {
          wv[i][r] = make_uint4(0u, 0u, 0u, 0u);
          wsb[i][r] = 0u;  // scale and bias +0
        }
      }
    }
  };
  load_batch(lane);
  const bool one_batch = Q <= 32 * kGuChunks;  // the whole row is in registers: keep it across passes
  const int begin = pg.begin, count = pg.count;

  const int U = a.H / 8;
  const int per_pass = a.rows_per_pass;
  for (int pass = 0; pass * per_pass < count; ++pass) {
    const int rows = min(per_pass, count - pass * per_pass);
    const int row0 = begin + pass * per_pass;
    int64_t token[kGuRowsPerPass];
#pragma unroll
    for (int r = 0; r < kGuRowsPerPass; ++r) token[r] = r < rows ? plan_row(a, row0 + r) / a.k : 0;
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
        const int64_t out_row = plan_row(a, row0 + r);
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
    const uint4* wbase = reinterpret_cast<const uint4*>(a.down.w);
    uint4 wv[kDnChunks][kDnColSets];
    float ws[kDnChunks][kDnColSets], wb[kDnChunks][kDnColSets];
    auto load_batch = [&](int c0) {
#pragma unroll
      for (int i = 0; i < kDnChunks; ++i) {
        const int c = c0 + kDnLanesPerRow * i;
        const int grp = (c * kVals) >> a.down.group_shift;
#pragma unroll
        for (int m = 0; m < kDnColSets; ++m) {
          if (live[m] && c < Q) {
            wv[i][m] = __ldg(wbase + wr[m] * Q + c);
            ws[i][m] = raw_param<D>(__ldg(a.down.scales + wr[m] * a.down.groups_per_row + grp));
            wb[i][m] = raw_param<D>(__ldg(a.down.biases + wr[m] * a.down.groups_per_row + grp));
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


}  // namespace

int gate_up_scalar_rows_per_pass(int64_t T) { return static_cast<int>(std::min<int64_t>(kGuRowsPerPass, T)); }

size_t gate_up_scalar_smem(int64_t T, int64_t H) {
  return static_cast<size_t>(gate_up_scalar_rows_per_pass(T) * staged_floats(static_cast<int>(H))) * 4;
}

void launch_gate_up_scalar(DType dtype, Activation act, const GateUpArgs& a, size_t smem, cudaStream_t stream) {
  const dim3 grid(ceil_div(a.I, kGuCols), static_cast<unsigned>(a.group_rows));
  auto launch = [&](auto kernel) {
    allow_smem(reinterpret_cast<const void*>(kernel));
    kernel<<<grid, kThreads, smem, stream>>>(a);
    EXPERTQMM_CUDA_CHECK_LAUNCH(decode_gate_up_glu_kernel);
  };
  const bool geglu = act == Activation::geglu;
  if (dtype == DType::bf16)
    launch(geglu ? decode_gate_up_glu_kernel<DType::bf16, Activation::geglu>
                 : decode_gate_up_glu_kernel<DType::bf16, Activation::swiglu>);
  else
    launch(geglu ? decode_gate_up_glu_kernel<DType::f16, Activation::geglu>
                 : decode_gate_up_glu_kernel<DType::f16, Activation::swiglu>);
}

size_t down_scalar_smem(int64_t k, int64_t I) { return static_cast<size_t>(k * staged_floats(static_cast<int>(I))) * 4; }

void launch_down_scalar(DType dtype, const DownArgs& a, int T, size_t smem, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(T), ceil_div(a.H, kDnCols));
  auto launch = [&](auto kernel) {
    allow_smem(reinterpret_cast<const void*>(kernel));
    kernel<<<grid, kThreads, smem, stream>>>(a);
    EXPERTQMM_CUDA_CHECK_LAUNCH(decode_down_combine_kernel);
  };
  if (dtype == DType::bf16) launch(decode_down_combine_kernel<DType::bf16>);
  else launch(decode_down_combine_kernel<DType::f16>);
}

}  // namespace expertqmm::cuda::decode

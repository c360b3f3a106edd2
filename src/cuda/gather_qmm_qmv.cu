// qmv: the decode route of gather_qmm (MLX gather_qmv numerics): for each problem row, every
// output column is a dot product of the row of x with one dequantized weight row, computed as
// sum over chunks of s * sum(x * q) + b * sum(x) in fp32, never rounding the dequantized weight.
// The fp modes (kFp: 1 mxfp4 / mxfp8, E8M0 scales, group 32; 2 nvfp4, E4M3 scales, group 16) sum
// s * sum(x * v) per group, v the E2M1 / E4M3 value (device::fp_word_dot), no bias term.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/device/dequant.cuh"
#include "cuda/device/glu.cuh"
#include "cuda/device/staging.cuh"
#include "cuda/gather_qmm_routes.h"
#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

namespace {

using device::Elem;
using device::small_uint_to_float;
using device::word_dot;
using device::word_x;
using device::padded;
using device::round_up4;

constexpr int kQmvWarps = 8;
constexpr int kQmvThreads = 32 * kQmvWarps;
constexpr int kQmvMinCtasPerSm = 3;  // register cap 85: 3 CTAs (24 warps) resident per SM
constexpr int kQmvColsPerWarp = 4;   // output columns a warp accumulates at once (x read once for 4)
constexpr int kQmvChunksPerLane = 2;  // chunks per column a lane loads before any math (one batch)
constexpr int kQmvPartials = kQmvWarps * kQmvColsPerWarp;  // split-K partial sums per CTA
constexpr int kQmvStageVals = 8;      // x values one thread stages at a time (one 16-byte load)
constexpr int64_t kQmvMaxK = 8192;    // x row staged as float in shared memory: <= 48 KB in all
// Several rows of one batch element per CTA (rows_per_cta > 1: a dense linear's M = T tokens, one
// weight matrix): the weights are loaded once for all of them instead of once per row. 2 CTAs per SM
// (register cap 128: 8 rows x 4 columns of accumulators beside the batch), each row's staged x in
// shared memory, so at most kQmvMultiRowMaxSmem per CTA (K <= 3,968 at 8 rows, 8,064 at 4), less
// where the device allows less (qmv_multi_row_smem: 99 KB on sm_86 / sm_89).
constexpr int kQmvMultiRowCtasPerSm = 2;
constexpr size_t kQmvMultiRowMaxSmem = 113 * 1024;

// What a qmv kernel writes: each column's sum (plain), or act(T(gate)) * T(up) of two weight sets of
// one geometry, q the gate's and up the up's (geglu: the Gemma 4 block's dense MLP at one token).
enum class QmvEpilogue { plain, geglu };

struct QmvArgs {
  const void* x;           // x_batch matrices of (M, K) T, x_batch_stride elements apart
  device::QuantView q;     // (E, N, K*bits/32) codes, (E, N, K/group_size) raw T scales and biases
  device::QuantView up;    // QmvEpilogue::geglu: the up weights, q's geometry
  const int32_t* lhs;  // (B,) or nullptr (identity)
  const int32_t* rhs;  // (B,) or nullptr (identity)
  void* out;           // (B*M, N) T
  uint32_t* faults;
  int64_t x_batch, x_batch_stride;
  int M, N, K, E;
  int num_chunks;  // chunks per weight row (K / values per chunk)
  int k_split;     // warps that share one set of columns, each summing a slice of the chunks
  int row_blocks;  // CTA rows per batch element: ceil(M / kRows)
  bool x_vec;      // every x row starts 16-byte aligned: stage with 16-byte loads
};

// x is staged as float with 4 floats of padding after every 32 (device/staging.cuh: padded), so
// that lanes reading consecutive chunks (8 to 32 values each) start in different bank groups.

// One lane's weights for a batch: kChunks chunks of each of the warp's 4 columns, with
// the scale and bias of each chunk's group. Columns past N and chunks past the row read nothing and
// hold zero codes, scale and bias, so they add exactly 0.
// Scales per chunk: one, except nvfp4's 16-value groups under a 32-value chunk (two).
constexpr int scales_per_chunk(int fp, int vals_per_chunk) { return fp == 2 && vals_per_chunk > 16 ? vals_per_chunk / 16 : 1; }

template <class T, int kVecWords, int kFp = 0, int kScales = 1, int kChunks = kQmvChunksPerLane>
struct QmvBatch {
  uint32_t words[kChunks][kQmvColsPerWarp][kVecWords];
  float scale[kChunks][kQmvColsPerWarp][kScales];
  float bias[kChunks][kQmvColsPerWarp];

  // chunk0: the lane's first chunk of this batch; consecutive chunks of a lane are chunk_stride apart.
  // w_col0, scale_col0, bias_col0: column col0's weight row and its first scale and bias; the
  // warp's other columns follow at words_per_row / groups_per_row strides.
  // fp_col0 (fp modes; scale_col0 and bias_col0 are then null): column col0's uint8 scale codes.
  __device__ __forceinline__ void load(const QmvArgs& a, const uint32_t* w_col0, const uint16_t* scale_col0,
                                       const uint16_t* bias_col0, const uint8_t* fp_col0, int cols_left, int chunk0,
                                       int chunk_stride, int vals_per_chunk) {
#pragma unroll
    for (int it = 0; it < kChunks; ++it) {
      const int c = chunk0 + it * chunk_stride;
      const int group = (c * vals_per_chunk) >> a.q.group_shift;
#pragma unroll
      for (int i = 0; i < kQmvColsPerWarp; ++i) {
        if (c < a.num_chunks && i < cols_left) {
          const uint32_t* src = w_col0 + i * a.q.words_per_row + c * kVecWords;
          if constexpr (kVecWords == 4) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
            words[it][i][0] = v.x;
            words[it][i][1] = v.y;
            words[it][i][2] = v.z;
            words[it][i][3] = v.w;
          } else {
            words[it][i][0] = __ldg(src);
          }
          if constexpr (kFp != 0) {
            const uint8_t* fp_col = fp_col0 + i * a.q.groups_per_row;  // E4M3 (nvfp4) or E8M0 codes
#pragma unroll
            for (int s = 0; s < kScales; ++s) {
              const uint8_t code = __ldg(fp_col + ((c * vals_per_chunk + 16 * s) >> a.q.group_shift));
              scale[it][i][s] = kFp == 2 ? e4m3_value(code) : e8m0_value(code);
            }
            bias[it][i] = 0.f;
          } else {
            scale[it][i][0] = Elem<T>::raw_to_float(__ldg(scale_col0 + i * a.q.groups_per_row + group));
            bias[it][i] = Elem<T>::raw_to_float(__ldg(bias_col0 + i * a.q.groups_per_row + group));
          }
        } else {
#pragma unroll
          for (int v = 0; v < kVecWords; ++v) words[it][i][v] = 0u;
#pragma unroll
          for (int s = 0; s < kScales; ++s) scale[it][i][s] = 0.f;
          bias[it][i] = 0.f;
        }
      }
    }
  }
};

// Kernel: grid (ceil(N / cols_per_cta), B * row_blocks), 256 threads = 8 warps, at least 3 CTAs per
// SM (kRows = 1; 2 for kRows > 1). CTA (x, y) takes batch element b = y / row_blocks (expert rhs[b],
// x batch lhs[b]) and its rows m0 = (y % row_blocks) * kRows .. m0 + rows - 1 (rows = min(kRows,
// M - m0)), for cols_per_cta = (8 / k_split) * 4 consecutive columns from x * cols_per_cta. With
// kRows > 1 every weight batch a lane loads serves all of the CTA's rows, each row's sums in the
// one-row kernel's order (the same bits at the same k_split).
//   xs         (rows, K padded) float: the x rows, pre-divided by 16^(k % 4) for 4-bit (see word_dot)
//   unit_sum   (rows, K / 4 padded) float: sum of each staged unit of x (8 values, 4 for 8-bit
//              single-word chunks); a chunk's sum(x) is the sum of its units
//   partial    (k_split, kRows, cols_per_cta) float: split-K partial sums
// Warp w works on column set w / k_split (4 columns) and chunk slice w % k_split: lane l takes
// chunks l + 32 * (slice + k_split * i), a chunk being kVecWords consecutive words of a weight
// row (uint4 = 32 4-bit or 16 8-bit codes when rows are 16-byte aligned, else one word).
// Latency is what decode pays, so the order is: read the expert id, issue the first batch of
// weight loads (2 chunks x 4 columns per lane: 8 x 16 bytes in flight per lane, ~96 KB per SM; one
// chunk with kRows > 1, whose registers hold kRows x 4 sums),
// only then stage x (its loads overlap the weights'), then the math. Later batches (K beyond
// 64 chunks per slice) load and compute in turn. Lanes reduce with xor shuffles; with
// k_split > 1 the slices meet in shared memory.
// kEpi = geglu (affine, one row per CTA): the lane's batch holds one chunk of each column of both
// weight sets, each set's sums in the plain kernel's order (so T(gate) and T(up) are the bits two
// one-row launches at the same k_split write), and the store is act(T(gate)) * T(up) rounded to T.
template <class T, int kBits, int kVecWords, int kFp, int kRows, QmvEpilogue kEpi = QmvEpilogue::plain>
__global__ void __launch_bounds__(kQmvThreads, kRows == 1 ? kQmvMinCtasPerSm : kQmvMultiRowCtasPerSm)
    qmv_kernel(QmvArgs a) {
  constexpr bool kGlu = kEpi != QmvEpilogue::plain;
  static_assert(!kGlu || (kFp == 0 && kRows == 1), "the GLU epilogue is built for affine codes, one row per CTA");
  constexpr int kValsPerChunk = kVecWords * (32 / kBits);
  constexpr int kScales = scales_per_chunk(kFp, kValsPerChunk);
  constexpr int kUnit = kValsPerChunk < kQmvStageVals ? kValsPerChunk : kQmvStageVals;  // values per staged unit
  constexpr int kUnitsPerChunk = kValsPerChunk / kUnit;
  extern __shared__ __align__(16) float qmv_smem[];
  const int b = blockIdx.y / a.row_blocks;
  const int m0 = (blockIdx.y - b * a.row_blocks) * kRows;
  const int rows = min(kRows, a.M - m0);
  const int xs_stride = round_up4(padded(a.K)), unit_stride = round_up4(a.K / 4);  // qmv_smem_bytes
  float* xs = qmv_smem;                                    // (rows, K padded) float
  float* unit_sum = xs + rows * xs_stride;                 // (rows, K / kUnit) float, rows K / 4 apart
  float* partial = unit_sum + rows * unit_stride;          // (k_split, kRows, cols_per_cta) float
  const int64_t expert = a.rhs ? static_cast<int64_t>(a.rhs[b]) : b;
  const int64_t xb = a.lhs ? static_cast<int64_t>(a.lhs[b]) : b;
  if (expert < 0 || expert >= a.E) {
    if (threadIdx.x == 0) record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(expert), a.E);
    return;  // uniform: the whole CTA skips the row
  }
  if (xb < 0 || xb >= a.x_batch) {
    if (threadIdx.x == 0)
      record_fault(a.faults, kFaultRowOutOfRange, static_cast<uint32_t>(xb), static_cast<uint32_t>(a.x_batch));
    return;
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slice = warp % a.k_split, col_set = warp / a.k_split;
  const int cols_per_cta = (kQmvWarps / a.k_split) * kQmvColsPerWarp;
  const int col0 = blockIdx.x * cols_per_cta + col_set * kQmvColsPerWarp;
  const int cols_left = a.N - col0;  // may be <= 0: the warp then loads nothing
  const int64_t col_row = expert * a.N + col0;  // (expert, col0) as a row of w / scales / biases
  const uint32_t* w_col0 = a.q.w + col_row * a.q.words_per_row;
  // Affine: raw T scales and biases; fp modes: uint8 scale codes (the others null).
  const int64_t group_row0 = col_row * a.q.groups_per_row;
  const uint16_t* scale_col0 = kFp ? nullptr : a.q.scales + group_row0;
  const uint16_t* bias_col0 = kFp ? nullptr : a.q.biases + group_row0;
  const uint8_t* fp_col0 = kFp ? a.q.fp_scales + group_row0 : nullptr;
  const uint32_t* up_w_col0 = kGlu ? a.up.w + col_row * a.q.words_per_row : nullptr;
  const uint16_t* up_scale_col0 = kGlu ? a.up.scales + group_row0 : nullptr;
  const uint16_t* up_bias_col0 = kGlu ? a.up.biases + group_row0 : nullptr;
  const int chunk_stride = 32 * a.k_split;  // between one lane's consecutive chunks
  // Several rows per CTA: one chunk per column in a batch, the registers going to the rows' sums
  // (8 rows x 4 columns) instead; the rows' math per batch covers the next batch's load.
  // The GLU epilogue: one chunk per column too, the registers going to the second weight set.
  constexpr int kChunks = kRows == 1 && !kGlu ? kQmvChunksPerLane : 1;
  const int batch_stride = kChunks * chunk_stride;

  QmvBatch<T, kVecWords, kFp, kScales, kChunks> batch, up_batch;
  int chunk0 = slice * 32 + lane;
  batch.load(a, w_col0, scale_col0, bias_col0, fp_col0, cols_left, chunk0, chunk_stride, kValsPerChunk);
  if constexpr (kGlu)
    up_batch.load(a, up_w_col0, up_scale_col0, up_bias_col0, nullptr, cols_left, chunk0, chunk_stride, kValsPerChunk);

  // Stage x: thread i takes units i, i + 256, ... of the rows' units laid end to end; 16-byte loads
  // when the rows are aligned.
  const T* x0 = static_cast<const T*>(a.x) + xb * a.x_batch_stride + static_cast<int64_t>(m0) * a.K;
  const int units = a.K / kUnit;
  for (int i = threadIdx.x; i < rows * units; i += kQmvThreads) {
    const int r = kRows == 1 ? 0 : i / units, u = i - r * units;
    const T* xrow = x0 + static_cast<int64_t>(r) * a.K;
    float* xs_r = xs + r * xs_stride;
    float xv[kUnit];
    if (kUnit == 8 && a.x_vec) {
      const uint4 raw = *reinterpret_cast<const uint4*>(xrow + u * kUnit);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int v = 0; v < kUnit; ++v) xv[v] = Elem<T>::to_float(e[v]);
    } else {
#pragma unroll
      for (int v = 0; v < kUnit; ++v) xv[v] = Elem<T>::to_float(xrow[u * kUnit + v]);
    }
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kUnit; ++v) {
      sum += xv[v];
      // kUnit is 4 or 8, so value v sits at k % 4 == v % 4 (the affine nibble trick; fp: x as it is).
      xs_r[padded(u * kUnit + v)] =
          kBits == 4 && kFp == 0 ? xv[v] * (1.0f / static_cast<float>(1 << (4 * (v & 3)))) : xv[v];
    }
    unit_sum[r * unit_stride + u] = sum;
  }
  __syncthreads();

  float acc[kRows][kQmvColsPerWarp], acc_up[kQmvColsPerWarp];  // acc_up: the GLU's up sums (row 0)
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < kQmvColsPerWarp; ++i) acc[r][i] = 0.f;
#pragma unroll
  for (int i = 0; i < kQmvColsPerWarp; ++i) acc_up[i] = 0.f;

  for (;;) {
#pragma unroll
    for (int it = 0; it < kChunks; ++it) {
      const int c = chunk0 + it * chunk_stride;
      if (c >= a.num_chunks) break;  // later chunks of the lane are past the row too
      // One word's x values at a time (8 or 4 floats), shared by the 4 columns: keeps the x
      // registers to one word's worth while the batch's weights are live. Several rows: each word
      // goes to every row before the next word (rows inner, so that only one word of x per row is
      // live), each row's sums in the one-row kernel's order.
      constexpr int kValsPerWord = 32 / kBits;
      if constexpr (kFp != 0) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r >= rows) break;  // CTA-uniform
          const float* xc = xs + r * xs_stride + padded(c * kValsPerChunk);
          // One scale per kVecWords / kScales words: sum x * v over them, then times the scale.
          constexpr int kWordsPerScale = kVecWords / kScales;
#pragma unroll
          for (int s = 0; s < kScales; ++s) {
            float dot[kQmvColsPerWarp];
#pragma unroll
            for (int i = 0; i < kQmvColsPerWarp; ++i) dot[i] = 0.f;
#pragma unroll
            for (int wj = 0; wj < kWordsPerScale; ++wj) {
              float xv[kValsPerWord];
              word_x<kBits>(xc, s * kWordsPerScale + wj, xv);
#pragma unroll
              for (int i = 0; i < kQmvColsPerWarp; ++i)
                dot[i] = device::fp_word_dot<kBits>(batch.words[it][i][s * kWordsPerScale + wj], xv, dot[i]);
            }
#pragma unroll
            for (int i = 0; i < kQmvColsPerWarp; ++i) acc[r][i] = fmaf(batch.scale[it][i][s], dot[i], acc[r][i]);
          }
        }
      } else {
        const int x_off = padded(c * kValsPerChunk);
        float dot[kRows][kQmvColsPerWarp], dot_up[kQmvColsPerWarp];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int i = 0; i < kQmvColsPerWarp; ++i) dot[r][i] = 0.f;
#pragma unroll
        for (int i = 0; i < kQmvColsPerWarp; ++i) dot_up[i] = 0.f;
#pragma unroll
        for (int wi = 0; wi < kVecWords; ++wi) {
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (r >= rows) break;  // CTA-uniform
            float xv[kValsPerWord];
            word_x<kBits>(xs + r * xs_stride + x_off, wi, xv);
#pragma unroll
            for (int i = 0; i < kQmvColsPerWarp; ++i) dot[r][i] = word_dot<kBits>(batch.words[it][i][wi], xv, dot[r][i]);
            if constexpr (kGlu) {
#pragma unroll
              for (int i = 0; i < kQmvColsPerWarp; ++i)
                dot_up[i] = word_dot<kBits>(up_batch.words[it][i][wi], xv, dot_up[i]);
            }
          }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r >= rows) break;
          const float* us = unit_sum + r * unit_stride + c * kUnitsPerChunk;
          float sx = 0.f;
#pragma unroll
          for (int u = 0; u < kUnitsPerChunk; ++u) sx += us[u];
#pragma unroll
          for (int i = 0; i < kQmvColsPerWarp; ++i)
            acc[r][i] += batch.scale[it][i][0] * dot[r][i] + batch.bias[it][i] * sx;
          if constexpr (kGlu) {
#pragma unroll
            for (int i = 0; i < kQmvColsPerWarp; ++i)
              acc_up[i] += up_batch.scale[it][i][0] * dot_up[i] + up_batch.bias[it][i] * sx;
          }
        }
      }
    }
    chunk0 += batch_stride;
    if (chunk0 - lane >= a.num_chunks) break;  // warp-uniform: no lane has chunks left
    batch.load(a, w_col0, scale_col0, bias_col0, fp_col0, cols_left, chunk0, chunk_stride, kValsPerChunk);
    if constexpr (kGlu)
      up_batch.load(a, up_w_col0, up_scale_col0, up_bias_col0, nullptr, cols_left, chunk0, chunk_stride, kValsPerChunk);
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int i = 0; i < kQmvColsPerWarp; ++i)
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) acc[r][i] += __shfl_xor_sync(0xffffffffu, acc[r][i], offset);
  if constexpr (kGlu) {
#pragma unroll
    for (int i = 0; i < kQmvColsPerWarp; ++i)
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) acc_up[i] += __shfl_xor_sync(0xffffffffu, acc_up[i], offset);
  }
  // The stored value of a column from its sums: T(sum), or act(T(gate)) * T(up) rounded to T.
  auto result = [](float gate, float up) {
    if constexpr (kGlu)
      return Elem<T>::from_float(device::glu<Activation::geglu>(Elem<T>::to_float(Elem<T>::from_float(gate)),
                                                                Elem<T>::to_float(Elem<T>::from_float(up))));
    else
      return Elem<T>::from_float(gate);
  };

  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(b) * a.M + m0) * a.N;  // the CTA's first row
  if (a.k_split == 1) {
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < kQmvColsPerWarp; ++i)
          if (r < rows && i < cols_left) out[static_cast<int64_t>(r) * a.N + col0 + i] = result(acc[r][i], acc_up[i]);
    }
    return;
  }
  // partial: (k_split, kRows, cols_per_cta) sums, then (GLU) the up sums of the one row.
  float* partial_up = partial + a.k_split * kRows * cols_per_cta;
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int i = 0; i < kQmvColsPerWarp; ++i) {
        partial[(slice * kRows + r) * cols_per_cta + col_set * kQmvColsPerWarp + i] = acc[r][i];
        if (kGlu) partial_up[slice * cols_per_cta + col_set * kQmvColsPerWarp + i] = acc_up[i];
      }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < rows * cols_per_cta; j += kQmvThreads) {
    const int r = kRows == 1 ? 0 : j / cols_per_cta, c = j - r * cols_per_cta;
    const int n = blockIdx.x * cols_per_cta + c;
    if (n >= a.N) continue;
    float sum = 0.f, sum_up = 0.f;
    for (int s = 0; s < a.k_split; ++s) sum += partial[(s * kRows + r) * cols_per_cta + c];
    if (kGlu)
      for (int s = 0; s < a.k_split; ++s) sum_up += partial_up[s * cols_per_cta + c];
    out[static_cast<int64_t>(r) * a.N + n] = result(sum, sum_up);
  }
}

size_t qmv_multi_row_smem() { return std::min(kQmvMultiRowMaxSmem, device_smem_optin()); }

template <class T, int kBits, int kVecWords, int kFp = 0, int kRows = 1, QmvEpilogue kEpi = QmvEpilogue::plain>
void launch_qmv(const QmvArgs& a, dim3 grid, size_t smem) {
  auto* kernel = qmv_kernel<T, kBits, kVecWords, kFp, kRows, kEpi>;
  static const bool smem_configured = [kernel] {  // the multi-row kernels stage up to 113 KB
    if (kRows > 1)
      EXPERTQMM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(qmv_multi_row_smem())));
    return true;
  }();
  (void)smem_configured;
  kernel<<<grid, kQmvThreads, smem, current_stream()>>>(a);
  EXPERTQMM_CUDA_CHECK_LAUNCH("qmv_kernel");
}

// The qmv kernels by (dtype, mode, bits, words per chunk, rows per CTA): 16-byte loads when every
// weight row starts 16-byte aligned, single words otherwise (K % 8 == 0 is all qmv asks of K);
// several rows per CTA for affine 16-byte rows (the dense MLP's and other single-matrix calls);
// the GeGLU epilogue for 8-bit affine 16-byte rows (the Gemma 4 block's 8-bit dense MLP at one token).
// ptxas (sm_90a): 120-128 registers; 4-bit at 8 rows spills 28 B, the others none.
struct QmvVariant {
  DType dtype;
  QuantMode mode;
  int bits;
  int vec_words;
  void (*launch)(const QmvArgs&, dim3, size_t);
  int rows_per_cta = 1;
  QmvEpilogue epilogue = QmvEpilogue::plain;
};
constexpr QuantMode kAffine = QuantMode::affine, kMxfp4 = QuantMode::mxfp4, kMxfp8 = QuantMode::mxfp8,
                    kNvfp4 = QuantMode::nvfp4;
const QmvVariant kQmvVariants[] = {
    {DType::bf16, kAffine, 4, 4, launch_qmv<__nv_bfloat16, 4, 4>}, {DType::bf16, kAffine, 4, 1, launch_qmv<__nv_bfloat16, 4, 1>},
    {DType::bf16, kAffine, 8, 4, launch_qmv<__nv_bfloat16, 8, 4>}, {DType::bf16, kAffine, 8, 1, launch_qmv<__nv_bfloat16, 8, 1>},
    {DType::f16, kAffine, 4, 4, launch_qmv<__half, 4, 4>},         {DType::f16, kAffine, 4, 1, launch_qmv<__half, 4, 1>},
    {DType::f16, kAffine, 8, 4, launch_qmv<__half, 8, 4>},         {DType::f16, kAffine, 8, 1, launch_qmv<__half, 8, 1>},
    {DType::bf16, kMxfp4, 4, 4, launch_qmv<__nv_bfloat16, 4, 4, 1>}, {DType::bf16, kMxfp4, 4, 1, launch_qmv<__nv_bfloat16, 4, 1, 1>},
    {DType::bf16, kMxfp8, 8, 4, launch_qmv<__nv_bfloat16, 8, 4, 1>}, {DType::bf16, kMxfp8, 8, 1, launch_qmv<__nv_bfloat16, 8, 1, 1>},
    {DType::bf16, kNvfp4, 4, 4, launch_qmv<__nv_bfloat16, 4, 4, 2>}, {DType::bf16, kNvfp4, 4, 1, launch_qmv<__nv_bfloat16, 4, 1, 2>},
    {DType::f16, kMxfp4, 4, 4, launch_qmv<__half, 4, 4, 1>},         {DType::f16, kMxfp4, 4, 1, launch_qmv<__half, 4, 1, 1>},
    {DType::f16, kMxfp8, 8, 4, launch_qmv<__half, 8, 4, 1>},         {DType::f16, kMxfp8, 8, 1, launch_qmv<__half, 8, 1, 1>},
    {DType::f16, kNvfp4, 4, 4, launch_qmv<__half, 4, 4, 2>},         {DType::f16, kNvfp4, 4, 1, launch_qmv<__half, 4, 1, 2>},
    {DType::bf16, kAffine, 4, 4, launch_qmv<__nv_bfloat16, 4, 4, 0, 4>, 4}, {DType::bf16, kAffine, 4, 4, launch_qmv<__nv_bfloat16, 4, 4, 0, 8>, 8},
    {DType::bf16, kAffine, 8, 4, launch_qmv<__nv_bfloat16, 8, 4, 0, 4>, 4}, {DType::bf16, kAffine, 8, 4, launch_qmv<__nv_bfloat16, 8, 4, 0, 8>, 8},
    {DType::f16, kAffine, 4, 4, launch_qmv<__half, 4, 4, 0, 4>, 4},         {DType::f16, kAffine, 4, 4, launch_qmv<__half, 4, 4, 0, 8>, 8},
    {DType::f16, kAffine, 8, 4, launch_qmv<__half, 8, 4, 0, 4>, 4},         {DType::f16, kAffine, 8, 4, launch_qmv<__half, 8, 4, 0, 8>, 8},
    {DType::bf16, kAffine, 8, 4, launch_qmv<__nv_bfloat16, 8, 4, 0, 1, QmvEpilogue::geglu>, 1, QmvEpilogue::geglu},
    {DType::f16, kAffine, 8, 4, launch_qmv<__half, 8, 4, 0, 1, QmvEpilogue::geglu>, 1, QmvEpilogue::geglu},
};

// Per staged row: xs and unit_sum (at most K / 4 units: 8-bit single-word chunks); then the split-K
// partials of rows_per_cta rows (twice for a GLU epilogue's two weight sets). staged_rows: the most
// rows a CTA stages (min(rows_per_cta, M)).
size_t qmv_smem_bytes(int64_t K, int staged_rows = 1, int rows_per_cta = 1, QmvEpilogue epi = QmvEpilogue::plain) {
  const int64_t per_row = round_up4(padded(static_cast<int>(K))) + round_up4(static_cast<int>(K / 4));
  const int sets = epi == QmvEpilogue::plain ? 1 : 2;
  return sizeof(float) * (staged_rows * per_row + kQmvPartials * rows_per_cta * sets);
}

// The table's kernel for p at vec_words words per chunk, r rows per CTA and an epilogue, or null.
const QmvVariant* find_qmv_variant(const detail::GatherQmmProblem& p, int vec_words, int r,
                                   QmvEpilogue epi = QmvEpilogue::plain) {
  for (const QmvVariant& v : kQmvVariants)
    if (v.dtype == p.dtype && v.mode == p.mode && v.bits == p.bits && v.vec_words == vec_words &&
        v.rows_per_cta == r && v.epilogue == epi)
      return &v;
  return nullptr;
}

// Rows per CTA: several where they share one weight matrix (M >= 2 rows of a batch element: a dense
// linear's tokens) and the table has a multi-row kernel (affine, 16-byte weight rows), as long as the grid
// still gives every SM a CTA at k_split 2 and the staged rows fit qmv_multi_row_smem(). So the
// router's projection (N = 128: 8 column blocks) stays at one row per CTA, and Gemma 4's dense MLP
// takes 4 rows per CTA at T = 2 (from 3 rows rhs_tiles takes them: kQmvMaxSharedRows; a 4-bit dense
// MLP at T <= 8 runs gate and up on the decode GLU kernel instead). 5-7 rows per CTA-row (8 rows per
// CTA) where rhs_tiles does not take a wide matrix (K % 64 != 0) or many narrow ones fill the grid.
int qmv_rows_per_cta(const detail::GatherQmmProblem& p, int vec_words) {
  if (p.M < 2) return 1;
  constexpr int64_t kColsAtSplit2 = (kQmvWarps / 2) * kQmvColsPerWarp;
  const int64_t col_blocks = (p.N + kColsAtSplit2 - 1) / kColsAtSplit2;
  for (int r : {8, 4}) {
    if ((r == 8 && p.M < 5) || find_qmv_variant(p, vec_words, r) == nullptr) continue;
    const int64_t row_blocks = (p.M + r - 1) / r;
    const int staged = static_cast<int>(std::min<int64_t>(r, p.M));
    if (p.B * row_blocks * col_blocks >= device_sm_count() && qmv_smem_bytes(p.K, staged, r) <= qmv_multi_row_smem())
      return r;
  }
  return 1;
}

}  // namespace

// Row limit (kQmvMaxRows = 64, decode up to 8 tokens x top-8): qmv runs one CTA row per problem
// row, so its grid only grows with rows: at 64 rows and Gemma's N=704 it is 22 x 64 = 1408 CTAs
// (2816: 5632), well above 4 per SM without splitting K. Each row streams its expert's weights once
// (64 rows over about 50 distinct experts of 128: ~1.3 reads per weight byte, partly from L2), while
// rhs_tiles at those sizes sees runs of one or two rows per 16-row tile and re-reads each run's
// expert weights for mostly-empty mma tiles.
RouteSupport supports_qmv(const detail::GatherQmmProblem& p) {
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return route_miss(Fallback::dtype);
  if (p.bits != 4 && p.bits != 8) return route_miss(Fallback::quantization);
  if (!p.transpose) return route_miss(Fallback::quantization);  // codes run along N, not K
  if (p.B * p.M > kQmvMaxRows || p.M > kQmvMaxSharedRowsNarrow) return route_miss(Fallback::shape);
  if (p.M > kQmvMaxSharedRows && p.N > kQmvNarrowN && supports_rhs_tiles(p).ok) return route_miss(Fallback::shape);
  if (p.K <= 0 || p.N <= 0 || p.K > kQmvMaxK) return route_miss(Fallback::shape);
  if (!fits_int32(p.N) || !fits_int32(p.M) || !fits_int32(p.w_batch)) return route_miss(Fallback::shape);
  if (p.K % 8 != 0) return route_miss(Fallback::alignment);
  return route_ok();
}

namespace {

// rows_per_cta: 0 for qmv_rows_per_cta's choice, else that many (1: the one-row kernel). glu_up: the
// up weights of a GeGLU epilogue (supports_qmv_glu holds; one row per CTA), else null.
void run_qmv(const detail::GatherQmmProblem& p, void* out, int rows_per_cta,
             const detail::GatherQmmProblem* glu_up = nullptr) {
  const RouteSupport s = supports_qmv(p);
  EXPERTQMM_CHECK(s.ok, "gather_qmm", "qmv does not support ", p.describe(), " (", fallback_name(s.reason), ")");
  const QmvEpilogue epi = glu_up ? QmvEpilogue::geglu : QmvEpilogue::plain;
  QmvArgs a{};
  a.x = p.x.data();
  a.q = quant_view(p);
  if (glu_up) a.up = quant_view(*glu_up);
  a.lhs = p.lhs_is_identity ? nullptr : static_cast<const int32_t*>(p.lhs.data());
  a.rhs = p.rhs_is_identity ? nullptr : static_cast<const int32_t*>(p.rhs.data());
  a.out = out;
  a.faults = device_faults();
  a.x_batch = p.x_batch;
  a.x_batch_stride = p.x_batch_stride;
  a.M = static_cast<int>(p.M);
  a.N = static_cast<int>(p.N);
  a.K = static_cast<int>(p.K);
  a.E = static_cast<int>(p.w_batch);
  const int vec_words = (a.q.words_per_row % 4 == 0 && is_aligned(p.w.data(), 16)) ? 4 : 1;
  a.num_chunks = a.q.words_per_row / vec_words;
  a.x_vec = is_aligned(p.x.data(), 16) && p.x_batch_stride % 8 == 0;  // K % 8 == 0: every row aligned

  const int r = glu_up ? 1 : rows_per_cta > 0 ? rows_per_cta : qmv_rows_per_cta(p, vec_words);
  a.row_blocks = static_cast<int>((p.M + r - 1) / r);

  // Split K across warps while the grid would not fill the resident CTA slots (3 per SM; 2 for
  // several rows per CTA), as long as every lane of every slice still gets at least two chunks.
  const int64_t cta_rows = p.B * a.row_blocks;
  const int64_t target_ctas = (r == 1 ? kQmvMinCtasPerSm : kQmvMultiRowCtasPerSm) * static_cast<int64_t>(device_sm_count());
  int k_split = 1;
  auto ctas = [&](int ks) { return cta_rows * ((p.N + (kQmvWarps / ks) * kQmvColsPerWarp - 1) / ((kQmvWarps / ks) * kQmvColsPerWarp)); };
  while (k_split < kQmvWarps && ctas(k_split) < target_ctas && a.num_chunks >= 32 * 2 * k_split) k_split *= 2;
  a.k_split = k_split;

  const int cols_per_cta = (kQmvWarps / k_split) * kQmvColsPerWarp;
  const dim3 grid(ceil_div(p.N, cols_per_cta), static_cast<unsigned>(cta_rows));
  const size_t smem = qmv_smem_bytes(p.K, static_cast<int>(std::min<int64_t>(r, p.M)), r, epi);
  const QmvVariant* v = find_qmv_variant(p, vec_words, r, epi);
  if (v == nullptr)
    throw Error("gather_qmm", detail::cat("qmv has no kernel for dtype=", dtype_name(p.dtype), " bits=", p.bits,
                                          " rows per CTA=", r, glu_up ? " with the GeGLU epilogue" : ""));
  v->launch(a, grid, smem);
}

}  // namespace

void call_qmv(const detail::GatherQmmProblem& p, void* out, Workspace*) { run_qmv(p, out, 0); }
void call_qmv_one_row(const detail::GatherQmmProblem& p, void* out, Workspace*) { run_qmv(p, out, 1); }

RouteSupport supports_qmv_glu(const detail::GatherQmmProblem& gate, const detail::GatherQmmProblem& up,
                              Activation act) {
  if (act != Activation::geglu) return route_miss(Fallback::topology);  // the table's epilogue
  for (const detail::GatherQmmProblem* p : {&gate, &up}) {
    const RouteSupport s = supports_qmv(*p);
    if (!s.ok) return s;
    // One weight matrix, identity indices: the block's dense linears (single_matrix_problem).
    if (p->B != 1 || p->w_batch != 1 || !p->lhs_is_identity || !p->rhs_is_identity)
      return route_miss(Fallback::topology);
    if (p->w_row_words() % 4 != 0 || !is_aligned(p->w.data(), 16)) return route_miss(Fallback::alignment);
  }
  const bool same = gate.N == up.N && gate.K == up.K && gate.M == up.M && gate.bits == up.bits &&
                    gate.group_size == up.group_size && gate.mode == up.mode && gate.dtype == up.dtype &&
                    gate.x.data() == up.x.data() && gate.x_batch_stride == up.x_batch_stride;
  if (!same) return route_miss(Fallback::shape);
  if (find_qmv_variant(gate, 4, 1, QmvEpilogue::geglu) == nullptr) return route_miss(Fallback::quantization);
  return route_ok();
}

void call_qmv_glu(const detail::GatherQmmProblem& gate, const detail::GatherQmmProblem& up, Activation act, void* out) {
  const RouteSupport s = supports_qmv_glu(gate, up, act);
  EXPERTQMM_CHECK(s.ok, "gather_qmm", "qmv with the GLU epilogue does not support gate ", gate.describe(), " and up ",
                  up.describe(), " (", fallback_name(s.reason), ")");
  run_qmv(gate, out, 1, &up);
}

}  // namespace expertqmm::cuda

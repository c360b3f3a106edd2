// qmv: the decode route of gather_qmm (MLX gather_qmv numerics): for each problem row, every
// output column is a dot product of the row of x with one dequantized weight row, computed as
// sum over chunks of s * sum(x * q) + b * sum(x) in fp32, never rounding the dequantized weight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/device/dequant.cuh"
#include "cuda/gather_qmm_routes.h"
#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

namespace {

using device::Elem;
using device::small_uint_to_float;

constexpr int kQmvWarps = 8;
constexpr int kQmvThreads = 32 * kQmvWarps;
constexpr int kQmvColsPerWarp = 4;  // output columns a warp accumulates at once (4 weight loads in flight per lane)
constexpr int kQmvPartials = kQmvWarps * kQmvColsPerWarp;  // split-K partial sums per CTA
constexpr int64_t kQmvMaxK = 8192;  // x row staged as float in shared memory: <= 48 KB in all

struct QmvArgs {
  const void* x;           // x_batch matrices of (M, K) T, x_batch_stride elements apart
  const uint32_t* w;       // (E, N, K*bits/32) uint32 codes
  const uint16_t* scales;  // (E, N, K/group_size) raw T
  const uint16_t* biases;
  const int32_t* lhs;  // (B,) or nullptr (identity)
  const int32_t* rhs;  // (B,) or nullptr (identity)
  void* out;           // (B*M, N) T
  uint32_t* faults;
  int64_t x_batch, x_batch_stride;
  int M, N, K, E;
  int words_per_row, groups_per_row, group_shift;
  int num_chunks;  // chunks per weight row (K / values per chunk)
  int k_split;     // warps that share one set of columns, each summing a slice of the chunks
};

// x is staged as float with 4 floats of padding after every 32, so that lanes reading
// consecutive chunks (8 to 32 values each) start in different bank groups.
__host__ __device__ constexpr int padded_index(int k) { return k + ((k >> 5) << 2); }
__host__ __device__ constexpr int round_up4(int v) { return (v + 3) & ~3; }

// sum_i x[i] * q[i] over one chunk of codes. 4-bit: x arrives pre-divided by 16^(i % 4) and each
// nibble is read masked in place inside its 16-bit half (MLX's qdot trick), so one LOP3 gives the
// code times 16^(i % 4) as an exact float. 8-bit: byte_perm moves each byte under the float
// exponent 2^23. Both are exact; only the fp32 sums round.
template <int kBits, int kVecWords>
__device__ __forceinline__ float chunk_dot(const uint32_t (&words)[kVecWords], const float* xv) {
  float dot = 0.f;
#pragma unroll
  for (int wi = 0; wi < kVecWords; ++wi) {
    const uint32_t w = words[wi];
    if constexpr (kBits == 4) {
      const uint32_t hi = w >> 16;
#pragma unroll
      for (int j = 0; j < 4; ++j) dot += xv[8 * wi + j] * small_uint_to_float(w & (0xFu << (4 * j)));
#pragma unroll
      for (int j = 0; j < 4; ++j) dot += xv[8 * wi + 4 + j] * small_uint_to_float(hi & (0xFu << (4 * j)));
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        dot += xv[4 * wi + j] * (__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | j)) - 8388608.0f);
    }
  }
  return dot;
}

// Kernel: grid (ceil(N / cols_per_cta), rows), 256 threads = 8 warps. CTA (x, y) computes problem
// row y (its expert rhs[y / M] and x row lhs[y / M], m = y % M) for cols_per_cta = (8 / k_split)
// * 4 consecutive columns from x * cols_per_cta. First the whole x row is staged once in shared
// memory as float (xs, padded, pre-scaled for 4-bit) with one float sum per chunk (chunk_sum).
// Warp w works on column set w / k_split (4 columns) and chunk slice w % k_split: lane l takes
// chunks l + 32 * (slice + k_split * i), a chunk being kVecWords consecutive words of a weight
// row (uint4 = 32 4-bit codes when rows are 16-byte aligned, else one word). Per chunk the lane
// issues the 4 columns' weight loads together, then accumulates s * dot + b * sum(x) per column.
// Lanes reduce with xor shuffles; with k_split > 1 the slices meet in shared memory (partial).
template <class T, int kBits, int kVecWords>
__global__ void __launch_bounds__(kQmvThreads) qmv_kernel(QmvArgs a) {
  constexpr int kValsPerChunk = kVecWords * (32 / kBits);
  extern __shared__ __align__(16) float qmv_smem[];
  float* xs = qmv_smem;                                     // padded (K,) float
  float* chunk_sum = xs + round_up4(padded_index(a.K));     // (num_chunks,) float
  float* partial = chunk_sum + round_up4(a.num_chunks);     // (k_split, cols_per_cta) float

  const int64_t row = blockIdx.y;
  const int64_t b = row / a.M;
  const int64_t m = row - b * a.M;
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

  const T* xrow = static_cast<const T*>(a.x) + xb * a.x_batch_stride + m * a.K;
  for (int c = threadIdx.x; c < a.num_chunks; c += kQmvThreads) {
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kValsPerChunk; ++v) {
      const int k = c * kValsPerChunk + v;
      const float xv = Elem<T>::to_float(xrow[k]);
      sum += xv;
      xs[padded_index(k)] = kBits == 4 ? xv * (1.0f / static_cast<float>(1 << (4 * (v & 3)))) : xv;
    }
    chunk_sum[c] = sum;
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slice = warp % a.k_split, col_set = warp / a.k_split;
  const int cols_per_cta = (kQmvWarps / a.k_split) * kQmvColsPerWarp;
  const int col0 = blockIdx.x * cols_per_cta + col_set * kQmvColsPerWarp;
  const uint32_t* w_expert = a.w + expert * a.N * a.words_per_row;
  const int64_t param_expert = expert * a.N * a.groups_per_row;

  float acc[kQmvColsPerWarp];
#pragma unroll
  for (int i = 0; i < kQmvColsPerWarp; ++i) acc[i] = 0.f;

  for (int c = slice * 32 + lane; c < a.num_chunks; c += 32 * a.k_split) {
    float xv[kValsPerChunk];
    const float4* xp = reinterpret_cast<const float4*>(xs + padded_index(c * kValsPerChunk));
#pragma unroll
    for (int i = 0; i < kValsPerChunk / 4; ++i) {
      const float4 f = xp[i];
      xv[4 * i] = f.x;
      xv[4 * i + 1] = f.y;
      xv[4 * i + 2] = f.z;
      xv[4 * i + 3] = f.w;
    }
    const float sx = chunk_sum[c];
    const int group = (c * kValsPerChunk) >> a.group_shift;

    uint32_t words[kQmvColsPerWarp][kVecWords];
    float sc[kQmvColsPerWarp], bi[kQmvColsPerWarp];
#pragma unroll
    for (int i = 0; i < kQmvColsPerWarp; ++i) {
      const int n = col0 + i;
      if (n < a.N) {
        const uint32_t* src = w_expert + static_cast<int64_t>(n) * a.words_per_row + static_cast<int64_t>(c) * kVecWords;
        if constexpr (kVecWords == 4) {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
          words[i][0] = v.x;
          words[i][1] = v.y;
          words[i][2] = v.z;
          words[i][3] = v.w;
        } else {
          words[i][0] = __ldg(src);
        }
        const int64_t pi = param_expert + static_cast<int64_t>(n) * a.groups_per_row + group;
        sc[i] = Elem<T>::raw_to_float(__ldg(a.scales + pi));
        bi[i] = Elem<T>::raw_to_float(__ldg(a.biases + pi));
      } else {
#pragma unroll
        for (int v = 0; v < kVecWords; ++v) words[i][v] = 0u;
        sc[i] = 0.f;
        bi[i] = 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < kQmvColsPerWarp; ++i)
      acc[i] += sc[i] * chunk_dot<kBits, kVecWords>(words[i], xv) + bi[i] * sx;
  }

#pragma unroll
  for (int i = 0; i < kQmvColsPerWarp; ++i)
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], offset);

  T* out = static_cast<T*>(a.out) + row * a.N;
  if (a.k_split == 1) {
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < kQmvColsPerWarp; ++i)
        if (col0 + i < a.N) out[col0 + i] = Elem<T>::from_float(acc[i]);
    }
    return;
  }
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kQmvColsPerWarp; ++i)
      partial[slice * cols_per_cta + col_set * kQmvColsPerWarp + i] = acc[i];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < cols_per_cta; c += kQmvThreads) {
    const int n = blockIdx.x * cols_per_cta + c;
    if (n >= a.N) continue;
    float sum = 0.f;
    for (int s = 0; s < a.k_split; ++s) sum += partial[s * cols_per_cta + c];
    out[n] = Elem<T>::from_float(sum);
  }
}

template <class T, int kBits, int kVecWords>
void launch_qmv(const QmvArgs& a, dim3 grid, size_t smem) {
  qmv_kernel<T, kBits, kVecWords><<<grid, kQmvThreads, smem, current_stream()>>>(a);
  EXPERTQMM_CUDA_CHECK_LAUNCH("qmv_kernel");
}

// The qmv kernels by (dtype, bits, words per chunk): 16-byte loads when every weight row starts
// 16-byte aligned, single words otherwise (K % 8 == 0 is all qmv asks of K).
struct QmvVariant {
  DType dtype;
  int bits;
  int vec_words;
  void (*launch)(const QmvArgs&, dim3, size_t);
};
const QmvVariant kQmvVariants[] = {
    {DType::bf16, 4, 4, launch_qmv<__nv_bfloat16, 4, 4>}, {DType::bf16, 4, 1, launch_qmv<__nv_bfloat16, 4, 1>},
    {DType::bf16, 8, 4, launch_qmv<__nv_bfloat16, 8, 4>}, {DType::bf16, 8, 1, launch_qmv<__nv_bfloat16, 8, 1>},
    {DType::f16, 4, 4, launch_qmv<__half, 4, 4>},         {DType::f16, 4, 1, launch_qmv<__half, 4, 1>},
    {DType::f16, 8, 4, launch_qmv<__half, 8, 4>},         {DType::f16, 8, 1, launch_qmv<__half, 8, 1>},
};

size_t qmv_smem_bytes(int64_t K, int64_t num_chunks) {
  return sizeof(float) * (round_up4(padded_index(static_cast<int>(K))) + round_up4(static_cast<int>(num_chunks)) +
                          kQmvPartials);
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
  if (p.B * p.M > kQmvMaxRows) return route_miss(Fallback::shape);
  if (p.K <= 0 || p.N <= 0 || p.K > kQmvMaxK) return route_miss(Fallback::shape);
  if (!fits_int32(p.N) || !fits_int32(p.M) || !fits_int32(p.w_batch)) return route_miss(Fallback::shape);
  if (p.K % 8 != 0) return route_miss(Fallback::alignment);
  return route_ok();
}

void call_qmv(const detail::GatherQmmProblem& p, void* out, Workspace*) {
  const RouteSupport s = supports_qmv(p);
  EXPERTQMM_CHECK(s.ok, "gather_qmm", "qmv does not support ", p.describe(), " (", fallback_name(s.reason), ")");
  QmvArgs a{};
  a.x = p.x.data();
  a.w = static_cast<const uint32_t*>(p.w.data());
  a.scales = static_cast<const uint16_t*>(p.scales.data());
  a.biases = static_cast<const uint16_t*>(p.biases.data());
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
  a.words_per_row = static_cast<int>(p.w_row_words());
  a.groups_per_row = static_cast<int>(p.groups_per_row());
  a.group_shift = log2_of(p.group_size);
  const int vec_words = (a.words_per_row % 4 == 0 && is_aligned(p.w.data(), 16)) ? 4 : 1;
  a.num_chunks = a.words_per_row / vec_words;

  // Split K across warps while the grid would leave the GPU short of CTAs, as long as every lane
  // of every slice still gets at least one chunk.
  const int64_t rows = p.B * p.M;
  const int64_t target_ctas = 4 * static_cast<int64_t>(device_sm_count());
  int k_split = 1;
  auto ctas = [&](int ks) { return rows * ((p.N + (kQmvWarps / ks) * kQmvColsPerWarp - 1) / ((kQmvWarps / ks) * kQmvColsPerWarp)); };
  while (k_split < kQmvWarps && ctas(k_split) < target_ctas && a.num_chunks >= 32 * 2 * k_split) k_split *= 2;
  a.k_split = k_split;

  const int cols_per_cta = (kQmvWarps / k_split) * kQmvColsPerWarp;
  const dim3 grid(ceil_div(p.N, cols_per_cta), static_cast<unsigned>(rows));
  const size_t smem = qmv_smem_bytes(p.K, a.num_chunks);
  for (const QmvVariant& v : kQmvVariants) {
    if (v.dtype != p.dtype || v.bits != p.bits || v.vec_words != vec_words) continue;
    v.launch(a, grid, smem);
    return;
  }
  throw Error("gather_qmm", detail::cat("qmv has no kernel for dtype=", dtype_name(p.dtype), " bits=", p.bits));
}

}  // namespace expertqmm::cuda

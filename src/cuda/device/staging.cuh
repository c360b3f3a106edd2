// Activations staged as floats in shared memory for the scalar GEMV kernels (qmv and the decode
// layer's 8-bit kernels), and the chunk dot products over them. A row of K values lives in shared
// memory as floats, with 4 floats of padding after every 32 (lanes reading consecutive 16-byte
// weight chunks start in different bank groups), followed (decode layer) by the plain sum of each
// unit of 8 values:
//   xs    padded(K) floats
//   usum  K / 8 floats, at round_up4(padded(K))
#pragma once
#include <cstdint>

#include "cuda/device/dequant.cuh"
#include "cuda/device/elem.cuh"

namespace expertqmm::cuda::device {

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
__device__ __forceinline__ void load8(const typename cuda::Elem<D>::storage* src, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const typename cuda::Elem<D>::storage* e = reinterpret_cast<const typename cuda::Elem<D>::storage*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = cuda::Elem<D>::load(e[i]);
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

// A raw 16-bit scale or bias of dtype D as float.
template <DType D>
__device__ __forceinline__ float raw_param(uint16_t v) {
  return cuda::Elem<D>::load(v);
}

}  // namespace expertqmm::cuda::device

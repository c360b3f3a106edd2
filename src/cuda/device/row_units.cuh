// 8-value units of a float row (activations or a norm weight) loaded as raw bits and converted
// after every load of the kernel is in flight: the block's norm kernels (gemma4_ffn_norms.cu) and
// the decode router's norm weight (moe_decode_router.cu).
#pragma once
#include <cstdint>

#include "cuda/device/elem.cuh"

namespace expertqmm::cuda::device {

// 8 values of a float row as raw bits, loaded without being used (converted once every load of the
// kernel is in flight).
struct RawUnit {
  uint4 lo, hi;
};

// How a kernel instance reads a row (activations or a norm weight), a compile-time choice so that
// the common case carries no other path in its code (the code of these one-CTA-per-row kernels is
// fetched cold at every layer: bench/NOTES.md step 17):
//   Units16<W>  the row in 16-byte units of dtype W (16-bit: one load per unit), fixed at compile time;
//   UnitsAny    a run-time dtype per row, 16-byte units when `vec` (16-bit: one load, f32: two), else
//               one load per element into the eight words (zero-extended; 0 past H).
template <DType W>
struct Units16 {};
struct UnitsAny {
  bool vec;
};
template <DType W>
__device__ __forceinline__ constexpr bool in_units(Units16<W>) { return true; }
__device__ __forceinline__ bool in_units(UnitsAny l) { return l.vec; }

template <DType W>
__device__ __forceinline__ void load_unit(Units16<W>, const void* row, DType, int64_t u, int64_t, RawUnit& r) {
  static_assert(sizeof(typename cuda::Elem<W>::storage) == 2, "Units16 is for 16-bit rows");
  r.lo = __ldg(static_cast<const uint4*>(row) + u);
}
template <DType W>
__device__ __forceinline__ void unit_values(Units16<W>, const RawUnit& r, DType, float (&v)[8]) {
  const uint32_t w[4] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = cuda::Elem<W>::load(static_cast<uint16_t>(w[i] & 0xffffu));
    v[2 * i + 1] = cuda::Elem<W>::load(static_cast<uint16_t>(w[i] >> 16));
  }
}

__device__ __forceinline__ void load_unit(UnitsAny l, const void* row, DType dt, int64_t u, int64_t H, RawUnit& r) {
  if (l.vec) {
    if (dt == DType::f32) {
      const uint4* q = static_cast<const uint4*>(row) + 2 * u;
      r.lo = __ldg(q);
      r.hi = __ldg(q + 1);
    } else {
      r.lo = __ldg(static_cast<const uint4*>(row) + u);
    }
    return;
  }
  uint32_t e[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t idx = 8 * u + i;
    e[i] = idx < H ? load_raw_any(row, dt, idx) : 0u;
  }
  r.lo = make_uint4(e[0], e[1], e[2], e[3]);
  r.hi = make_uint4(e[4], e[5], e[6], e[7]);
}
// (0 past H: their bits are 0 on the element path, and on the 16-byte path H % 8 == 0.)
__device__ __forceinline__ void unit_values(UnitsAny l, const RawUnit& r, DType dt, float (&v)[8]) {
  const uint32_t w[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
  if (l.vec && dt != DType::f32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = raw_any_to_float(w[i] & 0xffffu, dt);
      v[2 * i + 1] = raw_any_to_float(w[i] >> 16, dt);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = raw_any_to_float(w[i], dt);
  }
}

}  // namespace expertqmm::cuda::device

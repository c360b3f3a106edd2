// The GLU activations of spec 4.3 in fp32, with the CPU backend's constants and operation order
// (explicit round-to-nearest intrinsics, no FMA contraction), shared by the GLU product kernels and
// the GEMM epilogues that apply them.
#pragma once
#include <cstdint>

#include "cuda/device/elem.cuh"
#include "expertqmm/ops.h"

namespace expertqmm::cuda::device {

constexpr float kSqrt2OverPi = 0.7978845608028654f;  // math.sqrt(2 / math.pi), as mlx nn.gelu_approx
constexpr float kGeluCubic = 0.044715f;

// geglu: gelu_tanh(g); swiglu: silu(g).
template <Activation A>
__device__ __forceinline__ float activate(float g) {
  if constexpr (A == Activation::geglu) {
    // 0.5 * g * (1 + tanh(c * (g + 0.044715 * g^3))), evaluated left to right as the CPU does.
    const float cubic = __fmul_rn(__fmul_rn(__fmul_rn(kGeluCubic, g), g), g);
    const float t = tanhf(__fmul_rn(kSqrt2OverPi, __fadd_rn(g, cubic)));
    return __fmul_rn(__fmul_rn(0.5f, g), __fadd_rn(1.0f, t));
  } else {
    return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
  }
}

// The fused GLU product of one element: act(gate) * up, one rounding by the caller.
template <Activation A>
__device__ __forceinline__ float glu(float gate, float up) {
  return __fmul_rn(activate<A>(gate), up);
}

// Eight GLU products of 16-byte vectors of T (the GEMM epilogues' stores), each rounded to T once.
template <Activation A, class T>
__device__ __forceinline__ uint4 glu8(uint4 gate, uint4 up) {
  const T* g = reinterpret_cast<const T*>(&gate);
  const T* u = reinterpret_cast<const T*>(&up);
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = Elem<T>::from_float(glu<A>(Elem<T>::to_float(g[e]), Elem<T>::to_float(u[e])));
  return out;
}

}  // namespace expertqmm::cuda::device

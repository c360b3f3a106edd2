// The batch loop both gathered matmuls of the CPU reference share (gather_qmm, gather_mm).
#pragma once
#include <vector>

#include "core/gather_qmm_problem.h"
#include "cpu/elements.h"

namespace expertqmm::cpu {

// out[b] = x[lhs[b]] (M x K) @ W[rhs[b]]^T for every slot b of problem p (a GatherQmmProblem or a
// GatherMmProblem: batch, B, x, lhs, rhs and their identity flags, M, N, K, dtype), with W[e]
// written by weight(e, w_nk) as an N x K row-major fp32 matrix; products accumulated in fp32 in
// increasing k, each output rounded once to p.dtype. Consecutive slots on the same matrix (sorted
// rows) reuse it. Returns p.batch + [M, N].
template <class Problem, class Weight>
Tensor gathered_matmul(const Problem& p, Weight&& weight) {
  Shape out_shape = p.batch;
  out_shape.push_back(p.M);
  out_shape.push_back(p.N);
  const int32_t* lhs = p.lhs_is_identity ? nullptr : p.lhs.template data_as<const int32_t>();
  const int32_t* rhs = p.rhs_is_identity ? nullptr : p.rhs.template data_as<const int32_t>();
  // A contiguous fp32 copy of x: matrix j of the flattened batch starts at j * M * K.
  const std::vector<float> x32 = to_f32(p.x);
  std::vector<float> out(static_cast<size_t>(p.B * p.M * p.N), 0.f);
  std::vector<float> w_nk;
  int64_t cached = -1;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t x_index = lhs ? lhs[b] : b;
    const int64_t matrix = rhs ? rhs[b] : b;
    if (matrix != cached) {
      weight(matrix, w_nk);
      cached = matrix;
    }
    const float* xb = x32.data() + x_index * p.M * p.K;
    float* ob = out.data() + b * p.M * p.N;
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t n = 0; n < p.N; ++n) {
        const float* xr = xb + m * p.K;
        const float* wr = w_nk.data() + n * p.K;
        float acc = 0.f;
        for (int64_t k = 0; k < p.K; ++k) acc += xr[k] * wr[k];
        ob[m * p.N + n] = acc;
      }
  }
  Tensor out32 = Tensor::from_host(out.data(), out_shape, DType::f32, Device::cpu);
  return detail::cast_floating(out32, p.dtype);
}

}  // namespace expertqmm::cpu

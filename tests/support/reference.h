// Float64 references used by the cross-backend tests (DESIGN.md "Numerics").
#pragma once
#include <vector>

#include "expertqmm/moe.h"

namespace expertqmm::test {

// Dequantized weight in float32 (scales and biases widened first), [..., N, K] (or [..., K, N]
// when transpose=false), on the host.
std::vector<float> dequantize_f32(const QuantizedWeight& q);

// out[b] = x[lhs[b]] @ W[rhs[b]]^T in float64 for flat batch indices (already broadcast, length B).
// x: [x_batch, M, K] values; result [B, M, N].
std::vector<double> reference_gather_qmm(const std::vector<float>& x, int64_t M, int64_t K,
                                         const QuantizedWeight& q, const std::vector<int32_t>& lhs,
                                         const std::vector<int32_t>& rhs, bool transpose);

// Whole expert path in float64 from the given routing: out[t] = sum_j w[t,j] * down(act(gate x, up x)).
// Activations are applied in float64 (no intermediate rounding). Projections quantized or 16-bit.
std::vector<double> reference_switch_glu_combine(const std::vector<float>& x, int64_t T, int64_t D,
                                                 const std::vector<int32_t>& indices,
                                                 const std::vector<float>& weights, int64_t k,
                                                 const SwitchGLUWeights& experts);

// The scores the CPU router ranks [T, E], recomputed from its documented formula
// (src/cpu/router.cpp) with the public CPU ops: the logits of a gemma4 router, the rounded softmax
// probabilities of a softmax_topk one. Used only to judge whether a GPU/CPU routing disagreement
// sits on a near-tie. h on the host.
std::vector<float> cpu_router_logits(const Tensor& h, const RouterWeights& r);

}  // namespace expertqmm::test

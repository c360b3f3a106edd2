// Float64 reference of the expert path for a few tokens, straight from the packed MLX weights on the
// host (one dequantized row at a time, so the 26B preset needs no multi-GB float copy). The CLI's
// own copy: the CLI does not link the test support library.
#pragma once
#include <cstdint>
#include <vector>

#include "expertqmm/moe.h"

namespace expertqmm::cli {

// For each token t in `tokens`: out[t] = sum_j w[t, j] * down_e(act(gate_e x_t) * up_e x_t) with
// e = indices[t, j]; weights dequantized as float(s) * q + float(b) (fp32, as MLX's tile kernels
// before their bf16 rounding), everything else in double. x [T, H] as floats, indices and weights
// [T, k] row-major. `experts` must live on the host. Returns [tokens.size(), H].
std::vector<double> reference_tokens(const SwitchGLUWeights& experts, const std::vector<float>& x, int64_t H,
                                     const std::vector<int64_t>& tokens, const std::vector<int32_t>& indices,
                                     const std::vector<float>& weights, int64_t k);

// The tokens the bench checks against the reference: of `candidates` (token ids in increasing
// order, logits [candidates, E] row by row as cpu::router_logits gives them), the first and the last
// whose k-th and (k+1)-th logits are not a near-tie: there the layer's router and route(), which sum
// in other orders, may pick different experts, and the reference (route()'s experts) would not be
// the layer's. Near-tie: within 1/64 of the k-th's magnitude plus 1/512 of the row's largest (the
// tests' band). With only near-ties, the first and last candidates.
std::vector<int64_t> checked_tokens(const std::vector<float>& logits, const std::vector<int64_t>& candidates,
                                    int64_t E, int k);

// ||got - ref|| / ||ref||; +inf when got has a NaN or Inf, or ref is 0 while got is not.
double rel_error(const float* got, const double* ref, int64_t n);

// Host copies of a float tensor (bf16 / f16 / f32, any device) and of an int32 tensor.
std::vector<float> host_floats(const Tensor& t);
std::vector<int32_t> host_i32(const Tensor& t);

}  // namespace expertqmm::cli

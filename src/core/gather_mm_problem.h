// The validated, backend-neutral description of one gather_mm call (MLX's unquantized gathered
// matmul): out[b] = a[lhs[b]] (M x K) @ b_mat[rhs[b]] (K x N), output S + [M, N] in promote(a, b).
#pragma once
#include <string>

#include "core/gather_qmm_problem.h"

namespace expertqmm::detail {

struct GatherMmProblem : GatherBatch {
  int64_t M = 0, N = 0, K = 0;
  bool sorted_indices = false;  // the caller's promise; backends must stay correct if it is false
  DType dtype = DType::bf16;    // promote(a, b): the output dtype (a is cast to it, exactly)
  Device device = Device::cpu;
  // b as given (its own float dtype, read widened): w_batch [K, N] matrices; matrix e starts at
  // element e * w_batch_stride and element (k, n) is k * w_stride_k + n * w_stride_n further, so
  // mlx-lm's weight.swapaxes(-1, -2) of an [E, N, K] weight needs no copy.
  Tensor w;
  int64_t w_batch_stride = 0, w_stride_k = 0, w_stride_n = 0;
  // CUDA tile route: a tile plan already built for rhs on the current stream (shared by the GEMMs of
  // an MoE layer, as GatherQmmProblem::tile_plan); nullptr: the route builds one.
  const void* tile_plan = nullptr;
  std::string describe() const;  // every field, for "no route" errors
};

// Validates every argument (throws Error naming "gather_mm" and the values) and builds the problem.
GatherMmProblem make_gather_mm_problem(const Tensor& a, const Tensor& b, const Tensor& lhs_indices,
                                       const Tensor& rhs_indices, bool sorted_indices);

}  // namespace expertqmm::detail

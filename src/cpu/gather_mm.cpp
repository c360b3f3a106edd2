// CPU reference of mx.gather_mm (MLX's unquantized gathered matmul, used by mlx-lm's SwitchLinear
// when experts are left unquantized): for each batch slot b,
//   out[b] = a[lhs[b]] (M x K) @ b_mat[rhs[b]] (K x N)
// b_mat is read in its own float dtype and widened exactly (MLX casts a and b to promote(a, b), which
// only widens); products are accumulated in fp32 in increasing k and each output is rounded once to
// p.dtype. MLX's CPU backend computes gather_mm for float32 only; its Metal kernels accumulate
// 16-bit inputs in fp32 and round once, which is what this computes for every float dtype.
#include <vector>

#include "core/gather_mm_problem.h"
#include "cpu/cpu_backend.h"
#include "cpu/elements.h"
#include "cpu/gathered_matmul.h"

namespace expertqmm::cpu {

Tensor gather_mm(const detail::GatherMmProblem& p) {
  uint8_t* base = static_cast<uint8_t*>(p.w.data());
  const size_t es = dtype_size(p.w.dtype());
  return gathered_matmul(p, [&](int64_t e, std::vector<float>& w_nk) {
    // Matrix e as an [N, K] view (b_mat transposed, whatever its strides), widened row-major.
    const Tensor view = Tensor::view(base + e * p.w_batch_stride * static_cast<int64_t>(es), {p.N, p.K},
                                     p.w.dtype(), p.w.device(), {p.w_stride_n, p.w_stride_k});
    w_nk = to_f32(view);
  });
}

}  // namespace expertqmm::cpu

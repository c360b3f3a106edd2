// CPU reference of the weighted combine (mlx-lm Experts: (expand_dims(w, -1) * y).sum(-2)):
//   out[t, d] = sum_j weights[t, j] * y[t, j, d]
// fp32 products and accumulation in slot order j = 0..k-1, one rounding to y's dtype. (MLX
// multiplies and sums in bf16 for bf16 inputs; we keep fp32, docs/numerics.md.)
#include <cstring>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "cpu/cpu_backend.h"
#include "cpu/elements.h"

namespace expertqmm::cpu {

Tensor weighted_combine(const Tensor& y, const Tensor& weights) {
  const int64_t T = y.size(0), k = y.size(1), D = y.size(2);
  const std::vector<float> yv = to_f32(y);        // (T, k, D)
  const std::vector<float> wv = to_f32(weights);  // (T, k)
  std::vector<float> out(static_cast<size_t>(T * D), 0.f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j) acc += wv[t * k + j] * yv[(t * k + j) * D + d];
      out[t * D + d] = acc;
    }
  Tensor out32 = Tensor::from_host(out.data(), {T, D}, DType::f32, Device::cpu);
  return detail::cast_floating(out32, y.dtype());
}

}  // namespace expertqmm::cpu

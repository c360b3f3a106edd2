// CPU reference of the GLU products (spec mlx-semantics.md 4.3, 3.1):
//   geglu(gate, up)  = gelu_tanh(gate) * up,  gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
//   swiglu(gate, up) = silu(gate) * up,       silu(g) = g / (1 + exp(-g))
// Both in fp32 on the widened inputs with fp32 constants, one rounding to the input dtype. MLX's
// compiled bf16 graph rounds each intermediate (and the constants) to bf16; we deliberately do
// not copy that (docs/numerics.md).
#include <cmath>
#include <cstring>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "cpu/cpu_backend.h"
#include "cpu/elements.h"

namespace expertqmm::cpu {

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;  // math.sqrt(2 / math.pi), as mlx nn.gelu_approx
constexpr float kGeluCubic = 0.044715f;

float gelu_tanh(float g) { return 0.5f * g * (1.0f + std::tanh(kSqrt2OverPi * (g + kGeluCubic * g * g * g))); }
float silu(float g) { return g / (1.0f + std::exp(-g)); }


}  // namespace

Tensor glu_product(Activation act, const Tensor& gate, const Tensor& up) {
  const std::vector<float> g = to_f32(gate);
  const std::vector<float> u = to_f32(up);
  std::vector<float> out(g.size());
  for (size_t i = 0; i < g.size(); ++i)
    out[i] = (act == Activation::geglu ? gelu_tanh(g[i]) : silu(g[i])) * u[i];
  Tensor out32 = Tensor::from_host(out.data(), gate.shape(), DType::f32, Device::cpu);
  return detail::cast_floating(out32, gate.dtype());
}

}  // namespace expertqmm::cpu

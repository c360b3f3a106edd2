#include "support/reference.h"

#include <algorithm>
#include <cmath>

#include "core/gather_qmm_problem.h"
#include "expertqmm/ops.h"
#include "support/test_util.h"

namespace expertqmm::test {

std::vector<float> dequantize_f32(const QuantizedWeight& q) {
  // fp modes: the E2M1 / E4M3 value times the decoded scale is exact in float32.
  if (q.mode != QuantMode::affine) return to_float(dequantize(to_device(q, Device::cpu), DType::f32));
  Tensor s = detail::cast_floating(q.scales.to(Device::cpu), DType::f32);
  Tensor b = detail::cast_floating(q.biases.to(Device::cpu), DType::f32);
  return to_float(dequantize(q.w.to(Device::cpu), s, b, q.group_size, q.bits));
}

std::vector<double> reference_gather_qmm(const std::vector<float>& x, int64_t M, int64_t K,
                                         const QuantizedWeight& q, const std::vector<int32_t>& lhs,
                                         const std::vector<int32_t>& rhs, bool transpose) {
  std::vector<float> w = dequantize_f32(q);
  const int64_t N = static_cast<int64_t>(w.size()) / (q.w.numel() / (q.w.size(-1) * q.w.size(-2))) / K;
  const int64_t B = static_cast<int64_t>(lhs.size());
  std::vector<double> out(B * M * N, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    const float* xb = x.data() + static_cast<int64_t>(lhs[b]) * M * K;
    const float* wb = w.data() + static_cast<int64_t>(rhs[b]) * N * K;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t kk = 0; kk < K; ++kk) {
          double wv = transpose ? wb[n * K + kk] : wb[kk * N + n];
          acc += static_cast<double>(xb[m * K + kk]) * wv;
        }
        out[(b * M + m) * N + n] = acc;
      }
  }
  return out;
}

namespace {
// One expert projection as float [E, N, K]: the quantized weight dequantized, or the 16-bit one widened.
std::vector<float> projection_f32(const QuantizedWeight& q, const Tensor& dense) {
  return q.defined() ? dequantize_f32(q) : to_float(dense);
}

double act(Activation a, double g) {
  if (a == Activation::swiglu) return g / (1.0 + std::exp(-g));
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * g * (1.0 + std::tanh(c * (g + 0.044715 * g * g * g)));
}
}  // namespace

std::vector<double> reference_switch_glu_combine(const std::vector<float>& x, int64_t T, int64_t D,
                                                 const std::vector<int32_t>& indices,
                                                 const std::vector<float>& weights, int64_t k,
                                                 const SwitchGLUWeights& ex) {
  std::vector<float> gate, up;
  int64_t I;
  if (ex.fused()) {
    std::vector<float> gu = projection_f32(ex.gate_up, ex.gate_up_dense);  // [E, 2I, D]
    const Tensor& gu_w = ex.gate_up.defined() ? ex.gate_up.w : ex.gate_up_dense;
    I = gu_w.size(-2) / 2;
    const int64_t E = gu_w.size(0);
    gate.resize(E * I * D);
    up.resize(E * I * D);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < I * D; ++r) {
        gate[e * I * D + r] = gu[e * 2 * I * D + r];
        up[e * I * D + r] = gu[e * 2 * I * D + I * D + r];
      }
  } else {
    gate = projection_f32(ex.gate, ex.gate_dense);
    up = projection_f32(ex.up, ex.up_dense);
    I = (ex.gate.defined() ? ex.gate.w : ex.gate_dense).size(-2);
  }
  std::vector<float> down = projection_f32(ex.down, ex.down_dense);  // [E, D, I]
  std::vector<double> out(T * D, 0.0), h(I);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = indices[t * k + j];
      const float* xt = x.data() + t * D;
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        const float* gr = gate.data() + (e * I + i) * D;
        const float* ur = up.data() + (e * I + i) * D;
        for (int64_t d = 0; d < D; ++d) {
          g += static_cast<double>(xt[d]) * gr[d];
          u += static_cast<double>(xt[d]) * ur[d];
        }
        h[i] = act(ex.activation, g) * u;
      }
      for (int64_t d = 0; d < D; ++d) {
        const float* dr = down.data() + (e * D + d) * I;
        double y = 0;
        for (int64_t i = 0; i < I; ++i) y += h[i] * dr[i];
        out[t * D + d] += static_cast<double>(weights[t * k + j]) * y;
      }
    }
  return out;
}

std::vector<float> cpu_router_logits(const Tensor& h, const RouterWeights& r) {
  const int64_t T = h.size(0), H = h.size(1);
  const bool gemma4 = r.kind == RouterKind::gemma4;
  const std::vector<float> x = test::to_float(h);
  std::vector<float> normed = x;
  if (gemma4) {
    const std::vector<float> scale = test::to_float(r.scale);
    const float root_size = 1.0f / std::sqrt(static_cast<float>(H));
    for (int64_t t = 0; t < T; ++t) {
      float sum_sq = 0.f;
      for (int64_t i = 0; i < H; ++i) sum_sq += x[t * H + i] * x[t * H + i];
      const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(H) + r.eps);
      for (int64_t i = 0; i < H; ++i) normed[t * H + i] = x[t * H + i] * inv_rms * (scale[i] * root_size);
    }
  }
  const Tensor rn = test::from_float(normed, {T, H}, h.dtype());
  std::vector<float> logits;
  DType logit_dtype = h.dtype();
  if (r.proj.defined()) {
    const Tensor l = gather_qmm(rn, r.proj, Tensor(), Tensor());
    logit_dtype = l.dtype();
    logits = test::to_float(l);
  } else {
    const std::vector<float> p = test::to_float(r.proj_dense);
    const int64_t E = r.proj_dense.size(0);
    logit_dtype = promote_floating(h.dtype(), r.proj_dense.dtype());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) {
        double acc = 0;
        for (int64_t i = 0; i < H; ++i) acc += double(normed[t * H + i]) * p[e * H + i];
        logits.push_back(static_cast<float>(acc));
      }
  }
  if (gemma4) return logits;
  // softmax_topk ranks the probabilities, rounded to the logits' dtype (src/cpu/router.cpp).
  const int64_t E = static_cast<int64_t>(logits.size()) / T;
  logits = test::to_float(test::from_float(logits, {T, E}, logit_dtype));
  std::vector<float> probs(logits.size());
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits.data() + t * E;
    float m = l[0], sum = 0.f;
    for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
    for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - m);
    for (int64_t e = 0; e < E; ++e) probs[t * E + e] = std::exp(l[e] - m) * (1.0f / sum);
  }
  return test::to_float(test::from_float(probs, {T, E}, logit_dtype));
}

}  // namespace expertqmm::test

#include "synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/float16.h"
#include "core/synthetic_fp.h"
#include "expertqmm/error.h"

namespace expertqmm::cli {

double SplitMix64::normal() {
  // Box-Muller; one of the pair is dropped to keep the generator stateless beyond `state_`.
  const double u1 = uniform_open(), u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

uint64_t derive_seed(uint64_t seed, uint64_t stream) {
  SplitMix64 g(seed ^ (0x632be59bd9b4e019ull * (stream + 1)));
  return g.next();
}

namespace {

Tensor bf16_host(const std::vector<uint16_t>& bits, const Shape& shape) {
  return Tensor::from_host(bits.data(), shape, DType::bf16, Device::cpu);
}

}  // namespace

QuantizedWeight synthetic_quantized(int64_t E, int64_t N, int64_t K, int bits, int group_size, uint64_t seed,
                                    QuantMode mode) {
  EXPERTQMM_CHECK(valid_quant_params(mode, bits, group_size), "synthetic_quantized", "bits ", bits,
                  " / group_size ", group_size, " is not an MLX ", quant_mode_name(mode), " pair");
  EXPERTQMM_CHECK(K % group_size == 0 && (K * bits) % 32 == 0, "synthetic_quantized", "K ", K,
                  " must be a multiple of group_size ", group_size, " and of 32/bits");
  QuantizedWeight q;
  q.bits = bits;
  q.group_size = group_size;
  q.mode = mode;
  q.w = Tensor::empty({E, N, K * bits / 32}, DType::u32);
  // Any bit pattern is a valid row of codes, so the words are just random.
  SplitMix64 words(derive_seed(seed, 0));
  uint32_t* w = q.w.data_as<uint32_t>();
  const int64_t n_words = q.w.numel();
  for (int64_t i = 0; i + 1 < n_words; i += 2) {
    uint64_t r = words.next();
    w[i] = uint32_t(r);
    w[i + 1] = uint32_t(r >> 32);
  }
  if (n_words % 2) w[n_words - 1] = uint32_t(words.next());

  const int64_t n_groups = E * N * (K / group_size);
  if (mode != QuantMode::affine) {  // uint8 scales, no biases
    q.scales = Tensor::empty({E, N, K / group_size}, DType::u8);
    detail::finish_synthetic_fp(mode, w, n_words, q.scales.data_as<uint8_t>(), n_groups, derive_seed(seed, 1));
    return q;
  }
  std::vector<uint16_t> scales(n_groups), biases(n_groups);
  SplitMix64 groups(derive_seed(seed, 1));
  const double mid = std::ldexp(1.0, bits - 1) - 0.5;  // the middle code
  for (int64_t g = 0; g < n_groups; ++g) {
    const double sign = (groups.next() & 1) ? 1.0 : -1.0;  // MLX scales may be negative (spec 1.3)
    const float s = round_to_bf16(float(sign * (0.01 + 0.002 * groups.normal())));
    scales[g] = float_to_bf16(s);
    biases[g] = float_to_bf16(float(-double(s) * mid));
  }
  q.scales = bf16_host(scales, {E, N, K / group_size});
  q.biases = bf16_host(biases, {E, N, K / group_size});
  return q;
}

SwitchGLUWeights synthetic_experts(const Preset& p, uint64_t seed) {
  SwitchGLUWeights ex;
  ex.activation = p.activation;
  const int64_t E = p.experts, H = p.hidden, I = p.intermediate;
  if (p.fused_gate_up) {
    ex.gate_up = synthetic_quantized(E, 2 * I, H, p.bits, p.group_size, derive_seed(seed, 10), p.mode);
  } else {
    ex.gate = synthetic_quantized(E, I, H, p.bits, p.group_size, derive_seed(seed, 11), p.mode);
    ex.up = synthetic_quantized(E, I, H, p.bits, p.group_size, derive_seed(seed, 12), p.mode);
  }
  ex.down = synthetic_quantized(E, H, I, p.bits, p.group_size, derive_seed(seed, 13), p.mode);
  return ex;
}

// Router weights of the preset's kind from bf16 bits: proj [E, H] quantized to 8 bits, group 64,
// as the Gemma 4 QAT checkpoints (spec mlx-semantics 4.6) and mlx-lm's qwen3_moe quant_predicate
// do; a gemma4 router also gets scale [H] and per_expert_scale [E].
static RouterWeights make_router(const Preset& p, const std::vector<uint16_t>& proj, const std::vector<uint16_t>& scale,
                                 const std::vector<uint16_t>& per_expert) {
  const int64_t E = p.experts, H = p.hidden;
  RouterWeights r;
  r.kind = p.router;
  r.proj = quantize(bf16_host(proj, {E, H}), QuantSpec{8, 64, Rounding::cpu});
  if (p.router == RouterKind::gemma4) {
    r.scale = bf16_host(scale, {H});
    r.per_expert_scale = bf16_host(per_expert, {E});
  }
  r.top_k = p.top_k;
  return r;
}

RouterWeights synthetic_router(const Preset& p, uint64_t seed) {
  const int64_t E = p.experts, H = p.hidden;
  SplitMix64 g(derive_seed(seed, 20));
  std::vector<uint16_t> proj(E * H), scale(H), per_expert(E);
  const double std_proj = 1.0 / std::sqrt(double(H));
  for (auto& v : proj) v = float_to_bf16(float(std_proj * g.normal()));
  for (auto& v : scale) v = float_to_bf16(float(1.0 + 0.05 * g.normal()));
  for (auto& v : per_expert) v = float_to_bf16(float(1.0 + 0.05 * g.normal()));
  return make_router(p, proj, scale, per_expert);
}

RouterWeights steering_router(const Preset& p, uint64_t seed) {
  const int64_t E = p.experts, H = p.hidden;
  EXPERTQMM_CHECK(H >= E, "steering_router", "needs hidden >= experts, got H ", H, " E ", E);
  SplitMix64 g(derive_seed(seed, 21));
  std::vector<uint16_t> proj(E * H), scale(H, float_to_bf16(1.0f)), per_expert(E);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < H; ++i) proj[e * H + i] = float_to_bf16(float((i == e ? 1.0 : 0.0) + 2e-4 * g.normal()));
  for (auto& v : per_expert) v = float_to_bf16(float(1.0 + 0.05 * g.normal()));
  return make_router(p, proj, scale, per_expert);
}

Tensor steering_tokens(const std::vector<int32_t>& indices, int64_t T, const Preset& p, uint64_t seed) {
  const int64_t E = p.experts, H = p.hidden, k = p.top_k;
  EXPERTQMM_CHECK(int64_t(indices.size()) == T * k, "steering_tokens", "expected ", T * k, " indices, got ",
                  indices.size());
  SplitMix64 g(derive_seed(seed, 30));
  std::vector<uint16_t> h(T * H);
  for (int64_t t = 0; t < T; ++t) {
    uint16_t* row = h.data() + t * H;
    for (int64_t i = 0; i < H; ++i) row[i] = float_to_bf16(i < E ? 0.0f : float(g.normal()));
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = indices[t * k + j];
      EXPERTQMM_CHECK(e >= 0 && e < E, "steering_tokens", "expert ", e, " out of range [0, ", E, ")");
      row[e] = float_to_bf16(float(4.0 + 0.25 * double(k - 1 - j)));
    }
  }
  return bf16_host(h, {T, H});
}

Tensor random_tokens(int64_t T, int64_t H, uint64_t seed) {
  SplitMix64 g(derive_seed(seed, 40));
  std::vector<uint16_t> x(T * H);
  for (auto& v : x) v = float_to_bf16(float(g.normal()));
  return bf16_host(x, {T, H});
}

std::vector<int32_t> zipf_routing(int64_t T, int experts, int k, double s, uint64_t seed) {
  EXPERTQMM_CHECK(k >= 1 && k <= experts, "zipf_routing", "top_k ", k, " must be in [1, ", experts, "]");
  SplitMix64 g(derive_seed(seed, 50));
  std::vector<int32_t> by_rank(experts);
  std::iota(by_rank.begin(), by_rank.end(), 0);
  for (int i = experts - 1; i > 0; --i) std::swap(by_rank[i], by_rank[g.next() % uint64_t(i + 1)]);
  std::vector<double> log_p(experts);
  for (int r = 0; r < experts; ++r) log_p[by_rank[r]] = -s * std::log(double(r + 1));
  std::vector<int32_t> out(T * k);
  std::vector<std::pair<double, int32_t>> keys(experts);
  for (int64_t t = 0; t < T; ++t) {
    // Gumbel top-k: the k largest of log p + Gumbel noise are a draw without replacement.
    for (int e = 0; e < experts; ++e) keys[e] = {log_p[e] - std::log(-std::log(g.uniform_open())), e};
    std::partial_sort(keys.begin(), keys.begin() + k, keys.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first; });
    for (int j = 0; j < k; ++j) out[t * k + j] = keys[j].second;
  }
  return out;
}

std::vector<uint16_t> random_routing_weights(int64_t T, int k, uint64_t seed) {
  SplitMix64 g(derive_seed(seed, 60));
  std::vector<uint16_t> out(T * k);
  std::vector<double> e(k);
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += (e[j] = std::exp(g.normal()));
    for (int j = 0; j < k; ++j) out[t * k + j] = float_to_bf16(float(e[j] / sum));
  }
  return out;
}

}  // namespace expertqmm::cli

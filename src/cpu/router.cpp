// CPU reference of the routers (include/expertqmm/moe.h RouterKind).
// RouterKind::gemma4 (spec gemma4-moe.md 5, mlx-semantics.md 4.2):
//   r      = h * rsqrt(mean(h^2) + eps) * (scale * H^-0.5)     fp32, rounded once to h's dtype
//   logits = r @ proj^T                                        in the matmul output dtype
//   idx    = the top_k experts by descending logit             ties -> higher expert id first
//   w      = softmax(logits[idx]) * per_expert_scale[idx]      fp32, rounded once to h's dtype
// RouterKind::softmax_topk (mlx-lm qwen3_moe.Qwen3MoeSparseMoeBlock):
//   logits = h @ proj^T                                        in the matmul output dtype L
//   p      = softmax(logits) over all E                        fp32 (exp * 1/sum, as MLX's precise
//                                                              softmax), rounded to L
//   idx    = the top_k experts by descending p                 ties -> higher expert id first
//   w      = p[idx] / L(sum_j p[idx_j]) when norm_topk_prob    fp32 sum in slot order, each step
//            else p[idx]                                       rounded to L as MLX's bf16 ops; then
//                                                              to h's dtype
// The top-k runs on the rounded p as mlx-lm's argpartition does, so experts whose probabilities
// round to one value tie even where their logits differ (the higher id wins, as in MLX).
// Which experts, as MLX picks them (mlx-lm's argpartition on MLX's CPU backend orders (logit, id)
// ascending with nth_element and NaN last; Metal's stable merge sort gives the same order; the
// last k are taken), verified against MLX in docs/numerics.md:
//  - Ties (equal logits, +0 == -0): the higher expert id wins.
//  - NaN logits rank above every number, so a NaN in h reaches the weights instead of being
//    silently routed around. Between several NaNs MLX's pick is unspecified (nth_element treats
//    them as equal); here the higher id wins, as for any tie.
// Choices where MLX leaves the result unspecified or rounds differently:
//  - Order of the k slots: best first (ties: higher id first). mx.argpartition returns the k best
//    in no promised order, so callers compare routings as sets per token.
//  - The rms weight and the softmax stay in fp32 (MLX rounds the weight to scale's dtype and
//    accumulates the bf16 softmax in bf16); the logits are rounded to the activation dtype as
//    MLX's proj does, so the top-k sees the same values MLX sees up to matmul summation order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "cpu/cpu_backend.h"
#include "cpu/elements.h"

namespace expertqmm::cpu {

namespace {

// True when expert a ranks before expert b: NaN first, then larger logit, then higher id.
bool ranks_before(float la, int32_t a, float lb, int32_t b) {
  const bool na = std::isnan(la), nb = std::isnan(lb);
  if (na != nb) return na;
  if (!na && la != lb) return la > lb;
  return a > b;
}

// r = rms_norm(h) * scale * H^-0.5, rounded to h's dtype: the router projection's input.
Tensor normalize(const Tensor& h, const RouterWeights& router) {
  const int64_t T = h.size(0), H = h.size(1);
  const std::vector<float> x = to_f32(h);
  const std::vector<float> scale = to_f32(router.scale);
  const float root_size = 1.0f / std::sqrt(static_cast<float>(H));
  std::vector<float> r(x.size());
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x.data() + t * H;
    float sum_sq = 0.f;
    for (int64_t i = 0; i < H; ++i) sum_sq += xt[i] * xt[i];
    const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(H) + router.eps);
    for (int64_t i = 0; i < H; ++i) r[t * H + i] = xt[i] * inv_rms * (scale[i] * root_size);
  }
  Tensor r32 = Tensor::from_host(r.data(), {T, H}, DType::f32, Device::cpu);
  return detail::cast_floating(r32, h.dtype());
}

// logits [T, E] from r [T, H]: the quantized proj through the gather_qmm reference (one weight
// matrix, no indices), or the dense proj with fp32 accumulation.
Tensor project(const Tensor& r, const RouterWeights& router) {
  if (router.proj.defined()) {
    const QuantizedWeight& q = router.proj;
    detail::GatherQmmProblem p = detail::make_gather_qmm_problem(
        r, q.w, q.scales, q.biases, Tensor(), Tensor(), /*transpose=*/true, q.group_size, q.bits,
        /*sorted_indices=*/false, q.mode);
    return gather_qmm(p);
  }
  const int64_t T = r.size(0), H = r.size(1), E = router.proj_dense.size(0);
  const std::vector<float> x = to_f32(r);
  const std::vector<float> w = to_f32(router.proj_dense);
  std::vector<float> logits(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      float acc = 0.f;
      for (int64_t i = 0; i < H; ++i) acc += x[t * H + i] * w[e * H + i];
      logits[t * E + e] = acc;
    }
  Tensor l32 = Tensor::from_host(logits.data(), {T, E}, DType::f32, Device::cpu);
  return detail::cast_floating(l32, promote_floating(r.dtype(), router.proj_dense.dtype()));
}

// Ranks the first k of experts (iota over E) by `score`, best first.
void top_k(const float* score, int k, std::vector<int32_t>& experts) {
  std::iota(experts.begin(), experts.end(), 0);
  std::partial_sort(experts.begin(), experts.begin() + k, experts.end(),
                    [&](int32_t a, int32_t b) { return ranks_before(score[a], a, score[b], b); });
}

// Gemma 4: softmax over the k selected logits (slot 0 holds the largest, or a NaN, which
// propagates), times per_expert_scale. p: k floats of scratch.
void gemma4_weights(const float* logits, const std::vector<int32_t>& experts, int k,
                    const std::vector<float>& per_expert, float* p, float* weights) {
  const float max_logit = logits[experts[0]];
  float sum = 0.f;
  for (int j = 0; j < k; ++j) {
    p[j] = std::exp(logits[experts[j]] - max_logit);
    sum += p[j];
  }
  for (int j = 0; j < k; ++j) weights[j] = p[j] / sum * per_expert[experts[j]];
}

// Qwen3-MoE: the softmax over all E logits, each probability rounded to the logits' dtype.
void softmax_rounded(const float* logits, int64_t E, DType dtype, float* p) {
  float max_logit = logits[0];  // a NaN logit makes every p NaN, as in MLX
  for (int64_t e = 1; e < E; ++e) max_logit = std::max(max_logit, logits[e]);
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(logits[e] - max_logit));
  const float inv_sum = 1.0f / sum;
  for (int64_t e = 0; e < E; ++e) p[e] = round_as(p[e] * inv_sum, dtype);
}

}  // namespace

Tensor router_logits(const Tensor& h, const RouterWeights& router) {
  return project(router.kind == RouterKind::gemma4 ? normalize(h, router) : h, router);
}

Routing route(const Tensor& h, const RouterWeights& router) {
  const int64_t T = h.size(0);
  const int k = router.top_k;
  const bool gemma4 = router.kind == RouterKind::gemma4;
  const Tensor logits_t = router_logits(h, router);
  const int64_t E = logits_t.size(1);
  const DType logit_dtype = logits_t.dtype();
  const std::vector<float> logits = to_f32(logits_t);
  const std::vector<float> per_expert = gemma4 ? to_f32(router.per_expert_scale) : std::vector<float>();

  std::vector<int32_t> indices(static_cast<size_t>(T * k));
  std::vector<float> weights(static_cast<size_t>(T * k));
  std::vector<int32_t> experts(static_cast<size_t>(E));
  std::vector<float> probs(static_cast<size_t>(E));  // softmax_topk's p; gemma4's k numerators
  for (int64_t t = 0; t < T; ++t) {
    const float* lt = logits.data() + t * E;
    float* wt = weights.data() + t * k;
    if (gemma4) {
      top_k(lt, k, experts);
      gemma4_weights(lt, experts, k, per_expert, probs.data(), wt);
    } else {
      softmax_rounded(lt, E, logit_dtype, probs.data());
      top_k(probs.data(), k, experts);
      float sum = 0.f;
      for (int j = 0; j < k; ++j) sum += (wt[j] = probs[experts[j]]);
      if (router.norm_topk_prob) {
        const float denom = round_as(sum, logit_dtype);
        for (int j = 0; j < k; ++j) wt[j] = round_as(wt[j] / denom, logit_dtype);
      }
    }
    for (int j = 0; j < k; ++j) indices[t * k + j] = experts[j];
  }
  Routing out;
  out.indices = Tensor::from_host(indices.data(), {T, k}, DType::i32, Device::cpu);
  Tensor w32 = Tensor::from_host(weights.data(), {T, k}, DType::f32, Device::cpu);
  out.weights = detail::cast_floating(w32, h.dtype());
  return out;
}

}  // namespace expertqmm::cpu

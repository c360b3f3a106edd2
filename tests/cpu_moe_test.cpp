// The Gemma 4 router, the weighted combine, SwitchGLU and the MoE layer on the CPU: hand-checked
// routings, an independent float64 router, separate vs fused gate/up, sorted vs unsorted paths,
// and the whole layer against the float64 reference of tests/support/reference.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "expertqmm/error.h"
#include "expertqmm/moe.h"
#include "support/reference.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

// bf16 activations through gate/up (rounded), the GLU product (rounded) and down (rounded): each
// step adds at most 2^-9 relative per element, so a few 1e-3 norm-wise (docs/numerics.md: 1e-2).
constexpr double kBf16PathBound = 1e-2;

// Concatenates two [E, R, C] tensors of one dtype along axis 1 -> [E, 2R, C].
Tensor concat_rows(const Tensor& a, const Tensor& b) {
  const int64_t E = a.size(0), R = a.size(1), C = a.size(2);
  const size_t es = dtype_size(a.dtype());
  const std::vector<uint8_t> av = a.to_host_bytes(), bv = b.to_host_bytes();
  std::vector<uint8_t> out(av.size() + bv.size());
  const size_t block = static_cast<size_t>(R * C) * es;
  for (int64_t e = 0; e < E; ++e) {
    std::memcpy(out.data() + (2 * e) * block, av.data() + e * block, block);
    std::memcpy(out.data() + (2 * e + 1) * block, bv.data() + e * block, block);
  }
  return Tensor::from_host(out.data(), {E, 2 * R, C}, a.dtype());
}

// HF gate_up_proj layout from mlx-lm's separate gate and up: gate rows first.
QuantizedWeight fuse_gate_up(const QuantizedWeight& gate, const QuantizedWeight& up) {
  QuantizedWeight f = gate;
  f.w = concat_rows(gate.w, up.w);
  f.scales = concat_rows(gate.scales, up.scales);
  f.biases = concat_rows(gate.biases, up.biases);
  return f;
}

SwitchGLUWeights random_experts(int64_t E, int64_t D, int64_t I, Activation act, int bits = 4, int gs = 32) {
  SwitchGLUWeights w;
  w.gate = test::random_quantized({E, I, D}, bits, gs);
  w.up = test::random_quantized({E, I, D}, bits, gs);
  w.down = test::random_quantized({E, D, I}, bits, gs);
  w.activation = act;
  return w;
}

SwitchGLUWeights fused_copy(const SwitchGLUWeights& w) {
  SwitchGLUWeights f;
  f.gate_up = fuse_gate_up(w.gate, w.up);
  f.down = w.down;
  f.activation = w.activation;
  return f;
}

RouterWeights dense_router(int64_t E, int64_t H, int top_k) {
  RouterWeights r;
  r.proj_dense = test::random_tensor({E, H}, DType::f32, 0.3f);
  r.scale = test::from_float(std::vector<float>(H, 1.f), {H}, DType::f32);
  std::vector<float> pes(E);
  for (int64_t e = 0; e < E; ++e) pes[e] = 0.5f + 0.1f * static_cast<float>(e);
  r.per_expert_scale = test::from_float(pes, {E}, DType::f32);
  r.top_k = top_k;
  return r;
}

Tensor rows(const Tensor& t, int64_t first, int64_t count) {
  const std::vector<uint8_t> all = t.to_host_bytes();
  Shape s = t.shape();
  const size_t row_bytes = all.size() / s[0];
  s[0] = count;
  return Tensor::from_host(all.data() + first * row_bytes, s, t.dtype());
}

}  // namespace

TEST(CpuRouter, HandCheckedRouting) {
  // H = E = 4, identity proj, unit scale: logits = h / rms(h) * 4^-0.5.
  RouterWeights r;
  std::vector<float> eye(16, 0.f);
  for (int i = 0; i < 4; ++i) eye[i * 4 + i] = 1.f;
  r.proj_dense = test::from_float(eye, {4, 4}, DType::f32);
  r.scale = test::from_float({1, 1, 1, 1}, {4}, DType::f32);
  r.per_expert_scale = test::from_float({1.f, 1.f, 2.f, 0.5f}, {4}, DType::f32);
  r.top_k = 2;
  // token 0: [1, 2, 3, 4] -> experts 3 then 2; token 1: [-1, 5, 5, 0] -> a tie, higher id first
  // (MLX's rule).
  const Tensor h = test::from_float({1, 2, 3, 4, -1, 5, 5, 0}, {2, 4}, DType::f32);
  const Routing out = route(h, r);
  ASSERT_EQ(out.indices.shape(), (Shape{2, 2}));
  ASSERT_EQ(out.indices.dtype(), DType::i32);
  ASSERT_EQ(out.weights.dtype(), DType::f32);
  EXPECT_EQ(test::to_i32(out.indices), (std::vector<int32_t>{3, 2, 2, 1}));
  const double inv_rms = 1.0 / std::sqrt(7.5 + 1e-6);
  const double gap = 0.5 * inv_rms;  // logit(3) - logit(2)
  const double p3 = 1.0 / (1.0 + std::exp(-gap));
  const std::vector<float> w = test::to_float(out.weights);
  EXPECT_NEAR(w[0], p3 * 0.5, 1e-6);
  EXPECT_NEAR(w[1], (1.0 - p3) * 2.0, 1e-6);
  EXPECT_NEAR(w[2], 0.5 * 2.0, 1e-6);
  EXPECT_NEAR(w[3], 0.5 * 1.0, 1e-6);
}

// MLX's rule (docs/numerics.md): all six logits equal, so the three highest ids win.
TEST(CpuRouter, EqualLogitsPickHighestIds) {
  RouterWeights r = dense_router(6, 8, 3);
  r.proj_dense = test::from_float(std::vector<float>(48, 0.25f), {6, 8}, DType::f32);
  const Routing out = route(test::random_tensor({3, 8}, DType::f32), r);
  EXPECT_EQ(test::to_i32(out.indices), (std::vector<int32_t>{5, 4, 3, 5, 4, 3, 5, 4, 3}));
  const std::vector<float> w = test::to_float(out.weights);
  for (int t = 0; t < 3; ++t)
    for (int j = 0; j < 3; ++j) EXPECT_NEAR(w[t * 3 + j], (0.5f + 0.1f * (5 - j)) / 3.0f, 1e-6);
}

// A NaN logit ranks above every number (MLX sorts NaN last and the top k are the last k), so the
// NaN reaches the weights; several NaNs tie, and the higher ids win.
TEST(CpuRouter, NaNLogitsRankFirst) {
  RouterWeights r = dense_router(4, 4, 2);
  const float nan = std::nanf("");
  std::vector<float> proj(16, 0.f);
  for (int i = 0; i < 4; ++i) proj[i * 4 + i] = 1.f;
  for (int i = 0; i < 4; ++i) proj[1 * 4 + i] = nan;  // expert 1 scores NaN for every token
  r.proj_dense = test::from_float(proj, {4, 4}, DType::f32);
  // token 0: logits [l0, NaN, l2, l3] with l3 largest -> 1, 3; token 1: h holds a NaN, so every
  // logit is NaN and all four tie -> 3, 2.
  const Tensor h = test::from_float({1.f, 2.f, 3.f, 4.f, 1.f, nan, 2.f, 3.f}, {2, 4}, DType::f32);
  const Routing out = route(h, r);
  EXPECT_EQ(test::to_i32(out.indices), (std::vector<int32_t>{1, 3, 3, 2}));
  for (float w : test::to_float(out.weights)) EXPECT_TRUE(std::isnan(w));
}

TEST(CpuRouter, MatchesFloat64Router) {
  const int64_t T = 11, H = 48, E = 16;
  const int k = 4;
  RouterWeights r = dense_router(E, H, k);
  r.scale = test::random_tensor({H}, DType::f32, 0.2f);
  const Tensor h = test::random_tensor({T, H}, DType::f32, 3.f);
  const Routing out = route(h, r);
  const std::vector<float> hv = test::to_float(h), pv = test::to_float(r.proj_dense), sv = test::to_float(r.scale);
  const std::vector<float> pes = test::to_float(r.per_expert_scale);
  const std::vector<int32_t> idx = test::to_i32(out.indices);
  const std::vector<float> wv = test::to_float(out.weights);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += double(hv[t * H + i]) * hv[t * H + i];
    const double inv = 1.0 / std::sqrt(ss / H + 1e-6);
    std::vector<double> logits(E, 0.0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < H; ++i) logits[e] += hv[t * H + i] * inv * sv[i] / std::sqrt(double(H)) * pv[e * H + i];
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += std::exp(logits[order[j]] - logits[order[0]]);
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ(idx[t * k + j], order[j]) << "token " << t << " slot " << j << " " << test::seed_note();
      const double p = std::exp(logits[order[j]] - logits[order[0]]) / sum * pes[order[j]];
      EXPECT_NEAR(wv[t * k + j], p, 1e-5 * (1 + p));
    }
  }
}

TEST(CpuRouter, QuantizedProjEqualsDenseProjOnTheSameWeights) {
  const int64_t T = 9, H = 128, E = 8;
  RouterWeights q = dense_router(E, H, 2);
  q.proj = test::random_quantized({E, H}, 8, 64);
  const Tensor dense = test::from_float(test::dequantize_f32(q.proj), {E, H}, DType::f32);
  RouterWeights d = q;
  d.proj = QuantizedWeight();
  d.proj_dense = dense;
  q.proj_dense = Tensor();
  const Tensor h = test::random_tensor({T, H}, DType::f32);
  const Routing a = route(h, q), b = route(h, d);
  EXPECT_EQ(test::to_i32(a.indices), test::to_i32(b.indices));
  EXPECT_LE(test::rel_error(test::to_float(a.weights), test::to_float(b.weights)), 1e-6);
  // bf16 activations: weights come back in bf16.
  const Routing c = route(test::from_float(test::to_float(h), {T, H}, DType::bf16), q);
  EXPECT_EQ(c.weights.dtype(), DType::bf16);
}

// Qwen3-MoE's router (RouterKind::softmax_topk): logits = h @ proj^T (no norm), softmax over all
// E, top-k by probability, weights renormalised over the k or left as the probabilities.
TEST(CpuRouter, SoftmaxTopkHandChecked) {
  RouterWeights r;
  r.kind = RouterKind::softmax_topk;
  std::vector<float> eye(16, 0.f);
  for (int i = 0; i < 4; ++i) eye[i * 4 + i] = 1.f;
  r.proj_dense = test::from_float(eye, {4, 4}, DType::f32);
  r.top_k = 2;
  // token 0: logits [1, 2, 3, 4] -> experts 3, 2; token 1: [-1, 5, 5, 0] -> the tie, higher id first.
  const Tensor h = test::from_float({1, 2, 3, 4, -1, 5, 5, 0}, {2, 4}, DType::f32);
  const double z0 = std::exp(1.0) + std::exp(2.0) + std::exp(3.0) + std::exp(4.0);
  const double z1 = std::exp(-1.0) + 2 * std::exp(5.0) + 1.0;
  for (bool renorm : {true, false}) {
    r.norm_topk_prob = renorm;
    const Routing out = route(h, r);
    EXPECT_EQ(test::to_i32(out.indices), (std::vector<int32_t>{3, 2, 2, 1})) << renorm;
    const std::vector<float> w = test::to_float(out.weights);
    if (renorm) {
      EXPECT_NEAR(w[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
      EXPECT_NEAR(w[1], 1.0 / (1.0 + std::exp(1.0)), 1e-6);
      EXPECT_NEAR(w[2], 0.5, 1e-6);
      EXPECT_NEAR(w[3], 0.5, 1e-6);
    } else {
      EXPECT_NEAR(w[0], std::exp(4.0) / z0, 1e-6);
      EXPECT_NEAR(w[1], std::exp(3.0) / z0, 1e-6);
      EXPECT_NEAR(w[2], std::exp(5.0) / z1, 1e-6);
      EXPECT_NEAR(w[3], std::exp(5.0) / z1, 1e-6);
    }
  }
  // Un-normalised h: scaling h scales the logits (a gemma4 router would normalise it away).
  const Routing doubled = route(test::from_float({2, 4, 6, 8, -2, 10, 10, 0}, {2, 4}, DType::f32), r);
  EXPECT_NEAR(test::to_float(doubled.weights)[0], std::exp(8.0) / (std::exp(2.0) + std::exp(4.0) + std::exp(6.0) + std::exp(8.0)), 1e-6);
  // Gemma 4's vectors given to a softmax_topk router would be ignored: refused instead.
  r.scale = test::from_float({1, 1, 1, 1}, {4}, DType::f32);
  EXPECT_THROW(route(h, r), Error);
}

// bf16: the probabilities are rounded to bf16 before the top-k and the renormalisation divides by
// their bf16 sum, as mlx-lm's bf16 ops do: every weight is a bf16 value and the k sum to ~1.
TEST(CpuRouter, SoftmaxTopkRoundsLikeMlxBf16Ops) {
  const int64_t T = 9, H = 64, E = 16;
  RouterWeights r;
  r.kind = RouterKind::softmax_topk;
  r.top_k = 4;
  r.proj_dense = test::random_tensor({E, H}, DType::bf16, 0.125f);
  const Tensor h = test::random_tensor({T, H}, DType::bf16, 1.0f);
  const Routing out = route(h, r);
  EXPECT_EQ(out.weights.dtype(), DType::bf16);
  const std::vector<float> w = test::to_float(out.weights);
  const std::vector<float> probs = test::cpu_router_logits(h, r);
  const std::vector<int32_t> idx = test::to_i32(out.indices);
  for (int64_t t = 0; t < T; ++t) {
    float sum = 0.f, psum = 0.f;
    for (int j = 0; j < 4; ++j) sum += w[t * 4 + j], psum += probs[t * E + idx[t * 4 + j]];
    EXPECT_NEAR(sum, 1.0f, 2e-2) << "token " << t;
    const float denom = test::to_float(test::from_float({psum}, {1}, DType::bf16))[0];
    for (int j = 0; j < 4; ++j) {
      const float expected = test::to_float(test::from_float({probs[t * E + idx[t * 4 + j]] / denom}, {1}, DType::bf16))[0];
      EXPECT_EQ(w[t * 4 + j], expected) << "token " << t << " slot " << j;
    }
  }
}

// The GPU tests' near-tie judge (test::cpu_router_logits) recomputes the CPU router's logits:
// its per-token top-k (best first, ties to the higher id) is the CPU route's, dense and quantized.
TEST(CpuRouter, ReferenceLogitsGiveTheRoutersTopK) {
  const int64_t T = 7, H = 128, E = 16;
  const int k = 4;
  RouterWeights dense = dense_router(E, H, k);
  RouterWeights quant = dense;
  quant.proj_dense = Tensor();
  quant.proj = test::random_quantized({E, H}, 8, 64);
  RouterWeights softmax = dense;  // Qwen3-MoE's kind: the judge ranks its probabilities
  softmax.kind = RouterKind::softmax_topk;
  softmax.scale = softmax.per_expert_scale = Tensor();
  const Tensor h = test::random_tensor({T, H}, DType::f32);
  for (const RouterWeights* r : {&dense, &quant, &softmax}) {
    const std::vector<float> logits = test::cpu_router_logits(h, *r);
    ASSERT_EQ(logits.size(), static_cast<size_t>(T * E));
    const std::vector<int32_t> got = test::to_i32(route(h, *r).indices);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        const float la = logits[t * E + a], lb = logits[t * E + b];
        return la != lb ? la > lb : a > b;
      });
      for (int j = 0; j < k; ++j) EXPECT_EQ(got[t * k + j], order[j]) << "token " << t << " slot " << j;
    }
  }
}

TEST(CpuCombine, HandWeightedSum) {
  // y [T=1, k=3, D=2], weights [1, 3]: out = 0.5*[1,2] + 2*[3,4] - 1*[5,6] = [1.5, 3].
  const Tensor y = test::from_float({1, 2, 3, 4, 5, 6}, {1, 3, 2}, DType::f32);
  const Tensor w = test::from_float({0.5f, 2.f, -1.f}, {1, 3}, DType::f32);
  const Tensor out = weighted_combine(y, w);
  ASSERT_EQ(out.shape(), (Shape{1, 2}));
  EXPECT_EQ(test::to_float(out), (std::vector<float>{1.5f, 3.f}));
  // Output takes y's dtype, also when the weights are another float type.
  const Tensor yb = test::from_float({1, 2, 3, 4, 5, 6}, {1, 3, 2}, DType::bf16);
  const Tensor ob = weighted_combine(yb, w);
  EXPECT_EQ(ob.dtype(), DType::bf16);
  EXPECT_EQ(test::to_float(ob), (std::vector<float>{1.5f, 3.f}));
}

TEST(CpuSwitchGlu, SeparateAndFusedGateUpAreIdentical) {
  const SwitchGLUWeights sep = random_experts(6, 64, 32, Activation::geglu);
  const SwitchGLUWeights fused = fused_copy(sep);
  for (int64_t T : {5, 40}) {  // T*k = 10 (unsorted) and 80 (sorted)
    const Tensor x = test::random_tensor({T, 64}, DType::bf16);
    const Tensor idx = test::random_ids({T, 2}, 6);
    const Tensor a = switch_glu(x, idx, sep), b = switch_glu(x, idx, fused);
    ASSERT_EQ(a.shape(), (Shape{T, 2, 64}));
    EXPECT_EQ(a.to_host_bytes(), b.to_host_bytes()) << "T=" << T;
  }
}

TEST(CpuSwitchGlu, SortedAndUnsortedPathsAgree) {
  // T*k = 96 >= 64 takes the sorted path; one token at a time (T*k = 3) the unsorted one. Each
  // output row depends only on its own x row and expert, so the two must agree bit for bit.
  const int64_t T = 32, k = 3, D = 64;
  const SwitchGLUWeights w = random_experts(5, D, 32, Activation::swiglu);
  const Tensor x = test::random_tensor({T, D}, DType::bf16);
  const Tensor idx = test::random_ids({T, k}, 5);
  const std::vector<uint8_t> all = switch_glu(x, idx, w).to_host_bytes();
  const size_t token_bytes = all.size() / T;
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<uint8_t> one = switch_glu(rows(x, t, 1), rows(idx, t, 1), w).to_host_bytes();
    ASSERT_EQ(one.size(), token_bytes);
    EXPECT_TRUE(std::equal(one.begin(), one.end(), all.begin() + t * token_bytes)) << "token " << t;
  }
}

TEST(CpuSwitchGlu, MatchesFloat64ReferenceBothActivationsBothPaths) {
  const int64_t D = 128, I = 64, E = 8, k = 2;
  for (Activation act : {Activation::geglu, Activation::swiglu})
    for (int64_t T : {3, 40}) {
      SCOPED_TRACE(testing::Message() << activation_name(act) << " T=" << T);
      const SwitchGLUWeights w = random_experts(E, D, I, act, 4, 64);
      const Tensor x = test::random_tensor({T, D}, DType::bf16);
      const Tensor idx = test::random_ids({T, k}, E);
      const Tensor weights = test::random_tensor({T, k}, DType::bf16);
      const Tensor out = weighted_combine(switch_glu(x, idx, w), weights);
      const std::vector<double> ref = test::reference_switch_glu_combine(
          test::to_float(x), T, D, test::to_i32(idx), test::to_float(weights), k, w);
      EXPECT_LE(test::rel_error(test::to_float(out), ref), kBf16PathBound) << test::seed_note();
      const Tensor out_fused = weighted_combine(switch_glu(x, idx, fused_copy(w)), weights);
      EXPECT_LE(test::rel_error(test::to_float(out_fused), ref), kBf16PathBound) << test::seed_note();
    }
}

TEST(CpuMoeLayer, MatchesReferenceAndComposition) {
  const int64_t H = 128, I = 64, E = 8;
  const int k = 2;
  MoeWeights mw;
  mw.router = dense_router(E, H, k);
  mw.router.proj_dense = Tensor();  // a quantized proj instead, as in the checkpoints
  mw.router.proj = test::random_quantized({E, H}, 8, 64);
  mw.experts = random_experts(E, H, I, Activation::geglu, 4, 64);
  for (int64_t T : {4, 40}) {
    SCOPED_TRACE(testing::Message() << "T=" << T);
    const Tensor h = test::random_tensor({T, H}, DType::bf16, 2.f);
    const Tensor x = test::random_tensor({T, H}, DType::bf16);
    const Tensor out = moe_layer(h, x, mw);
    ASSERT_EQ(out.shape(), (Shape{T, H}));
    ASSERT_EQ(out.dtype(), DType::bf16);
    // The layer is exactly route -> switch_glu -> weighted_combine.
    const Routing r = route(h, mw.router);
    const Tensor composed = weighted_combine(switch_glu(x, r.indices, mw.experts), r.weights);
    EXPECT_EQ(out.to_host_bytes(), composed.to_host_bytes());
    const std::vector<double> ref = test::reference_switch_glu_combine(
        test::to_float(x), T, H, test::to_i32(r.indices), test::to_float(r.weights), k, mw.experts);
    EXPECT_LE(test::rel_error(test::to_float(out), ref), kBf16PathBound) << test::seed_note();
    // moe_layer_into writes the same bytes into a caller-owned tensor.
    Tensor into = Tensor::empty({T, H}, DType::bf16);
    test::poison(into);
    Workspace ws;
    moe_layer_into(into, h, x, mw, ws);
    EXPECT_EQ(into.to_host_bytes(), out.to_host_bytes());
  }
  // The one-argument form routes and computes on the same tensor.
  const Tensor x = test::random_tensor({6, H}, DType::bf16);
  EXPECT_EQ(moe_layer(x, mw).to_host_bytes(), moe_layer(x, x, mw).to_host_bytes());
}

// switch_glu_into (a caller-owned output): switch_glu's bytes on both paths (unsorted, sorted);
// a wrong output is refused with the shape it needs.
TEST(CpuSwitchGlu, IntoWritesTheCallersOutput) {
  const SwitchGLUWeights w = random_experts(6, 64, 32, Activation::geglu);
  Workspace ws;
  for (int64_t T : {5, 40}) {  // T*k = 10 (unsorted) and 80 (sorted)
    const Tensor x = test::random_tensor({T, 64}, DType::bf16);
    const Tensor idx = test::random_ids({T, 2}, 6);
    const Tensor want = switch_glu(x, idx, w);
    Tensor out = Tensor::empty(want.shape(), want.dtype());
    test::poison(out);
    switch_glu_into(out, x, idx, w, ws);
    EXPECT_EQ(out.to_host_bytes(), want.to_host_bytes()) << "T=" << T;
  }
  const Tensor x = test::random_tensor({3, 64}, DType::bf16);
  const Tensor idx = test::random_ids({3, 2}, 6);
  Tensor wrong = Tensor::empty({3, 1, 64}, DType::bf16);
  test::expect_error([&] { switch_glu_into(wrong, x, idx, w, ws); }, "switch_glu_into",
                     "out must be bfloat16[3, 2, 64]");
}

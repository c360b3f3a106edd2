// gemma4_ffn and its ops on the CPU: against a float64 reference written here from the spec
// (mlx-semantics 4.1), the elementwise ops against float64, zero tokens, and input validation.
#include <gtest/gtest.h>

#include <cmath>

#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"
#include "support/checkpoint_files.h"
#include "support/reference.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

constexpr double kTolerance = 1e-2;  // docs/numerics.md: bf16 activations vs float64

Gemma4Config config(int64_t H, int64_t I, int64_t Ie, int64_t E, int64_t k) {
  Gemma4Config c = test::gemma4_config(H, I, Ie, E, k, 1);
  for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "router.proj"})
    c.overrides[std::string("model.layers.0.") + m] = {8, 64};
  return c;
}

std::vector<double> ref_rms_norm(const std::vector<double>& x, int64_t T, int64_t D, const Tensor& weight, double eps) {
  const std::vector<float> w = test::to_float(weight);
  std::vector<double> y(x.size());
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += x[t * D + i] * x[t * D + i];
    const double inv = 1.0 / std::sqrt(ss / double(D) + eps);
    for (int64_t i = 0; i < D; ++i) y[t * D + i] = x[t * D + i] * inv * w[i];
  }
  return y;
}

// x [T, K] @ W^T with W dequantized (fp32 scales) or dense, in float64.
std::vector<double> ref_linear(const std::vector<double>& x, int64_t T, const Linear& l) {
  const int64_t K = l.in_features(), N = l.out_features();
  const std::vector<float> w = l.is_quantized() ? test::dequantize_f32(l.quantized) : test::to_float(l.dense);
  std::vector<double> y(static_cast<size_t>(T * N));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += x[t * K + k] * double(w[n * K + k]);
      y[t * N + n] = acc;
    }
  return y;
}

std::vector<double> widen(const Tensor& t) {
  const std::vector<float> f = test::to_float(t);
  return std::vector<double>(f.begin(), f.end());
}

// The spec in float64. The routing (indices, weights) is the library's route(h), which has its own
// tests; everything after it is recomputed here.
std::vector<double> reference_ffn(const Tensor& h, const Gemma4FfnWeights& w) {
  const int64_t T = h.size(0), H = h.size(1), I = w.mlp.gate.out_features();
  const std::vector<double> hv = widen(h);
  const std::vector<double> x1 = ref_rms_norm(hv, T, H, w.pre_feedforward_layernorm, w.eps);
  const std::vector<double> g = ref_linear(x1, T, w.mlp.gate), u = ref_linear(x1, T, w.mlp.up);
  std::vector<double> a(g.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = g[i];
    a[i] = 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))) * u[i];
  }
  (void)I;
  const std::vector<double> h1 = ref_rms_norm(ref_linear(a, T, w.mlp.down), T, H, w.post_feedforward_layernorm_1, w.eps);
  const std::vector<double> x2 = ref_rms_norm(hv, T, H, w.pre_feedforward_layernorm_2, w.eps);
  const Routing r = route(h, w.moe.router);
  const std::vector<float> x2f(x2.begin(), x2.end());
  const std::vector<double> m = test::reference_switch_glu_combine(
      x2f, T, H, test::to_i32(r.indices), test::to_float(r.weights), w.moe.router.top_k, w.moe.experts);
  const std::vector<double> h2 = ref_rms_norm(m, T, H, w.post_feedforward_layernorm_2, w.eps);
  std::vector<double> s(h1.size());
  for (size_t i = 0; i < s.size(); ++i) s[i] = h1[i] + h2[i];
  const std::vector<double> f = ref_rms_norm(s, T, H, w.post_feedforward_layernorm, w.eps);
  const double scalar = test::to_float(w.layer_scalar)[0];
  std::vector<double> out(f.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = (hv[i] + f[i]) * scalar;
  return out;
}

TEST(Gemma4Ffn, MatchesTheFloat64SpecOnUnsortedAndSortedSizes) {
  const Gemma4FfnWeights w = synthetic_gemma4_layer(config(128, 192, 64, 8, 2), 0, 21);
  for (int64_t T : {1, 5, 40}) {  // T*k = 80 >= 64 takes the sorted SwitchGLU path
    const Tensor h = test::random_tensor({T, 128}, DType::bf16, 1.0f);
    const Tensor out = gemma4_ffn(h, w);
    ASSERT_EQ(out.shape(), (Shape{T, 128}));
    EXPECT_EQ(out.dtype(), DType::bf16);
    const std::vector<double> ref = reference_ffn(h, w);
    EXPECT_LE(test::rel_error(test::to_float(out), ref), kTolerance) << "T=" << T << test::seed_note();
    // The layer does change h: a pass-through would be far off.
    EXPECT_GT(test::rel_error(test::to_float(h), ref), 0.05) << "T=" << T;
  }
}

TEST(Gemma4Ffn, DenseBf16RouterAndMlpAlsoWork) {
  Gemma4Config c = config(128, 192, 64, 8, 2);
  for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "router.proj"})
    c.overrides[std::string("model.layers.0.") + m] = QuantSetting{};  // unquantized
  const Gemma4FfnWeights w = synthetic_gemma4_layer(c, 0, 22);
  ASSERT_FALSE(w.mlp.gate.is_quantized());
  ASSERT_TRUE(w.moe.router.proj_dense.defined());
  const Tensor h = test::random_tensor({7, 128}, DType::bf16, 1.0f);
  EXPECT_LE(test::rel_error(test::to_float(gemma4_ffn(h, w)), reference_ffn(h, w)), kTolerance) << test::seed_note();
}

// Group size 128 with no per-module entries: mlx-lm's quantize_model leaves every module whose
// input width is not a multiple of 128 in bf16: the experts' down_proj (64 inputs) and the dense
// mlp.down_proj (192), while gate/up (128 inputs) are 4-bit g128.
TEST(Gemma4Ffn, SixteenBitExpertsAndMlpFromGroupSize128) {
  Gemma4Config c = config(128, 192, 64, 8, 2);
  c.default_quant = {4, 128};
  c.overrides.clear();
  const Gemma4FfnWeights w = synthetic_gemma4_layer(c, 0, 24);
  ASSERT_TRUE(w.moe.experts.down_dense.defined());
  EXPECT_EQ(w.moe.experts.down_dense.shape(), (Shape{8, 128, 64}));
  ASSERT_EQ(w.moe.experts.gate.group_size, 128);
  ASSERT_FALSE(w.mlp.down.is_quantized());
  ASSERT_TRUE(w.mlp.gate.is_quantized());
  for (int64_t T : {3, 40}) {
    const Tensor h = test::random_tensor({T, 128}, DType::bf16, 1.0f);
    EXPECT_LE(test::rel_error(test::to_float(gemma4_ffn(h, w)), reference_ffn(h, w)), kTolerance)
        << "T=" << T << test::seed_note();
  }
}

TEST(Gemma4Ffn, IntoWritesTheSameAsTheAllocatingCallAndZeroTokensIsANoOp) {
  const Gemma4FfnWeights w = synthetic_gemma4_layer(config(128, 192, 64, 8, 2), 0, 23);
  const Tensor h = test::random_tensor({4, 128}, DType::bf16, 1.0f);
  Tensor out = Tensor::empty({4, 128}, DType::bf16);
  test::poison(out);
  Workspace ws;
  gemma4_ffn_into(out, h, w, ws);
  EXPECT_EQ(out.to_host_bytes(), gemma4_ffn(h, w).to_host_bytes());
  const Tensor empty = gemma4_ffn(Tensor::empty({0, 128}, DType::bf16), w);
  EXPECT_EQ(empty.shape(), (Shape{0, 128}));
}

TEST(Gemma4Ffn, ElementwiseOpsFollowTheirDefinitions) {
  const Tensor x = test::random_tensor({6, 96}, DType::f32, 3.0f);
  const Tensor wt = test::random_tensor({96}, DType::bf16, 1.0f);
  const std::vector<double> ref = ref_rms_norm(widen(x), 6, 96, wt, 1e-5);
  EXPECT_LE(test::rel_error(test::to_float(rms_norm(x, wt, 1e-5f)), ref), 1e-6);
  const Tensor a = test::random_tensor({3, 5}, DType::bf16), b = test::random_tensor({3, 5}, DType::bf16);
  const Tensor s = test::from_float({0.5f}, {1}, DType::bf16);
  const std::vector<float> av = test::to_float(a), bv = test::to_float(b);
  const std::vector<float> sum = test::to_float(add(a, b)), scaled = test::to_float(add_scaled(a, b, s));
  for (size_t i = 0; i < av.size(); ++i) {
    EXPECT_NEAR(sum[i], av[i] + bv[i], std::fabs(av[i] + bv[i]) * 4e-3 + 1e-6) << i;
    EXPECT_NEAR(scaled[i], 0.5 * sum[i], std::fabs(sum[i]) * 4e-3 + 1e-6) << i;
  }
}

using test::expect_error;

TEST(Gemma4FfnBadInput, EveryEntryNamesTheOpAndTheValue) {
  const Tensor x = test::random_tensor({2, 64}, DType::bf16);
  expect_error([&] { rms_norm(x, test::random_tensor({63}, DType::bf16), 1e-6f); }, "rms_norm", "[D=64]");
  expect_error([&] { rms_norm(x, test::random_tensor({64}, DType::bf16), -1.f); }, "rms_norm", "eps");
  expect_error([&] { rms_norm(Tensor(), test::random_tensor({64}, DType::bf16), 1e-6f); }, "rms_norm", "undefined");
  expect_error([&] { add(x, test::random_tensor({2, 63}, DType::bf16)); }, "add", "same shape");
  expect_error([&] { add(x, test::random_tensor({2, 64}, DType::f32)); }, "add", "float32");
  expect_error([&] { add_scaled(x, x, test::random_tensor({2}, DType::bf16)); }, "add_scaled", "one value");
  Linear l;
  expect_error([&] { linear(x, l); }, "linear", "exactly one");
  l.quantized = test::random_quantized({32, 128}, 4, 64);
  expect_error([&] { linear(x, l); }, "linear", "K=128");

  const Gemma4FfnWeights good = synthetic_gemma4_layer(config(128, 192, 64, 8, 2), 0, 24);
  const Tensor h = test::random_tensor({3, 128}, DType::bf16);
  Gemma4FfnWeights w = good;
  w.post_feedforward_layernorm_2 = Tensor();
  expect_error([&] { gemma4_ffn(h, w); }, "gemma4_ffn", "post_feedforward_layernorm_2");
  w = good;
  w.layer_scalar = test::random_tensor({2}, DType::bf16);
  expect_error([&] { gemma4_ffn(h, w); }, "gemma4_ffn", "layer_scalar");
  w = good;
  std::swap(w.mlp.gate, w.mlp.down);
  expect_error([&] { gemma4_ffn(h, w); }, "gemma4_ffn", "mlp.");
  expect_error([&] { gemma4_ffn(test::random_tensor({3, 64}, DType::bf16), good); }, "gemma4_ffn", "[64]");
  Tensor out = Tensor::empty({3, 64}, DType::bf16);
  Workspace ws;
  expect_error([&] { gemma4_ffn_into(out, h, good, ws); }, "gemma4_ffn", "out must be");
}

}  // namespace
}  // namespace expertqmm

// 16-bit (unquantized) experts on the CPU: gather_mm (MLX's unquantized gathered matmul) against a
// float64 reference and its MLX shape rules; SwitchGLU / moe_layer with any mix of quantized and
// 16-bit projections; and the op front's Error when 16-bit experts would reach the CUDA backend.
#include <gtest/gtest.h>

#include <vector>

#include "core/gather_qmm_problem.h"
#include "expertqmm/error.h"
#include "expertqmm/gemma4.h"
#include "expertqmm/moe.h"
#include "support/reference.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

// docs/numerics.md: vs float64, by the output dtype (fp32 accumulation, one rounding).
double tolerance(DType t) { return t == DType::bf16 ? 1e-2 : t == DType::f16 ? 5e-3 : 1e-5; }

// out[b] = a[lhs[b]] @ w[rhs[b]]^T in float64, w given [E, N, K] (what mlx-lm's SwitchLinear holds).
std::vector<double> reference_gather_mm(const Tensor& a, const Tensor& w_enk, const std::vector<int32_t>& lhs,
                                        const std::vector<int32_t>& rhs) {
  const std::vector<float> x = test::to_float(a), w = test::to_float(w_enk);
  const int64_t M = a.size(-2), K = a.size(-1), N = w_enk.size(-2);
  std::vector<double> out;
  for (size_t b = 0; b < rhs.size(); ++b)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc += double(x[(lhs[b] * M + m) * K + k]) * w[(rhs[b] * N + n) * K + k];
        out.push_back(acc);
      }
  return out;
}

TEST(GatherMm, MatchesFloat64OnATransposedWeightInEveryDtype) {
  const int64_t E = 5, N = 24, K = 80, T = 7, k = 3;
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    const Tensor w = test::random_tensor({E, N, K}, dt, 0.05f);  // [E, N, K] as mlx-lm stores it
    const Tensor x = test::random_tensor({T, 1, 1, K}, dt);
    const Tensor ids = test::random_ids({T, k}, E);
    const Tensor out = gather_mm(x, w.swapaxes(-1, -2), Tensor(), ids);
    ASSERT_EQ(out.shape(), (Shape{T, k, 1, N}));
    ASSERT_EQ(out.dtype(), dt);
    std::vector<int32_t> lhs;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) lhs.push_back(static_cast<int32_t>(t));
    EXPECT_LE(test::rel_error(test::to_float(out), reference_gather_mm(x, w, lhs, test::to_i32(ids))), tolerance(dt))
        << dtype_name(dt) << test::seed_note();
    // The same weight stored [E, K, N] contiguously gives the same bits (strides are only layout).
    EXPECT_EQ(out.to_host_bytes(), gather_mm(x, w.swapaxes(-1, -2).contiguous(), Tensor(), ids).to_host_bytes());
  }
}

TEST(GatherMm, IndexBroadcastNoIndicesAndPromotion) {
  // lhs [4, 1] with rhs [1, 5]: S = [4, 5], out[i, j] = a[lhs[i]] @ b[rhs[j]].
  const Tensor a = test::random_tensor({3, 2, 32}, DType::f32), w = test::random_tensor({5, 6, 32}, DType::f32);
  const Tensor lhs = test::ids_tensor({2, 0, 1, 1}, {4, 1}), rhs = test::ids_tensor({4, 3, 2, 1, 0}, {1, 5});
  const Tensor out = gather_mm(a, w.swapaxes(-1, -2), lhs, rhs);
  ASSERT_EQ(out.shape(), (Shape{4, 5, 2, 6}));
  std::vector<int32_t> bl, br;
  for (int32_t i : {2, 0, 1, 1})
    for (int32_t j : {4, 3, 2, 1, 0}) bl.push_back(i), br.push_back(j);
  EXPECT_LE(test::rel_error(test::to_float(out), reference_gather_mm(a, w, bl, br)), 1e-5);
  // No indices: MLX's matmul with broadcast batch dims, a [1, M, K] against b [E, K, N].
  const Tensor one = test::random_tensor({1, 2, 32}, DType::f32);
  const Tensor all = gather_mm(one, w.swapaxes(-1, -2), Tensor(), Tensor());
  ASSERT_EQ(all.shape(), (Shape{5, 2, 6}));
  EXPECT_LE(test::rel_error(test::to_float(all), reference_gather_mm(one, w, {0, 0, 0, 0, 0}, {0, 1, 2, 3, 4})), 1e-5);
  // promote(a, b): bf16 with f32 gives f32, f16 with bf16 gives f32.
  const Tensor ids = test::ids_tensor({1, 0}, {2});
  EXPECT_EQ(gather_mm(test::random_tensor({2, 1, 32}, DType::bf16), w.swapaxes(-1, -2), Tensor(), ids).dtype(),
            DType::f32);
  const Tensor wb = test::random_tensor({5, 6, 32}, DType::bf16);
  EXPECT_EQ(gather_mm(test::random_tensor({2, 1, 32}, DType::f16), wb.swapaxes(-1, -2), Tensor(), ids).dtype(),
            DType::f32);
  // Empty cases: no rows, and K = 0 (sums over nothing are zeros).
  EXPECT_EQ(gather_mm(test::random_tensor({0, 1, 32}, DType::bf16), wb.swapaxes(-1, -2), Tensor(),
                      test::ids_tensor({}, {0}))
                .shape(),
            (Shape{0, 1, 6}));
  const Tensor zero_k = gather_mm(Tensor::empty({2, 1, 0}, DType::f32), Tensor::empty({5, 0, 6}, DType::f32),
                                  Tensor(), ids);
  EXPECT_EQ(test::to_float(zero_k), std::vector<float>(12, 0.f));
}

template <class F>
void expect_error(F&& f, const std::string& op, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error from " << op << "; expected one mentioning " << parts[0];
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), op) << e.what();
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << p << " not in " << e.what();
  }
}

TEST(GatherMm, BadInputNamesTheOpAndTheValues) {
  const Tensor a = test::random_tensor({3, 1, 32}, DType::bf16), w = test::random_tensor({4, 32, 8}, DType::bf16);
  const Tensor ids = test::ids_tensor({0, 3, 1}, {3});
  expect_error([&] { gather_mm(test::random_tensor({3, 1, 16}, DType::bf16), w, Tensor(), ids); }, "gather_mm",
               {"K=16", "K=32"});
  expect_error([&] { gather_mm(a, test::ids_tensor({1, 2}, {1, 2}), Tensor(), ids); }, "gather_mm", {"int32"});
  expect_error([&] { gather_mm(a, w, Tensor(), test::ids_tensor({0, 4, 1}, {3})); }, "gather_mm",
               {"rhs index 4", "[0, 4)"});
  expect_error([&] { gather_mm(a, w, Tensor(), test::random_tensor({3}, DType::f32)); }, "gather_mm",
               {"int32 or uint32"});
  expect_error([&] { gather_mm(test::random_tensor({32}, DType::bf16), w, Tensor(), ids); }, "gather_mm",
               {"at least 2 dims"});
  expect_error([&] { gather_mm(a, w, test::ids_tensor({0, 1}, {2}), ids); }, "gather_mm", {"cannot be broadcast"});
}

// Experts [E, I, D] / [E, D, I]: each projection quantized (4-bit g32) or bf16, as `which` says.
SwitchGLUWeights experts(int64_t E, int64_t D, int64_t I, bool gate_q, bool up_q, bool down_q, Activation act) {
  SwitchGLUWeights w;
  w.activation = act;
  if (gate_q) w.gate = test::random_quantized({E, I, D}, 4, 32);
  else w.gate_dense = test::random_tensor({E, I, D}, DType::bf16, 0.05f);
  if (up_q) w.up = test::random_quantized({E, I, D}, 4, 32);
  else w.up_dense = test::random_tensor({E, I, D}, DType::bf16, 0.05f);
  if (down_q) w.down = test::random_quantized({E, D, I}, 4, 32);
  else w.down_dense = test::random_tensor({E, D, I}, DType::bf16, 0.05f);
  return w;
}

TEST(SwitchGlu16Bit, EveryMixOfQuantizedAnd16BitProjectionsMatchesFloat64) {
  const int64_t E = 6, D = 64, I = 96, k = 2;
  struct Mix { bool gate, up, down; };
  for (const Mix m : {Mix{false, false, false}, Mix{true, true, false}, Mix{false, false, true}, Mix{true, false, true}}) {
    const SwitchGLUWeights w = experts(E, D, I, m.gate, m.up, m.down, Activation::geglu);
    for (int64_t T : {5, 40}) {  // T*k = 10: the unsorted path; 80: sorted
      const Tensor x = test::random_tensor({T, D}, DType::bf16);
      const Tensor idx = test::random_ids({T, k}, E);
      const Tensor comb = test::random_tensor({T, k}, DType::bf16, 0.5f);
      const Tensor y = switch_glu(x, idx, w);
      ASSERT_EQ(y.shape(), (Shape{T, k, D}));
      EXPECT_EQ(y.dtype(), DType::bf16);
      const std::vector<double> ref = test::reference_switch_glu_combine(
          test::to_float(x), T, D, test::to_i32(idx), test::to_float(comb), k, w);
      EXPECT_LE(test::rel_error(test::to_float(weighted_combine(y, comb)), ref), 1e-2)
          << "gate_q " << m.gate << " up_q " << m.up << " down_q " << m.down << " T " << T << test::seed_note();
    }
  }
}

// The 16-bit path is MLX's SwitchLinear with gather_mm: given the fp32 values the quantized path
// dequantizes to, it computes the same result (same accumulation order; only an fp32 contraction
// of s * q + b may differ by an ulp), fused gate_up included.
TEST(SwitchGlu16Bit, DequantizedWeightsAs16BitExpertsGiveTheSameResult) {
  const int64_t E = 4, D = 64, I = 32, T = 40, k = 2;
  auto f32_scales = [](QuantizedWeight q) {
    q.scales = detail::cast_floating(q.scales, DType::f32);
    q.biases = detail::cast_floating(q.biases, DType::f32);
    return q;
  };
  SwitchGLUWeights q;
  q.activation = Activation::swiglu;
  q.gate_up = f32_scales(test::random_quantized({E, 2 * I, D}, 4, 32));
  q.down = f32_scales(test::random_quantized({E, D, I}, 8, 32));
  SwitchGLUWeights d;
  d.activation = Activation::swiglu;
  d.gate_up_dense = dequantize(q.gate_up);
  d.down_dense = dequantize(q.down);
  ASSERT_EQ(d.gate_up_dense.dtype(), DType::f32);
  const Tensor x = test::random_tensor({T, D}, DType::f32);
  const Tensor idx = test::random_ids({T, k}, E);
  EXPECT_LE(test::rel_error(test::to_float(switch_glu(x, idx, d)), test::to_float(switch_glu(x, idx, q))), 1e-6);
}

TEST(SwitchGlu16Bit, WeightChecksNameTheProjection) {
  const int64_t E = 4, D = 64, I = 32;
  const Tensor x = test::random_tensor({3, D}, DType::bf16);
  const Tensor idx = test::ids_tensor({0, 1, 2, 3, 1, 0}, {3, 2});
  SwitchGLUWeights w = experts(E, D, I, true, true, false, Activation::geglu);
  w.down = test::random_quantized({E, D, I}, 4, 32);
  expect_error([&] { switch_glu(x, idx, w); }, "switch_glu", {"down", "not both"});
  w = experts(E, D, I, true, true, false, Activation::geglu);
  w.down_dense = test::random_tensor({E, D, 2 * I}, DType::bf16);
  expect_error([&] { switch_glu(x, idx, w); }, "switch_glu", {"down rows hold K=64", "I=32"});
  w = experts(E, D, I, true, false, true, Activation::geglu);
  w.up_dense = test::random_tensor({E, I, D}, DType::f32);  // up would produce f32, gate bf16
  expect_error([&] { switch_glu(x, idx, w); }, "switch_glu", {"gate produces bfloat16", "up produces float32"});
  w = experts(E, D, I, false, false, false, Activation::geglu);
  w.gate_dense = test::random_tensor({E, I}, DType::bf16);
  expect_error([&] { switch_glu(x, idx, w); }, "switch_glu", {"gate (16-bit) must be [E, N, K]"});
}

}  // namespace
}  // namespace expertqmm

// DESIGN.md "Bad input" on the CPU: every public op rejects malformed arguments with an
// expertqmm::Error that names the op and the offending values; zero tokens is a valid no-op;
// NaN / Inf in the activations propagate to the affected rows only, without a crash.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "expertqmm/error.h"
#include "expertqmm/moe.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

// Runs `f`, which must throw expertqmm::Error for `op` whose message contains `needle`.
template <class F>
void expect_op_error(const std::string& op, const std::string& needle, F&& f) {
  try {
    f();
    ADD_FAILURE() << "expected expertqmm::Error from " << op << " mentioning '" << needle << "'";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.op(), op) << what;
    EXPECT_NE(what.find("expertqmm::" + op + ":"), std::string::npos) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << "'" << needle << "' not in: " << what;
  }
}
#define EXPECT_OP_ERROR(op, needle, ...) expect_op_error(op, needle, [&] { __VA_ARGS__; })

Tensor u32_zeros(const Shape& s) {
  std::vector<uint32_t> v(shape_numel(s), 0u);
  return Tensor::from_host(v.data(), s, DType::u32);
}

bool row_all_finite(const std::vector<float>& v, int64_t row, int64_t width) {
  for (int64_t i = 0; i < width; ++i)
    if (!std::isfinite(v[row * width + i])) return false;
  return true;
}
bool row_all_nan(const std::vector<float>& v, int64_t row, int64_t width) {
  for (int64_t i = 0; i < width; ++i)
    if (!std::isnan(v[row * width + i])) return false;
  return true;
}

class BadInput : public ::testing::Test {
 protected:
  static constexpr int64_t E = 4, N = 16, K = 64, D = 64, I = 32;
  void SetUp() override {
    q = test::random_quantized({E, N, K}, 4, 64);
    x = test::random_tensor({3, 1, K}, DType::bf16);
    rhs = test::ids_tensor({0, 3, 1}, {3});
    experts.gate = test::random_quantized({E, I, D}, 4, 32);
    experts.up = test::random_quantized({E, I, D}, 4, 32);
    experts.down = test::random_quantized({E, D, I}, 4, 32);
    router.proj_dense = test::random_tensor({E, D}, DType::bf16);
    router.scale = test::random_tensor({D}, DType::bf16);
    router.per_expert_scale = test::random_tensor({E}, DType::bf16);
    router.top_k = 2;
    moe.router = router;
    moe.experts = experts;
  }
  QuantizedWeight q;
  Tensor x, rhs;
  SwitchGLUWeights experts;
  RouterWeights router;
  MoeWeights moe;
};

}  // namespace

TEST_F(BadInput, GatherQmmShapesAndRanks) {
  EXPECT_OP_ERROR("gather_qmm", "at least 2 dims", gather_qmm(test::random_tensor({K}, DType::bf16), q, Tensor(), rhs));
  EXPECT_OP_ERROR("gather_qmm", "w must have at least 2 dims",
                  gather_qmm(x, u32_zeros({8}), test::random_tensor({1}, DType::bf16),
                             test::random_tensor({1}, DType::bf16), Tensor(), Tensor(), true, 64, 4));
  EXPECT_OP_ERROR("gather_qmm", "K=128", gather_qmm(test::random_tensor({3, 1, 128}, DType::bf16), q, Tensor(), rhs));
  EXPECT_OP_ERROR("gather_qmm", "cannot be broadcast",
                  gather_qmm(x, q, test::ids_tensor({0, 1, 2}, {3}), test::ids_tensor({0, 1}, {2})));
}

TEST_F(BadInput, GatherQmmKNotAMultipleOfTheGroup) {
  // 96 values per row (12 words at 4 bits) cannot be covered by groups of 64.
  const Tensor w = u32_zeros({E, N, 12});
  const Tensor s = test::random_tensor({E, N, 2}, DType::bf16);
  EXPECT_OP_ERROR("gather_qmm", "96", gather_qmm(test::random_tensor({3, 1, 96}, DType::bf16), w, s, s, Tensor(), rhs,
                                                  true, 64, 4));
}

TEST_F(BadInput, GatherQmmUnsupportedBitsAndGroups) {
  for (int bits : {0, 1, 7, 16})
    EXPECT_OP_ERROR("gather_qmm", "bits=" + std::to_string(bits),
                    gather_qmm(x, q.w, q.scales, q.biases, Tensor(), rhs, true, 64, bits));
  for (int gs : {0, 16, 96, 256})
    EXPECT_OP_ERROR("gather_qmm", "group_size=" + std::to_string(gs),
                    gather_qmm(x, q.w, q.scales, q.biases, Tensor(), rhs, true, gs, 4));
}

TEST_F(BadInput, GatherQmmScalesAndBiasesDisagreeWithW) {
  const Tensor fewer_experts = test::random_tensor({E - 1, N, 1}, DType::bf16);
  EXPECT_OP_ERROR("gather_qmm", "do not match w", gather_qmm(x, q.w, fewer_experts, fewer_experts, Tensor(), rhs, true, 64, 4));
  const Tensor fewer_rows = test::random_tensor({E, N / 2, 1}, DType::bf16);
  EXPECT_OP_ERROR("gather_qmm", "do not match w", gather_qmm(x, q.w, fewer_rows, fewer_rows, Tensor(), rhs, true, 64, 4));
  const Tensor two_groups = test::random_tensor({E, N, 2}, DType::bf16);
  EXPECT_OP_ERROR("gather_qmm", "cover 128", gather_qmm(x, q.w, two_groups, two_groups, Tensor(), rhs, true, 64, 4));
  EXPECT_OP_ERROR("gather_qmm", "same shape", gather_qmm(x, q.w, q.scales, two_groups, Tensor(), rhs, true, 64, 4));
  EXPECT_OP_ERROR("gather_qmm", "biases are required", gather_qmm(x, q.w, q.scales, Tensor(), Tensor(), rhs, true, 64, 4));
  const Tensor f32_biases = test::from_float(test::to_float(q.biases), q.biases.shape(), DType::f32);
  EXPECT_OP_ERROR("gather_qmm", "differs from scales dtype", gather_qmm(x, q.w, q.scales, f32_biases, Tensor(), rhs, true, 64, 4));
}

TEST_F(BadInput, GatherQmmWrongDtypes) {
  const Tensor w_i32 = Tensor::from_host(q.w.data(), q.w.shape(), DType::i32);
  EXPECT_OP_ERROR("gather_qmm", "w must be uint32", gather_qmm(x, w_i32, q.scales, q.biases, Tensor(), rhs, true, 64, 4));
  const Tensor s_u32 = u32_zeros(q.scales.shape());
  EXPECT_OP_ERROR("gather_qmm", "scales must be a float type", gather_qmm(x, q.w, s_u32, s_u32, Tensor(), rhs, true, 64, 4));
  const Tensor x_i32 = test::ids_tensor(std::vector<int32_t>(3 * K, 1), {3, 1, K});
  EXPECT_OP_ERROR("gather_qmm", "x must be a float type", gather_qmm(x_i32, q, Tensor(), rhs));
  const Tensor float_ids = test::from_float({0, 1, 2}, {3}, DType::f32);
  EXPECT_OP_ERROR("gather_qmm", "int32 or uint32", gather_qmm(x, q, Tensor(), float_ids));
  EXPECT_OP_ERROR("gather_qmm", "int32 or uint32", gather_qmm(x, q, float_ids, Tensor()));
}

TEST_F(BadInput, GatherQmmExpertIndexOutOfRange) {
  EXPECT_OP_ERROR("gather_qmm", "rhs index 4 is out of range [0, 4)", gather_qmm(x, q, Tensor(), test::ids_tensor({0, 4, 1}, {3})));
  EXPECT_OP_ERROR("gather_qmm", "rhs index -1", gather_qmm(x, q, Tensor(), test::ids_tensor({0, -1, 1}, {3})));
  std::vector<uint32_t> huge = {0u, 0xFFFFFFFFu, 1u};
  EXPECT_OP_ERROR("gather_qmm", "rhs index 4294967295",
                  gather_qmm(x, q, Tensor(), Tensor::from_host(huge.data(), {3}, DType::u32)));
  EXPECT_OP_ERROR("gather_qmm", "lhs index 3 is out of range [0, 3)",
                  gather_qmm(x, q, test::ids_tensor({0, 3, 1}, {3}), rhs));
}

TEST_F(BadInput, GatherQmmMixedDevices) {
  // A cuda-tagged view is rejected before anything reads it.
  const Tensor x_cuda = Tensor::view(x.data(), x.shape(), x.dtype(), Device::cuda);
  EXPECT_OP_ERROR("gather_qmm", "x is on cuda but w is on cpu", gather_qmm(x_cuda, q, Tensor(), rhs));
}

TEST_F(BadInput, SortAndUnsort) {
  const Tensor xt = test::random_tensor({3, D}, DType::bf16);
  const Tensor idx = test::ids_tensor({0, 1, 2, 3, 0, 1}, {3, 2});
  EXPECT_OP_ERROR("gather_sort", "x must be", gather_sort(test::ids_tensor({1, 2, 3}, {3, 1}), idx));
  EXPECT_OP_ERROR("gather_sort", "int32 or uint32", gather_sort(xt, test::from_float({0, 1, 2, 3, 0, 1}, {3, 2}, DType::f32)));
  EXPECT_OP_ERROR("gather_sort", "token rows", gather_sort(test::random_tensor({4, D}, DType::bf16), idx));
  std::vector<uint32_t> huge = {0u, 0x80000000u, 1u, 2u, 3u, 0u};
  EXPECT_OP_ERROR("gather_sort", "2147483648", gather_sort(xt, Tensor::from_host(huge.data(), {3, 2}, DType::u32)));
  const Tensor rows = test::random_tensor({6, 1, D}, DType::bf16);
  EXPECT_OP_ERROR("scatter_unsort", "inv_order value 6", scatter_unsort(rows, test::ids_tensor({0, 1, 2, 3, 4, 6}, {6}), {3, 2}));
  EXPECT_OP_ERROR("scatter_unsort", "1-D", scatter_unsort(rows, idx, {3, 2}));
  EXPECT_OP_ERROR("scatter_unsort", "holds 4 rows", scatter_unsort(rows, test::ids_tensor({0, 1, 2, 3, 4, 5}, {6}), {2, 2}));
}

TEST_F(BadInput, GluProducts) {
  const Tensor a = test::random_tensor({2, 8}, DType::bf16);
  EXPECT_OP_ERROR("geglu", "same shape", geglu(a, test::random_tensor({2, 4}, DType::bf16)));
  EXPECT_OP_ERROR("swiglu", "up is float32", swiglu(a, test::random_tensor({2, 8}, DType::f32)));
  EXPECT_OP_ERROR("geglu", "gate must be", geglu(test::ids_tensor(std::vector<int32_t>(16, 0), {2, 8}), a));
  EXPECT_OP_ERROR("swiglu", "up is undefined", swiglu(a, Tensor()));
  EXPECT_OP_ERROR("activation_name", "unknown activation value 7", activation_name(static_cast<Activation>(7)));
}

TEST_F(BadInput, Router) {
  const Tensor h = test::random_tensor({5, D}, DType::bf16);
  RouterWeights r = router;
  r.top_k = E + 1;
  EXPECT_OP_ERROR("route", "top_k=5", route(h, r));
  r.top_k = 0;
  EXPECT_OP_ERROR("route", "top_k=0", route(h, r));
  EXPECT_OP_ERROR("route", "h must be [T, H]", route(test::random_tensor({1, 5, D}, DType::bf16), router));
  r = router;
  r.scale = test::random_tensor({D + 1}, DType::bf16);
  EXPECT_OP_ERROR("route", "router scale must be [H=64]", route(h, r));
  r = router;
  r.per_expert_scale = test::random_tensor({E - 1}, DType::bf16);
  EXPECT_OP_ERROR("route", "per_expert_scale must be [E=4]", route(h, r));
  r = router;
  r.proj = test::random_quantized({E, D}, 8, 64);
  EXPECT_OP_ERROR("route", "exactly one", route(h, r));
  r.proj_dense = Tensor();
  r.proj = QuantizedWeight();
  EXPECT_OP_ERROR("route", "exactly one", route(h, r));
  r.proj = test::random_quantized({E, 2 * D}, 8, 64);
  EXPECT_OP_ERROR("route", "K=128", route(h, r));
  r.proj = test::random_quantized({E, D}, 8, 64);
  r.proj.bits = 7;
  EXPECT_OP_ERROR("route", "bits=7", route(h, r));
  r = router;
  r.eps = NAN;
  EXPECT_OP_ERROR("route", "eps", route(h, r));
}

TEST_F(BadInput, WeightedCombine) {
  const Tensor y = test::random_tensor({3, 2, D}, DType::bf16);
  EXPECT_OP_ERROR("weighted_combine", "y must be [T, k, D]", weighted_combine(test::random_tensor({3, D}, DType::bf16), test::random_tensor({3, 2}, DType::bf16)));
  EXPECT_OP_ERROR("weighted_combine", "weights must be [T, k] = [3, 2]", weighted_combine(y, test::random_tensor({3, 3}, DType::bf16)));
  EXPECT_OP_ERROR("weighted_combine", "weights must be", weighted_combine(y, test::ids_tensor({0, 0, 0, 0, 0, 0}, {3, 2})));
}

TEST_F(BadInput, SwitchGluWeightsAndIndices) {
  const Tensor xt = test::random_tensor({3, D}, DType::bf16);
  const Tensor idx = test::ids_tensor({0, 1, 2, 3, 1, 0}, {3, 2});
  SwitchGLUWeights w = experts;
  w.gate_up = test::random_quantized({E, 2 * I + 1, D}, 4, 32);
  EXPECT_OP_ERROR("switch_glu", "even number of rows", switch_glu(xt, idx, w));
  w = experts;
  w.up = test::random_quantized({E + 1, I, D}, 4, 32);
  EXPECT_OP_ERROR("switch_glu", "disagree on E or I", switch_glu(xt, idx, w));
  w = experts;
  w.down = test::random_quantized({E, D + 32, I}, 4, 32);
  EXPECT_OP_ERROR("switch_glu", "produces N=96", switch_glu(xt, idx, w));
  w = experts;
  w.down = test::random_quantized({E, D, 2 * I}, 4, 32);
  EXPECT_OP_ERROR("switch_glu", "down rows hold K=64", switch_glu(xt, idx, w));
  w = experts;
  w.down = test::random_quantized({E - 1, D, I}, 4, 32);
  EXPECT_OP_ERROR("switch_glu", "down has E=3", switch_glu(xt, idx, w));
  w = experts;
  w.gate = QuantizedWeight();
  EXPECT_OP_ERROR("switch_glu", "gate is undefined", switch_glu(xt, idx, w));
  w = experts;
  w.down.bits = 7;
  EXPECT_OP_ERROR("switch_glu", "bits=7", switch_glu(xt, idx, w));
  EXPECT_OP_ERROR("switch_glu", "D=128", switch_glu(test::random_tensor({3, 2 * D}, DType::bf16), idx, experts));
  EXPECT_OP_ERROR("switch_glu", "x must be [T, D]", switch_glu(test::random_tensor({3, 1, D}, DType::bf16), idx, experts));
  EXPECT_OP_ERROR("switch_glu", "expert index 4", switch_glu(xt, test::ids_tensor({0, 1, 2, 4, 1, 0}, {3, 2}), experts));
  EXPECT_OP_ERROR("switch_glu", "expert index -2", switch_glu(xt, test::ids_tensor({0, 1, 2, -2, 1, 0}, {3, 2}), experts));
  EXPECT_OP_ERROR("switch_glu", "int32 or uint32", switch_glu(xt, test::from_float({0, 1, 2, 3, 1, 0}, {3, 2}, DType::f32), experts));
  EXPECT_OP_ERROR("switch_glu", "T=3", switch_glu(xt, test::ids_tensor({0, 1, 2, 3}, {2, 2}), experts));
  // The bad expert id is found even on the sorted path (T*k >= 64).
  std::vector<int32_t> many(40 * 2, 1);
  many[57] = 9;
  EXPECT_OP_ERROR("switch_glu", "expert index 9",
                  switch_glu(test::random_tensor({40, D}, DType::bf16), test::ids_tensor(many, {40, 2}), experts));
}

TEST_F(BadInput, MoeLayer) {
  const Tensor h = test::random_tensor({3, D}, DType::bf16);
  MoeWeights m = moe;
  m.router.proj_dense = test::random_tensor({E + 2, D}, DType::bf16);
  m.router.per_expert_scale = test::random_tensor({E + 2}, DType::bf16);
  EXPECT_OP_ERROR("moe_layer", "E=6 experts but the experts have E=4", moe_layer(h, h, m));
  EXPECT_OP_ERROR("moe_layer", "same shape", moe_layer(h, test::random_tensor({4, D}, DType::bf16), moe));
  m = moe;
  m.router.top_k = E + 1;
  EXPECT_OP_ERROR("moe_layer", "top_k=5", moe_layer(h, m));
  Workspace ws;
  Tensor out = Tensor::empty({3, D + 1}, DType::bf16);
  EXPECT_OP_ERROR("moe_layer_into", "out must be bfloat16[3, 64]", moe_layer_into(out, h, h, moe, ws));
  out = Tensor::empty({3, D}, DType::f32);
  EXPECT_OP_ERROR("moe_layer_into", "out must be bfloat16[3, 64]", moe_layer_into(out, h, h, moe, ws));
  out = Tensor();
  EXPECT_OP_ERROR("moe_layer_into", "out is undefined", moe_layer_into(out, h, h, moe, ws));
}

TEST_F(BadInput, ZeroTokensAreValidNoOps) {
  const Tensor x0 = test::random_tensor({0, D}, DType::bf16);
  const Tensor idx0 = Tensor::empty({0, 2}, DType::i32);
  EXPECT_EQ(switch_glu(x0, idx0, experts).shape(), (Shape{0, 2, D}));
  const Routing r = route(x0, router);
  EXPECT_EQ(r.indices.shape(), (Shape{0, 2}));
  EXPECT_EQ(r.weights.shape(), (Shape{0, 2}));
  EXPECT_EQ(moe_layer(x0, moe).shape(), (Shape{0, D}));
  Workspace ws;
  Tensor out0 = Tensor::empty({0, D}, DType::bf16);
  moe_layer_into(out0, x0, x0, moe, ws);
  EXPECT_EQ(weighted_combine(test::random_tensor({0, 2, D}, DType::bf16), test::random_tensor({0, 2}, DType::bf16)).shape(),
            (Shape{0, D}));
  const SortedRows s = gather_sort(x0, idx0);
  EXPECT_EQ(s.x.shape(), (Shape{0, 1, D}));
  EXPECT_EQ(s.indices.shape(), (Shape{0}));
  EXPECT_EQ(scatter_unsort(s.x, s.inv_order, {0, 2}).shape(), (Shape{0, 2, 1, D}));
  EXPECT_EQ(geglu(x0, x0).shape(), (Shape{0, D}));
  EXPECT_EQ(gather_qmm(test::random_tensor({0, 1, K}, DType::bf16), q, Tensor(), Tensor::empty({0}, DType::i32)).shape(),
            (Shape{0, 1, N}));
  // k = 0 slots: the combine is a sum over nothing, i.e. zeros.
  const Tensor z = weighted_combine(test::random_tensor({2, 0, 3}, DType::f32), test::random_tensor({2, 0}, DType::f32));
  EXPECT_EQ(test::to_float(z), std::vector<float>(6, 0.f));
}

TEST_F(BadInput, NanAndInfPropagateToTheirRowsOnly) {
  // gather_qmm: row 1 of x carries a NaN, row 2 an Inf.
  std::vector<float> xv = test::to_float(x);
  xv[1 * K + 5] = NAN;
  xv[2 * K + 9] = INFINITY;
  const std::vector<float> out =
      test::to_float(gather_qmm(test::from_float(xv, {3, 1, K}, DType::bf16), q, Tensor(), rhs));
  EXPECT_TRUE(row_all_finite(out, 0, N));
  EXPECT_TRUE(row_all_nan(out, 1, N));
  for (int64_t n = 0; n < N; ++n) EXPECT_FALSE(std::isfinite(out[2 * N + n])) << n;

  // switch_glu and the MoE layer: token 1 has a NaN in the expert input, token 2 in the router input.
  std::vector<float> tokens = test::to_float(test::random_tensor({4, D}, DType::bf16));
  std::vector<float> with_nan = tokens;
  with_nan[1 * D + 3] = NAN;
  const Tensor xs = test::from_float(with_nan, {4, D}, DType::bf16);
  const std::vector<float> y = test::to_float(switch_glu(xs, test::ids_tensor({0, 1, 2, 3, 1, 2, 3, 0}, {4, 2}), experts));
  EXPECT_TRUE(row_all_finite(y, 0, 2 * D));
  EXPECT_TRUE(row_all_nan(y, 1, 2 * D));
  EXPECT_TRUE(row_all_finite(y, 2, 2 * D));

  std::vector<float> h_nan = tokens;
  h_nan[2 * D + 7] = NAN;
  const Tensor h = test::from_float(h_nan, {4, D}, DType::bf16);
  const Routing r = route(h, router);
  const std::vector<float> w = test::to_float(r.weights);
  EXPECT_TRUE(std::isfinite(w[0]) && std::isfinite(w[1]));
  EXPECT_TRUE(std::isnan(w[4]) && std::isnan(w[5]));
  for (int32_t e : test::to_i32(r.indices)) EXPECT_TRUE(e >= 0 && e < E) << e;
  const std::vector<float> o = test::to_float(moe_layer(h, xs, moe));
  EXPECT_TRUE(row_all_finite(o, 0, D));
  EXPECT_TRUE(row_all_nan(o, 1, D));  // NaN expert input
  EXPECT_TRUE(row_all_nan(o, 2, D));  // NaN routing weights
  EXPECT_TRUE(row_all_finite(o, 3, D));

  std::vector<float> h_inf = tokens;
  h_inf[0] = INFINITY;
  const Routing ri = route(test::from_float(h_inf, {4, D}, DType::bf16), router);
  const std::vector<float> wi = test::to_float(ri.weights);
  EXPECT_FALSE(std::isfinite(wi[0]));
  EXPECT_TRUE(std::isfinite(wi[2]) && std::isfinite(wi[7]));
}

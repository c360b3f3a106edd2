// gather_sort / scatter_unsort (mlx-lm _gather_sort / _scatter_unsort) and the GLU products on the
// CPU: hand-worked permutations, stability, the round trip, and the activation formulas at known
// points.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "core/float16.h"
#include "expertqmm/error.h"
#include "expertqmm/ops.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

double gelu_tanh_ref(double g) {
  return 0.5 * g * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g)));
}
double silu_ref(double g) { return g / (1.0 + std::exp(-g)); }

}  // namespace

TEST(CpuGatherSort, HandWorkedExample) {
  // indices [[2, 0], [0, 1]] -> flat [2, 0, 0, 1]; stable argsort = [1, 2, 3, 0];
  // inv_order = argsort(order) = [3, 0, 1, 2]; rows come from tokens order // 2 = [0, 1, 1, 0].
  const Tensor x = test::from_float({10, 11, 20, 21}, {2, 2}, DType::f32);
  const SortedRows s = gather_sort(x, test::ids_tensor({2, 0, 0, 1}, {2, 2}));
  EXPECT_EQ(s.x.shape(), (Shape{4, 1, 2}));
  EXPECT_EQ(s.indices.shape(), (Shape{4}));
  EXPECT_EQ(s.indices.dtype(), DType::i32);
  EXPECT_EQ(test::to_i32(s.indices), (std::vector<int32_t>{0, 0, 1, 2}));
  EXPECT_EQ(test::to_i32(s.inv_order), (std::vector<int32_t>{3, 0, 1, 2}));
  EXPECT_EQ(test::to_float(s.x), (std::vector<float>{10, 11, 20, 21, 20, 21, 10, 11}));
}

TEST(CpuGatherSort, StableAndInverse) {
  const int64_t T = 37, k = 4, D = 5, E = 6;  // many duplicate ids
  const Tensor x = test::random_tensor({T, D}, DType::bf16);
  const Tensor idx = test::random_ids({T, k}, E);
  const std::vector<int32_t> flat = test::to_i32(idx);
  const SortedRows s = gather_sort(x, idx);
  const std::vector<int32_t> sorted = test::to_i32(s.indices), inv = test::to_i32(s.inv_order);
  const std::vector<float> xs = test::to_float(s.x), xv = test::to_float(x);
  ASSERT_EQ(sorted.size(), static_cast<size_t>(T * k));
  // order[i] = the flat position sorted to slot i: the inverse of inv_order.
  std::vector<int32_t> order(T * k, -1);
  for (int64_t p = 0; p < T * k; ++p) {
    ASSERT_GE(inv[p], 0);
    ASSERT_LT(inv[p], T * k);
    order[inv[p]] = static_cast<int32_t>(p);
  }
  for (int64_t i = 0; i < T * k; ++i) {
    ASSERT_GE(order[i], 0) << "inv_order is not a permutation";
    EXPECT_EQ(sorted[i], flat[order[i]]);
    if (i > 0) {
      EXPECT_LE(sorted[i - 1], sorted[i]);
      if (sorted[i - 1] == sorted[i]) EXPECT_LT(order[i - 1], order[i]) << "not stable at " << i;
    }
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(xs[i * D + d], xv[(order[i] / k) * D + d]);
  }
}

TEST(CpuGatherSort, ScatterUnsortRoundTrip) {
  const int64_t T = 9, k = 3, D = 4;
  const Tensor x = test::random_tensor({T, D}, DType::f32);
  const Tensor idx = test::random_ids({T, k}, 5);
  const SortedRows s = gather_sort(x, idx);
  const Tensor back = scatter_unsort(s.x, s.inv_order, {T, k});
  ASSERT_EQ(back.shape(), (Shape{T, k, 1, D}));
  const std::vector<float> b = test::to_float(back), xv = test::to_float(x);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t d = 0; d < D; ++d) EXPECT_EQ(b[(t * k + j) * D + d], xv[t * D + d]);
}

TEST(CpuGatherSort, ScatterUnsortGathersRows) {
  // x[inv_order] unflattened: out[i] = x[inv[i]].
  const Tensor x = test::from_float({0, 1, 2, 3, 4, 5}, {3, 2}, DType::f32);
  const Tensor out = scatter_unsort(x, test::ids_tensor({2, 2, 0, 1}, {4}), {2, 2});
  ASSERT_EQ(out.shape(), (Shape{2, 2, 2}));
  EXPECT_EQ(test::to_float(out), (std::vector<float>{4, 5, 4, 5, 0, 1, 2, 3}));
}

TEST(CpuGatherSort, AcceptsUint32AndMlxShapedX) {
  // mlx-lm passes x as [T, 1, 1, D] and may pass uint32 ids (argpartition's dtype).
  std::vector<uint32_t> ids = {3, 1, 1, 0, 2, 3};
  const Tensor idx = Tensor::from_host(ids.data(), {3, 2}, DType::u32);
  const Tensor x = test::random_tensor({3, 1, 1, 4}, DType::bf16);
  const SortedRows a = gather_sort(x, idx);
  const SortedRows b = gather_sort(x.reshape({3, 4}), test::ids_tensor({3, 1, 1, 0, 2, 3}, {3, 2}));
  EXPECT_EQ(test::to_i32(a.indices), (std::vector<int32_t>{0, 1, 1, 2, 3, 3}));
  EXPECT_EQ(a.x.to_host_bytes(), b.x.to_host_bytes());
  EXPECT_EQ(test::to_i32(a.inv_order), test::to_i32(b.inv_order));
}

TEST(CpuActivation, KnownPointsInFloat32) {
  const std::vector<float> g = {0.f, 1.f, -1.f, 2.5f, -3.f, 10.f, -10.f};
  const std::vector<float> u = {3.f, 2.f, -1.5f, 0.5f, 4.f, 1.f, 1.f};
  const Tensor gate = test::from_float(g, {7}, DType::f32), up = test::from_float(u, {7}, DType::f32);
  const std::vector<float> ge = test::to_float(geglu(gate, up)), sw = test::to_float(swiglu(gate, up));
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_NEAR(ge[i], gelu_tanh_ref(g[i]) * u[i], 2e-6 * (1 + std::fabs(gelu_tanh_ref(g[i]) * u[i]))) << g[i];
    EXPECT_NEAR(sw[i], silu_ref(g[i]) * u[i], 2e-6 * (1 + std::fabs(silu_ref(g[i]) * u[i]))) << g[i];
  }
  // Anchors computed by hand: gelu_tanh(1) = 0.8411920, silu(1) = 0.7310586.
  EXPECT_NEAR(ge[1], 2 * 0.8411920f, 1e-6);
  EXPECT_NEAR(sw[1], 2 * 0.7310586f, 1e-6);
  EXPECT_EQ(ge[0], 0.f);
  // gelu_tanh(-1) = -0.1588080.
  EXPECT_NEAR(ge[2], -0.1588080f * -1.5f, 1e-6);
}

TEST(CpuActivation, GluProductDispatchesByName) {
  const Tensor gate = test::random_tensor({4, 6}, DType::f32), up = test::random_tensor({4, 6}, DType::f32);
  EXPECT_EQ(glu_product(Activation::geglu, gate, up).to_host_bytes(), geglu(gate, up).to_host_bytes());
  EXPECT_EQ(glu_product(Activation::swiglu, gate, up).to_host_bytes(), swiglu(gate, up).to_host_bytes());
  EXPECT_NE(geglu(gate, up).to_host_bytes(), swiglu(gate, up).to_host_bytes());
  EXPECT_STREQ(activation_name(Activation::geglu), "geglu");
  EXPECT_STREQ(activation_name(Activation::swiglu), "swiglu");
}

TEST(CpuActivation, OneRoundingToTheInputDtype) {
  // bf16 in -> bf16 out, equal to the fp32 formula rounded once.
  const Tensor gate = test::random_tensor({64}, DType::bf16, 2.f), up = test::random_tensor({64}, DType::bf16);
  const Tensor out = geglu(gate, up);
  ASSERT_EQ(out.dtype(), DType::bf16);
  const std::vector<float> g = test::to_float(gate), u = test::to_float(up), o = test::to_float(out);
  for (size_t i = 0; i < g.size(); ++i) {
    const float c = 0.7978845608028654f;
    const float expect = 0.5f * g[i] * (1.f + std::tanh(c * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * u[i];
    EXPECT_EQ(o[i], round_to_bf16(expect)) << i;
  }
}

TEST(CpuActivation, ExtremesStayFiniteAndNanPropagates) {
  const Tensor gate = test::from_float({-100.f, 100.f, NAN, INFINITY}, {4}, DType::f32);
  const Tensor up = test::from_float({1.f, 1.f, 1.f, 1.f}, {4}, DType::f32);
  for (const Tensor& out : {geglu(gate, up), swiglu(gate, up)}) {
    const std::vector<float> o = test::to_float(out);
    EXPECT_EQ(o[0], 0.f);  // -0 for both: no exp overflow into NaN
    EXPECT_EQ(o[1], 100.f);
    EXPECT_TRUE(std::isnan(o[2]));
    EXPECT_EQ(o[3], INFINITY);
  }
}

TEST(CpuActivation, StridedInputsAreRead) {
  // The fused gate_up split hands over column views of one [R, 2I] buffer.
  const Tensor gu = test::random_tensor({3, 8}, DType::f32);
  const Tensor gate = Tensor::view(gu.data(), {3, 4}, DType::f32, Device::cpu, {8, 1});
  const Tensor up = Tensor::view(gu.data_as<float>() + 4, {3, 4}, DType::f32, Device::cpu, {8, 1});
  EXPECT_EQ(geglu(gate, up).to_host_bytes(), geglu(gate.contiguous(), up.contiguous()).to_host_bytes());
}

// expertqmm's CPU ops against the real MLX: goldens written by tests/golden/make_op_goldens.py
// with mlx (CPU stream) and mlx-lm. A missing golden file fails; it never skips.
//
// Two MLX results per case (make_op_goldens.py explains): MLX's bf16 output as it runs on the CPU,
// and the same computation on float32 twins (the same bf16 values widened). On the CPU stream MLX's
// bf16 quantized matmul dequantizes in bf16 and accumulates in bf16, one rounding per
// multiply-add; that alone puts its bf16 results ~2% (norm-wise) from the exact product. The spec
// (and we) accumulate in fp32, so the float32 twins are the main reference.
//
// Tolerances, ||ours - mlx|| / ||mlx||:
//  - gather_qmm vs out_f32, our bf16 call: MLX's fp32 math is ours up to summation order, so the
//    difference is our one bf16 output rounding, <= 2^-9 per element: bound 4e-3.
//  - gather_qmm vs out_f32, our call with x widened to f32: the same fp32 math on the same
//    values, only summation order differs: bound 1e-5.
//  - router weights, SwitchGLU and the combined layer (bf16) vs the float32 twins: we round each
//    stage's output to bf16 (rms-norm output, logits, gate/up, GLU product, down, combine), each
//    <= 2^-9 per element; a handful in sequence stays within a few 1e-3 norm-wise: bound 1e-2
//    (docs/numerics.md).
//  - anything vs MLX's native bf16 outputs: MLX's own bf16 accumulation error (sequential over
//    K = 128..256 terms, rounding each partial sum: measured 1.4% to 2.6% here) plus ours: bound
//    5e-2. Still far below the O(1) error of a wrong row, group, expert or layout.
//  - router indices must equal MLX's as sets per token (mx.argpartition promises no order). The
//    generator redraws tokens whose k-th and (k+1)-th logits are close, so equality is well-posed.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "expertqmm/moe.h"
#include "support/golden.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

constexpr double kBf16OneRounding = 4e-3;
constexpr double kF32SameMath = 1e-5;
constexpr double kBf16Bound = 1e-2;
constexpr double kMlxBf16CpuBound = 5e-2;

Tensor optional_tensor(const SafetensorsFile& f, const std::string& name) {
  return f.has(name) ? f.get(name) : Tensor();
}

QuantizedWeight load_quantized(const SafetensorsFile& f, const std::string& prefix, int bits, int group_size,
                               QuantMode mode = QuantMode::affine) {
  QuantizedWeight q;
  EXPECT_NO_FATAL_FAILURE(test::golden_tensor(f, prefix + ".w", &q.w));
  EXPECT_NO_FATAL_FAILURE(test::golden_tensor(f, prefix + ".scales", &q.scales));
  if (mode == QuantMode::affine) EXPECT_NO_FATAL_FAILURE(test::golden_tensor(f, prefix + ".biases", &q.biases));
  else EXPECT_FALSE(f.has(prefix + ".biases")) << prefix << ": mode " << quant_mode_name(mode) << " has no biases";
  q.mode = mode;
  q.bits = bits;
  q.group_size = group_size;
  return q;
}

// For each token, the expert -> weight map of a routing (slot order is not part of the result).
std::vector<std::map<int32_t, float>> per_token(const Tensor& indices, const Tensor& weights) {
  const std::vector<int32_t> idx = test::to_i32(indices);
  const std::vector<float> w = test::to_float(weights);
  const int64_t T = indices.size(0), k = indices.size(1);
  std::vector<std::map<int32_t, float>> out(T);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) out[t][idx[t * k + j]] = w[t * k + j];
  return out;
}

// Same expert sets per token (exact), and weights aligned by expert within `bound`.
void expect_same_routing(const Routing& ours, const Tensor& mlx_indices, const Tensor& mlx_weights, double bound) {
  ASSERT_EQ(ours.indices.shape(), mlx_indices.shape());
  const auto a = per_token(ours.indices, ours.weights), b = per_token(mlx_indices, mlx_weights);
  std::vector<float> wa, wb;
  for (size_t t = 0; t < a.size(); ++t) {
    std::vector<int32_t> ea, eb;
    for (const auto& [e, w] : a[t]) ea.push_back(e);
    for (const auto& [e, w] : b[t]) eb.push_back(e);
    ASSERT_EQ(ea, eb) << "token " << t << ": experts differ from MLX";
    for (const auto& [e, w] : b[t]) {
      wa.push_back(a[t].at(e));
      wb.push_back(w);
    }
  }
  EXPECT_LE(test::rel_error(wa, wb), bound);
}

double rel_error(const Tensor& ours, const Tensor& mlx) { return test::rel_error(test::to_float(ours), test::to_float(mlx)); }

}  // namespace

TEST(CpuGoldenOps, GatherQmmMatchesMlx) {
  SafetensorsFile f;
  ASSERT_NO_FATAL_FAILURE(test::open_golden("ops_gather_qmm.safetensors", &f));
  const std::vector<test::GoldenCase> cases = test::golden_cases(f);
  ASSERT_EQ(cases.size(), 38u)
      << "the generator writes 8 shape cases, 18 bits x group cases and 4 cases per fp mode (mxfp4, mxfp8, nvfp4)";
  std::map<std::string, int> per_mode;
  for (const test::GoldenCase& c : cases) {
    SCOPED_TRACE("case " + c.name);
    const std::string p = "gqmm." + c.name + ".";
    Tensor x, out_mlx, out_mlx_f32;
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, p + "x", &x));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, p + "out", &out_mlx));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, p + "out_f32", &out_mlx_f32));
    QuantMode mode;
    ASSERT_TRUE(parse_quant_mode(c.params.at("mode"), &mode)) << c.params.at("mode");
    ++per_mode[c.params.at("mode")];
    const QuantizedWeight q =
        load_quantized(f, "gqmm." + c.name, c.int_param("bits"), c.int_param("group_size"), mode);
    const Tensor lhs = optional_tensor(f, p + "lhs"), rhs = optional_tensor(f, p + "rhs");
    const bool transpose = c.int_param("transpose") != 0, sorted_indices = c.int_param("sorted_indices") != 0;
    const Tensor out = gather_qmm(x, q, lhs, rhs, transpose, sorted_indices);
    ASSERT_EQ(out.shape(), out_mlx.shape());
    ASSERT_EQ(out.dtype(), out_mlx.dtype());
    EXPECT_LE(rel_error(out, out_mlx_f32), kBf16OneRounding);
    EXPECT_LE(rel_error(out, out_mlx), kMlxBf16CpuBound);
    const Tensor x32 = test::from_float(test::to_float(x), x.shape(), DType::f32);
    const Tensor out32 = gather_qmm(x32, q, lhs, rhs, transpose, sorted_indices);
    ASSERT_EQ(out32.dtype(), DType::f32);
    EXPECT_LE(rel_error(out32, out_mlx_f32), kF32SameMath);
  }
  EXPECT_EQ(per_mode, (std::map<std::string, int>{{"affine", 26}, {"mxfp4", 4}, {"mxfp8", 4}, {"nvfp4", 4}}));
}

class CpuGoldenGemma4 : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(test::open_golden("mlxlm_gemma4_moe.safetensors", &file_));
    cases_ = test::golden_cases(file_);
    ASSERT_EQ(cases_.size(), 2u) << "the generator writes T=3 and T=40";
    const test::GoldenCase& c = cases_[0];
    weights_.router.proj = load_quantized(file_, "router.proj", c.int_param("router_bits"),
                                          c.int_param("router_group_size"));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(file_, "router.scale", &weights_.router.scale));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(file_, "router.per_expert_scale", &weights_.router.per_expert_scale));
    weights_.router.top_k = c.int_param("top_k");
    const int bits = c.int_param("expert_bits"), gs = c.int_param("expert_group_size");
    weights_.experts.gate = load_quantized(file_, "experts.gate_proj", bits, gs);
    weights_.experts.up = load_quantized(file_, "experts.up_proj", bits, gs);
    weights_.experts.down = load_quantized(file_, "experts.down_proj", bits, gs);
    weights_.experts.activation = Activation::geglu;
    dense_router_ = weights_.router;
    dense_router_.proj = QuantizedWeight();
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(file_, "router_dense.proj", &dense_router_.proj_dense));
  }
  Tensor run_tensor(const test::GoldenCase& c, const std::string& what) {
    Tensor t;
    EXPECT_NO_FATAL_FAILURE(test::golden_tensor(file_, "t" + std::to_string(c.int_param("T")) + "." + what, &t));
    return t;
  }

  SafetensorsFile file_;
  std::vector<test::GoldenCase> cases_;
  MoeWeights weights_;
  RouterWeights dense_router_;
};

TEST_F(CpuGoldenGemma4, RouterMatchesMlxLm) {
  for (const test::GoldenCase& c : cases_) {
    SCOPED_TRACE("case " + c.name);
    const Tensor h = run_tensor(c, "h");
    const Routing quantized = route(h, weights_.router), dense = route(h, dense_router_);
    ASSERT_EQ(quantized.weights.dtype(), DType::bf16);
    ASSERT_NO_FATAL_FAILURE(expect_same_routing(quantized, run_tensor(c, "f32_indices"),
                                                run_tensor(c, "f32_weights"), kBf16Bound));
    ASSERT_NO_FATAL_FAILURE(expect_same_routing(dense, run_tensor(c, "f32_dense_indices"),
                                                run_tensor(c, "f32_dense_weights"), kBf16Bound));
    ASSERT_NO_FATAL_FAILURE(expect_same_routing(quantized, run_tensor(c, "indices"), run_tensor(c, "weights"),
                                                kMlxBf16CpuBound));
    ASSERT_NO_FATAL_FAILURE(expect_same_routing(dense, run_tensor(c, "dense_indices"),
                                                run_tensor(c, "dense_weights"), kMlxBf16CpuBound));
  }
}

TEST_F(CpuGoldenGemma4, SwitchGluMatchesMlxLmOnBothPaths) {
  // T=3: T*k = 6 < 64 (unsorted path); T=40: T*k = 80 (sorted path). Fed MLX's routing.
  for (const test::GoldenCase& c : cases_) {
    SCOPED_TRACE("case " + c.name);
    const Tensor x = run_tensor(c, "x"), idx = run_tensor(c, "f32_indices"), y_mlx = run_tensor(c, "y");
    const Tensor y = switch_glu(x, idx, weights_.experts);
    ASSERT_EQ(y.shape(), y_mlx.shape());
    ASSERT_EQ(y.dtype(), y_mlx.dtype());
    EXPECT_LE(rel_error(y, run_tensor(c, "f32_y")), kBf16Bound);
    EXPECT_LE(rel_error(y, y_mlx), kMlxBf16CpuBound);
    // Fed MLX's float32 routing weights rounded to bf16, as our router would hand them over.
    const Tensor w_f32 = run_tensor(c, "f32_weights");
    const Tensor w_bf16 = test::from_float(test::to_float(w_f32), w_f32.shape(), DType::bf16);
    const Tensor combined = weighted_combine(y, w_bf16);
    EXPECT_LE(rel_error(combined, run_tensor(c, "f32_out")), kBf16Bound);
    EXPECT_LE(rel_error(combined, run_tensor(c, "out")), kMlxBf16CpuBound);
  }
}

TEST_F(CpuGoldenGemma4, MoeLayerMatchesMlxLm) {
  for (const test::GoldenCase& c : cases_) {
    SCOPED_TRACE("case " + c.name);
    const Tensor out = moe_layer(run_tensor(c, "h"), run_tensor(c, "x"), weights_);
    const Tensor out_mlx = run_tensor(c, "out");
    ASSERT_EQ(out.shape(), out_mlx.shape());
    ASSERT_EQ(out.dtype(), out_mlx.dtype());
    EXPECT_LE(rel_error(out, run_tensor(c, "f32_out")), kBf16Bound);
    EXPECT_LE(rel_error(out, out_mlx), kMlxBf16CpuBound);
  }
}

TEST_F(CpuGoldenGemma4, Float32PathMatchesFloat32Twins) {
  // With the activations widened to f32 (bf16 scales promote to f32) every stage is fp32 on both
  // sides; only summation order and exp/tanh implementations differ: bound 1e-4 (docs/numerics.md).
  constexpr double kF32Bound = 1e-4;
  for (const test::GoldenCase& c : cases_) {
    SCOPED_TRACE("case " + c.name);
    const Tensor h_bf16 = run_tensor(c, "h"), x_bf16 = run_tensor(c, "x");
    const Tensor h = test::from_float(test::to_float(h_bf16), h_bf16.shape(), DType::f32);
    const Tensor x = test::from_float(test::to_float(x_bf16), x_bf16.shape(), DType::f32);
    const Routing r = route(h, weights_.router);
    ASSERT_EQ(r.weights.dtype(), DType::f32);
    ASSERT_NO_FATAL_FAILURE(
        expect_same_routing(r, run_tensor(c, "f32_indices"), run_tensor(c, "f32_weights"), kF32Bound));
    const Tensor y = switch_glu(x, run_tensor(c, "f32_indices"), weights_.experts);
    ASSERT_EQ(y.dtype(), DType::f32);
    EXPECT_LE(rel_error(y, run_tensor(c, "f32_y")), kF32Bound);
    const Tensor out = moe_layer(h, x, weights_);
    EXPECT_LE(rel_error(out, run_tensor(c, "f32_out")), kF32Bound);
  }
}

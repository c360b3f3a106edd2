// Cross-backend tests of the CUDA ops other than gather_qmm: each CUDA result is compared with the
// CPU backend of the same public op on the same inputs (bit for bit where the op is defined to be
// exact, else within a stated bound). Fresh random inputs every run; EXPERTQMM_TEST_SEED replays.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include "core/float16.h"
#include "core/gather_qmm_problem.h"
#include "expertqmm/error.h"
#include "support/reference.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.to_host_bytes() == b.to_host_bytes();
}

// Index of the first differing element (or -1), for failure messages.
int64_t first_difference(const Tensor& a, const Tensor& b) {
  const std::vector<uint8_t> x = a.to_host_bytes(), y = b.to_host_bytes();
  const size_t es = dtype_size(a.dtype());
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i)
    if (x[i] != y[i]) return static_cast<int64_t>(i / es);
  return x.size() == y.size() ? -1 : static_cast<int64_t>(std::min(x.size(), y.size()) / es);
}

// Distance in units in the last place of dtype between two values representable in it.
int64_t ulp_distance(float a, float b, DType dtype) {
  auto ordered = [&](float v) -> int64_t {
    int64_t bits;
    int64_t sign_bit;
    if (dtype == DType::f32) {
      bits = float_to_bits(v);
      sign_bit = int64_t{1} << 31;
    } else {
      bits = dtype == DType::bf16 ? float_to_bf16(v) : float_to_f16(v);
      sign_bit = 1 << 15;
    }
    return bits & sign_bit ? -(bits & (sign_bit - 1)) : bits;
  };
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) ? 0 : INT64_MAX;
  return std::llabs(ordered(a) - ordered(b));
}

// A weight [rows, K] (K = 256, a multiple of every group size) whose groups exercise the quantizer's
// edge cases: group g of row r is, by (r + g) % 6, random, all negative, a nonzero constant, all
// zero, mixed magnitudes (1e-2 .. 1e1 within one group), or a negative constant.
Tensor edge_case_weight(int64_t rows, DType dtype, Device device, int64_t batch = 1) {
  const int64_t K = 256, group = 32;
  std::vector<float> v = test::to_float(test::random_tensor({batch * rows, K}, DType::f32, 0.2f));
  for (int64_t r = 0; r < batch * rows; ++r)
    for (int64_t g = 0; g < K / group; ++g)
      for (int64_t j = 0; j < group; ++j) {
        float& x = v[r * K + g * group + j];
        switch ((r + g) % 6) {
          case 1: x = -std::fabs(x) - 0.01f; break;
          case 2: x = 0.37f; break;
          case 3: x = 0.0f; break;
          case 4: x *= std::pow(10.0f, static_cast<float>(j % 4) - 2.0f); break;
          case 5: x = -0.61f; break;
          default: break;
        }
      }
  Shape shape = batch > 1 ? Shape{batch, rows, K} : Shape{rows, K};
  return test::from_float(v, shape, dtype, device);
}

void expect_quantize_match(const Tensor& w_cpu, QuantSpec spec, const std::string& what) {
  const QuantizedWeight c = quantize(w_cpu, spec);
  const QuantizedWeight g = quantize(w_cpu.to(Device::cuda), spec);
  ASSERT_EQ(g.w.device(), Device::cuda);
  EXPECT_TRUE(same_bytes(g.w, c.w)) << what << ": codes differ at word " << first_difference(g.w, c.w) << " "
                                    << test::seed_note();
  EXPECT_TRUE(same_bytes(g.scales, c.scales))
      << what << ": scales differ at " << first_difference(g.scales, c.scales) << " " << test::seed_note();
  EXPECT_TRUE(same_bytes(g.biases, c.biases))
      << what << ": biases differ at " << first_difference(g.biases, c.biases) << " " << test::seed_note();
  // Dequantize each backend's own output: must agree bit for bit too.
  const Tensor dc = dequantize(c);
  const Tensor dg = dequantize(g);
  ASSERT_EQ(dg.device(), Device::cuda);
  EXPECT_TRUE(same_bytes(dg, dc)) << what << ": dequantize differs at " << first_difference(dg, dc) << " "
                                  << test::seed_note();
  cuda_check();
}

std::string spec_name(QuantSpec s, DType t) {
  return detail::cat("bits=", s.bits, " group=", s.group_size, " rounding=",
                     s.rounding == Rounding::gpu ? "gpu" : "cpu", " dtype=", dtype_name(t));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// quantize / dequantize

TEST(GpuQuantize, EveryBitsGroupAndFlavourMatchesCpuBitForBitSmall) {
  EXPERTQMM_REQUIRE_GPU();
  const Tensor w = edge_case_weight(12, DType::bf16, Device::cpu);
  for (Rounding rounding : {Rounding::cpu, Rounding::gpu})
    for (int bits : {2, 3, 4, 5, 6, 8})
      for (int gs : {32, 64, 128}) {
        const QuantSpec spec{bits, gs, rounding};
        expect_quantize_match(w, spec, spec_name(spec, DType::bf16));
      }
}

TEST(GpuQuantize, Float16Float32AndBatchedWeightsMatchCpu) {
  EXPERTQMM_REQUIRE_GPU();
  for (DType t : {DType::f16, DType::f32})
    for (Rounding rounding : {Rounding::cpu, Rounding::gpu})
      for (int bits : {3, 4, 8}) {
        const QuantSpec spec{bits, 64, rounding};
        expect_quantize_match(edge_case_weight(7, t, Device::cpu), spec, spec_name(spec, t));
      }
  // [E, N, K] with several experts, gemma-like 4-bit gs64.
  expect_quantize_match(edge_case_weight(33, DType::bf16, Device::cpu, 3), QuantSpec{4, 64, Rounding::gpu},
                        "batched [3, 33, 256]");
}

// Exact .5 ties: the two flavours must round them differently, each exactly like the CPU backend.
// Group = {0, n/2, and quarter steps in between} in f32: scale = -0.5 exactly, bias = n/2, so the
// odd quarter steps land on x.5 codes.
TEST(GpuQuantize, HalfwayTiesFollowEachFlavourSmall) {
  EXPERTQMM_REQUIRE_GPU();
  for (int bits : {2, 3, 4, 5, 6, 8})
    for (int gs : {32, 64, 128}) {
      const int n = (1 << bits) - 1;
      std::vector<float> v(static_cast<size_t>(gs) * 2);
      for (int g = 0; g < 2; ++g)
        for (int j = 0; j < gs; ++j) {
          const int quarter_steps = (j * 7 + g) % (2 * n + 1);  // in [0, 2n]
          v[g * gs + j] = 0.25f * static_cast<float>(quarter_steps);
        }
      for (int g = 0; g < 2; ++g) {
        v[g * gs] = 0.0f;
        v[g * gs + 1] = 0.5f * static_cast<float>(n);
      }
      const Tensor w = test::from_float(v, {1, 2 * gs}, DType::f32);
      const QuantSpec cpu_spec{bits, gs, Rounding::cpu}, gpu_spec{bits, gs, Rounding::gpu};
      expect_quantize_match(w, cpu_spec, spec_name(cpu_spec, DType::f32) + " ties");
      expect_quantize_match(w, gpu_spec, spec_name(gpu_spec, DType::f32) + " ties");
      // The flavours must disagree on these ties (half to even vs half away from zero).
      const Tensor wd = w.to(Device::cuda);
      EXPECT_FALSE(same_bytes(quantize(wd, cpu_spec).w, quantize(wd, gpu_spec).w))
          << "bits=" << bits << " group=" << gs << ": both flavours rounded every tie the same way";
    }
}

// ---------------------------------------------------------------------------------------------
// gather_sort / scatter_unsort

namespace {

void expect_sort_match(int64_t T, int64_t k, int64_t E, int64_t D, DType ids_dtype) {
  const std::string what = detail::cat("T=", T, " k=", k, " E=", E, " D=", D, " ids=", dtype_name(ids_dtype));
  const Tensor x = test::random_tensor({T, D}, DType::bf16);
  Tensor ids = test::random_ids({T, k}, E);
  if (ids_dtype == DType::u32) ids = Tensor::from_host(ids.data(), ids.shape(), DType::u32);
  const SortedRows c = gather_sort(x, ids);
  const SortedRows g = gather_sort(x.to(Device::cuda), ids.to(Device::cuda));
  ASSERT_EQ(g.x.device(), Device::cuda) << what;
  EXPECT_TRUE(same_bytes(g.indices, c.indices)) << what << ": sorted ids differ at "
                                                << first_difference(g.indices, c.indices) << " " << test::seed_note();
  EXPECT_TRUE(same_bytes(g.inv_order, c.inv_order))
      << what << ": inv_order differs at " << first_difference(g.inv_order, c.inv_order) << " " << test::seed_note();
  EXPECT_TRUE(same_bytes(g.x, c.x)) << what << ": x_sorted differs at " << first_difference(g.x, c.x);
  // Unsort on both backends: must equal each other and restore x[t] in every (t, j) slot.
  const Tensor uc = scatter_unsort(c.x, c.inv_order, {T, k});
  const Tensor ug = scatter_unsort(g.x, g.inv_order, {T, k});
  EXPECT_TRUE(same_bytes(ug, uc)) << what << ": scatter_unsort differs at " << first_difference(ug, uc);
  const std::vector<float> xs = test::to_float(x), us = test::to_float(ug);
  ASSERT_EQ(static_cast<int64_t>(us.size()), T * k * D) << what;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t d = 0; d < D; ++d)
        ASSERT_EQ(us[(t * k + j) * D + d], xs[t * D + d]) << what << ": round trip broke at t=" << t << " j=" << j;
  cuda_check();
}

}  // namespace

TEST(GpuSort, GatherSortAndUnsortMatchCpuSmall) {
  EXPERTQMM_REQUIRE_GPU();
  expect_sort_match(1, 1, 4, 16, DType::i32);
  expect_sort_match(3, 2, 3, 40, DType::i32);   // 80-byte rows: the byte-wise copy
  expect_sort_match(9, 8, 8, 64, DType::u32);   // 128-byte rows: 16-byte copies, uint32 ids
}

TEST(GpuSort, LargeSortsWithManyTiesMatchCpu) {
  EXPERTQMM_REQUIRE_GPU();
  expect_sort_match(64, 8, 128, 64, DType::i32);
  expect_sort_match(1000, 3, 5, 24, DType::i32);   // few experts: long runs of equal ids (stability)
  expect_sort_match(2048, 8, 128, 32, DType::i32);
  expect_sort_match(300, 2, 1024, 8, DType::u32);
}

// ---------------------------------------------------------------------------------------------
// GLU products

namespace {

class ProductModeGuard {
 public:
  explicit ProductModeGuard(ProductMode m) : saved_(product_mode()) { set_product_mode(m); }
  ~ProductModeGuard() { set_product_mode(saved_); }

 private:
  ProductMode saved_;
};

// Elementwise bound for tanh/exp evaluated by two math libraries (CUDA's and the host's differ by
// an ulp or two in fp32): 2 ulps of a 16-bit dtype, 1e-5 relative in f32, plus an absolute 1e-6
// for the cancellation in 1 + tanh(z) at very negative z (gelu is ~ -1e-7 there).
void expect_close_elementwise(const std::vector<float>& a, const std::vector<float>& b, DType dtype,
                              const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    if (dtype != DType::f32 && ulp_distance(a[i], b[i], dtype) <= 2) continue;
    const float rel = dtype == DType::f32 ? 1e-5f : 0.0f;
    ASSERT_LE(std::fabs(a[i] - b[i]), 1e-6f + rel * std::fabs(b[i]))
        << what << " at " << i << ": " << a[i] << " vs " << b[i] << " " << test::seed_note();
  }
}

}  // namespace

TEST(GpuProduct, FusedSeparateAndCpuAgreeSmall) {
  EXPERTQMM_REQUIRE_GPU();
  for (DType t : {DType::bf16, DType::f16, DType::f32})
    for (Activation act : {Activation::geglu, Activation::swiglu})
      for (const Shape& shape : {Shape{3, 5}, Shape{16, 704}, Shape{2, 7, 1408}}) {
        const std::string what = detail::cat(activation_name(act), " ", dtype_name(t), " ", shape_str(shape));
        const Tensor gate = test::random_tensor(shape, t, 2.0f);
        const Tensor up = test::random_tensor(shape, t, 1.0f);
        const Tensor cpu_out = glu_product(act, gate, up);
        const Tensor gd = gate.to(Device::cuda), ud = up.to(Device::cuda);
        Tensor fused, separate;
        {
          ProductModeGuard mode(ProductMode::fused);
          fused = glu_product(act, gd, ud);
        }
        {
          ProductModeGuard mode(ProductMode::separate);
          separate = glu_product(act, gd, ud);
        }
        ASSERT_EQ(fused.shape(), shape);
        ASSERT_EQ(fused.dtype(), t);
        expect_close_elementwise(test::to_float(fused), test::to_float(cpu_out), t, what + " fused vs cpu");
        if (t == DType::f32) {
          // The intermediate is f32 too: the two forms perform the same fp32 operations.
          EXPECT_TRUE(same_bytes(separate, fused)) << what << ": differs at " << first_difference(separate, fused);
        } else {
          // act(gate) is rounded once more in the separate form: at most one ulp of the product
          // (or a few f16 subnormal steps, where act(gate) itself is subnormal).
          const std::vector<float> s = test::to_float(separate), f = test::to_float(fused);
          for (size_t i = 0; i < s.size(); ++i)
            if (ulp_distance(s[i], f[i], t) > 1)
              ASSERT_LE(std::fabs(s[i] - f[i]), 1e-6f) << what << " separate vs fused at " << i << ": " << s[i]
                                                       << " vs " << f[i];
        }
      }
  cuda_check();
}

TEST(GpuProduct, PublicGegluAndSwigluDispatchToTheRightActivation) {
  EXPERTQMM_REQUIRE_GPU();
  const Tensor gate = test::random_tensor({4, 64}, DType::bf16, 2.0f);
  const Tensor up = test::random_tensor({4, 64}, DType::bf16);
  const Tensor gd = gate.to(Device::cuda), ud = up.to(Device::cuda);
  expect_close_elementwise(test::to_float(geglu(gd, ud)), test::to_float(geglu(gate, up)), DType::bf16, "geglu");
  expect_close_elementwise(test::to_float(swiglu(gd, ud)), test::to_float(swiglu(gate, up)), DType::bf16, "swiglu");
  EXPECT_FALSE(same_bytes(geglu(gd, ud), swiglu(gd, ud)));
}

// ---------------------------------------------------------------------------------------------
// weighted_combine

TEST(GpuCombine, MatchesCpuSmall) {
  EXPERTQMM_REQUIRE_GPU();
  struct Case { int64_t T, k, D; DType y, w; };
  for (const Case& c : {Case{1, 1, 8, DType::bf16, DType::bf16}, Case{5, 8, 33, DType::bf16, DType::bf16},
                        Case{3, 2, 64, DType::f32, DType::bf16}, Case{4, 3, 48, DType::f16, DType::f32}}) {
    const std::string what = detail::cat("T=", c.T, " k=", c.k, " D=", c.D, " y=", dtype_name(c.y), " w=",
                                         dtype_name(c.w));
    const Tensor y = test::random_tensor({c.T, c.k, c.D}, c.y);
    const Tensor w = test::random_tensor({c.T, c.k}, c.w, 0.5f);
    const Tensor cpu_out = weighted_combine(y, w);
    const Tensor gpu_out = weighted_combine(y.to(Device::cuda), w.to(Device::cuda));
    ASSERT_EQ(gpu_out.shape(), (Shape{c.T, c.D})) << what;
    ASSERT_EQ(gpu_out.dtype(), c.y) << what;
    // Same fp32 products and sums in the same order: equal up to the host compiler's choices.
    const std::vector<float> g = test::to_float(gpu_out), r = test::to_float(cpu_out);
    for (size_t i = 0; i < g.size(); ++i) ASSERT_LE(ulp_distance(g[i], r[i], c.y), 1) << what << " at " << i;
  }
  cuda_check();
}

TEST(GpuCombine, GemmaWidthMatchesFloat64) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t T = 300, k = 8, D = 2816;
  const Tensor y = test::random_tensor({T, k, D}, DType::bf16);
  const Tensor w = test::random_tensor({T, k}, DType::bf16, 0.3f);
  const std::vector<float> yv = test::to_float(y), wv = test::to_float(w);
  std::vector<double> ref(T * D, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t d = 0; d < D; ++d) ref[t * D + d] += double(wv[t * k + j]) * yv[(t * k + j) * D + d];
  Tensor out = weighted_combine(y.to(Device::cuda), w.to(Device::cuda));
  EXPECT_LE(test::rel_error(test::to_float(out), ref), 4e-3) << test::seed_note();
  cuda_check();
}

// ---------------------------------------------------------------------------------------------
// route

namespace {

RouterWeights make_router(int64_t E, int64_t H, int k, DType dtype, bool quantized, Device device) {
  RouterWeights r;
  r.top_k = k;
  if (quantized) {
    // 8-bit gs64 as the Gemma checkpoints; logits ~ N(0, 1).
    r.proj = test::random_quantized({E, H}, 8, 64, 1.0f, device);
    if (dtype != DType::bf16) {
      r.proj.scales = detail::cast_floating(r.proj.scales, dtype);
      r.proj.biases = detail::cast_floating(r.proj.biases, dtype);
    }
  } else {
    r.proj_dense = test::random_tensor({E, H}, dtype, 1.0f, device);
  }
  std::vector<float> scale = test::to_float(test::random_tensor({H}, DType::f32, 0.1f));
  for (float& s : scale) s += 1.0f;
  r.scale = test::from_float(scale, {H}, dtype, device);
  std::vector<float> pes = test::to_float(test::random_tensor({E}, DType::f32, 0.2f));
  for (float& p : pes) p = 1.0f + p;
  r.per_expert_scale = test::from_float(pes, {E}, dtype, device);
  return r;
}

RouterWeights router_to(const RouterWeights& r, Device device) {
  RouterWeights d = r;
  if (r.proj.defined()) d.proj = test::to_device(r.proj, device);
  if (r.proj_dense.defined()) d.proj_dense = r.proj_dense.to(device);
  d.scale = r.scale.to(device);
  d.per_expert_scale = r.per_expert_scale.to(device);
  return d;
}

// GPU routing vs CPU routing. exact_sets: every token must pick the same experts; otherwise a
// token may differ only where the GPU's pick is within `tie_tol` (relative) of the CPU's k-th
// logit. Weights are compared per expert on tokens whose sets agree.
void expect_routing_match(const Tensor& h, const RouterWeights& r, bool exact_sets, double weight_tol,
                          const std::string& what) {
  const int64_t T = h.size(0);
  const int k = r.top_k;
  const Routing c = route(h, r);
  const Routing g = route(h.to(Device::cuda), router_to(r, Device::cuda));
  ASSERT_EQ(g.indices.shape(), (Shape{T, k})) << what;
  ASSERT_EQ(g.indices.dtype(), DType::i32) << what;
  ASSERT_EQ(g.weights.dtype(), h.dtype()) << what;
  const std::vector<int32_t> ci = test::to_i32(c.indices), gi = test::to_i32(g.indices);
  const std::vector<float> cw = test::to_float(c.weights), gw = test::to_float(g.weights);
  const int64_t E = r.proj.defined() ? r.proj.w.size(0) : r.proj_dense.size(0);
  std::vector<float> logits;
  int64_t differing = 0;
  std::vector<float> gw_matched, cw_matched;
  for (int64_t t = 0; t < T; ++t) {
    std::map<int32_t, float> cmap, gmap;
    for (int j = 0; j < k; ++j) {
      ASSERT_GE(gi[t * k + j], 0) << what;
      ASSERT_LT(gi[t * k + j], E) << what;
      cmap[ci[t * k + j]] = cw[t * k + j];
      gmap[gi[t * k + j]] = gw[t * k + j];
    }
    ASSERT_EQ(static_cast<int>(gmap.size()), k) << what << ": token " << t << " picked an expert twice";
    bool same = true;
    for (const auto& kv : cmap) same = same && gmap.count(kv.first);
    if (same) {
      // Slots are best first on both backends; with equal sets the order can only differ on ties.
      for (const auto& kv : cmap) {
        cw_matched.push_back(kv.second);
        gw_matched.push_back(gmap[kv.first]);
      }
      continue;
    }
    ++differing;
    ASSERT_FALSE(exact_sets) << what << ": token " << t << " picked different experts " << test::seed_note();
    if (logits.empty()) logits = test::cpu_router_logits(h, r);
    std::vector<float> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    std::vector<float> sorted_row = row;
    std::sort(sorted_row.begin(), sorted_row.end(), std::greater<float>());
    const float kth = sorted_row[k - 1];
    for (const auto& kv : gmap)
      EXPECT_GE(row[kv.first], kth - std::fabs(kth) * (1.0f / 64) - 1e-6f)
          << what << ": token " << t << " picked expert " << kv.first << " (logit " << row[kv.first]
          << ") far below the k-th logit " << kth << " " << test::seed_note();
  }
  EXPECT_LE(differing, std::max<int64_t>(1, T / 10)) << what << ": too many tokens disagree";
  EXPECT_LE(test::rel_error(gw_matched, cw_matched), weight_tol) << what << " " << test::seed_note();
  cuda_check();
}

}  // namespace

TEST(GpuRoute, DenseFloat32RouterMatchesCpuExactlySmall) {
  EXPERTQMM_REQUIRE_GPU();
  const RouterWeights r = make_router(16, 64, 4, DType::f32, false, Device::cpu);
  expect_routing_match(test::random_tensor({9, 64}, DType::f32, 3.0f), r, true, 1e-5, "dense f32 E=16 k=4");
}

TEST(GpuRoute, QuantizedFloat32RouterMatchesCpuExactly) {
  EXPERTQMM_REQUIRE_GPU();
  const RouterWeights r = make_router(128, 256, 8, DType::f32, true, Device::cpu);
  expect_routing_match(test::random_tensor({37, 256}, DType::f32), r, true, 1e-5, "8-bit proj f32 E=128 k=8");
}

TEST(GpuRoute, GemmaLikeBf16RouterMatchesCpu) {
  EXPERTQMM_REQUIRE_GPU();
  // bf16 logits tie often: equal sets unless the CPU's own logits are within rounding at the k-th.
  const RouterWeights r = make_router(128, 512, 8, DType::bf16, true, Device::cpu);
  expect_routing_match(test::random_tensor({64, 512}, DType::bf16), r, false, 1e-2, "8-bit proj bf16 E=128 k=8");
  const RouterWeights dense = make_router(64, 256, 2, DType::bf16, false, Device::cpu);
  expect_routing_match(test::random_tensor({33, 256}, DType::bf16), dense, false, 1e-2, "dense bf16 E=64 k=2");
}

// Quantized projections of every supported width and group size, in both half dtypes, on shapes
// off the tile grids (token counts not a multiple of 16, expert counts not a multiple of 128 and
// below 32, one group per row or many), against the CPU router.
TEST(GpuRoute, QuantizedProjectionOnEdgeShapesSmall) {
  EXPERTQMM_REQUIRE_GPU();
  struct Case {
    int64_t E, H;
    int bits, group_size;
    DType dtype;
    int64_t T;
  };
  const Case cases[] = {{200, 384, 4, 128, DType::bf16, 37}, {40, 256, 8, 32, DType::f16, 300},
                        {128, 2816, 8, 64, DType::bf16, 130}, {8, 64, 4, 64, DType::f16, 17},
                        {128, 512, 4, 32, DType::bf16, 9}};
  for (const Case& c : cases) {
    RouterWeights r = make_router(c.E, c.H, static_cast<int>(std::min<int64_t>(8, c.E)), c.dtype, false, Device::cpu);
    r.proj_dense = Tensor();
    r.proj = test::random_quantized({c.E, c.H}, c.bits, c.group_size, 1.0f, Device::cpu);
    if (c.dtype != DType::bf16) {
      r.proj.scales = detail::cast_floating(r.proj.scales, c.dtype);
      r.proj.biases = detail::cast_floating(r.proj.biases, c.dtype);
    }
    const std::string what = "E " + std::to_string(c.E) + " H " + std::to_string(c.H) + " bits " +
                             std::to_string(c.bits) + " gs " + std::to_string(c.group_size) + " " +
                             dtype_name(c.dtype) + " T " + std::to_string(c.T);
    expect_routing_match(test::random_tensor({c.T, c.H}, c.dtype), r, false, 1e-2, what);
  }
}

TEST(GpuRoute, WideExpertCountsAndTopKEqualToE) {
  EXPERTQMM_REQUIRE_GPU();
  const RouterWeights wide = make_router(1024, 64, 8, DType::f32, false, Device::cpu);
  expect_routing_match(test::random_tensor({5, 64}, DType::f32), wide, true, 1e-5, "dense f32 E=1024 k=8");
  const RouterWeights all = make_router(8, 64, 8, DType::f32, false, Device::cpu);
  expect_routing_match(test::random_tensor({3, 64}, DType::f32), all, true, 1e-5, "dense f32 E=8 k=8");
}

TEST(GpuRoute, ExactTiesGoToTheHigherExpertId) {
  EXPERTQMM_REQUIRE_GPU();
  // proj rows 0..7 identical in pairs: logits tie exactly between experts 2i and 2i+1.
  const int64_t E = 8, H = 64;
  std::vector<float> proj = test::to_float(test::random_tensor({E / 2, H}, DType::f32));
  std::vector<float> doubled;
  for (int64_t e = 0; e < E; ++e) doubled.insert(doubled.end(), proj.begin() + (e / 2) * H, proj.begin() + (e / 2 + 1) * H);
  RouterWeights r = make_router(E, H, 3, DType::f32, false, Device::cpu);
  r.proj_dense = test::from_float(doubled, {E, H}, DType::f32);
  const Tensor h = test::random_tensor({6, H}, DType::f32);
  const Routing g = route(h.to(Device::cuda), router_to(r, Device::cuda));
  const std::vector<int32_t> gi = test::to_i32(g.indices);
  const std::vector<int32_t> ci = test::to_i32(route(h, r).indices);
  EXPECT_EQ(gi, ci);
  for (int64_t t = 0; t < 6; ++t) {
    // MLX's rule: the best pair is picked higher id first; the third slot is the higher id of the
    // second pair.
    EXPECT_EQ(gi[t * 3] % 2, 1) << "token " << t;
    EXPECT_EQ(gi[t * 3 + 1], gi[t * 3] - 1) << "token " << t;
    EXPECT_EQ(gi[t * 3 + 2] % 2, 1) << "token " << t;
  }
  cuda_check();
}

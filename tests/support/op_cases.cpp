#include "support/op_cases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/float16.h"
#include "core/gather_qmm_problem.h"
#include "support/moe_case.h"
#include "support/test_util.h"

namespace expertqmm::test {

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

// A weight [batch, rows, 256] whose groups of 32 exercise the quantizer's edge cases: group g of row
// r is, by (r + g) % 6, random, all negative, a nonzero constant, all zero, mixed magnitudes (1e-2 ..
// 1e1 within one group), or a negative constant.
Tensor edge_case_weight(int64_t batch, int64_t rows, DType dtype) {
  const int64_t K = 256, group = 32;
  std::vector<float> v = to_float(random_tensor({batch * rows, K}, DType::f32, 0.2f));
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
  return from_float(v, batch > 1 ? Shape{batch, rows, K} : Shape{rows, K}, dtype);
}

// Exact .5 ties in f32: two groups of {0, n/2 and quarter steps in between}, n = 2^bits - 1, so scale
// = -0.5 exactly, bias = n/2, and the odd quarter steps land on x.5 codes.
Tensor ties_weight(int bits, int group) {
  const int n = (1 << bits) - 1;
  std::vector<float> v(static_cast<size_t>(group) * 2);
  for (int g = 0; g < 2; ++g) {
    for (int j = 0; j < group; ++j) v[g * group + j] = 0.25f * static_cast<float>((j * 7 + g) % (2 * n + 1));
    v[g * group] = 0.0f;
    v[g * group + 1] = 0.5f * static_cast<float>(n);
  }
  return from_float(v, {1, 2 * group}, DType::f32);
}

// Elementwise bound for tanh/exp evaluated by two math libraries (CUDA's and the host's differ by
// an ulp or two in fp32): 2 ulps of a 16-bit dtype, 1e-5 relative in f32, plus an absolute 1e-6
// for the cancellation in 1 + tanh(z) at very negative z (gelu is ~ -1e-7 there).
void expect_close_elementwise(const std::vector<float>& a, const std::vector<float>& b, DType dtype,
                              const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    if (dtype != DType::f32 && ulp_distance(a[i], b[i], dtype) <= 2) continue;
    const float rel = dtype == DType::f32 ? 1e-5f : 0.0f;
    ASSERT_LE(std::fabs(a[i] - b[i]), 1e-6f + rel * std::fabs(b[i])) << what << " at " << i << ": " << a[i] << " vs " << b[i];
  }
}

}  // namespace

void check(const QuantizeCase& c) {
  const QuantSpec spec = c.mode == QuantMode::affine ? QuantSpec{c.bits, c.group, c.rounding} : default_quant_spec(c.mode);
  const Tensor w = c.values == Values::ties ? ties_weight(c.bits, c.group) : edge_case_weight(c.batch, c.rows, c.dtype);
  const std::string what = c.name() + " " + seed_note();
  const QuantizedWeight cq = quantize(w, spec);
  const QuantizedWeight gq = quantize(w.to(Device::cuda), spec);
  ASSERT_EQ(gq.w.device(), Device::cuda) << what;
  EXPECT_TRUE(same_bytes(gq.w, cq.w)) << what << ": codes differ at word " << first_difference(gq.w, cq.w);
  EXPECT_TRUE(same_bytes(gq.scales, cq.scales)) << what << ": scales differ at " << first_difference(gq.scales, cq.scales);
  if (c.mode == QuantMode::affine)
    EXPECT_TRUE(same_bytes(gq.biases, cq.biases)) << what << ": biases differ at " << first_difference(gq.biases, cq.biases);
  else
    EXPECT_FALSE(gq.biases.defined()) << what << ": an fp mode has no biases";
  // Dequantize each backend's own output: must agree bit for bit too (fp modes: in the weight's dtype).
  const Tensor dc = dequantize(cq, w.dtype()), dg = dequantize(gq, w.dtype());
  ASSERT_EQ(dg.device(), Device::cuda) << what;
  EXPECT_TRUE(same_bytes(dg, dc)) << what << ": dequantize differs at " << first_difference(dg, dc);
  if (c.values == Values::ties) {
    // Half to even and half away from zero must split on these ties.
    const QuantSpec other{c.bits, c.group, c.rounding == Rounding::cpu ? Rounding::gpu : Rounding::cpu};
    EXPECT_FALSE(same_bytes(gq.w, quantize(w.to(Device::cuda), other).w))
        << what << ": both flavours rounded every tie the same way";
  }
  cuda_check();
}

void check(const SortCase& c) {
  const std::string what = c.name() + " " + seed_note();
  const Tensor x = random_tensor({c.T, c.D}, DType::bf16);
  Tensor ids = random_ids({c.T, c.k}, c.E);
  if (c.ids == DType::u32) ids = Tensor::from_host(ids.data(), ids.shape(), DType::u32);
  const SortedRows cs = gather_sort(x, ids);
  const SortedRows gs = gather_sort(x.to(Device::cuda), ids.to(Device::cuda));
  ASSERT_EQ(gs.x.device(), Device::cuda) << what;
  EXPECT_TRUE(same_bytes(gs.indices, cs.indices)) << what << ": sorted ids differ at " << first_difference(gs.indices, cs.indices);
  EXPECT_TRUE(same_bytes(gs.inv_order, cs.inv_order))
      << what << ": inv_order differs at " << first_difference(gs.inv_order, cs.inv_order);
  EXPECT_TRUE(same_bytes(gs.x, cs.x)) << what << ": x_sorted differs at " << first_difference(gs.x, cs.x);
  // Unsort on both backends: must equal each other and restore x[t] in every (t, j) slot.
  const Tensor uc = scatter_unsort(cs.x, cs.inv_order, {c.T, c.k});
  const Tensor ug = scatter_unsort(gs.x, gs.inv_order, {c.T, c.k});
  EXPECT_TRUE(same_bytes(ug, uc)) << what << ": scatter_unsort differs at " << first_difference(ug, uc);
  const std::vector<float> xs = to_float(x), us = to_float(ug);
  ASSERT_EQ(static_cast<int64_t>(us.size()), c.T * c.k * c.D) << what;
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t j = 0; j < c.k; ++j)
      for (int64_t d = 0; d < c.D; ++d)
        ASSERT_EQ(us[(t * c.k + j) * c.D + d], xs[t * c.D + d]) << what << ": round trip broke at t=" << t << " j=" << j;
  cuda_check();
}

void check(const GluCase& c) {
  const std::string what = c.name() + " " + seed_note();
  const Tensor gate = random_tensor(c.shape, c.dtype, 2.0f), up = random_tensor(c.shape, c.dtype, 1.0f);
  const Tensor cpu_out = glu_product(c.act, gate, up);
  const Tensor gd = gate.to(Device::cuda), ud = up.to(Device::cuda);
  Tensor fused, separate, named;
  {
    ProductModeGuard mode(ProductMode::fused);
    fused = glu_product(c.act, gd, ud);
    named = c.act == Activation::geglu ? geglu(gd, ud) : swiglu(gd, ud);  // the public names dispatch right
  }
  {
    ProductModeGuard mode(ProductMode::separate);
    separate = glu_product(c.act, gd, ud);
  }
  ASSERT_EQ(fused.shape(), c.shape) << what;
  ASSERT_EQ(fused.dtype(), c.dtype) << what;
  expect_close_elementwise(to_float(fused), to_float(cpu_out), c.dtype, what + " fused vs cpu");
  expect_close_elementwise(to_float(named), to_float(cpu_out), c.dtype, what + " by name vs cpu");
  if (c.dtype == DType::f32) {
    // The intermediate is f32 too: the two forms perform the same fp32 operations.
    EXPECT_TRUE(same_bytes(separate, fused)) << what << ": differs at " << first_difference(separate, fused);
  } else {
    // act(gate) is rounded once more in the separate form: at most one ulp of the product (or a few
    // f16 subnormal steps, where act(gate) itself is subnormal).
    const std::vector<float> s = to_float(separate), f = to_float(fused);
    for (size_t i = 0; i < s.size(); ++i) {
      if (ulp_distance(s[i], f[i], c.dtype) <= 1) continue;
      ASSERT_LE(std::fabs(s[i] - f[i]), 1e-6f) << what << " separate vs fused at " << i << ": " << s[i] << " vs " << f[i];
    }
  }
  cuda_check();
}

void check(const CombineCase& c) {
  const std::string what = c.name() + " " + seed_note();
  const Tensor y = random_tensor({c.T, c.k, c.D}, c.y);
  const Tensor w = random_tensor({c.T, c.k}, c.w, c.float64 ? 0.3f : 0.5f);
  const Tensor gpu_out = weighted_combine(y.to(Device::cuda), w.to(Device::cuda));
  ASSERT_EQ(gpu_out.shape(), (Shape{c.T, c.D})) << what;
  ASSERT_EQ(gpu_out.dtype(), c.y) << what;
  const std::vector<float> g = to_float(gpu_out);
  if (c.float64) {
    const std::vector<float> yv = to_float(y), wv = to_float(w);
    std::vector<double> ref(c.T * c.D, 0.0);
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t j = 0; j < c.k; ++j)
        for (int64_t d = 0; d < c.D; ++d) ref[t * c.D + d] += double(wv[t * c.k + j]) * yv[(t * c.k + j) * c.D + d];
    EXPECT_LE(rel_error(g, ref), 4e-3) << what;
  } else {
    // Same fp32 products and sums in the same order: equal up to the host compiler's choices.
    const std::vector<float> r = to_float(weighted_combine(y, w));
    for (size_t i = 0; i < g.size(); ++i) ASSERT_LE(ulp_distance(g[i], r[i], c.y), 1) << what << " at " << i;
  }
  cuda_check();
}

}  // namespace expertqmm::test

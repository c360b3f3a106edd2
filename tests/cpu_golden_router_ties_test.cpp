// The router's tie rule against mlx-lm's Router (tests/golden/make_router_tie_goldens.py): every
// token of router_ties.safetensors has an exact tie at the k-th place, in f32 and bf16, with a dense
// and an 8-bit projection, so which experts win is decided by the tie rule alone (MLX: higher id).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "expertqmm/moe.h"
#include "support/golden.h"
#include "support/reference.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

// docs/numerics.md, "MLX goldens": router weights vs float32 MLX 1e-4; vs MLX's own bf16 5e-2.
constexpr double kTolF32 = 1e-4;
constexpr double kTolBf16 = 5e-2;

RouterWeights golden_router(const SafetensorsFile& g, const std::string& dtype, bool quantized, int top_k) {
  RouterWeights r;
  if (quantized) {
    test::golden_tensor(g, dtype + ".proj_q.w", &r.proj.w);
    test::golden_tensor(g, dtype + ".proj_q.scales", &r.proj.scales);
    test::golden_tensor(g, dtype + ".proj_q.biases", &r.proj.biases);
    r.proj.bits = 8;
    r.proj.group_size = 64;
  } else {
    test::golden_tensor(g, dtype + ".proj", &r.proj_dense);
  }
  test::golden_tensor(g, dtype + ".scale", &r.scale);
  test::golden_tensor(g, dtype + ".per_expert_scale", &r.per_expert_scale);
  r.top_k = top_k;
  return r;
}

// The k best experts of one row of logits, ties broken towards the higher (or lower) id.
std::set<int32_t> top_k_set(const std::vector<float>& row, int k, bool higher_id_wins) {
  std::vector<int32_t> order(row.size());
  for (size_t e = 0; e < row.size(); ++e) order[e] = static_cast<int32_t>(e);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (row[a] != row[b]) return row[a] > row[b];
    return higher_id_wins ? a > b : a < b;
  });
  return std::set<int32_t>(order.begin(), order.begin() + k);
}

TEST(GoldenRouterTies, PicksTheExpertsMlxPicksOnExactTies) {
  SafetensorsFile g;
  ASSERT_NO_FATAL_FAILURE(test::open_golden("router_ties.safetensors", &g));
  const std::vector<test::GoldenCase> cases = test::golden_cases(g);
  ASSERT_EQ(cases.size(), 8u);
  std::set<std::string> dtypes;
  for (const test::GoldenCase& c : cases) {
    const std::string dtype = c.params.at("dtype");
    dtypes.insert(dtype);
    const int k = c.int_param("top_k"), T = c.int_param("T");
    RouterWeights r;
    ASSERT_NO_FATAL_FAILURE(r = golden_router(g, dtype, c.int_param("quantized") != 0, k));
    Tensor h, mlx_indices, mlx_weights;
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, c.name + ".h", &h));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, c.name + ".indices", &mlx_indices));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, c.name + ".weights", &mlx_weights));
    ASSERT_EQ(h.dtype(), dtype == "bf16" ? DType::bf16 : DType::f32) << c.name;

    const Routing ours = route(h, r);
    const std::vector<int32_t> oi = test::to_i32(ours.indices), mi = test::to_i32(mlx_indices);
    const std::vector<float> ow = test::to_float(ours.weights), mw = test::to_float(mlx_weights);
    const int64_t E = r.per_expert_scale.size(0);
    const std::vector<float> logits = test::cpu_router_logits(h, r);
    std::vector<float> ours_matched, mlx_matched;
    for (int t = 0; t < T; ++t) {
      // The case is a tie case in our own logits too: the lower-id rule would pick other experts.
      const std::vector<float> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
      EXPECT_NE(top_k_set(row, k, true), top_k_set(row, k, false)) << c.name << " token " << t << ": no tie at place " << k;
      std::map<int32_t, float> mine, theirs;
      for (int j = 0; j < k; ++j) {
        mine[oi[t * k + j]] = ow[t * k + j];
        theirs[mi[t * k + j]] = mw[t * k + j];
      }
      ASSERT_EQ(static_cast<int>(mine.size()), k) << c.name << " token " << t;
      std::set<int32_t> a, b;
      for (const auto& kv : mine) a.insert(kv.first);
      for (const auto& kv : theirs) b.insert(kv.first);
      EXPECT_EQ(a, b) << c.name << " token " << t;
      EXPECT_EQ(a, top_k_set(row, k, true)) << c.name << " token " << t;
      if (a != b) continue;
      for (const auto& kv : mine) {
        ours_matched.push_back(kv.second);
        mlx_matched.push_back(theirs[kv.first]);
      }
    }
    EXPECT_LE(test::rel_error(ours_matched, mlx_matched), dtype == "bf16" ? kTolBf16 : kTolF32) << c.name;
  }
  EXPECT_EQ(dtypes, (std::set<std::string>{"bf16", "f32"}));
}

}  // namespace
}  // namespace expertqmm

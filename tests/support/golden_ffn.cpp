#include "support/golden_ffn.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "support/golden.h"
#include "support/test_util.h"

namespace expertqmm::test {

void expect_layer_matches_mlx(const std::string& golden_file, size_t expected_cases, int64_t H, int k,
                              const FfnRunner& run, const std::string& variant) {
  SafetensorsFile g;
  ASSERT_NO_FATAL_FAILURE(open_golden(golden_file, &g));
  const std::vector<GoldenCase> cases = golden_cases(g);
  ASSERT_EQ(cases.size(), expected_cases) << golden_file;
  for (const GoldenCase& c : cases) {
    const int layer = c.int_param("layer"), T = c.int_param("T");
    const bool mlx_bf16 = variant.empty() && (!c.params.count("mlx_bf16") || c.int_param("mlx_bf16") != 0);
    const std::string key = "l" + std::to_string(layer) + ".t" + std::to_string(T);
    const std::string what = golden_file + " " + key + (variant.empty() ? "" : " " + variant);
    Tensor h, out_f32, indices, out_bf16, weights;
    ASSERT_NO_FATAL_FAILURE(golden_tensor(g, key + ".h", &h));
    ASSERT_NO_FATAL_FAILURE(golden_tensor(g, key + "." + variant + "f32_out", &out_f32));
    ASSERT_NO_FATAL_FAILURE(golden_tensor(g, key + ".indices", &indices));
    if (mlx_bf16) ASSERT_NO_FATAL_FAILURE(golden_tensor(g, key + ".out", &out_bf16));
    const bool has_weights = g.has(key + "." + variant + "weights");
    if (has_weights) ASSERT_NO_FATAL_FAILURE(golden_tensor(g, key + "." + variant + "weights", &weights));

    const FfnRun r = run(layer, h);
    ASSERT_EQ(r.out.shape(), (Shape{T, H})) << what;
    EXPECT_EQ(r.out.dtype(), DType::bf16) << what;
    const std::vector<float> ours = to_float(r.out);
    const double vs_twin = rel_error(ours, to_float(out_f32));
    EXPECT_LE(vs_twin, kTolFfnF32Twin) << what << " vs the float32 mlx-lm twin";
    if (mlx_bf16) {
      const double vs_bf16 = rel_error(ours, to_float(out_bf16));
      std::printf("%s: rel error vs f32 twin %.2e, vs mlx bf16 %.2e\n", what.c_str(), vs_twin, vs_bf16);
      EXPECT_LE(vs_bf16, kTolFfnMlxBf16) << what << " vs mlx-lm's bf16 output";
    } else {
      std::printf("%s: rel error vs f32 twin %.2e (no MLX bf16 result compared)\n", what.c_str(), vs_twin);
    }
    // The router picks the same experts per token (as sets; MLX leaves argpartition's order), with
    // the same weight per expert where the golden has them.
    const std::vector<int32_t> ours_idx = to_i32(r.routing.indices), mlx_idx = to_i32(indices);
    const std::vector<float> ours_w = to_float(r.routing.weights);
    const std::vector<float> mlx_w = has_weights ? to_float(weights) : std::vector<float>();
    for (int t = 0; t < T; ++t) {
      const std::set<int32_t> a(ours_idx.begin() + k * t, ours_idx.begin() + k * (t + 1));
      const std::set<int32_t> b(mlx_idx.begin() + k * t, mlx_idx.begin() + k * (t + 1));
      EXPECT_EQ(a, b) << what << " token " << t;
      if (!has_weights || a != b) continue;
      std::map<int32_t, float> expected;
      for (int j = 0; j < k; ++j) expected[mlx_idx[k * t + j]] = mlx_w[k * t + j];
      for (int j = 0; j < k; ++j)
        EXPECT_NEAR(ours_w[k * t + j], expected[ours_idx[k * t + j]], kTolRoutingWeight)
            << what << " token " << t << " expert " << ours_idx[k * t + j];
    }
  }
}

void expect_ffn_matches_mlx(const Gemma4Checkpoint& ck, const std::string& golden_file, size_t expected_cases) {
  expect_layer_matches_mlx(golden_file, expected_cases, ck.config().hidden_size,
                           static_cast<int>(ck.config().top_k_experts), [&](int layer, const Tensor& h) {
                             const Gemma4FfnWeights w = ck.layer(layer);
                             return FfnRun{gemma4_ffn(h, w), route(h, w.moe.router)};
                           });
}

}  // namespace expertqmm::test

#include "support/golden_ffn.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <set>

#include "support/golden.h"
#include "support/test_util.h"

namespace expertqmm::test {

void expect_ffn_matches_mlx(const Gemma4Checkpoint& ck, const std::string& golden_file, size_t expected_cases) {
  SafetensorsFile g;
  ASSERT_NO_FATAL_FAILURE(open_golden(golden_file, &g));
  const std::vector<GoldenCase> cases = golden_cases(g);
  ASSERT_EQ(cases.size(), expected_cases) << golden_file;
  const int64_t H = ck.config().hidden_size;
  const int k = static_cast<int>(ck.config().top_k_experts);
  for (const GoldenCase& c : cases) {
    const int layer = c.int_param("layer"), T = c.int_param("T");
    const bool mlx_bf16 = !c.params.count("mlx_bf16") || c.int_param("mlx_bf16") != 0;
    const std::string key = "l" + std::to_string(layer) + ".t" + std::to_string(T);
    const std::string what = golden_file + " " + key;
    Tensor h, out_f32, indices, out_bf16;
    ASSERT_NO_FATAL_FAILURE(golden_tensor(g, key + ".h", &h));
    ASSERT_NO_FATAL_FAILURE(golden_tensor(g, key + ".f32_out", &out_f32));
    ASSERT_NO_FATAL_FAILURE(golden_tensor(g, key + ".indices", &indices));
    if (mlx_bf16) ASSERT_NO_FATAL_FAILURE(golden_tensor(g, key + ".out", &out_bf16));
    const Gemma4FfnWeights w = ck.layer(layer);

    const Tensor out = gemma4_ffn(h, w);
    ASSERT_EQ(out.shape(), (Shape{T, H})) << what;
    EXPECT_EQ(out.dtype(), DType::bf16) << what;
    const std::vector<float> ours = to_float(out);
    const double vs_twin = rel_error(ours, to_float(out_f32));
    EXPECT_LE(vs_twin, kTolFfnF32Twin) << what << " vs the float32 mlx-lm twin";
    if (mlx_bf16) {
      const double vs_bf16 = rel_error(ours, to_float(out_bf16));
      std::printf("%s: rel error vs f32 twin %.2e, vs mlx bf16 %.2e\n", what.c_str(), vs_twin, vs_bf16);
      EXPECT_LE(vs_bf16, kTolFfnMlxBf16) << what << " vs mlx-lm's bf16 output";
    } else {
      std::printf("%s: rel error vs f32 twin %.2e (MLX's CPU has no bf16 result here)\n", what.c_str(), vs_twin);
    }
    // The router picks the same experts per token (as sets; MLX leaves argpartition's order).
    const Routing r = route(h, w.moe.router);
    const std::vector<int32_t> ours_idx = to_i32(r.indices), mlx_idx = to_i32(indices);
    for (int t = 0; t < T; ++t) {
      const std::set<int32_t> a(ours_idx.begin() + k * t, ours_idx.begin() + k * (t + 1));
      const std::set<int32_t> b(mlx_idx.begin() + k * t, mlx_idx.begin() + k * (t + 1));
      EXPECT_EQ(a, b) << what << " token " << t;
    }
  }
}

}  // namespace expertqmm::test

// The Gemma 4 decoder layer's feed-forward part against mlx-lm (tests/golden/make_layer_goldens.py):
// a tiny random gemma4_text model quantized and saved by mlx-lm itself is loaded through our
// checkpoint reader, and gemma4_ffn must reproduce mlx-lm's DecoderLayer feed-forward output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <set>

#include "expertqmm/checkpoint.h"
#include "support/golden.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

// docs/numerics.md, "MLX goldens": bf16 layer vs the float32 mlx-lm twin, and vs MLX's own bf16.
constexpr double kTolF32Twin = 1e-2;
constexpr double kTolMlxBf16 = 5e-2;

Gemma4Checkpoint open_tiny() { return Gemma4Checkpoint::open(test::golden_dir() + "/gemma4_tiny_ckpt"); }

TEST(GoldenGemma4Layer, ReaderSeesTheMlxLmCheckpointAsMlxLmWroteIt) {
  const Gemma4Checkpoint ck = open_tiny();
  const Gemma4Config& c = ck.config();
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 192);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.top_k_experts, 2);
  EXPECT_EQ(ck.num_layers(), 2);
  EXPECT_EQ(ck.prefix(), "model.");
  for (int l = 0; l < ck.num_layers(); ++l) {
    const Gemma4FfnWeights w = ck.layer(l);
    // experts at the default 4-bit g32; dense MLP and router.proj overridden to 8-bit g64
    EXPECT_EQ(w.moe.experts.gate.bits, 4);
    EXPECT_EQ(w.moe.experts.gate.group_size, 32);
    EXPECT_EQ(w.moe.experts.down.w.shape(), (Shape{8, 128, 64 * 4 / 32}));
    ASSERT_TRUE(w.mlp.gate.is_quantized());
    EXPECT_EQ(w.mlp.gate.quantized.bits, 8);
    EXPECT_EQ(w.mlp.down.quantized.group_size, 64);
    EXPECT_EQ(w.mlp.down.quantized.w.shape(), (Shape{128, 192 * 8 / 32}));
    ASSERT_TRUE(w.moe.router.proj.defined());
    EXPECT_EQ(w.moe.router.proj.bits, 8);
    EXPECT_EQ(w.moe.router.top_k, 2);
    EXPECT_EQ(w.layer_scalar.numel(), 1);
  }
}

TEST(GoldenGemma4Layer, FeedForwardMatchesMlxLmDecoderLayer) {
  const Gemma4Checkpoint ck = open_tiny();
  SafetensorsFile g;
  ASSERT_NO_FATAL_FAILURE(test::open_golden("gemma4_layer_ffn.safetensors", &g));
  const std::vector<test::GoldenCase> cases = test::golden_cases(g);
  ASSERT_EQ(cases.size(), 4u);
  for (const test::GoldenCase& c : cases) {
    const int layer = c.int_param("layer"), T = c.int_param("T");
    const std::string key = "l" + std::to_string(layer) + ".t" + std::to_string(T);
    Tensor h, out_bf16, out_f32, indices;
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, key + ".h", &h));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, key + ".out", &out_bf16));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, key + ".f32_out", &out_f32));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, key + ".indices", &indices));
    const Gemma4FfnWeights w = ck.layer(layer);

    const Tensor out = gemma4_ffn(h, w);
    ASSERT_EQ(out.shape(), (Shape{T, 128})) << key;
    EXPECT_EQ(out.dtype(), DType::bf16) << key;
    const std::vector<float> ours = test::to_float(out);
    const double vs_twin = test::rel_error(ours, test::to_float(out_f32));
    const double vs_bf16 = test::rel_error(ours, test::to_float(out_bf16));
    std::printf("%s: rel error vs f32 twin %.2e, vs mlx bf16 %.2e\n", key.c_str(), vs_twin, vs_bf16);
    EXPECT_LE(vs_twin, kTolF32Twin) << key << " vs the float32 mlx-lm twin";
    EXPECT_LE(vs_bf16, kTolMlxBf16) << key << " vs mlx-lm's bf16 output";

    // The router picks the same experts per token (as sets; MLX orders by ascending score).
    const Routing r = route(h, w.moe.router);
    const std::vector<int32_t> ours_idx = test::to_i32(r.indices), mlx_idx = test::to_i32(indices);
    for (int t = 0; t < T; ++t) {
      std::set<int32_t> a(ours_idx.begin() + 2 * t, ours_idx.begin() + 2 * t + 2);
      std::set<int32_t> b(mlx_idx.begin() + 2 * t, mlx_idx.begin() + 2 * t + 2);
      EXPECT_EQ(a, b) << key << " token " << t;
    }
  }
}

// Sanity of the goldens themselves: the layer changes h (so a pass-through could not match).
TEST(GoldenGemma4Layer, GoldenOutputIsNotTheInput) {
  SafetensorsFile g;
  ASSERT_NO_FATAL_FAILURE(test::open_golden("gemma4_layer_ffn.safetensors", &g));
  Tensor h, out;
  ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, "l0.t40.h", &h));
  ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, "l0.t40.f32_out", &out));
  EXPECT_GT(test::rel_error(test::to_float(h), test::to_float(out)), 0.1);
}

}  // namespace
}  // namespace expertqmm

// The Gemma 4 decoder layer's feed-forward part against mlx-lm (tests/golden/make_layer_goldens.py):
// a tiny random gemma4_text model quantized and saved by mlx-lm itself is loaded through our
// checkpoint reader, and gemma4_ffn must reproduce mlx-lm's DecoderLayer feed-forward output.
#include <gtest/gtest.h>

#include "expertqmm/checkpoint.h"
#include "support/golden.h"
#include "support/golden_ffn.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

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
  test::expect_ffn_matches_mlx(open_tiny(), "gemma4_layer_ffn.safetensors", 4);
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

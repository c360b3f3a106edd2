// The Qwen3-MoE feed-forward part against mlx-lm (tests/golden/make_qwen3_goldens.py): a tiny
// random qwen3_moe model quantized and saved by mlx-lm itself is loaded through our checkpoint
// reader, and qwen3_moe_ffn (softmax_topk router + SwiGLU SwitchGLU) must reproduce mlx-lm's
// Qwen3MoeDecoderLayer feed-forward output and its router's experts and weights.
#include <gtest/gtest.h>

#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"
#include "support/golden.h"
#include "support/golden_ffn.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

Gemma4Checkpoint open_tiny() { return Gemma4Checkpoint::open(test::golden_dir() + "/qwen3_tiny_ckpt"); }

// The layer's output and the routing of its normalised input (the block routes x, not h).
test::FfnRunner qwen3_runner(const Gemma4Checkpoint& ck, bool norm_topk_prob) {
  return [&ck, norm_topk_prob](int layer, const Tensor& h) {
    Qwen3MoeFfnWeights w = ck.qwen3_moe_layer(layer);
    w.moe.router.norm_topk_prob = norm_topk_prob;
    const Tensor x = rms_norm(h, w.post_attention_layernorm, w.eps);
    return test::FfnRun{qwen3_moe_ffn(h, w), route(x, w.moe.router)};
  };
}

TEST(GoldenQwen3Layer, ReaderSeesTheMlxLmCheckpointAsMlxLmWroteIt) {
  const Gemma4Checkpoint ck = open_tiny();
  const Gemma4Config& c = ck.config();
  EXPECT_EQ(ck.family(), ModelFamily::qwen3_moe);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.top_k_experts, 2);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(ck.num_layers(), 2);
  EXPECT_EQ(ck.prefix(), "model.");
  for (int l = 0; l < ck.num_layers(); ++l) {
    const Qwen3MoeFfnWeights w = ck.qwen3_moe_layer(l);
    EXPECT_EQ(w.post_attention_layernorm.shape(), (Shape{128}));
    // mlx-lm's qwen3_moe quant_predicate: mlp.gate 8-bit g64; the experts the default 4-bit g64.
    EXPECT_EQ(w.moe.router.kind, RouterKind::softmax_topk);
    ASSERT_TRUE(w.moe.router.proj.defined());
    EXPECT_EQ(w.moe.router.proj.bits, 8);
    EXPECT_EQ(w.moe.router.proj.group_size, 64);
    EXPECT_FALSE(w.moe.router.scale.defined());
    EXPECT_EQ(w.moe.router.top_k, 2);
    EXPECT_EQ(w.moe.experts.activation, Activation::swiglu);
    EXPECT_EQ(w.moe.experts.gate.bits, 4);
    EXPECT_EQ(w.moe.experts.up.group_size, 64);
    EXPECT_EQ(w.moe.experts.down.w.shape(), (Shape{8, 128, 64 * 4 / 32}));
  }
  // The Gemma 4 accessor refuses a Qwen3 checkpoint instead of reading absent names.
  EXPECT_THROW(ck.layer(0), Error);
}

TEST(GoldenQwen3Layer, FeedForwardAndRouterMatchMlxLm) {
  const Gemma4Checkpoint ck = open_tiny();
  test::expect_layer_matches_mlx("qwen3_layer_ffn.safetensors", 4, 128, 2, qwen3_runner(ck, true));
}

TEST(GoldenQwen3Layer, WithoutRenormalisationMatchesMlxLm) {
  const Gemma4Checkpoint ck = open_tiny();
  test::expect_layer_matches_mlx("qwen3_layer_ffn.safetensors", 4, 128, 2, qwen3_runner(ck, false), "no_renorm_");
}

// Sanity of the goldens: the layer changes h, and norm_topk_prob changes the output (so neither a
// pass-through nor a router that ignores the flag could match both).
TEST(GoldenQwen3Layer, GoldenOutputsDependOnTheLayerAndTheFlag) {
  SafetensorsFile g;
  ASSERT_NO_FATAL_FAILURE(test::open_golden("qwen3_layer_ffn.safetensors", &g));
  Tensor h, out, no_renorm;
  ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, "l0.t40.h", &h));
  ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, "l0.t40.f32_out", &out));
  ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, "l0.t40.no_renorm_f32_out", &no_renorm));
  const std::vector<float> hf = test::to_float(h), of = test::to_float(out), nf = test::to_float(no_renorm);
  std::vector<float> moe(of.size()), moe_nr(of.size());
  for (size_t i = 0; i < of.size(); ++i) moe[i] = of[i] - hf[i], moe_nr[i] = nf[i] - hf[i];
  EXPECT_GT(test::rel_error(hf, of), 1e-3);
  EXPECT_GT(test::rel_error(moe_nr, moe), 0.05);
}

}  // namespace
}  // namespace expertqmm

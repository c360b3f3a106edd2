// Checkpoints mlx-lm quantized per module in other ways than the default (tests/golden/
// make_checkpoint_goldens.py), loaded through our reader as mlx-lm's loader sees them, and
// gemma4_ffn against mlx-lm's feed-forward outputs on them.
#include <gtest/gtest.h>

#include "core/gather_qmm_problem.h"
#include "expertqmm/checkpoint.h"
#include "support/golden.h"
#include "support/golden_ffn.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

Gemma4Checkpoint open_golden_ckpt(const std::string& name) {
  return Gemma4Checkpoint::open(test::golden_dir() + "/" + name + "_ckpt");
}

void expect_quantized(const QuantizedWeight& q, int bits, int group_size, const std::string& what) {
  ASSERT_TRUE(q.defined()) << what;
  EXPECT_EQ(q.bits, bits) << what;
  EXPECT_EQ(q.group_size, group_size) << what;
}
void expect_quantized(const Linear& l, int bits, int group_size, const std::string& what) {
  ASSERT_TRUE(l.is_quantized()) << what;
  expect_quantized(l.quantized, bits, group_size, what);
}

// quant_predicate skipped ".mlp.": the dense MLP is bf16 and config.json has no entry for it.
TEST(GoldenCheckpoints, DenseMlpWithoutAConfigEntry) {
  const Gemma4Checkpoint ck = open_golden_ckpt("gemma4_dense_mlp");
  for (const auto& [path, setting] : ck.config().overrides)
    EXPECT_EQ(path.find(".mlp."), std::string::npos) << "the golden's config.json should not mention " << path;
  const Gemma4FfnWeights w = ck.layer(0);
  for (const Linear* l : {&w.mlp.gate, &w.mlp.up, &w.mlp.down}) {
    ASSERT_FALSE(l->is_quantized());
    EXPECT_EQ(l->dense.dtype(), DType::bf16);
  }
  EXPECT_EQ(w.mlp.down.dense.shape(), (Shape{128, 64}));
  // router.proj's entry is {"bits": 8}: group size from to_quantized's default, 64.
  expect_quantized(w.moe.router.proj, 8, 64, "router.proj");
  expect_quantized(w.moe.experts.down, 4, 64, "experts.down");
  test::expect_ffn_matches_mlx(ck, "gemma4_dense_mlp_ffn.safetensors", 2);
}

// The multimodal wrapper's names, bits and group sizes per projection and per layer, a `false`
// entry for a bf16 module, and an entry for every leaf module (mlx-lm's AWQ config form).
TEST(GoldenCheckpoints, MixedBitsPerModuleAndLayer) {
  const Gemma4Checkpoint ck = open_golden_ckpt("gemma4_mixed_bits");
  EXPECT_EQ(ck.prefix(), "language_model.model.");
  ASSERT_EQ(ck.num_layers(), 2);
  const Gemma4FfnWeights l0 = ck.layer(0), l1 = ck.layer(1);
  expect_quantized(l0.moe.experts.gate, 3, 32, "l0 experts.gate");
  expect_quantized(l0.moe.experts.up, 6, 128, "l0 experts.up");
  expect_quantized(l0.moe.experts.down, 2, 64, "l0 experts.down");
  expect_quantized(l0.mlp.gate, 8, 64, "l0 mlp.gate");
  expect_quantized(l0.mlp.up, 4, 64, "l0 mlp.up");
  expect_quantized(l0.mlp.down, 5, 32, "l0 mlp.down");
  expect_quantized(l0.moe.router.proj, 8, 64, "l0 router.proj");
  expect_quantized(l1.moe.experts.gate, 8, 128, "l1 experts.gate");
  expect_quantized(l1.moe.experts.up, 4, 64, "l1 experts.up");
  expect_quantized(l1.moe.experts.down, 5, 32, "l1 experts.down");
  ASSERT_FALSE(l1.mlp.up.is_quantized());
  EXPECT_EQ(l1.mlp.up.dense.dtype(), DType::bf16);
  expect_quantized(l1.moe.router.proj, 6, 32, "l1 router.proj");
  test::expect_ffn_matches_mlx(ck, "gemma4_mixed_bits_ffn.safetensors", 4);
}

// Expert width 80 with group size 64: mlx-lm left the experts' down_proj in bf16 (an unquantized
// SwitchLinear, MLX gather_mm) with no config entry; gate and up stay 4-bit. MLX's CPU computes
// gather_mm in float32 only, so the golden has the float32 twin's output and no bf16 one.
TEST(GoldenCheckpoints, ExpertsDownProjIn16Bit) {
  const Gemma4Checkpoint ck = open_golden_ckpt("gemma4_bf16_down");
  const Gemma4FfnWeights w = ck.layer(0);
  const SwitchGLUWeights& ex = w.moe.experts;
  ASSERT_TRUE(ex.down_dense.defined());
  EXPECT_FALSE(ex.down.defined());
  EXPECT_EQ(ex.down_dense.dtype(), DType::bf16);
  EXPECT_EQ(ex.down_dense.shape(), (Shape{8, 128, 80}));
  expect_quantized(ex.gate, 4, 64, "experts.gate");
  expect_quantized(ex.up, 4, 64, "experts.up");
  expect_quantized(w.moe.router.proj, 8, 64, "router.proj");
  test::expect_ffn_matches_mlx(ck, "gemma4_bf16_down_ffn.safetensors", 2);

  // With every float widened to float32 as the twin is, the whole layer (gather_mm included) is
  // MLX's float32 computation up to summation order (docs/numerics.md: 1e-4).
  auto widen = [](Tensor& t) {
    if (t.defined()) t = detail::cast_floating(t, DType::f32);
  };
  auto widen_q = [&](QuantizedWeight& q) { widen(q.scales), widen(q.biases); };
  Gemma4FfnWeights w32 = w;
  for (Tensor* t : {&w32.pre_feedforward_layernorm, &w32.post_feedforward_layernorm_1, &w32.pre_feedforward_layernorm_2,
                    &w32.post_feedforward_layernorm_2, &w32.post_feedforward_layernorm, &w32.layer_scalar,
                    &w32.moe.router.scale, &w32.moe.router.per_expert_scale, &w32.moe.experts.down_dense})
    widen(*t);
  for (QuantizedWeight* q : {&w32.mlp.gate.quantized, &w32.mlp.up.quantized, &w32.mlp.down.quantized,
                             &w32.moe.router.proj, &w32.moe.experts.gate, &w32.moe.experts.up})
    widen_q(*q);
  SafetensorsFile g;
  ASSERT_NO_FATAL_FAILURE(test::open_golden("gemma4_bf16_down_ffn.safetensors", &g));
  for (const char* key : {"l0.t3", "l0.t40"}) {
    Tensor h, out_f32;
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, std::string(key) + ".h", &h));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, std::string(key) + ".f32_out", &out_f32));
    const Tensor out = gemma4_ffn(detail::cast_floating(h, DType::f32), w32);
    ASSERT_EQ(out.dtype(), DType::f32);
    EXPECT_LE(test::rel_error(test::to_float(out), test::to_float(out_f32)), 1e-4) << key;
  }
}

// num_experts 1, top_k_experts 1: every token is routed to expert 0 with weight
// per_expert_scale[0] (the softmax of one logit is 1), as mlx-lm computes it.
TEST(GoldenCheckpoints, OneExpertTopOne) {
  const Gemma4Checkpoint ck = open_golden_ckpt("gemma4_one_expert");
  const Gemma4FfnWeights w = ck.layer(0);
  EXPECT_EQ(w.moe.experts.gate.w.size(0), 1);
  EXPECT_EQ(w.moe.router.top_k, 1);
  const Tensor h = test::random_tensor({5, 128}, DType::bf16);
  const Routing r = route(h, w.moe.router);
  EXPECT_EQ(test::to_i32(r.indices), std::vector<int32_t>(5, 0));
  const float pes = test::to_float(w.moe.router.per_expert_scale)[0];
  for (float weight : test::to_float(r.weights)) EXPECT_EQ(weight, pes);
  test::expect_ffn_matches_mlx(ck, "gemma4_one_expert_ffn.safetensors", 2);
}

// quantize_model(mode="mxfp4") with per-module modes: the experts' gate and up mxfp4 (the default),
// their down_proj nvfp4, the dense MLP mxfp8 (a dict with only "mode"), router.proj affine 8-bit
// (a dict without "mode"); uint8 scales, no biases; the layer against mlx-lm's own outputs.
TEST(GoldenCheckpoints, FpQuantizationModesPerModule) {
  const Gemma4Checkpoint ck = open_golden_ckpt("gemma4_fp_modes");
  EXPECT_EQ(ck.config().default_quant.mode, QuantMode::mxfp4);
  const Gemma4FfnWeights w = ck.layer(0);
  const std::pair<const QuantizedWeight*, QuantMode> expected[] = {
      {&w.moe.experts.gate, QuantMode::mxfp4}, {&w.moe.experts.up, QuantMode::mxfp4},
      {&w.moe.experts.down, QuantMode::nvfp4}, {&w.mlp.gate.quantized, QuantMode::mxfp8},
      {&w.mlp.down.quantized, QuantMode::mxfp8}, {&w.moe.router.proj, QuantMode::affine}};
  for (const auto& [q, mode] : expected) {
    ASSERT_TRUE(q->defined());
    EXPECT_EQ(q->mode, mode) << quant_mode_name(mode);
    EXPECT_EQ(q->bits, mode == QuantMode::affine ? 8 : quant_mode_bits(mode));
    EXPECT_EQ(q->group_size, mode == QuantMode::affine ? 64 : quant_mode_group_size(mode));
    EXPECT_EQ(q->scales.dtype(), mode == QuantMode::affine ? DType::bf16 : DType::u8);
    EXPECT_EQ(q->biases.defined(), mode == QuantMode::affine);
  }
  test::expect_ffn_matches_mlx(ck, "gemma4_fp_modes_ffn.safetensors", 2);
}

// T = 0: MLX 0.32.4's CPU cannot run mlx-lm's layer on it (its quantized_matmul stops the process
// with SIGFPE on zero rows: router.proj and the dense MLP), while gather_qmm and the dense router
// give the empty shapes; gemma4_ffn returns [0, H] in h's dtype for every golden checkpoint.
TEST(GoldenCheckpoints, ZeroTokensGiveAnEmptyOutput) {
  for (const char* name : {"gemma4_tiny", "gemma4_dense_mlp", "gemma4_mixed_bits", "gemma4_bf16_down", "gemma4_one_expert",
                           "gemma4_fp_modes"}) {
    const Gemma4Checkpoint ck = open_golden_ckpt(name);
    const int64_t H = ck.config().hidden_size;
    const Gemma4FfnWeights w = ck.layer(0);
    const Tensor out = gemma4_ffn(Tensor::empty({0, H}, DType::bf16), w);
    EXPECT_EQ(out.shape(), (Shape{0, H})) << name;
    EXPECT_EQ(out.dtype(), DType::bf16) << name;
    const Routing r = route(Tensor::empty({0, H}, DType::bf16), w.moe.router);
    EXPECT_EQ(r.indices.shape(), (Shape{0, ck.config().top_k_experts})) << name;
    EXPECT_EQ(r.weights.dtype(), DType::bf16) << name;
  }
}

}  // namespace
}  // namespace expertqmm

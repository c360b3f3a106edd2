// Checkpoints in MLX's fp quantization modes (mxfp4, mxfp8, nvfp4): config.json's "mode" at the top
// level and per module (as mlx-lm's load_model passes them to to_quantized), the mode inferred
// from uint8 scales for a module without an entry (mlx-lm's infer_quant_config), the writer's
// round trip, and the errors for combinations MLX refuses.
#include <gtest/gtest.h>

#include "expertqmm/checkpoint.h"
#include "support/checkpoint_files.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

using test::expect_error;
using test::read_all;
using test::replace_once;
using test::write_all;

std::string text_keys() {
  return R"("hidden_size": 128, "intermediate_size": 192, "moe_intermediate_size": 64, "num_experts": 8,
      "top_k_experts": 2, "enable_moe_block": true, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
      "num_hidden_layers": 1)";
}

TEST(CheckpointQuantModes, ConfigModesAsMlxLmReadsThem) {
  const Gemma4Config c = parse_gemma4_config(
      "{" + text_keys() + R"(, "quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4",
          "model.layers.0.router.proj": {"group_size": 64, "bits": 8},
          "model.layers.0.mlp.gate_proj": {"mode": "mxfp8"},
          "model.layers.0.mlp.up_proj": {"mode": "nvfp4", "bits": 4},
          "model.layers.0.mlp.down_proj": true}})",
      "c.json");
  EXPECT_EQ(c.default_quant.mode, QuantMode::mxfp4);
  EXPECT_EQ(c.default_quant.group_size, 32);
  // A module dict without "mode" is affine (to_quantized's default), whatever the top level says.
  EXPECT_EQ(c.quant_for("model.layers.0.router.proj").mode, QuantMode::affine);
  EXPECT_EQ(c.quant_for("model.layers.0.router.proj").bits, 8);
  // Missing bits / group_size: the mode's defaults.
  const QuantSetting g = c.quant_for("model.layers.0.mlp.gate_proj");
  EXPECT_EQ(g.mode, QuantMode::mxfp8);
  EXPECT_EQ(g.bits, 8);
  EXPECT_EQ(g.group_size, 32);
  const QuantSetting u = c.quant_for("model.layers.0.mlp.up_proj");
  EXPECT_EQ(u.mode, QuantMode::nvfp4);
  EXPECT_EQ(u.group_size, 16);
  EXPECT_EQ(c.quant_for("model.layers.0.mlp.down_proj").mode, QuantMode::mxfp4);  // true: the default
  EXPECT_EQ(c.quant_for("model.layers.0.experts.switch_glu.gate_proj").mode, QuantMode::mxfp4);

  expect_error([] {
    parse_gemma4_config("{" + text_keys() + R"(, "quantization": {"group_size": 64, "bits": 4, "mode": "mxfp4"}})",
                        "c.json");
  }, {"c.json", "quantization \"default\"", "mode \"mxfp4\" takes bits=4 and group_size=32 only; got bits=4 group_size=64"});
  expect_error([] {
    parse_gemma4_config("{" + text_keys() + R"(, "quantization": {"group_size": 32, "bits": 4, "mode": 4}})", "c.json");
  }, {"c.json", "unknown quantization mode (not a string)"});
}

// Experts mxfp4 (the default), dense MLP mxfp8, router nvfp4 (per-module entries).
Gemma4Config mixed_modes_config() {
  Gemma4Config c = test::gemma4_config(128, 192, 64, 8, 2, 1);
  c.default_quant = {4, 32, QuantMode::mxfp4};
  for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
    c.overrides[std::string("model.layers.0.") + m] = {8, 32, QuantMode::mxfp8};
  c.overrides["model.layers.0.router.proj"] = {4, 16, QuantMode::nvfp4};
  return c;
}

TEST(CheckpointQuantModes, WriterRoundTripAndTheLayerRuns) {
  const Gemma4Config c = mixed_modes_config();
  const std::string dir = test::fresh_dir("fp_modes");
  write_gemma4_checkpoint(dir, c, 1, [&](int n) { return synthetic_gemma4_layer(c, n, 11); });
  const std::string text = read_all(dir + "/config.json");
  EXPECT_NE(text.find("\"bits\": 4, \"mode\": \"mxfp4\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"model.layers.0.router.proj\": {\"group_size\": 16, \"bits\": 4, \"mode\": \"nvfp4\"}"),
            std::string::npos) << text;
  const Gemma4Checkpoint ck = Gemma4Checkpoint::open(dir);
  const Gemma4FfnWeights w = ck.layer(0), want = synthetic_gemma4_layer(c, 0, 11);
  test::expect_same_layer(w, want, "layer 0");
  EXPECT_EQ(w.moe.experts.gate.mode, QuantMode::mxfp4);
  EXPECT_EQ(w.moe.experts.gate.scales.dtype(), DType::u8);
  EXPECT_FALSE(w.moe.experts.gate.biases.defined());
  EXPECT_EQ(w.mlp.gate.quantized.mode, QuantMode::mxfp8);
  EXPECT_EQ(w.moe.router.proj.mode, QuantMode::nvfp4);
  EXPECT_EQ(w.moe.router.proj.scales.shape(), (Shape{8, 128 / 16}));
  const Tensor h = test::random_tensor({5, 128}, DType::bf16);
  const Tensor out = gemma4_ffn(h, w);
  EXPECT_EQ(out.to_host_bytes(), gemma4_ffn(h, want).to_host_bytes());
  for (float v : test::to_float(out)) ASSERT_TRUE(std::isfinite(v));
}

// Without config entries, a module's mode comes from its tensors: uint8 scales and (bits, group).
TEST(CheckpointQuantModes, ModeInferredFromUint8Scales) {
  const Gemma4Config c = mixed_modes_config();
  const std::string dir = test::fresh_dir("fp_infer");
  write_gemma4_checkpoint(dir, c, 1, [&](int n) { return synthetic_gemma4_layer(c, n, 12); });
  std::string text = read_all(dir + "/config.json");
  for (int twice = 0; twice < 2; ++twice) {
    replace_once(text, ",\n    \"model.layers.0.router.proj\": {\"group_size\": 16, \"bits\": 4, \"mode\": \"nvfp4\"}", "");
    replace_once(text, ",\n    \"model.layers.0.mlp.gate_proj\": {\"group_size\": 32, \"bits\": 8, \"mode\": \"mxfp8\"}",
                 "");
  }
  write_all(dir + "/config.json", text);
  const Gemma4FfnWeights w = Gemma4Checkpoint::open(dir).layer(0);
  EXPECT_EQ(w.moe.router.proj.mode, QuantMode::nvfp4);
  EXPECT_EQ(w.moe.router.proj.group_size, 16);
  EXPECT_EQ(w.mlp.gate.quantized.mode, QuantMode::mxfp8);
  EXPECT_EQ(w.mlp.gate.quantized.bits, 8);
}

TEST(CheckpointQuantModes, EntriesThatDisagreeWithTheTensorsAreErrors) {
  const Gemma4Config c = mixed_modes_config();
  const std::string dir = test::fresh_dir("fp_disagree");
  write_gemma4_checkpoint(dir, c, 1, [&](int n) { return synthetic_gemma4_layer(c, n, 13); });
  const std::string cfg = read_all(dir + "/config.json");
  // The config says affine 8-bit for an mxfp8 module: its uint8 scales are not float scales, and
  // it has no biases.
  std::string text = cfg;
  for (int twice = 0; twice < 2; ++twice)
    replace_once(text, "\"model.layers.0.mlp.gate_proj\": {\"group_size\": 32, \"bits\": 8, \"mode\": \"mxfp8\"}",
                 "\"model.layers.0.mlp.gate_proj\": {\"group_size\": 32, \"bits\": 8}");
  write_all(dir + "/config.json", text);
  expect_error([&] { Gemma4Checkpoint::open(dir).layer(0); },
               {"model.layers.0.mlp.gate_proj.scales", "is uint8", "quantizes 'model.layers.0.mlp.gate_proj' as affine"});
  // An nvfp4 global scale (MLX computes gather_qmm with one on the GPU only).
  write_all(dir + "/config.json", cfg);
  test::rewrite_safetensors(dir + "/model.safetensors", [](std::vector<std::pair<std::string, Tensor>>& t) {
    const float g = 0.5f;
    t.push_back({"model.layers.0.router.proj.global_scale", Tensor::from_host(&g, {}, DType::f32, Device::cpu)});
  });
  expect_error([&] { Gemma4Checkpoint::open(dir).layer(0); },
               {"model.layers.0.router.proj.global_scale", "global scales are not supported"});
}

}  // namespace
}  // namespace expertqmm

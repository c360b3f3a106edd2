// config.json and per-module quantization read the way mlx-lm reads them (utils.load_model,
// gemma4.ModelArgs / gemma4_text.ModelArgs): which object holds the text config, mlx-lm's defaults
// for absent keys, config entries (dict, true, false, absent) and, for a module without an entry,
// "quantized iff <module>.scales exists" with bits and group size read off the shapes.
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

// A text config body with the keys mlx-lm needs for a Gemma 4 MoE layer (no enclosing braces).
std::string text_keys(int layers = 2) {
  return R"("hidden_size": 128, "intermediate_size": 192, "moe_intermediate_size": 64, "num_experts": 8,
      "top_k_experts": 2, "enable_moe_block": true, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
      "num_hidden_layers": )" + std::to_string(layers);
}

TEST(CheckpointMlxConfig, ModelTypeSaysWhereTheTextConfigIs) {
  // gemma4: text_config, even when the top level has other numbers.
  Gemma4Config c = parse_gemma4_config(
      R"({"model_type": "gemma4", "hidden_size": 999, "text_config": {)" + text_keys() + "}}", "c.json");
  EXPECT_EQ(c.hidden_size, 128);
  // gemma4_text: the top level; a text_config beside it is not read (mlx-lm reads the top level).
  c = parse_gemma4_config(R"({"model_type": "gemma4_text", )" + text_keys(3) +
                              R"(, "text_config": {"hidden_size": 5}})",
                          "c.json");
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_hidden_layers, 3);
  // No model_type: text_config when present, else the top level.
  EXPECT_EQ(parse_gemma4_config("{\"text_config\": {" + text_keys() + "}}", "c.json").hidden_size, 128);
  EXPECT_EQ(parse_gemma4_config("{" + text_keys() + "}", "c.json").hidden_size, 128);
  expect_error([] { parse_gemma4_config(R"({"model_type": "gemma3", )" + text_keys() + "}", "c.json"); },
               {"c.json", "gemma3", "not a supported MoE model"});
  expect_error([] { parse_gemma4_config(R"({"model_type": "gemma4", )" + text_keys() + "}", "c.json"); },
               {"c.json", "text_config"});
}

// qwen3_moe.ModelArgs' keys: num_experts_per_tok is the top-k, norm_topk_prob is required, and a
// model with dense layers is refused (qwen3_moe_ffn runs MoE layers only).
TEST(CheckpointMlxConfig, Qwen3MoeKeysAsMlxLmReadsThem) {
  auto qwen3 = [](const std::string& extra) {
    return R"({"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 192,
      "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 3)" + extra + "}";
  };
  const std::string ok = R"(, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": false)";
  const Gemma4Config c = parse_gemma4_config(qwen3(ok), "c.json");
  EXPECT_EQ(c.family, ModelFamily::qwen3_moe);
  EXPECT_EQ(c.top_k_experts, 2);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.mlp_intermediate_size(2), 192);
  expect_error([&] { parse_gemma4_config(qwen3(R"(, "decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": true)"), "c.json"); },
               {"c.json", "decoder_sparse_step\" is 2"});
  expect_error([&] { parse_gemma4_config(qwen3(R"(, "decoder_sparse_step": 1, "mlp_only_layers": [0], "norm_topk_prob": true)"), "c.json"); },
               {"c.json", "mlp_only_layers", "empty"});
  expect_error([&] { parse_gemma4_config(qwen3(R"(, "decoder_sparse_step": 1, "mlp_only_layers": [])"), "c.json"); },
               {"c.json", "norm_topk_prob"});
  // Gemma 4's key name is not read for Qwen3.
  expect_error([&] { parse_gemma4_config(R"({"model_type": "qwen3_moe", )" + text_keys() + ok + "}", "c.json"); },
               {"c.json", "num_experts_per_tok", "missing"});
  // The writer's config.json reads back as the same Qwen3 config.
  const Gemma4Config q = Gemma4Config::qwen3_30b_a3b(2);
  const Gemma4Config back = parse_gemma4_config(q.to_json(), "written.json");
  EXPECT_EQ(back.family, ModelFamily::qwen3_moe);
  EXPECT_EQ(back.hidden_size, 2048);
  EXPECT_EQ(back.moe_intermediate_size, 768);
  EXPECT_EQ(back.num_experts, 128);
  EXPECT_EQ(back.top_k_experts, 8);
  EXPECT_TRUE(back.norm_topk_prob);
  EXPECT_EQ(back.quant_for("model.layers.1.mlp.gate").bits, 8);
  EXPECT_EQ(back.quant_for("model.layers.1.mlp.switch_mlp.down_proj", 768).bits, 4);
}

TEST(CheckpointMlxConfig, AbsentKeysTakeMlxLmDefaults) {
  const std::string base = R"("hidden_size": 128, "intermediate_size": 192, "moe_intermediate_size": 64,
      "num_experts": 8, "top_k_experts": 2, "num_hidden_layers": 30)";
  // enable_moe_block defaults to false in mlx-lm: no MoE block, nothing for gemma4_ffn to run.
  expect_error([&] { parse_gemma4_config("{" + base + ", \"hidden_size_per_layer_input\": 0}", "c.json"); },
               {"c.json", "enable_moe_block", "absent"});
  expect_error([&] {
    parse_gemma4_config("{" + base + ", \"enable_moe_block\": false, \"hidden_size_per_layer_input\": 0}", "c.json");
  }, {"c.json", "enable_moe_block", "false"});
  // hidden_size_per_layer_input defaults to 256: per-layer inputs, which gemma4_ffn does not compute.
  expect_error([&] { parse_gemma4_config("{" + base + ", \"enable_moe_block\": true}", "c.json"); },
               {"c.json", "hidden_size_per_layer_input", "256", "default"});
  expect_error([&] {
    parse_gemma4_config("{" + base + ", \"enable_moe_block\": true, \"hidden_size_per_layer_input\": 64}", "c.json");
  }, {"c.json", "hidden_size_per_layer_input\" is 64"});
  // num_kv_shared_layers defaults to 20 and use_double_wide_mlp to true: mlx-lm's MLP is twice as
  // wide on the last 20 of 30 layers.
  const Gemma4Config c = parse_gemma4_config(
      "{" + base + ", \"enable_moe_block\": true, \"hidden_size_per_layer_input\": 0}", "c.json");
  EXPECT_EQ(c.num_kv_shared_layers, 20);
  EXPECT_TRUE(c.use_double_wide_mlp);
  EXPECT_EQ(c.mlp_intermediate_size(9), 192);
  EXPECT_EQ(c.mlp_intermediate_size(10), 384);
  EXPECT_EQ(c.mlp_intermediate_size(29), 384);
  const Gemma4Config narrow = parse_gemma4_config(
      "{" + base + ", \"enable_moe_block\": true, \"hidden_size_per_layer_input\": 0, \"use_double_wide_mlp\": false}",
      "c.json");
  EXPECT_EQ(narrow.mlp_intermediate_size(29), 192);
  // Every layer shared (first shared layer 0) is not a KV-shared layer in mlx-lm (it needs > 0).
  Gemma4Config all_shared = c;
  all_shared.num_kv_shared_layers = 30;
  EXPECT_EQ(all_shared.mlp_intermediate_size(29), 192);
  // The 26B-A4B config (num_kv_shared_layers 0) keeps every MLP at 2112, and to_json says so.
  const Gemma4Config big = parse_gemma4_config(Gemma4Config::gemma4_26b_a4b(30).to_json(), "big.json");
  EXPECT_EQ(big.num_kv_shared_layers, 0);
  EXPECT_EQ(big.mlp_intermediate_size(29), 2112);
}

TEST(CheckpointMlxConfig, QuantizationEntriesAsMlxLmHonoursThem) {
  const Gemma4Config c = parse_gemma4_config(
      "{" + text_keys() + R"(, "quantization": {"group_size": 32, "bits": 4, "mode": "affine",
          "model.layers.0.router.proj": {"bits": 8},
          "model.layers.0.mlp.gate_proj": {"group_size": 128},
          "model.layers.0.mlp.up_proj": true,
          "model.layers.0.mlp.down_proj": false}})",
      "c.json");
  // A dict entry goes to to_quantized: what it omits takes MLX's affine defaults (64, 4 bits).
  EXPECT_EQ(c.quant_for("model.layers.0.router.proj").bits, 8);
  EXPECT_EQ(c.quant_for("model.layers.0.router.proj").group_size, 64);
  EXPECT_EQ(c.quant_for("model.layers.0.mlp.gate_proj").bits, 4);
  EXPECT_EQ(c.quant_for("model.layers.0.mlp.gate_proj").group_size, 128);
  // true takes the top-level default; false leaves the module unquantized.
  EXPECT_EQ(c.quant_for("model.layers.0.mlp.up_proj").group_size, 32);
  EXPECT_FALSE(c.quant_for("model.layers.0.mlp.down_proj").quantized());
  // mlx-lm's quantize_model leaves a module whose input width is not a multiple of the default
  // group size unquantized (Gemma 4's expert down_proj, 704 inputs, at group size 128).
  Gemma4Config g128 = Gemma4Config::gemma4_26b_a4b(1);
  g128.default_quant = {4, 128};
  EXPECT_FALSE(g128.quant_for("model.layers.0.experts.switch_glu.down_proj", 704).quantized());
  EXPECT_EQ(g128.quant_for("model.layers.0.experts.switch_glu.gate_proj", 2816).group_size, 128);
  EXPECT_EQ(g128.quant_for("model.layers.0.router.proj", 2816).bits, 8);  // its override
  expect_error([] {
    parse_gemma4_config("{" + text_keys() + R"(, "quantization": {"group_size": 64, "bits": 4,
        "model.layers.0.mlp.up_proj": {"bits": 4, "group_size": 32, "mode": "nvfp4"}}})", "c.json");
  }, {"c.json", "model.layers.0.mlp.up_proj", "mode \"nvfp4\" takes bits=4 and group_size=16 only"});
  expect_error([] {
    parse_gemma4_config("{" + text_keys() + R"(, "quantization": {"group_size": 64, "bits": 4, "mode": "fp4"}})",
                        "c.json");
  }, {"c.json", "unknown quantization mode \"fp4\""});
  expect_error([] {
    parse_gemma4_config("{" + text_keys() + R"(, "quantization": {"group_size": 64, "bits": 4,
        "model.layers.0.mlp.up_proj": [4]}})", "c.json");
  }, {"c.json", "model.layers.0.mlp.up_proj", "object or a boolean"});
}

// A tiny checkpoint (layers 2) written by our writer with the dense MLP left unquantized through
// `false` entries; tests then edit config.json the way other mlx-lm configurations look.
Gemma4Config dense_mlp_config() {
  Gemma4Config c = test::gemma4_config(128, 192, 64, 8, 2, 2);
  for (int l = 0; l < 2; ++l) {
    const std::string layer = "model.layers." + std::to_string(l) + ".";
    for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) c.overrides[layer + m] = QuantSetting{};
    c.overrides[layer + "router.proj"] = {8, 64};
  }
  return c;
}

std::string write_dense_mlp(const std::string& tag) {
  const std::string dir = test::fresh_dir(tag);
  const Gemma4Config c = dense_mlp_config();
  write_gemma4_checkpoint(dir, c, 1, [&](int n) { return synthetic_gemma4_layer(c, n, 5); });
  return dir;
}

// Removes every `"<key>": false` entry of config.json (both quantization objects).
void drop_false_entries(const std::string& dir) {
  std::string text = read_all(dir + "/config.json");
  for (size_t at; (at = text.find(": false")) != std::string::npos;) {
    const size_t begin = text.rfind(",", at);
    text.erase(begin, at + 7 - begin);
  }
  write_all(dir + "/config.json", text);
}

TEST(CheckpointMlxLoad, DenseMlpWithoutAConfigEntryLoadsAndRuns) {
  const std::string with_false = write_dense_mlp("dense_false"), no_entry = write_dense_mlp("dense_none");
  drop_false_entries(no_entry);
  ASSERT_EQ(read_all(no_entry + "/config.json").find("mlp.gate_proj"), std::string::npos);
  const Gemma4Checkpoint a = Gemma4Checkpoint::open(with_false), b = Gemma4Checkpoint::open(no_entry);
  const Tensor h = test::random_tensor({5, 128}, DType::bf16);
  for (int l = 0; l < 2; ++l) {
    const Gemma4FfnWeights wa = a.layer(l), wb = b.layer(l);
    ASSERT_FALSE(wb.mlp.gate.is_quantized());
    ASSERT_FALSE(wb.mlp.down.is_quantized());
    EXPECT_EQ(wb.mlp.down.dense.dtype(), DType::bf16);
    EXPECT_EQ(wb.mlp.down.dense.shape(), (Shape{128, 192}));
    EXPECT_EQ(wb.moe.router.proj.bits, 8);
    EXPECT_EQ(wb.moe.experts.gate.bits, 4);
    EXPECT_EQ(gemma4_ffn(h, wa).to_host_bytes(), gemma4_ffn(h, wb).to_host_bytes()) << "layer " << l;
  }
}

TEST(CheckpointMlxLoad, ModuleWithoutAnEntryTakesItsBitsFromTheShapes) {
  // The dense MLP at 8-bit group 32 while the default says 4-bit group 64, and layer 1's entries
  // removed: mlx-lm infers 8/32 from its tensors (utils.infer_quant_config).
  Gemma4Config c = dense_mlp_config();
  for (const char* layer : {"model.layers.0.", "model.layers.1."})
    for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) c.overrides[std::string(layer) + m] = {8, 32};
  const std::string dir = test::fresh_dir("inferred");
  write_gemma4_checkpoint(dir, c, 1, [&](int n) { return synthetic_gemma4_layer(c, n, 5); });
  std::string text = read_all(dir + "/config.json");
  for (const char* m : {"gate_proj", "up_proj", "down_proj"})
    for (int twice = 0; twice < 2; ++twice)
      replace_once(text, ",\n    \"model.layers.1.mlp." + std::string(m) + "\": {\"group_size\": 32, \"bits\": 8}", "");
  write_all(dir + "/config.json", text);
  const Gemma4Checkpoint ck = Gemma4Checkpoint::open(dir);
  const Gemma4FfnWeights w = ck.layer(1);
  ASSERT_TRUE(w.mlp.gate.is_quantized());
  EXPECT_EQ(w.mlp.gate.quantized.bits, 8);
  EXPECT_EQ(w.mlp.gate.quantized.group_size, 32);
  EXPECT_EQ(w.mlp.down.quantized.w.shape(), (Shape{128, 192 * 8 / 32}));
  EXPECT_EQ(ck.layer(0).mlp.gate.quantized.group_size, 32);  // by its entry
}

// 16-bit experts: the writer leaves what group size 128 cannot quantize in bf16 (mlx-lm's rule),
// and the experts' gate_proj by a `false` entry; the reader hands each back as written.
TEST(CheckpointMlxLoad, SixteenBitExpertsRoundTrip) {
  Gemma4Config c = dense_mlp_config();
  c.default_quant = {4, 128};
  c.overrides.clear();
  for (const char* layer : {"model.layers.0.", "model.layers.1."})
    c.overrides[std::string(layer) + "experts.switch_glu.gate_proj"] = QuantSetting{};
  const std::string dir = test::fresh_dir("bf16_experts");
  write_gemma4_checkpoint(dir, c, 2, [&](int n) { return synthetic_gemma4_layer(c, n, 9); });
  std::string text = read_all(dir + "/config.json");
  ASSERT_NE(text.find("\"model.layers.1.experts.switch_glu.gate_proj\": false"), std::string::npos);
  const Gemma4Checkpoint ck = Gemma4Checkpoint::open(dir);
  for (int l = 0; l < 2; ++l) {
    const Gemma4FfnWeights w = ck.layer(l), want = synthetic_gemma4_layer(c, l, 9);
    const SwitchGLUWeights& ex = w.moe.experts;
    ASSERT_TRUE(ex.down_dense.defined()) << "layer " << l;  // 64 inputs: not a multiple of 128
    EXPECT_FALSE(ex.down.defined());
    EXPECT_EQ(ex.down_dense.to_host_bytes(), want.moe.experts.down_dense.to_host_bytes());
    EXPECT_EQ(ex.up.group_size, 128);
    EXPECT_TRUE(ex.gate_dense.defined());
    EXPECT_FALSE(ex.gate.defined());
    EXPECT_FALSE(w.mlp.down.is_quantized());  // 192 inputs
    const Tensor h = test::random_tensor({4, 128}, DType::bf16);
    EXPECT_EQ(gemma4_ffn(h, w).to_host_bytes(), gemma4_ffn(h, want).to_host_bytes()) << "layer " << l;
  }
}

// No "quantization" at all (a bf16 checkpoint as mlx-lm saves an unconverted model): every module,
// experts and router included, is 16-bit.
TEST(CheckpointMlxLoad, UnquantizedCheckpointIsAll16Bit) {
  Gemma4Config c = test::gemma4_config(128, 192, 64, 8, 2, 1);
  c.quantized = false;
  const std::string dir = test::fresh_dir("bf16_all");
  write_gemma4_checkpoint(dir, c, 1, [&](int n) { return synthetic_gemma4_layer(c, n, 3); });
  ASSERT_EQ(read_all(dir + "/config.json").find("quantization"), std::string::npos);
  const Gemma4FfnWeights w = Gemma4Checkpoint::open(dir).layer(0);
  EXPECT_TRUE(w.moe.router.proj_dense.defined());
  EXPECT_TRUE(w.moe.experts.gate_dense.defined() && w.moe.experts.up_dense.defined() && w.moe.experts.down_dense.defined());
  EXPECT_FALSE(w.mlp.gate.is_quantized());
  const Tensor h = test::random_tensor({6, 128}, DType::bf16);
  EXPECT_EQ(gemma4_ffn(h, w).to_host_bytes(), gemma4_ffn(h, synthetic_gemma4_layer(c, 0, 3)).to_host_bytes());
}

TEST(CheckpointMlxLoad, EntriesThatDisagreeWithTheTensorsAreErrors) {
  // `false` for a module that has scales (mlx-lm's strict load rejects the extra tensors).
  const std::string dir = write_dense_mlp("disagree");
  const std::string cfg = read_all(dir + "/config.json");
  std::string text = cfg;
  replace_once(text, "\"model.layers.0.router.proj\": {\"group_size\": 64, \"bits\": 8}", "\"model.layers.0.router.proj\": false");
  write_all(dir + "/config.json", text);
  expect_error([&] { Gemma4Checkpoint::open(dir); },
               {dir + "/model.safetensors", "model.layers.0.router.proj.scales", "unquantized (false)"});
  // A dict entry for a module stored in bf16 (no scales).
  text = cfg;
  replace_once(text, "\"model.layers.1.mlp.up_proj\": false", "\"model.layers.1.mlp.up_proj\": {\"bits\": 8}");
  write_all(dir + "/config.json", text);
  expect_error([&] { Gemma4Checkpoint::open(dir); },
               {dir + "/model.safetensors", "quantizes 'model.layers.1.mlp.up_proj'", "no tensor"});
  // Scales without any "quantization" object: mlx-lm would quantize nothing.
  text = cfg;
  const size_t q = text.find(",\n  \"quantization\"");
  ASSERT_NE(q, std::string::npos);
  text = text.substr(0, q) + "\n}\n";
  write_all(dir + "/config.json", text);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {"router.proj.scales", "no \"quantization\""});
  // Shapes no MLX quantization gives: 28 words for 128 inputs would be 7 bits.
  write_all(dir + "/config.json", cfg);
  test::rewrite_safetensors(dir + "/model.safetensors", [](auto& t) {
    for (auto& [name, tensor] : t)
      if (name == "model.layers.0.experts.switch_glu.gate_proj.weight")
        tensor = Tensor::from_host(std::vector<uint32_t>(8 * 64 * 28, 0u).data(), {8, 64, 28}, DType::u32);
  });
  expect_error([&] { Gemma4Checkpoint::open(dir); },
               {"model.layers.0.experts.switch_glu.gate_proj.weight", "bits=7"});
}

}  // namespace
}  // namespace expertqmm

// The Gemma 4 checkpoint writer and reader: round trips (one file, shards with an index, both name
// prefixes), and every bad-input class of an untrusted checkpoint giving an Error that names the
// file and the tensor or key: truncated files, header lengths past the end, overlapping byte
// ranges, wrong dtypes or shapes for a known name, missing tensors, unknown quantization.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"
#include "support/checkpoint_util.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

using test::expect_error;
using test::expect_same_layer;
using test::fresh_dir;
using test::read_all;
using test::tiny_config;
using test::write_all;
using test::write_tiny;

void replace_once(std::string& s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  s.replace(at, from.size(), to);
}

TEST(Checkpoint, OneFileRoundTripGivesTheWrittenWeightsAsViews) {
  const std::string dir = fresh_dir("one");
  write_tiny(dir, 3, 1);
  struct stat st;
  EXPECT_EQ(::stat((dir + "/model.safetensors.index.json").c_str(), &st), -1) << "one file needs no index";
  const Gemma4Checkpoint ck = Gemma4Checkpoint::open(dir);
  EXPECT_EQ(ck.files().size(), 1u);
  EXPECT_EQ(ck.prefix(), "model.");
  EXPECT_EQ(ck.num_layers(), 3);
  const Gemma4Config c = tiny_config(3);
  for (int n = 0; n < 3; ++n) expect_same_layer(ck.layer(n), synthetic_gemma4_layer(c, n, 7), "layer " + std::to_string(n));
  // The first tensor of the file starts at data offset 0: a view into the mapping, no copy.
  const Tensor a = ck.tensor("model.layers.0.experts.switch_glu.gate_proj.weight");
  const Tensor b = ck.tensor("model.layers.0.experts.switch_glu.gate_proj.weight");
  EXPECT_EQ(a.data(), b.data());
  EXPECT_EQ(ck.layer(0).moe.experts.gate.w.data(), a.data());
}

TEST(Checkpoint, ShardedCheckpointLoadsTheSameWeights) {
  const std::string one = fresh_dir("s1"), two = fresh_dir("s2");
  write_tiny(one, 3, 1);
  write_tiny(two, 3, 2);
  const Gemma4Checkpoint a = Gemma4Checkpoint::open(one), b = Gemma4Checkpoint::open(two);
  ASSERT_EQ(b.files().size(), 2u);
  EXPECT_NE(b.files()[0].find("model-00001-of-00002.safetensors"), std::string::npos);
  EXPECT_NE(b.files()[1].find("model-00002-of-00002.safetensors"), std::string::npos);
  EXPECT_NE(b.file_of("model.layers.0.layer_scalar"), b.file_of("model.layers.2.layer_scalar"));
  for (int n = 0; n < 3; ++n) expect_same_layer(a.layer(n), b.layer(n), "layer " + std::to_string(n));
}

TEST(Checkpoint, LanguageModelPrefixIsFoundByLooking) {
  const std::string dir = fresh_dir("lm");
  write_tiny(dir, 2, 1, "language_model.model.");
  const Gemma4Checkpoint ck = Gemma4Checkpoint::open(dir);
  EXPECT_EQ(ck.prefix(), "language_model.model.");
  EXPECT_EQ(ck.layer(1).mlp.gate.quantized.bits, 8);  // override keyed under that prefix
  EXPECT_EQ(ck.layer(1).moe.experts.gate.bits, 4);
}

TEST(Checkpoint, ConfigReadsTextConfigAndOverrides) {
  const Gemma4Config c = parse_gemma4_config(
      R"({"text_config": {"hidden_size": 2816, "intermediate_size": 2112, "moe_intermediate_size": 704,
          "num_experts": 128, "top_k_experts": 8, "num_hidden_layers": 30, "rms_norm_eps": 1e-05},
          "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
          "language_model.model.layers.0.router.proj": {"group_size": 64, "bits": 8},
          "language_model.model.layers.0.mlp.up_proj": false}})",
      "cfg.json");
  EXPECT_EQ(c.hidden_size, 2816);
  EXPECT_EQ(c.num_hidden_layers, 30);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_EQ(c.quant_for("language_model.model.layers.0.router.proj").bits, 8);
  EXPECT_FALSE(c.quant_for("language_model.model.layers.0.mlp.up_proj").quantized());
  EXPECT_EQ(c.quant_for("language_model.model.layers.3.experts.switch_glu.gate_proj").bits, 4);
  // The 26B-A4B geometry writes and reads back through JSON unchanged.
  const Gemma4Config big = Gemma4Config::gemma4_26b_a4b(30);
  const Gemma4Config back = parse_gemma4_config(big.to_json(), "big.json");
  EXPECT_EQ(back.hidden_size, 2816);
  EXPECT_EQ(back.moe_intermediate_size, 704);
  EXPECT_EQ(back.overrides.size(), 120u);
  EXPECT_EQ(back.quant_for("model.layers.29.mlp.down_proj").bits, 8);
  EXPECT_EQ(back.quant_for("model.layers.29.experts.switch_glu.down_proj").bits, 4);
}

TEST(CheckpointBadInput, BadConfigNamesTheFileAndKey) {
  expect_error([] { parse_gemma4_config("{\"hidden_size\": 8", "c.json"); }, {"c.json", "not valid JSON"});
  expect_error([] { parse_gemma4_config("{\"hidden_size\": 8}", "c.json"); }, {"c.json", "intermediate_size"});
  Gemma4Config c = tiny_config(1);
  std::string text = c.to_json();
  replace_once(text, "\"bits\": 4", "\"bits\": 7");
  expect_error([&] { parse_gemma4_config(text, "c.json"); }, {"c.json", "bits=7", "unknown quantization"});
  text = c.to_json();
  replace_once(text, "\"mode\": \"affine\"", "\"mode\": \"mxfp4\"");
  expect_error([&] { parse_gemma4_config(text, "c.json"); }, {"c.json", "mxfp4"});
  text = c.to_json();
  replace_once(text, "{\"group_size\": 64, \"bits\": 8}", "{\"group_size\": 48, \"bits\": 8}");
  expect_error([&] { parse_gemma4_config(text, "c.json"); }, {"c.json", "group_size=48", "model.layers.0."});
  text = c.to_json();
  replace_once(text, "\"top_k_experts\": 2", "\"top_k_experts\": 9");
  expect_error([&] { parse_gemma4_config(text, "c.json"); }, {"c.json", "top_k_experts=9"});
}

TEST(CheckpointBadInput, UnknownBitsInConfigJsonOfADirectory) {
  const std::string dir = fresh_dir("bits");
  write_tiny(dir, 1, 1);
  std::string text = read_all(dir + "/config.json");
  replace_once(text, "\"bits\": 4", "\"bits\": 9");
  write_all(dir + "/config.json", text);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {dir + "/config.json", "bits=9"});
}

TEST(CheckpointBadInput, TruncatedFileNamesTheFileAndTensor) {
  const std::string dir = fresh_dir("trunc");
  write_tiny(dir, 1, 1);
  const std::string path = dir + "/model.safetensors";
  const std::string bytes = read_all(path);
  write_all(path, bytes.substr(0, bytes.size() - 100));
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {path, "router.scale"});
  write_all(path, bytes.substr(0, 5));
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {path, "shorter than the 8-byte header length"});
}

TEST(CheckpointBadInput, HeaderLengthPastTheEnd) {
  const std::string dir = fresh_dir("hlen");
  write_tiny(dir, 1, 1);
  const std::string path = dir + "/model.safetensors";
  std::string bytes = read_all(path);
  const uint64_t huge = bytes.size();  // larger than what follows the 8 length bytes
  bytes.replace(0, 8, reinterpret_cast<const char*>(&huge), 8);
  write_all(path, bytes);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {path, "runs past the end"});
}

TEST(CheckpointBadInput, OverlappingAndOutOfRangeByteRanges) {
  const std::string dir = fresh_dir("overlap");
  write_tiny(dir, 1, 1);
  const std::string path = dir + "/model.safetensors";
  const auto write_raw = [&](const std::string& header, size_t data_bytes) {
    std::string h = header;
    while (h.size() % 8) h += ' ';
    const uint64_t n = h.size();
    write_all(path, std::string(reinterpret_cast<const char*>(&n), 8) + h + std::string(data_bytes, '\0'));
  };
  write_raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {path});
  write_raw(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {path, "'a'"});
}

// Re-saves `file` with `edit` applied to its tensor list.
void rewrite(const std::string& file,
             const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  {
    const SafetensorsFile f = SafetensorsFile::open(file);
    for (const std::string& n : f.names()) tensors.push_back({n, f.get(n).contiguous().to(Device::cpu)});
  }
  edit(tensors);
  save_safetensors(file, tensors);
}

TEST(CheckpointBadInput, MissingTensorNamesTheFileAndTensor) {
  const std::string dir = fresh_dir("missing");
  write_tiny(dir, 2, 1);
  const std::string path = dir + "/model.safetensors";
  rewrite(path, [](auto& t) {
    for (size_t i = 0; i < t.size(); ++i)
      if (t[i].first == "model.layers.1.post_feedforward_layernorm_2.weight") t.erase(t.begin() + long(i));
  });
  expect_error([&] { Gemma4Checkpoint::open(dir); },
               {path, "missing tensor", "model.layers.1.post_feedforward_layernorm_2.weight"});
  // Quantized in config.json but the scales are gone.
  rewrite(path, [](auto& t) {
    for (size_t i = 0; i < t.size(); ++i)
      if (t[i].first == "model.layers.0.mlp.up_proj.scales" || t[i].first == "model.layers.0.mlp.up_proj.biases")
        t.erase(t.begin() + long(i--));
  });
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {path, "model.layers.0.mlp.up_proj"});
}

TEST(CheckpointBadInput, WrongShapeOrDtypeForAKnownName) {
  const std::string dir = fresh_dir("shape");
  write_tiny(dir, 1, 1);
  const std::string path = dir + "/model.safetensors";
  // A config whose dense width disagrees with the tensors.
  std::string cfg = read_all(dir + "/config.json");
  const std::string good_cfg = cfg;
  replace_once(cfg, "\"intermediate_size\": 192", "\"intermediate_size\": 256");
  write_all(dir + "/config.json", cfg);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {path, "model.layers.0.mlp.gate_proj.weight", "[256, 32]"});
  write_all(dir + "/config.json", good_cfg);
  // Codes stored as int32 instead of uint32.
  rewrite(path, [](auto& t) {
    for (auto& [name, tensor] : t)
      if (name == "model.layers.0.experts.switch_glu.down_proj.weight")
        tensor = Tensor::from_host(tensor.data(), tensor.shape(), DType::i32);
  });
  expect_error([&] { Gemma4Checkpoint::open(dir); },
               {path, "model.layers.0.experts.switch_glu.down_proj.weight", "int32"});
  write_tiny(dir, 1, 1);
  // A norm of the wrong length.
  rewrite(path, [](auto& t) {
    for (auto& [name, tensor] : t)
      if (name == "model.layers.0.pre_feedforward_layernorm_2.weight")
        tensor = Tensor::from_host(tensor.data(), {64}, tensor.dtype());
  });
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {path, "pre_feedforward_layernorm_2.weight", "[128]"});
}

TEST(CheckpointBadInput, IndexProblemsNameTheIndexOrShard) {
  const std::string dir = fresh_dir("index");
  write_tiny(dir, 2, 2);
  const std::string index = dir + "/model.safetensors.index.json";
  const std::string good = read_all(index);
  std::string text = good;
  replace_once(text, "\"model-00002-of-00002.safetensors\"", "\"../elsewhere.safetensors\"");
  write_all(index, text);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {index, "not a file in the checkpoint directory"});
  text = good;
  replace_once(text, "\"model-00002-of-00002.safetensors\"", "\"model-00003-of-00002.safetensors\"");
  write_all(index, text);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {"model-00003-of-00002.safetensors", "cannot open"});
  text = good;
  replace_once(text, "\"weight_map\": {", "\"weight_map\": {\n    \"model.layers.0.extra\": \"model-00001-of-00002.safetensors\",");
  write_all(index, text);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {"model-00001-of-00002.safetensors", "model.layers.0.extra"});
}

TEST(CheckpointBadInput, NotAGemma4Checkpoint) {
  const std::string dir = fresh_dir("notgemma");
  write_tiny(dir, 1, 1);
  save_safetensors(dir + "/model.safetensors", {{"something", test::random_tensor({4}, DType::f32)}});
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {dir, "not a Gemma 4 MoE checkpoint"});
  expect_error([&] { Gemma4Checkpoint::open(dir + "/nope"); }, {dir + "/nope/config.json", "cannot open"});
}

TEST(CheckpointBadInput, WriterRejectsBadArguments) {
  const Gemma4Config c = tiny_config(2);
  const auto gen = [&](int n) { return synthetic_gemma4_layer(c, n, 1); };
  expect_error([&] { write_gemma4_checkpoint(fresh_dir("w1"), c, 3, gen); }, {"shards=3"});
  expect_error([&] { write_gemma4_checkpoint(fresh_dir("w2"), c, 0, gen); }, {"shards=0"});
  // A layer whose structure differs from layer 0.
  const auto odd = [&](int n) {
    Gemma4FfnWeights w = synthetic_gemma4_layer(c, n, 1);
    if (n == 1) w.pre_feedforward_layernorm = test::random_tensor({128}, DType::f32);
    return w;
  };
  expect_error([&] { write_gemma4_checkpoint(fresh_dir("w3"), c, 1, odd); }, {"layer 1", "pre_feedforward_layernorm"});
}

}  // namespace
}  // namespace expertqmm

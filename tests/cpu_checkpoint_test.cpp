// The Gemma 4 checkpoint writer and reader: round trips (one file, shards with an index, both name
// prefixes), and every bad-input class of an untrusted checkpoint giving an Error that names the
// file and the tensor or key: truncated files, header lengths past the end, overlapping byte
// ranges, wrong dtypes or shapes for a known name, missing tensors, unknown quantization.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"
#include "support/checkpoint_files.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

using test::expect_error;
using test::expect_same_layer;
using test::fresh_dir;
using test::read_all;
using test::replace_once;
using test::rewrite_safetensors;
using test::tiny_config;
using test::write_all;
using test::write_tiny;

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
      R"({"model_type": "gemma4", "text_config": {"hidden_size": 2816, "intermediate_size": 2112,
          "moe_intermediate_size": 704, "num_experts": 128, "top_k_experts": 8, "num_hidden_layers": 30,
          "rms_norm_eps": 1e-05, "enable_moe_block": true, "hidden_size_per_layer_input": 0,
          "num_kv_shared_layers": 0},
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

TEST(CheckpointBadInput, MissingTensorNamesTheFileAndTensor) {
  const std::string dir = fresh_dir("missing");
  write_tiny(dir, 2, 1);
  const std::string path = dir + "/model.safetensors";
  rewrite_safetensors(path, [](auto& t) {
    for (size_t i = 0; i < t.size(); ++i)
      if (t[i].first == "model.layers.1.post_feedforward_layernorm_2.weight") t.erase(t.begin() + long(i));
  });
  expect_error([&] { Gemma4Checkpoint::open(dir); },
               {path, "missing tensor", "model.layers.1.post_feedforward_layernorm_2.weight"});
  // Quantized in config.json but the scales are gone.
  rewrite_safetensors(path, [](auto& t) {
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
  rewrite_safetensors(path, [](auto& t) {
    for (auto& [name, tensor] : t)
      if (name == "model.layers.0.experts.switch_glu.down_proj.weight")
        tensor = Tensor::from_host(tensor.data(), tensor.shape(), DType::i32);
  });
  expect_error([&] { Gemma4Checkpoint::open(dir); },
               {path, "model.layers.0.experts.switch_glu.down_proj.weight", "int32"});
  write_tiny(dir, 1, 1);
  // A norm of the wrong length.
  rewrite_safetensors(path, [](auto& t) {
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
  expect_error([&] { Gemma4Checkpoint::open(dir + "/nope"); }, {dir + "/nope", "No such file or directory"});
}

// Runs f on a thread, expecting an Error holding `parts` within seconds. Should f block opening the
// FIFO at `fifo` (waiting for a writer), the test fails and opens the FIFO for writing, which
// releases the blocked open, so that even the failure ends.
template <class F>
void expect_error_not_hang(F&& f, const std::string& fifo, const std::vector<std::string>& parts) {
  std::promise<void> done;
  std::future<void> finished = done.get_future();
  std::thread t([&] {
    expect_error(f, parts);
    done.set_value();
  });
  if (finished.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "blocked on the FIFO " << fifo;
    const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    finished.wait();
    if (w >= 0) ::close(w);
  }
  t.join();
}

// A FIFO where a file belongs (config.json, the index, a shard) is an error at once: opened
// without O_NONBLOCK it blocked forever, waiting for a writer.
TEST(CheckpointBadInput, FifoInPlaceOfAFileIsAnErrorNotAHang) {
  for (const char* name : {"config.json", "model.safetensors.index.json", "model-00002-of-00002.safetensors"}) {
    SCOPED_TRACE(name);
    const std::string dir = fresh_dir("fifo");
    write_tiny(dir, 2, 2);
    const std::string path = dir + "/" + name;
    ASSERT_EQ(std::remove(path.c_str()), 0);
    ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
    expect_error_not_hang([&] { Gemma4Checkpoint::open(dir); }, path, {path, "is a FIFO, not a file"});
    expect_error_not_hang([&] { SafetensorsFile::open(path); }, path, {path, "is a FIFO, not a file"});
  }
}

// Sizes and counts are range-checked before they are narrowed: 2^31 layers was a negative count
// and 2^32 + 2 layers was 2.
TEST(CheckpointBadInput, ConfigIntegersOutOfRangeAreErrors) {
  const std::string good = tiny_config(1).to_json();
  const std::pair<const char*, const char*> cases[] = {
      {"\"num_hidden_layers\": 1", "\"num_hidden_layers\": 2147483648"},
      {"\"num_hidden_layers\": 1", "\"num_hidden_layers\": 4294967298"},
      {"\"num_hidden_layers\": 1", "\"num_hidden_layers\": 65537"},
      {"\"num_experts\": 8", "\"num_experts\": 1099511627776"},
      {"\"hidden_size\": 128", "\"hidden_size\": 9223372036854775808"},
      {"\"bits\": 4", "\"bits\": 4294967300"},
  };
  for (const auto& [from, to] : cases) {
    std::string text = good;
    replace_once(text, from, to);
    const std::string key = std::string(to).substr(0, std::string(to).find(':'));
    expect_error([&] { parse_gemma4_config(text, "c.json"); }, {"c.json", key, "must be an integer in [1, "});
  }
  std::string text = good;
  replace_once(text, "\"num_hidden_layers\": 1", "\"num_hidden_layers\": 65536");
  EXPECT_EQ(parse_gemma4_config(text, "c.json").num_hidden_layers, 65536);
  Gemma4Config c = tiny_config(1);
  c.num_hidden_layers = int64_t(1) << 32;  // the writer checks before narrowing too
  expect_error([&] { write_gemma4_checkpoint(fresh_dir("wl"), c, 1, [](int) { return Gemma4FfnWeights(); }); },
               {"num_hidden_layers must be in [1, 65536]"});
}

// Python's json takes the last of two equal keys, a first-match lookup the first: refused.
TEST(CheckpointBadInput, DuplicateKeysInConfigAndIndexAreErrors) {
  std::string text = tiny_config(1).to_json();
  replace_once(text, "\"num_hidden_layers\": 1", "\"num_hidden_layers\": 1, \"num_hidden_layers\": 30");
  expect_error([&] { parse_gemma4_config(text, "c.json"); }, {"c.json", "duplicate key \"num_hidden_layers\""});
  const std::string dir = fresh_dir("dupidx");
  write_tiny(dir, 2, 2);
  const std::string index = dir + "/model.safetensors.index.json";
  text = read_all(index);
  replace_once(text, "\"weight_map\": {", "\"weight_map\": {\"model.layers.0.layer_scalar\": \"x.safetensors\",");
  write_all(index, text);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {index, "duplicate key \"model.layers.0.layer_scalar\""});
}

// "cannot open" says why; a directory or another kind of file where a file belongs says what it is
// (a directory config.json was "9223372036854775807 bytes").
TEST(CheckpointBadInput, OpenErrorsSayWhy) {
  const std::string dir = fresh_dir("why");
  write_tiny(dir, 1, 1);
  const std::string config = dir + "/config.json";
  const std::string saved = read_all(config);
  ASSERT_EQ(std::remove(config.c_str()), 0);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {config, "cannot open: No such file or directory"});
  ASSERT_EQ(::mkdir(config.c_str(), 0755), 0);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {config, "is a directory, not a file"});
  ASSERT_EQ(::rmdir(config.c_str()), 0);
  ASSERT_EQ(::symlink("config.json", config.c_str()), 0);  // a link to itself
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {config, "Too many levels of symbolic links"});
  ASSERT_EQ(std::remove(config.c_str()), 0);
  write_all(config, saved);
  EXPECT_NO_THROW(Gemma4Checkpoint::open(dir));
  const std::string shard = dir + "/model.safetensors";
  expect_error([&] { Gemma4Checkpoint::open(shard); }, {shard, "is a regular file, not a checkpoint directory"});
  expect_error([&] { Gemma4Checkpoint::open(shard + "/x"); }, {shard + "/x", "Not a directory"});
  // A dangling index link is reported, not skipped in favour of model.safetensors.
  const std::string index = dir + "/model.safetensors.index.json";
  ASSERT_EQ(::symlink("gone.json", index.c_str()), 0);
  expect_error([&] { Gemma4Checkpoint::open(dir); }, {index, "cannot open: No such file or directory"});
}

// A shard truncated while it is mapped: reading its pages would kill the process with SIGBUS, so
// the tensors are not handed out (README: the SIGBUS note).
TEST(CheckpointBadInput, ShardTruncatedAfterOpenIsAnErrorNotSigbus) {
  const std::string dir = fresh_dir("shrink");
  write_tiny(dir, 2, 1);
  const Gemma4Checkpoint ck = Gemma4Checkpoint::open(dir);
  const std::string shard = dir + "/model.safetensors";
  const std::string bytes = read_all(shard);
  ASSERT_EQ(::truncate(shard.c_str(), off_t(bytes.size() / 2)), 0);
  expect_error([&] { ck.layer(1); }, {shard, "shrank from", "since it was opened"});
  expect_error([&] { ck.tensor("model.layers.1.layer_scalar"); }, {shard, "shrank"});
  write_all(shard, bytes);  // the same size again: readable again
  EXPECT_NO_THROW(ck.layer(1));
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

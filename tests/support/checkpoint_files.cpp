#include "support/checkpoint_files.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "expertqmm/safetensors.h"

namespace expertqmm::test {

Gemma4Config gemma4_config(int64_t hidden, int64_t intermediate, int64_t moe_intermediate, int64_t experts,
                           int64_t top_k, int64_t layers) {
  Gemma4Config c;
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.moe_intermediate_size = moe_intermediate;
  c.num_experts = experts;
  c.top_k_experts = top_k;
  c.num_hidden_layers = layers;
  c.quantized = true;
  c.default_quant = {4, 64};
  return c;
}

std::string fresh_dir(const std::string& tag) {
  const std::string dir = ::testing::TempDir() + "/eqmm_ckpt_" + tag + "_" + std::to_string(::getpid());
  std::system(("rm -rf '" + dir + "' '" + dir + ".lock'").c_str());
  return dir;
}

Gemma4Config tiny_config(int layers, const std::string& prefix) {
  Gemma4Config c = gemma4_config(128, 192, 64, 8, 2, layers);
  for (int l = 0; l < layers; ++l)
    for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "router.proj"})
      c.overrides[prefix + "layers." + std::to_string(l) + "." + m] = {8, 64};
  return c;
}

void write_tiny(const std::string& dir, int layers, int shards, const std::string& prefix) {
  const Gemma4Config c = tiny_config(layers, prefix);
  CheckpointWriteOptions options;
  options.prefix = prefix;
  options.force = true;
  write_gemma4_checkpoint(
      dir, c, shards, [&](int n) { return synthetic_gemma4_layer(c, n, 7, prefix); }, options);
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_all(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

void replace_once(std::string& s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  s.replace(at, from.size(), to);
}

void rewrite_safetensors(const std::string& file,
                         const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  {
    const SafetensorsFile f = SafetensorsFile::open(file);
    for (const std::string& n : f.names()) tensors.push_back({n, f.get(n).contiguous().to(Device::cpu)});
  }
  edit(tensors);
  save_safetensors(file, tensors);
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

void expect_same(const Tensor& a, const Tensor& b, const std::string& what) {
  EXPECT_EQ(a.dtype(), b.dtype()) << what;
  EXPECT_EQ(a.shape(), b.shape()) << what;
  EXPECT_TRUE(a.to_host_bytes() == b.to_host_bytes()) << what;
}
void expect_same(const QuantizedWeight& a, const QuantizedWeight& b, const std::string& what) {
  EXPECT_EQ(a.bits, b.bits) << what;
  EXPECT_EQ(a.group_size, b.group_size) << what;
  EXPECT_EQ(a.mode, b.mode) << what;
  expect_same(a.w, b.w, what + ".weight");
  expect_same(a.scales, b.scales, what + ".scales");
  EXPECT_EQ(a.biases.defined(), b.biases.defined()) << what << ".biases";
  if (a.biases.defined() && b.biases.defined()) expect_same(a.biases, b.biases, what + ".biases");
}
void expect_same_layer(const Gemma4FfnWeights& a, const Gemma4FfnWeights& b, const std::string& what) {
  expect_same(a.pre_feedforward_layernorm, b.pre_feedforward_layernorm, what + " pre_ff");
  expect_same(a.post_feedforward_layernorm_1, b.post_feedforward_layernorm_1, what + " post_ff_1");
  expect_same(a.pre_feedforward_layernorm_2, b.pre_feedforward_layernorm_2, what + " pre_ff_2");
  expect_same(a.post_feedforward_layernorm_2, b.post_feedforward_layernorm_2, what + " post_ff_2");
  expect_same(a.post_feedforward_layernorm, b.post_feedforward_layernorm, what + " post_ff");
  expect_same(a.layer_scalar, b.layer_scalar, what + " layer_scalar");
  expect_same(a.mlp.gate.quantized, b.mlp.gate.quantized, what + " mlp.gate");
  expect_same(a.mlp.up.quantized, b.mlp.up.quantized, what + " mlp.up");
  expect_same(a.mlp.down.quantized, b.mlp.down.quantized, what + " mlp.down");
  expect_same(a.moe.router.proj, b.moe.router.proj, what + " router.proj");
  expect_same(a.moe.router.scale, b.moe.router.scale, what + " router.scale");
  expect_same(a.moe.router.per_expert_scale, b.moe.router.per_expert_scale, what + " per_expert_scale");
  expect_same(a.moe.experts.gate, b.moe.experts.gate, what + " experts.gate");
  expect_same(a.moe.experts.up, b.moe.experts.up, what + " experts.up");
  expect_same(a.moe.experts.down, b.moe.experts.down, what + " experts.down");
  EXPECT_EQ(a.moe.router.top_k, b.moe.router.top_k) << what;
}

void expect_same_layer(const Qwen3MoeFfnWeights& a, const Qwen3MoeFfnWeights& b, const std::string& what) {
  expect_same(a.post_attention_layernorm, b.post_attention_layernorm, what + " post_attention_layernorm");
  expect_same(a.moe.router.proj, b.moe.router.proj, what + " mlp.gate");
  expect_same(a.moe.experts.gate, b.moe.experts.gate, what + " switch_mlp.gate_proj");
  expect_same(a.moe.experts.up, b.moe.experts.up, what + " switch_mlp.up_proj");
  expect_same(a.moe.experts.down, b.moe.experts.down, what + " switch_mlp.down_proj");
  EXPECT_EQ(a.moe.router.kind, b.moe.router.kind) << what;
  EXPECT_EQ(a.moe.router.top_k, b.moe.router.top_k) << what;
  EXPECT_EQ(a.moe.router.norm_topk_prob, b.moe.router.norm_topk_prob) << what;
  EXPECT_EQ(a.moe.experts.activation, b.moe.experts.activation) << what;
  EXPECT_EQ(a.eps, b.eps) << what;
}

}  // namespace expertqmm::test

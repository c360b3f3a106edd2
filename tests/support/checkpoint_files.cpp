#include "support/checkpoint_files.h"

#include <unistd.h>

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
  std::system(("rm -rf '" + dir + "'").c_str());
  return dir;
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

}  // namespace expertqmm::test

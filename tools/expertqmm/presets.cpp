#include "presets.h"

#include <fstream>

#include "expertqmm/backend.h"
#include "expertqmm/error.h"

namespace expertqmm::cli {

int64_t Preset::bytes_per_expert() const {
  const int64_t weights = 3 * int64_t(intermediate) * hidden;  // gate, up, down
  const int64_t code_bytes = weights * bits / 8;
  const int64_t group_bytes = weights / group_size * (mode == QuantMode::affine ? 2 * 2 : 1);  // bf16 s + b, or u8 s
  return code_bytes + group_bytes;
}

double Preset::flops_per_assignment() const { return 2.0 * 3.0 * double(intermediate) * double(hidden); }

const std::vector<Preset>& presets() {
  // Gemma 4 26B-A4B: shared/spec/gemma4-moe.md section 6, mlx-semantics.md 4.6. Qwen3-30B-A3B:
  // mlx-lm qwen3_moe (config: hidden 2048, moe_intermediate_size 768, 128 experts, top-8,
  // norm_topk_prob true; mlx-community's 4-bit checkpoints: experts 4-bit g64).
  constexpr RouterKind gemma4 = RouterKind::gemma4, qwen3 = RouterKind::softmax_topk;
  static const std::vector<Preset> table = {
      {"gemma4-26b-a4b", "Gemma 4 26B-A4B experts, mlx-lm layout (separate gate and up)", 128, 8, 2816, 704, 4,
       64, Activation::geglu, false, gemma4},
      {"gemma4-26b-a4b-fused", "Gemma 4 26B-A4B experts, HF layout (fused gate_up [E, 2I, H])", 128, 8, 2816,
       704, 4, 64, Activation::geglu, true, gemma4},
      // 8-bit experts (mlx-community publishes 8-bit Gemma 4 checkpoints): the decode layer's scalar
      // kernels at T <= 8 (moe_decode_scalar.cu), the mma.sync expert tiles above.
      {"gemma4-26b-a4b-q8", "Gemma 4 26B-A4B experts quantized 8-bit g64 (mlx-lm layout)", 128, 8, 2816, 704, 8, 64,
       Activation::geglu, false, gemma4},
      {"qwen3-30b-a3b", "Qwen3-30B-A3B experts (SwiGLU, softmax -> top-8 -> renormalised), mlx-lm layout", 128, 8,
       2048, 768, 4, 64, Activation::swiglu, false, qwen3},
      {"tiny", "small geometry for tests: E=8, k=2, H=256, I=128", 8, 2, 256, 128, 4, 64, Activation::geglu,
       false, gemma4},
      {"tiny-fused", "tiny with a fused gate_up", 8, 2, 256, 128, 4, 64, Activation::geglu, true, gemma4},
      {"qwen3-tiny", "tiny with Qwen3-MoE's router and SwiGLU experts", 8, 2, 256, 128, 4, 64, Activation::swiglu,
       false, qwen3},
  };
  return table;
}

const Preset& find_preset(const std::string& name) {
  std::string known;
  for (const Preset& p : presets()) {
    if (name == p.name) return p;
    known += known.empty() ? "" : ", ";
    known += p.name;
  }
  usage_error(detail::cat("--preset: unknown preset '", name, "' (known: ", known, ")"));
}

Device resolve_backend(const std::string& name) {
  if (name == "cpu") return Device::cpu;
  if (name == "auto") return best_device();
  if (name != "cuda") usage_error("--backend expects auto, cpu or cuda, got '" + name + "'");
  EXPERTQMM_CHECK(cuda_built(), "cli",
                  "--backend cuda: this build has no CUDA backend (configure with -DEXPERTQMM_CUDA=ON)");
  EXPERTQMM_CHECK(cuda_available(), "cli", "--backend cuda: no usable CUDA device on this machine");
  return Device::cuda;
}

std::vector<RouteSwitch> expert_tile_settings(const Args& args) {
  const std::string v = args.get_choice("expert-tiles", "auto", {"auto", "on", "off", "both"});
  if (v == "both") return {RouteSwitch::automatic, RouteSwitch::off};
  return {v == "on" ? RouteSwitch::on : v == "off" ? RouteSwitch::off : RouteSwitch::automatic};
}

const char* expert_tiles_name(RouteSwitch s) {
  return s == RouteSwitch::off ? "off" : s == RouteSwitch::on ? "on" : "auto";
}

std::vector<ProductMode> product_modes(const Args& args, const std::string& fallback) {
  const std::string v = args.get_choice("product", fallback, {"fused", "separate", "both"});
  if (v == "both") return {ProductMode::fused, ProductMode::separate};
  return {v == "fused" ? ProductMode::fused : ProductMode::separate};
}

std::string device_label(Device d) {
  if (d == Device::cuda) return cuda_device_name();
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    size_t colon = line.find(':');
    if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
  }
  return "host CPU";
}

}  // namespace expertqmm::cli

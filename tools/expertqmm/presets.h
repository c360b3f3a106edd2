// Workload presets of the CLI (a data table), the backend choice of `run` / `diag`, and the option
// values several commands share.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cli.h"
#include "expertqmm/backend.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/dtype.h"
#include "expertqmm/moe.h"

namespace expertqmm::cli {

// A model family's MoE layer as data: geometry, quantization, the experts' activation and the
// router kind. A new family is a row here (and a golden), not new kernels.
struct Preset {
  const char* name;
  const char* description;
  int experts;       // E
  int top_k;         // k
  int hidden;        // H (= D of the experts)
  int intermediate;  // I
  int bits;
  int group_size;
  Activation activation;
  bool fused_gate_up;  // one gate_up [E, 2I, H] (gate rows first) instead of gate and up
  RouterKind router;   // gemma4: h is routed through its own norm; softmax_topk (Qwen3-MoE): renormalised
  QuantMode mode = QuantMode::affine;  // the experts' quantization mode (--quant)

  // Bytes of one expert's gate, up and down: codes plus bf16 scales and biases (affine) or uint8
  // scales (fp modes).
  int64_t bytes_per_expert() const;
  // Multiply-adds x2 of one (token, expert) assignment: gate and up (2*I*H) and down (I*H).
  double flops_per_assignment() const;
  // Bytes of all experts (the whole layer's expert weights).
  int64_t expert_bytes() const { return bytes_per_expert() * experts; }
};

const std::vector<Preset>& presets();

// Token counts the commands accept: far beyond a benchmark's 2048, small enough that no buffer
// size built from them overflows or asks for an absurd allocation.
constexpr int64_t kMaxTokens = 65536;
constexpr int64_t kMaxSeed = INT64_MAX;
// Throws UsageError naming the unknown preset and the known ones.
const Preset& find_preset(const std::string& name);
// --quant affine|mxfp4|mxfp8|nvfp4 (default affine): the preset with its experts in that mode
// (affine keeps the preset's bits and group size; an fp mode has one of each).
Preset with_quant_option(const Preset& p, const Args& args);

// "auto" (CUDA when expertqmm::cuda_available(), else CPU), "cpu" or "cuda". Throws when CUDA is
// requested and this build or this machine cannot provide it.
Device resolve_backend(const std::string& name);

// --expert-tiles auto|on|off|both, the same values in every command: the tile route at its
// default, forced on, forced off, or both the default and off (one run compares them).
std::vector<RouteSwitch> expert_tile_settings(const Args& args);
const char* expert_tiles_name(RouteSwitch s);
// --product fused|separate|both.
std::vector<ProductMode> product_modes(const Args& args, const std::string& fallback);

// Name of the device that runs `d`: the CUDA device name, or the host CPU's model name.
std::string device_label(Device d);

}  // namespace expertqmm::cli

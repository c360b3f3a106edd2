// Gemma 4 and Qwen3-MoE checkpoints in MLX (mlx-lm) format: config.json, one model.safetensors or shards
// model-0000N-of-0000M.safetensors with model.safetensors.index.json. The reader maps the files
// (no copy of the weights) and hands out per-layer Gemma4FfnWeights (or Qwen3MoeFfnWeights) as views; the writer produces
// the same format (used for synthetic benchmark checkpoints and test fixtures).
// Every file is untrusted: a malformed one gives expertqmm::Error("checkpoint" or "safetensors",
// "<file>: ...") naming the tensor or key, never a crash or an out-of-bounds read.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "expertqmm/gemma4.h"
#include "expertqmm/qwen3_moe.h"
#include "expertqmm/safetensors.h"

namespace expertqmm {

// An MLX quantization setting (mode, bits, group size); bits == 0 means "not quantized" (a
// `false` override).
struct QuantSetting {
  QuantSetting() = default;
  QuantSetting(int bits_, int group_size_, QuantMode mode_ = QuantMode::affine)
      : bits(bits_), group_size(group_size_), mode(mode_) {}
  int bits = 0;
  int group_size = 0;
  QuantMode mode = QuantMode::affine;
  bool quantized() const { return bits != 0; }
};

// Which mlx-lm model a checkpoint holds (config.json "model_type"): it decides the tensor names
// and the feed-forward part (gemma4_ffn or qwen3_moe_ffn).
enum class ModelFamily : uint8_t {
  gemma4,     // model_type "gemma4" / "gemma4_text"
  qwen3_moe,  // model_type "qwen3_moe": every layer an MoE layer (decoder_sparse_step 1, no mlp_only_layers)
};
const char* model_family_name(ModelFamily f);

// The keys of config.json that the feed-forward part depends on, read as mlx-lm reads them.
// Qwen3-MoE (qwen3_moe.ModelArgs): hidden_size, intermediate_size, moe_intermediate_size,
// num_experts, num_experts_per_tok (kept in top_k_experts), num_hidden_layers, norm_topk_prob,
// rms_norm_eps; a config with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is
// refused. Gemma 4:
// model_type "gemma4" takes them from "text_config", "gemma4_text" from the top level (no
// model_type: text_config when present); a key mlx-lm defaults when absent gets mlx-lm's default
// (gemma4_text.ModelArgs), and what gemma4_ffn cannot compute is refused (enable_moe_block false,
// per-layer inputs). "quantization" from the top level, else from text_config.
struct Gemma4Config {
  ModelFamily family = ModelFamily::gemma4;
  bool norm_topk_prob = true;  // qwen3_moe: renormalise the router's k probabilities
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP width (doubled on KV-shared layers, see below)
  int64_t moe_intermediate_size = 0;  // expert width
  int64_t num_experts = 0;
  int64_t top_k_experts = 0;
  int64_t num_hidden_layers = 0;     // in [1, kMaxLayers] (checked before it is narrowed to int)
  static constexpr int64_t kMaxLayers = int64_t(1) << 16;
  float rms_norm_eps = 1e-6f;
  // mlx-lm's MLP is 2 * intermediate_size wide on the last num_kv_shared_layers layers when
  // use_double_wide_mlp (mlx-lm's defaults when absent: 20 and true; 26B-A4B: 0).
  int64_t num_kv_shared_layers = 0;
  bool use_double_wide_mlp = true;
  bool quantized = false;          // a "quantization" object is present
  QuantSetting default_quant;      // its group_size / bits
  // Per-module entries keyed by module path ("model.layers.0.router.proj"), as mlx-lm writes
  // them: a setting, or {0, 0} for `false`. A module without an entry is quantized iff its
  // ".scales" tensor exists (mlx-lm's loader), with bits and group size read off the shapes.
  std::map<std::string, QuantSetting> overrides;

  // The dense MLP width of `layer` (mlx-lm gemma4_text.MLP).
  int64_t mlp_intermediate_size(int64_t layer) const;
  // The setting of the module at `module_path` (override, else default; {0,0} when unquantized).
  QuantSetting quant_for(const std::string& module_path) const;
  // What mlx-lm's quantize_model gives a module with `in_features` inputs: its override, else
  // the default when in_features is a multiple of the default group size, else not quantized
  // (e.g. Gemma 4's expert down_proj, 704 inputs, at group size 128 stays 16-bit).
  QuantSetting quant_for(const std::string& module_path, int64_t in_features) const;
  // The 26B-A4B geometry with the QAT checkpoint's quantization: experts 4-bit gs64, dense MLP and
  // router.proj 8-bit gs64 (mlx-semantics 4.6), `layers` layers, overrides keyed under `prefix`.
  // dense_mlp_8bit = false: the dense MLP at the default quantization as every module but the
  // router (mlx-community's 4-bit upload: spec/gemma4-moe.md).
  static Gemma4Config gemma4_26b_a4b(int64_t layers, const std::string& prefix = "model.", bool dense_mlp_8bit = true);
  // Qwen3-30B-A3B's feed-forward geometry (hidden 2048, 128 experts of width 768, top-8,
  // norm_topk_prob) as mlx-community's 4-bit checkpoints quantize it: experts 4-bit gs64, the
  // router mlp.gate 8-bit gs64 (qwen3_moe.Model.quant_predicate).
  static Gemma4Config qwen3_30b_a3b(int64_t layers, const std::string& prefix = "model.");
  // The JSON text of config.json for this config, as mlx-lm writes it (model_type gemma4_text or qwen3_moe,
  // "quantization" and "quantization_config" with the per-module overrides).
  std::string to_json() const;
};

// Parses config.json text; `file` names it in errors.
Gemma4Config parse_gemma4_config(const std::string& text, const std::string& file);

class Gemma4Checkpoint {
 public:
  // Reads dir/config.json, dir/model.safetensors.index.json when present (else every
  // dir/*.safetensors), maps the files and checks every feed-forward tensor of every layer
  // (presence, dtype, shape against the config and its quantization) up front.
  // The shards are memory-mapped, not read: truncating or rewriting one in place while it is open
  // makes the next read of a page past its new end kill the process with SIGBUS (replacing the
  // files by rename, as write_gemma4_checkpoint does, is safe). layer() and tensor() check each
  // file's size again and throw if it shrank, which narrows that window but cannot close it.
  static Gemma4Checkpoint open(const std::string& dir);

  const Gemma4Config& config() const { return config_; }
  // "language_model.model." or "model." (found by looking at the tensor names).
  const std::string& prefix() const { return prefix_; }
  int num_layers() const { return static_cast<int>(config_.num_hidden_layers); }
  const std::vector<std::string>& files() const { return file_paths_; }
  // CPU views into the mappings (use .to(Device::cuda) to copy). layer in [0, num_layers()).
  // layer(): a Gemma 4 checkpoint's; qwen3_moe_layer(): a Qwen3-MoE checkpoint's (names
  // model.layers.N.post_attention_layernorm.weight, mlp.gate, mlp.switch_mlp.{gate,up,down}_proj).
  // Each throws for the other family.
  Gemma4FfnWeights layer(int layer) const;
  Qwen3MoeFfnWeights qwen3_moe_layer(int layer) const;
  ModelFamily family() const { return config_.family; }
  // A tensor by its full name (a view), and the file that holds it.
  Tensor tensor(const std::string& name) const;
  bool has(const std::string& name) const { return file_of_.count(name) != 0; }
  const std::string& file_of(const std::string& name) const;

 private:
  // mlx-lm's load-time decision for one module (utils.load_model): {0, 0} when it is left unquantized.
  QuantSetting module_quant(const std::string& module, int64_t in_features) const;
  Linear load_linear(const std::string& module, int64_t out_features, int64_t in_features) const;
  // An expert projection [E, rows, in]: quantized into *q, or 16-bit (mlx-lm's unquantized
  // SwitchLinear) into *dense.
  void load_expert_proj(const std::string& module, int64_t rows, int64_t in_features, int64_t experts,
                        QuantizedWeight* q, Tensor* dense) const;
  QuantizedWeight load_quantized(const std::string& module, int64_t rows, int64_t in_features, int64_t experts,
                                 QuantSetting qs) const;
  Tensor load_float(const std::string& name, const Shape& shape) const;

  std::string dir_;
  std::string source_;  // named by "missing tensor" errors: the index json, the one file, or dir
  Gemma4Config config_;
  std::string prefix_;
  std::vector<std::string> file_paths_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, int> file_of_;  // tensor name -> index into files_
};

struct CheckpointWriteOptions {
  // Tensor names are `prefix` + "layers.N." + the mlx-lm module names.
  std::string prefix = "model.";
  // Replace an existing non-empty `dir`, if it holds nothing but checkpoint files (config.json,
  // *.safetensors, the index). Without it a non-empty `dir` is refused.
  bool force = false;
  // Called after each layer is written: layers written and in all, bytes written and in all.
  std::function<void(int, int, uint64_t, uint64_t)> progress;
  // The free bytes of the filesystem of `parent` (the directory that holds `dir`); unset: statvfs.
  // Tests stand in a full disk here.
  std::function<uint64_t(const std::string& parent)> free_bytes;
};

// Writes a checkpoint in mlx-lm's format to `dir`: config.json, and either model.safetensors
// (shards == 1) or model-0000N-of-0000M.safetensors plus model.safetensors.index.json, with layers
// split across the shards in order. `layer(n)` gives layer n's weights (host tensors; quantized
// where the config says so, with the config's bits and group size). The data are streamed: one
// layer is in memory at a time.
// Nothing is lost or mixed: `dir` must be absent or empty (or options.force); the free space is
// checked first; everything is written into a fresh temporary directory beside `dir` and published
// with one rename, so that `dir` holds the old checkpoint or the new one, never parts of both, and a
// failure (an exception from `layer` or `progress` included) removes the temporary directory. A lock
// file "<dir>.lock" makes a second writer of the same `dir` fail at once.
void write_gemma4_checkpoint(const std::string& dir, const Gemma4Config& config, int shards,
                             const std::function<Gemma4FfnWeights(int)>& layer,
                             const CheckpointWriteOptions& options = {});

// write_gemma4_checkpoint for a qwen3_moe config: each layer's feed-forward tensors under mlx-lm's
// qwen3_moe names (post_attention_layernorm, mlp.gate, mlp.switch_mlp.{gate,up,down}_proj).
void write_qwen3_moe_checkpoint(const std::string& dir, const Gemma4Config& config, int shards,
                                const std::function<Qwen3MoeFfnWeights(int)>& layer,
                                const CheckpointWriteOptions& options = {});

// Synthetic weights for `config` from `seed`: random codes, bf16 scales ±(0.01 + 0.002 n) with
// biases centring the dequantized values on 0 (quantized modules), N(0, 0.02) dense weights, norm
// weights 1 + 0.1 n, router scale 1 + 0.05 n, per_expert_scale 1 + 0.05 n, layer_scalar in
// [0.75, 1.25). Module quantization from config.quant_for(prefix + "layers.N.<module>", its input
// width); a module left unquantized (experts included) is a bf16 N(0, 0.02) weight.
// Fast (no quantizer): meant for benchmark checkpoints at the real geometry and test fixtures.
Gemma4FfnWeights synthetic_gemma4_layer(const Gemma4Config& config, int layer, uint64_t seed,
                                        const std::string& prefix = "model.");
// The same for a qwen3_moe config: post_attention_layernorm 1 + 0.1 n, mlp.gate and the experts as
// the config quantizes them (a softmax_topk router, SwiGLU experts).
Qwen3MoeFfnWeights synthetic_qwen3_moe_layer(const Gemma4Config& config, int layer, uint64_t seed,
                                             const std::string& prefix = "model.");

}  // namespace expertqmm

// Reading Gemma 4 checkpoints in mlx-lm's format (include/expertqmm/checkpoint.h): config.json ->
// Gemma4Config, the index json -> which shard holds which tensor, and per-layer feed-forward views
// checked against the config (dtype, shape, quantization) before anything uses them.
#include "expertqmm/checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>

#include "core/input_file.h"
#include "core/json.h"
#include "expertqmm/error.h"

namespace expertqmm {

namespace {

constexpr const char* kOp = "checkpoint";
constexpr uint64_t kMaxJsonBytes = uint64_t(64) << 20;  // config and index files are kilobytes
constexpr uint64_t kMaxExperts = uint64_t(1) << 16;     // expert ids are int32 and index [E, ...] tensors

[[noreturn]] void fail(const std::string& file, const std::string& what) { throw Error(kOp, file + ": " + what); }

// Whether something is at `path`, a dangling link included: opening it then reports the reason
// instead of the file being silently skipped (as is an entry stat() cannot reach).
bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 || errno != ENOENT;
}

std::string read_text(const std::string& path) { return detail::read_input_file(path, kOp, kMaxJsonBytes); }

json::Value parse_json(const std::string& text, const std::string& file) {
  try {
    return json::parse(text);
  } catch (const Error& e) {
    fail(file, std::string("is not valid JSON: ") + e.what());
  }
}

// The largest value config.json may give a size or count: far above any real model, and small
// enough that the products the loader forms (e.g. 2 * I * H * bits) cannot overflow int64.
constexpr uint64_t kMaxConfigInt = uint64_t(1) << 20;

// An integer member `key` of `obj` in [1, max] (required), checked before it is narrowed.
int64_t positive_int(const json::Value& obj, const char* key, const std::string& file, const std::string& where,
                     uint64_t max = kMaxConfigInt) {
  const json::Value* v = obj.find(key);
  if (!v) fail(file, where + "\"" + key + "\" is missing");
  uint64_t u = 0;
  if (!v->to_uint64(&u) || u == 0 || u > max)
    fail(file, detail::cat(where, "\"", key, "\" must be an integer in [1, ", max, "], got ",
                           v->is_number() ? v->number_text() : std::string(json::Value::kind_name(v->kind()))));
  return static_cast<int64_t>(u);
}

// {"group_size": g, "bits": b, "mode": m} (extra keys allowed). mode defaults to "affine" (mlx-lm:
// quantization.get("mode", "affine"); a per-module dict goes to to_quantized, whose mode default is
// affine too, whatever the top level says). A per-module entry may omit bits or group_size: the
// mode's defaults fill them (affine 4 / 64, mxfp4 4 / 32, mxfp8 8 / 32, nvfp4 4 / 16); the
// top-level default must have both (mlx-lm indexes them).
QuantSetting quant_setting(const json::Value& obj, const std::string& file, const std::string& key,
                           bool module_entry) {
  const std::string where = "quantization \"" + key + "\": ";
  QuantMode mode = QuantMode::affine;
  if (const json::Value* m = obj.find("mode"))
    if (!m->is_string() || !parse_quant_mode(m->as_string(), &mode))
      fail(file, where + "unknown quantization mode " +
                     (m->is_string() ? "\"" + m->as_string() + "\"" : "(not a string)") +
                     " (MLX: \"affine\", \"mxfp4\", \"mxfp8\", \"nvfp4\")");
  auto int_or_default = [&](const char* name, int fallback) {
    if (module_entry && !obj.find(name)) return fallback;
    return static_cast<int>(positive_int(obj, name, file, where));  // <= kMaxConfigInt: fits int
  };
  QuantSetting q;
  q.mode = mode;
  q.bits = int_or_default("bits", quant_mode_bits(mode));
  q.group_size = int_or_default("group_size", quant_mode_group_size(mode));
  if (!valid_quant_params(mode, q.bits, q.group_size)) {
    if (mode == QuantMode::affine)
      fail(file, detail::cat(where, "unknown quantization bits=", q.bits, " group_size=", q.group_size,
                             " (MLX affine: bits 2, 3, 4, 5, 6, 8; group_size 32, 64, 128)"));
    fail(file, detail::cat(where, "mode \"", quant_mode_name(mode), "\" takes bits=", quant_mode_bits(mode),
                           " and group_size=", quant_mode_group_size(mode), " only; got bits=", q.bits,
                           " group_size=", q.group_size));
  }
  return q;
}

// The object mlx-lm builds its text model from: text_config for model_type "gemma4" (the
// multimodal wrapper), the top level for "gemma4_text"; without model_type, text_config when
// present. `where` prefixes error messages.
const json::Value& text_config_of(const json::Value& root, const std::string& file, std::string* where) {
  const json::Value* text_config = root.find("text_config");
  const json::Value* model_type = root.find("model_type");
  std::string type;
  if (model_type) {
    if (!model_type->is_string()) fail(file, "\"model_type\" must be a string");
    type = model_type->as_string();
    if (type != "gemma4" && type != "gemma4_text" && type != "qwen3_moe")
      fail(file, "model_type \"" + type +
                     "\" is not a supported MoE model (\"gemma4\", \"gemma4_text\" or \"qwen3_moe\")");
  }
  const bool nested = type == "gemma4" || (type.empty() && text_config);
  if (!nested) {
    *where = "";
    return root;
  }
  if (!text_config || !text_config->is_object()) fail(file, "model_type \"gemma4\" needs a \"text_config\" object");
  *where = "text_config ";
  return *text_config;
}

// A boolean member, `fallback` when absent.
bool bool_or(const json::Value& obj, const char* key, bool fallback, const std::string& file,
             const std::string& where) {
  const json::Value* v = obj.find(key);
  if (!v) return fallback;
  if (!v->is_bool()) fail(file, where + "\"" + key + "\" must be true or false");
  return v->as_bool();
}

// A non-negative integer member, `fallback` when absent.
int64_t count_or(const json::Value& obj, const char* key, int64_t fallback, const std::string& file,
                 const std::string& where) {
  const json::Value* v = obj.find(key);
  if (!v) return fallback;
  uint64_t u = 0;
  if (!v->to_uint64(&u) || u > (uint64_t(1) << 40))
    fail(file, where + "\"" + key + "\" must be a non-negative integer, got " +
                   (v->is_number() ? v->number_text() : std::string(json::Value::kind_name(v->kind()))));
  return static_cast<int64_t>(u);
}

// The keys of the decoder layer's structure that mlx-lm defaults when absent (gemma4_text.ModelArgs:
// enable_moe_block false, hidden_size_per_layer_input 256, num_kv_shared_layers 20,
// use_double_wide_mlp true): the feed-forward part needs the MoE block and no per-layer input.
void read_layer_structure(const json::Value& cfg, const std::string& file, const std::string& where, Gemma4Config* c) {
  if (!bool_or(cfg, "enable_moe_block", false, file, where))
    fail(file, where + "\"enable_moe_block\" is " + (cfg.find("enable_moe_block") ? "false" : "absent (mlx-lm: false)") +
                   ": only the MoE layers of Gemma 4 are supported");
  const int64_t ple = count_or(cfg, "hidden_size_per_layer_input", 256, file, where);
  if (ple != 0)
    fail(file, detail::cat(where, "\"hidden_size_per_layer_input\" is ", ple,
                           cfg.find("hidden_size_per_layer_input") ? "" : " (mlx-lm's default when absent)",
                           ": the per-layer input gate (Gemma 4 E2B/E4B) is not part of gemma4_ffn; it must be 0"));
  c->num_kv_shared_layers = count_or(cfg, "num_kv_shared_layers", 20, file, where);
  c->use_double_wide_mlp = bool_or(cfg, "use_double_wide_mlp", true, file, where);
}

// qwen3_moe.ModelArgs' layer structure: layer l is an MoE layer iff l is not in mlp_only_layers and
// (l + 1) % decoder_sparse_step == 0; qwen3_moe_ffn covers the MoE layers only, so all must be.
void read_qwen3_layer_structure(const json::Value& cfg, const std::string& file, Gemma4Config* c) {
  const int64_t step = positive_int(cfg, "decoder_sparse_step", file, "");
  if (step != 1)
    fail(file, detail::cat("\"decoder_sparse_step\" is ", step,
                           ": layers with a dense MLP are not part of qwen3_moe_ffn; it must be 1"));
  const json::Value* dense = cfg.find("mlp_only_layers");
  if (!dense) fail(file, "\"mlp_only_layers\" is missing");
  if (!dense->is_array() || !dense->items().empty())
    fail(file, "\"mlp_only_layers\" must be an empty list: layers with a dense MLP are not part of qwen3_moe_ffn");
  const json::Value* renorm = cfg.find("norm_topk_prob");
  if (!renorm || !renorm->is_bool()) fail(file, "\"norm_topk_prob\" must be true or false");
  c->norm_topk_prob = renorm->as_bool();
}

// Tensor names of this layer, relative to the checkpoint prefix.
std::string layer_name(const std::string& prefix, int layer, const std::string& rest) {
  return prefix + "layers." + std::to_string(layer) + "." + rest;
}

std::string shape_of(DType dtype, const Shape& shape) { return std::string(dtype_name(dtype)) + shape_str(shape); }

// A float as a JSON number that reads back to the same float.
std::string json_float(float v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v));
  return buf;
}

}  // namespace

const char* model_family_name(ModelFamily f) {
  switch (f) {
    case ModelFamily::gemma4: return "gemma4";
    case ModelFamily::qwen3_moe: return "qwen3_moe";
  }
  throw Error("model_family_name", detail::cat("unknown model family value ", static_cast<int>(f)));
}

QuantSetting Gemma4Config::quant_for(const std::string& module_path) const {
  if (!quantized) return {};
  auto it = overrides.find(module_path);
  if (it != overrides.end()) return it->second;
  return default_quant;
}

int64_t Gemma4Config::mlp_intermediate_size(int64_t layer) const {
  // mlx-lm gemma4_text.MLP: KV-shared layers are layer >= first_shared > 0.
  const int64_t first_shared = num_hidden_layers - num_kv_shared_layers;
  const bool kv_shared = first_shared > 0 && layer >= first_shared;
  return intermediate_size * (use_double_wide_mlp && kv_shared ? 2 : 1);
}

QuantSetting Gemma4Config::quant_for(const std::string& module_path, int64_t in_features) const {
  if (!quantized) return {};
  auto it = overrides.find(module_path);
  if (it != overrides.end()) return it->second;
  if (default_quant.group_size <= 0 || in_features % default_quant.group_size != 0) return {};
  return default_quant;
}

Gemma4Config parse_gemma4_config(const std::string& text, const std::string& file) {
  const json::Value root = parse_json(text, file);
  if (!root.is_object()) fail(file, "must hold a JSON object");
  std::string where;
  const json::Value& cfg = text_config_of(root, file, &where);
  Gemma4Config c;
  const json::Value* model_type = root.find("model_type");
  if (model_type && model_type->as_string() == "qwen3_moe") c.family = ModelFamily::qwen3_moe;
  const bool qwen3 = c.family == ModelFamily::qwen3_moe;
  const char* top_k_key = qwen3 ? "num_experts_per_tok" : "top_k_experts";
  c.hidden_size = positive_int(cfg, "hidden_size", file, where);
  c.intermediate_size = positive_int(cfg, "intermediate_size", file, where);
  c.moe_intermediate_size = positive_int(cfg, "moe_intermediate_size", file, where);
  c.num_experts = positive_int(cfg, "num_experts", file, where, kMaxExperts);
  c.top_k_experts = positive_int(cfg, top_k_key, file, where, kMaxExperts);
  c.num_hidden_layers = positive_int(cfg, "num_hidden_layers", file, where, Gemma4Config::kMaxLayers);
  if (c.top_k_experts > c.num_experts)
    fail(file, detail::cat(where, top_k_key, "=", c.top_k_experts, " exceeds num_experts=", c.num_experts));
  if (qwen3) {
    c.num_kv_shared_layers = 0;  // no KV sharing: the dense width is never doubled
    read_qwen3_layer_structure(cfg, file, &c);
  } else {
    read_layer_structure(cfg, file, where, &c);
  }
  if (const json::Value* eps = cfg.find("rms_norm_eps")) {
    if (!eps->is_number()) fail(file, where + "\"rms_norm_eps\" must be a number");
    const double e = std::strtod(eps->number_text().c_str(), nullptr);
    if (!(e >= 0.0 && e < 1.0)) fail(file, where + "\"rms_norm_eps\" must be in [0, 1), got " + eps->number_text());
    c.rms_norm_eps = static_cast<float>(e);
  }
  const json::Value* quant = root.find("quantization");
  if (!quant) quant = cfg.find("quantization");
  if (quant && !quant->is_null()) {
    if (!quant->is_object()) fail(file, "\"quantization\" must be an object");
    c.quantized = true;
    c.default_quant = quant_setting(*quant, file, "default", false);
    for (const auto& [key, value] : quant->members()) {
      if (value.is_object()) {
        c.overrides[key] = quant_setting(value, file, key, true);
      } else if (value.is_bool()) {
        // mlx-lm writes `false` for a module left unquantized; `true` takes the default.
        c.overrides[key] = value.as_bool() ? c.default_quant : QuantSetting{};
      } else if (key != "group_size" && key != "bits" && key != "mode" && !value.is_string() && !value.is_number()) {
        fail(file, "quantization \"" + key + "\" must be an object or a boolean");
      }
    }
  }
  return c;
}

Gemma4Config Gemma4Config::gemma4_26b_a4b(int64_t layers, const std::string& prefix, bool dense_mlp_8bit) {
  Gemma4Config c;
  c.hidden_size = 2816;
  c.intermediate_size = 2112;
  c.moe_intermediate_size = 704;
  c.num_experts = 128;
  c.top_k_experts = 8;
  c.num_hidden_layers = layers;
  c.rms_norm_eps = 1e-6f;
  c.quantized = true;
  c.default_quant = {4, 64};
  for (int64_t l = 0; l < layers; ++l) {
    const int n = static_cast<int>(l);
    c.overrides[layer_name(prefix, n, "router.proj")] = {8, 64};
    if (dense_mlp_8bit)
      for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) c.overrides[layer_name(prefix, n, m)] = {8, 64};
  }
  return c;
}

Gemma4Config Gemma4Config::qwen3_30b_a3b(int64_t layers, const std::string& prefix) {
  Gemma4Config c;
  c.family = ModelFamily::qwen3_moe;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.moe_intermediate_size = 768;
  c.num_experts = 128;
  c.top_k_experts = 8;
  c.norm_topk_prob = true;
  c.num_hidden_layers = layers;
  c.num_kv_shared_layers = 0;
  c.rms_norm_eps = 1e-6f;
  c.quantized = true;
  c.default_quant = {4, 64};
  for (int64_t l = 0; l < layers; ++l) c.overrides[layer_name(prefix, static_cast<int>(l), "mlp.gate")] = {8, 64};
  return c;
}

std::string Gemma4Config::to_json() const {
  std::ostringstream s;
  s << "{\n  \"hidden_size\": " << hidden_size << ",\n  \"intermediate_size\": " << intermediate_size
    << ",\n  \"moe_intermediate_size\": " << moe_intermediate_size << ",\n  \"num_experts\": " << num_experts
    << ",\n  \"num_hidden_layers\": " << num_hidden_layers << ",\n  \"rms_norm_eps\": " << json_float(rms_norm_eps);
  if (family == ModelFamily::qwen3_moe) {
    s << ",\n  \"model_type\": \"qwen3_moe\",\n  \"architectures\": [\"Qwen3MoeForCausalLM\"]"
      << ",\n  \"num_experts_per_tok\": " << top_k_experts
      << ",\n  \"norm_topk_prob\": " << (norm_topk_prob ? "true" : "false")
      << ",\n  \"decoder_sparse_step\": 1,\n  \"mlp_only_layers\": []";
  } else {
    s << ",\n  \"model_type\": \"gemma4_text\",\n  \"architectures\": [\"Gemma4ForCausalLM\"]"
      << ",\n  \"top_k_experts\": " << top_k_experts << ",\n  \"enable_moe_block\": true"
      << ",\n  \"num_kv_shared_layers\": " << num_kv_shared_layers
      << ",\n  \"use_double_wide_mlp\": " << (use_double_wide_mlp ? "true" : "false")
      << ",\n  \"hidden_size_per_layer_input\": 0";
  }
  if (quantized) {
    for (const char* key : {"quantization", "quantization_config"}) {
      s << ",\n  \"" << key << "\": {\"group_size\": " << default_quant.group_size
        << ", \"bits\": " << default_quant.bits << ", \"mode\": \"" << quant_mode_name(default_quant.mode) << "\"";
      for (const auto& [path, q] : overrides) {
        s << ",\n    " << json::quote(path) << ": ";
        if (q.quantized() && q.mode != QuantMode::affine)  // a module dict without "mode" is affine
          s << "{\"group_size\": " << q.group_size << ", \"bits\": " << q.bits << ", \"mode\": \""
            << quant_mode_name(q.mode) << "\"}";
        else if (q.quantized())
          s << "{\"group_size\": " << q.group_size << ", \"bits\": " << q.bits << "}";
        else
          s << "false";
      }
      s << "}";
    }
  }
  s << "\n}\n";
  return s.str();
}

Gemma4Checkpoint Gemma4Checkpoint::open(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) fail(dir, std::string("cannot open the checkpoint directory: ") + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) fail(dir, std::string("is ") + detail::file_kind(st.st_mode) + ", not a checkpoint directory");
  Gemma4Checkpoint ck;
  ck.dir_ = dir;
  const std::string config_path = dir + "/config.json";
  ck.config_ = parse_gemma4_config(read_text(config_path), config_path);

  // Which files: the index's weight_map, else model.safetensors, else every *.safetensors.
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::map<std::string, std::string> index;  // tensor -> file name
  std::vector<std::string> names;
  if (exists(index_path)) {
    const json::Value root = parse_json(read_text(index_path), index_path);
    const json::Value* map = root.is_object() ? root.find("weight_map") : nullptr;
    if (!map || !map->is_object()) fail(index_path, "\"weight_map\" is missing or not an object");
    std::set<std::string> seen;
    for (const auto& [tensor, file] : map->members()) {
      if (!file.is_string()) fail(index_path, "weight_map entry '" + tensor + "' is not a file name");
      const std::string& f = file.as_string();
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
        fail(index_path, "weight_map entry '" + tensor + "' names '" + f + "', not a file in the checkpoint directory");
      if (!index.emplace(tensor, f).second) fail(index_path, "tensor '" + tensor + "' is listed twice");
      if (seen.insert(f).second) names.push_back(f);
    }
    if (names.empty()) fail(index_path, "weight_map is empty");
  } else if (exists(dir + "/model.safetensors")) {
    names.push_back("model.safetensors");
  } else {
    DIR* d = ::opendir(dir.c_str());
    if (!d) fail(dir, std::string("cannot list the directory: ") + std::strerror(errno));
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) names.push_back(n);
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
    if (names.empty()) fail(dir, "holds no .safetensors file and no model.safetensors.index.json");
  }
  for (const std::string& n : names) {
    const std::string path = dir + "/" + n;
    ck.files_.push_back(std::make_shared<SafetensorsFile>(SafetensorsFile::open(path)));
    ck.file_paths_.push_back(path);
    const int idx = static_cast<int>(ck.files_.size()) - 1;
    for (const std::string& t : ck.files_.back()->names()) {
      auto listed = index.find(t);
      if (!index.empty() && (listed == index.end() || listed->second != n))
        fail(path, "holds tensor '" + t + "' that the index " +
                       (listed == index.end() ? std::string("does not list") : "places in " + listed->second));
      if (!ck.file_of_.emplace(t, idx).second)
        fail(path, "tensor '" + t + "' is also in " + ck.file_paths_[ck.file_of_[t]]);
    }
  }
  // Where a missing tensor is looked for: the index, or the one file, or the directory.
  ck.source_ = !index.empty() ? index_path : (ck.file_paths_.size() == 1 ? ck.file_paths_[0] : dir);
  for (const auto& [tensor, file] : index)
    if (!ck.file_of_.count(tensor))
      fail(dir + "/" + file, "tensor '" + tensor + "' is listed in the index but missing from the file");

  // The prefix: whatever precedes "layers.0.router.proj.weight" (mlx-lm writes
  // "language_model.model." for the multimodal wrapper and "model." for gemma4_text and qwen3_moe),
  // or "layers.0.mlp.gate.weight" for qwen3_moe.
  const bool qwen3 = ck.config_.family == ModelFamily::qwen3_moe;
  const std::string probe = qwen3 ? "layers.0.mlp.gate.weight" : "layers.0.router.proj.weight";
  std::set<std::string> prefixes;
  for (const auto& [name, file] : ck.file_of_)
    if (name.size() >= probe.size() && name.compare(name.size() - probe.size(), probe.size(), probe) == 0) {
      const std::string p = name.substr(0, name.size() - probe.size());
      if (p.empty() || p.back() == '.') prefixes.insert(p);
    }
  if (prefixes.empty())
    fail(dir, "no tensor named '*" + probe + "': not a " + (qwen3 ? "Qwen3-MoE" : "Gemma 4 MoE") + " checkpoint");
  if (prefixes.size() > 1)
    fail(dir, "layers under more than one prefix ('" + *prefixes.begin() + "', '" + *prefixes.rbegin() + "')");
  ck.prefix_ = *prefixes.begin();

  for (int l = 0; l < ck.num_layers(); ++l) {  // validate every layer up front
    if (qwen3) (void)ck.qwen3_moe_layer(l);
    else (void)ck.layer(l);
  }
  return ck;
}

const std::string& Gemma4Checkpoint::file_of(const std::string& name) const {
  auto it = file_of_.find(name);
  if (it == file_of_.end()) fail(source_, "missing tensor '" + name + "'");
  return file_paths_[static_cast<size_t>(it->second)];
}

Tensor Gemma4Checkpoint::tensor(const std::string& name) const {
  auto it = file_of_.find(name);
  if (it == file_of_.end()) fail(source_, "missing tensor '" + name + "'");
  return files_[static_cast<size_t>(it->second)]->get(name);
}

Tensor Gemma4Checkpoint::load_float(const std::string& name, const Shape& shape) const {
  const Tensor t = tensor(name);
  if (!is_floating(t.dtype()) || t.shape() != shape)
    fail(file_of(name), "tensor '" + name + "': expected a float tensor " + shape_str(shape) + ", got " +
                            shape_of(t.dtype(), t.shape()));
  return t;
}

QuantSetting Gemma4Checkpoint::module_quant(const std::string& module, int64_t in_features) const {
  // mlx-lm's loader (utils.load_model, _quantize): a config entry for the module decides; without
  // one the module is quantized iff "<module>.scales" exists, with bits and group size inferred
  // from the shapes (utils.infer_quant_config), not taken from the default.
  const std::string sname = module + ".scales", bname = module + ".biases", wname = module + ".weight";
  const bool has_quant_tensors = has(sname) || has(bname);
  auto entry = config_.overrides.find(module);
  if (entry == config_.overrides.end())  // mlx-lm keys entries by module path; accept unprefixed keys too
    entry = config_.overrides.find(module.substr(prefix_.size()));
  if (config_.quantized && entry != config_.overrides.end()) {
    const QuantSetting qs = entry->second;
    if (qs.quantized() && !has_quant_tensors)
      fail(file_of(wname), detail::cat("config.json quantizes '", module, "' (bits=", qs.bits,
                                       ") but there is no tensor '", sname, "'"));
    if (!qs.quantized() && has_quant_tensors)
      fail(file_of(has(sname) ? sname : bname), "tensor '" + (has(sname) ? sname : bname) +
                                                    "' is present but config.json leaves '" + module +
                                                    "' unquantized (false)");
    return qs;
  }
  if (!has_quant_tensors) return {};
  if (!config_.quantized)
    fail(file_of(has(sname) ? sname : bname), "tensor '" + (has(sname) ? sname : bname) +
                                                  "' is present but config.json has no \"quantization\"");
  const Tensor w = tensor(wname), scales = tensor(sname);
  if (!is_floating(scales.dtype()) && scales.dtype() != DType::u8)
    fail(file_of(sname), "tensor '" + sname + "' is " + dtype_name(scales.dtype()) +
                             ": MLX scales are a float type (affine) or uint8 (mxfp4, mxfp8, nvfp4)");
  if (w.ndim() < 2 || scales.ndim() < 2 || scales.size(-1) == 0 || in_features % scales.size(-1) != 0 ||
      (w.size(-1) * 32) % in_features != 0)
    fail(file_of(wname), detail::cat("tensors '", wname, "' ", shape_of(w.dtype(), w.shape()), " and '", sname, "' ",
                                     shape_of(scales.dtype(), scales.shape()), " are not an MLX quantization of ",
                                     in_features, " input features"));
  QuantSetting qs;
  qs.group_size = static_cast<int>(in_features / scales.size(-1));
  qs.bits = static_cast<int>(w.size(-1) * 32 / in_features);
  if (scales.dtype() == DType::u8) {
    // mlx-lm's infer_quant_config: uint8 scales are an fp mode, told apart by (bits, group_size).
    for (QuantMode m : {QuantMode::nvfp4, QuantMode::mxfp4, QuantMode::mxfp8})
      if (valid_quant_params(m, qs.bits, qs.group_size)) qs.mode = m;
    if (qs.mode == QuantMode::affine)
      fail(file_of(wname), detail::cat("tensors '", wname, "' ", shape_of(w.dtype(), w.shape()), " and '", sname,
                                       "' ", shape_of(scales.dtype(), scales.shape()), " give bits=", qs.bits,
                                       " group_size=", qs.group_size, " with uint8 scales: not an MLX fp mode "
                                       "(mxfp4: 4 / 32, mxfp8: 8 / 32, nvfp4: 4 / 16)"));
    return qs;
  }
  if (!valid_bits(qs.bits) || !valid_group_size(qs.group_size))
    fail(file_of(wname), detail::cat("tensors '", wname, "' ", shape_of(w.dtype(), w.shape()), " and '", sname, "' ",
                                     shape_of(scales.dtype(), scales.shape()), " give bits=", qs.bits,
                                     " group_size=", qs.group_size, " for ", in_features,
                                     " input features (MLX affine: bits 2, 3, 4, 5, 6, 8; group_size 32, 64, 128)"));
  return qs;
}

QuantizedWeight Gemma4Checkpoint::load_quantized(const std::string& module, int64_t rows, int64_t in_features,
                                                 int64_t experts, QuantSetting qs) const {
  const std::string wname = module + ".weight", sname = module + ".scales", bname = module + ".biases";
  const int bits = qs.bits, gs = qs.group_size;
  const std::string& wfile = file_of(wname);
  if (in_features % gs != 0 || (in_features * bits) % 32 != 0)
    fail(wfile, detail::cat("tensor '", wname, "': ", in_features, " input features cannot be quantized with bits=",
                            bits, " group_size=", gs));
  Shape wshape, gshape;
  if (experts > 0) wshape.push_back(experts), gshape.push_back(experts);
  wshape.push_back(rows);
  wshape.push_back(in_features * bits / 32);
  gshape.push_back(rows);
  gshape.push_back(in_features / gs);
  QuantizedWeight q;
  q.bits = bits;
  q.group_size = gs;
  q.mode = qs.mode;
  q.w = tensor(wname);
  if (q.w.dtype() != DType::u32 || q.w.shape() != wshape)
    fail(wfile, detail::cat("tensor '", wname, "': expected ", shape_of(DType::u32, wshape), " (bits=", bits,
                            " group_size=", gs, "), got ", shape_of(q.w.dtype(), q.w.shape())));
  if (has(module + ".global_scale"))
    fail(file_of(module + ".global_scale"), "tensor '" + module + ".global_scale': nvfp4 global scales are not "
                                            "supported (MLX 0.32 runs gather_qmm with one on the GPU only)");
  q.scales = tensor(sname);
  if (qs.mode != QuantMode::affine) {
    if (q.scales.dtype() != DType::u8 || q.scales.shape() != gshape)
      fail(file_of(sname), detail::cat("tensor '", sname, "': expected ", shape_of(DType::u8, gshape), " (mode ",
                                       quant_mode_name(qs.mode), " bits=", bits, " group_size=", gs, "), got ",
                                       shape_of(q.scales.dtype(), q.scales.shape())));
    if (has(bname))
      fail(file_of(bname), detail::cat("tensor '", bname, "' is present but mode ", quant_mode_name(qs.mode),
                                       " has no biases"));
    return q;
  }
  if (q.scales.dtype() == DType::u8)
    fail(file_of(sname), detail::cat("tensor '", sname, "' is uint8 (the scales of an MLX fp mode: mxfp4, mxfp8, "
                                     "nvfp4) but config.json quantizes '", module, "' as affine (bits=", bits,
                                     " group_size=", gs, ")"));
  q.biases = tensor(bname);
  for (const auto& [name, t] : {std::pair<std::string, Tensor>{sname, q.scales}, {bname, q.biases}})
    if (!is_floating(t.dtype()) || t.shape() != gshape)
      fail(file_of(name), detail::cat("tensor '", name, "': expected a float tensor ", shape_str(gshape), " (bits=",
                                      bits, " group_size=", gs, "), got ", shape_of(t.dtype(), t.shape())));
  if (q.scales.dtype() != q.biases.dtype())
    fail(file_of(bname), "tensor '" + bname + "' is " + dtype_name(q.biases.dtype()) + " but '" + sname + "' is " +
                             dtype_name(q.scales.dtype()));
  return q;
}

Linear Gemma4Checkpoint::load_linear(const std::string& module, int64_t out_features, int64_t in_features) const {
  Linear l;
  const QuantSetting qs = module_quant(module, in_features);
  if (qs.quantized())
    l.quantized = load_quantized(module, out_features, in_features, 0, qs);
  else
    l.dense = load_float(module + ".weight", {out_features, in_features});
  return l;
}

void Gemma4Checkpoint::load_expert_proj(const std::string& module, int64_t rows, int64_t in_features,
                                        int64_t experts, QuantizedWeight* q, Tensor* dense) const {
  const QuantSetting qs = module_quant(module, in_features);
  if (qs.quantized())
    *q = load_quantized(module, rows, in_features, experts, qs);
  else
    *dense = load_float(module + ".weight", {experts, rows, in_features});
}

Qwen3MoeFfnWeights Gemma4Checkpoint::qwen3_moe_layer(int n) const {
  EXPERTQMM_CHECK(family() == ModelFamily::qwen3_moe, kOp, dir_, " holds a ", model_family_name(family()),
                  " model, not qwen3_moe: use layer()");
  EXPERTQMM_CHECK(n >= 0 && n < num_layers(), kOp, dir_, ": layer ", n, " out of range [0, ", num_layers(), ")");
  const Gemma4Config& c = config_;
  const int64_t H = c.hidden_size, Ie = c.moe_intermediate_size, E = c.num_experts;
  auto name = [&](const std::string& rest) { return layer_name(prefix_, n, rest); };
  Qwen3MoeFfnWeights w;
  w.eps = c.rms_norm_eps;
  w.post_attention_layernorm = load_float(name("post_attention_layernorm.weight"), {H});
  RouterWeights& r = w.moe.router;
  r.kind = RouterKind::softmax_topk;
  r.top_k = static_cast<int>(c.top_k_experts);
  r.norm_topk_prob = c.norm_topk_prob;
  const Linear gate = load_linear(name("mlp.gate"), E, H);
  r.proj = gate.quantized;
  r.proj_dense = gate.dense;
  SwitchGLUWeights& ex = w.moe.experts;
  ex.activation = Activation::swiglu;
  load_expert_proj(name("mlp.switch_mlp.gate_proj"), Ie, H, E, &ex.gate, &ex.gate_dense);
  load_expert_proj(name("mlp.switch_mlp.up_proj"), Ie, H, E, &ex.up, &ex.up_dense);
  load_expert_proj(name("mlp.switch_mlp.down_proj"), H, Ie, E, &ex.down, &ex.down_dense);
  return w;
}

Gemma4FfnWeights Gemma4Checkpoint::layer(int n) const {
  EXPERTQMM_CHECK(family() == ModelFamily::gemma4, kOp, dir_, " holds a ", model_family_name(family()),
                  " model, not gemma4: use qwen3_moe_layer()");
  EXPERTQMM_CHECK(n >= 0 && n < num_layers(), kOp, dir_, ": layer ", n, " out of range [0, ", num_layers(), ")");
  const Gemma4Config& c = config_;
  const int64_t H = c.hidden_size, I = c.mlp_intermediate_size(n), Ie = c.moe_intermediate_size, E = c.num_experts;
  auto name = [&](const std::string& rest) { return layer_name(prefix_, n, rest); };
  Gemma4FfnWeights w;
  w.eps = c.rms_norm_eps;
  w.pre_feedforward_layernorm = load_float(name("pre_feedforward_layernorm.weight"), {H});
  w.post_feedforward_layernorm_1 = load_float(name("post_feedforward_layernorm_1.weight"), {H});
  w.pre_feedforward_layernorm_2 = load_float(name("pre_feedforward_layernorm_2.weight"), {H});
  w.post_feedforward_layernorm_2 = load_float(name("post_feedforward_layernorm_2.weight"), {H});
  w.post_feedforward_layernorm = load_float(name("post_feedforward_layernorm.weight"), {H});
  const std::string ls = name("layer_scalar");
  w.layer_scalar = tensor(ls);
  if (!is_floating(w.layer_scalar.dtype()) || w.layer_scalar.numel() != 1 || w.layer_scalar.ndim() > 1)
    fail(file_of(ls), "tensor '" + ls + "': expected a float tensor [1], got " +
                          shape_of(w.layer_scalar.dtype(), w.layer_scalar.shape()));
  w.mlp.gate = load_linear(name("mlp.gate_proj"), I, H);
  w.mlp.up = load_linear(name("mlp.up_proj"), I, H);
  w.mlp.down = load_linear(name("mlp.down_proj"), H, I);

  RouterWeights& r = w.moe.router;
  r.top_k = static_cast<int>(c.top_k_experts);
  r.eps = c.rms_norm_eps;
  const Linear proj = load_linear(name("router.proj"), E, H);
  r.proj = proj.quantized;
  r.proj_dense = proj.dense;
  const std::string scale = name("router.scale");
  const Tensor s = tensor(scale);
  if (is_floating(s.dtype()) && s.numel() == 1 && s.ndim() <= 1 && H != 1) {
    // A scalar router.scale (one third-party layout, gemma4-moe open question 5) broadcast to [H].
    std::vector<uint8_t> one = s.to_host_bytes(), all;
    for (int64_t i = 0; i < H; ++i) all.insert(all.end(), one.begin(), one.end());
    r.scale = Tensor::from_host(all.data(), {H}, s.dtype());
  } else {
    r.scale = load_float(scale, {H});
  }
  r.per_expert_scale = load_float(name("router.per_expert_scale"), {E});

  SwitchGLUWeights& ex = w.moe.experts;
  ex.activation = Activation::geglu;
  const std::string fused = name("experts.switch_glu.gate_up_proj");
  // Each projection quantized or 16-bit on its own, as mlx-lm decides per module.
  if (has(fused + ".weight")) {
    load_expert_proj(fused, 2 * Ie, H, E, &ex.gate_up, &ex.gate_up_dense);
  } else {
    load_expert_proj(name("experts.switch_glu.gate_proj"), Ie, H, E, &ex.gate, &ex.gate_dense);
    load_expert_proj(name("experts.switch_glu.up_proj"), Ie, H, E, &ex.up, &ex.up_dense);
  }
  load_expert_proj(name("experts.switch_glu.down_proj"), H, Ie, E, &ex.down, &ex.down_dense);
  return w;
}

}  // namespace expertqmm

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

// {"group_size": g, "bits": b} (extra keys allowed, "mode" must be affine when present).
QuantSetting quant_setting(const json::Value& obj, const std::string& file, const std::string& key) {
  const std::string where = "quantization \"" + key + "\": ";
  QuantSetting q;
  q.bits = static_cast<int>(positive_int(obj, "bits", file, where));
  q.group_size = static_cast<int>(positive_int(obj, "group_size", file, where));
  if (!valid_bits(q.bits) || !valid_group_size(q.group_size))
    fail(file, detail::cat(where, "unknown quantization bits=", q.bits, " group_size=", q.group_size,
                           " (MLX affine: bits 2, 3, 4, 5, 6, 8; group_size 32, 64, 128)"));
  if (const json::Value* mode = obj.find("mode"))
    if (!mode->is_string() || mode->as_string() != "affine")
      fail(file, where + "unsupported quantization mode " +
                     (mode->is_string() ? "\"" + mode->as_string() + "\"" : "(not a string)") + "; only affine");
  return q;
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

QuantSetting Gemma4Config::quant_for(const std::string& module_path) const {
  if (!quantized) return {};
  auto it = overrides.find(module_path);
  if (it != overrides.end()) return it->second;
  return default_quant;
}

Gemma4Config parse_gemma4_config(const std::string& text, const std::string& file) {
  const json::Value root = parse_json(text, file);
  if (!root.is_object()) fail(file, "must hold a JSON object");
  const json::Value* text_config = root.find("text_config");
  const json::Value& cfg = text_config && text_config->is_object() ? *text_config : root;
  const std::string where = text_config ? "text_config " : "";
  Gemma4Config c;
  c.hidden_size = positive_int(cfg, "hidden_size", file, where);
  c.intermediate_size = positive_int(cfg, "intermediate_size", file, where);
  c.moe_intermediate_size = positive_int(cfg, "moe_intermediate_size", file, where);
  c.num_experts = positive_int(cfg, "num_experts", file, where, kMaxExperts);
  c.top_k_experts = positive_int(cfg, "top_k_experts", file, where, kMaxExperts);
  c.num_hidden_layers = positive_int(cfg, "num_hidden_layers", file, where, Gemma4Config::kMaxLayers);
  if (c.top_k_experts > c.num_experts)
    fail(file, detail::cat(where, "top_k_experts=", c.top_k_experts, " exceeds num_experts=", c.num_experts));
  if (const json::Value* moe = cfg.find("enable_moe_block"))
    if (!moe->is_bool() || !moe->as_bool())
      fail(file, where + "\"enable_moe_block\" must be true: only the MoE layers of Gemma 4 are supported");
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
    c.default_quant = quant_setting(*quant, file, "default");
    for (const auto& [key, value] : quant->members()) {
      if (value.is_object()) {
        c.overrides[key] = quant_setting(value, file, key);
      } else if (value.is_bool() && !value.as_bool()) {
        c.overrides[key] = QuantSetting{};  // mlx-lm writes `false` for a module left unquantized
      } else if (key != "group_size" && key != "bits" && key != "mode" && !value.is_string() && !value.is_number()) {
        fail(file, "quantization \"" + key + "\" must be an object or false");
      }
    }
  }
  return c;
}

Gemma4Config Gemma4Config::gemma4_26b_a4b(int64_t layers, const std::string& prefix) {
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
  for (int64_t l = 0; l < layers; ++l)
    for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "router.proj"})
      c.overrides[layer_name(prefix, static_cast<int>(l), m)] = {8, 64};
  return c;
}

std::string Gemma4Config::to_json() const {
  std::ostringstream s;
  s << "{\n  \"model_type\": \"gemma4_text\",\n  \"architectures\": [\"Gemma4ForCausalLM\"],\n"
    << "  \"hidden_size\": " << hidden_size << ",\n  \"intermediate_size\": " << intermediate_size
    << ",\n  \"moe_intermediate_size\": " << moe_intermediate_size << ",\n  \"num_experts\": " << num_experts
    << ",\n  \"top_k_experts\": " << top_k_experts << ",\n  \"num_hidden_layers\": " << num_hidden_layers
    << ",\n  \"enable_moe_block\": true,\n  \"num_kv_shared_layers\": 0,\n  \"hidden_size_per_layer_input\": 0"
    << ",\n  \"rms_norm_eps\": " << json_float(rms_norm_eps);
  if (quantized) {
    for (const char* key : {"quantization", "quantization_config"}) {
      s << ",\n  \"" << key << "\": {\"group_size\": " << default_quant.group_size
        << ", \"bits\": " << default_quant.bits << ", \"mode\": \"affine\"";
      for (const auto& [path, q] : overrides) {
        s << ",\n    " << json::quote(path) << ": ";
        if (q.quantized())
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
  // "language_model.model." for the multimodal wrapper and "model." for gemma4_text).
  const std::string probe = "layers.0.router.proj.weight";
  std::set<std::string> prefixes;
  for (const auto& [name, file] : ck.file_of_)
    if (name.size() >= probe.size() && name.compare(name.size() - probe.size(), probe.size(), probe) == 0) {
      const std::string p = name.substr(0, name.size() - probe.size());
      if (p.empty() || p.back() == '.') prefixes.insert(p);
    }
  if (prefixes.empty()) fail(dir, "no tensor named '*" + probe + "': not a Gemma 4 MoE checkpoint");
  if (prefixes.size() > 1)
    fail(dir, "layers under more than one prefix ('" + *prefixes.begin() + "', '" + *prefixes.rbegin() + "')");
  ck.prefix_ = *prefixes.begin();

  for (int l = 0; l < ck.num_layers(); ++l) (void)ck.layer(l);  // validate every layer up front
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

QuantizedWeight Gemma4Checkpoint::load_quantized(const std::string& module, int64_t rows, int64_t in_features,
                                                 int64_t experts) const {
  const std::string wname = module + ".weight", sname = module + ".scales", bname = module + ".biases";
  QuantSetting qs = config_.quant_for(module);
  if (!qs.quantized()) {
    // mlx-lm keys overrides by the model's module path; accept keys written without the prefix too.
    auto it = config_.overrides.find(module.substr(prefix_.size()));
    if (config_.quantized && it != config_.overrides.end()) qs = it->second;
  }
  if (!qs.quantized())
    fail(file_of(sname), "tensor '" + sname + "' is present but config.json does not quantize '" + module + "'");
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
  q.w = tensor(wname);
  if (q.w.dtype() != DType::u32 || q.w.shape() != wshape)
    fail(wfile, detail::cat("tensor '", wname, "': expected ", shape_of(DType::u32, wshape), " (bits=", bits,
                            " group_size=", gs, " per config.json), got ", shape_of(q.w.dtype(), q.w.shape())));
  q.scales = tensor(sname);
  q.biases = tensor(bname);
  for (const auto& [name, t] : {std::pair<std::string, Tensor>{sname, q.scales}, {bname, q.biases}})
    if (!is_floating(t.dtype()) || t.shape() != gshape)
      fail(file_of(name), detail::cat("tensor '", name, "': expected a float tensor ", shape_str(gshape), " (bits=",
                                      bits, " group_size=", gs, " per config.json), got ",
                                      shape_of(t.dtype(), t.shape())));
  if (q.scales.dtype() != q.biases.dtype())
    fail(file_of(bname), "tensor '" + bname + "' is " + dtype_name(q.biases.dtype()) + " but '" + sname + "' is " +
                             dtype_name(q.scales.dtype()));
  return q;
}

Linear Gemma4Checkpoint::load_linear(const std::string& module, int64_t out_features, int64_t in_features) const {
  Linear l;
  if (has(module + ".scales") || has(module + ".biases")) {
    l.quantized = load_quantized(module, out_features, in_features, 0);
    return l;
  }
  const QuantSetting qs = config_.quant_for(module);
  if (qs.quantized())
    fail(file_of(module + ".weight"), detail::cat("config.json quantizes '", module, "' (bits=", qs.bits,
                                                  ") but there is no tensor '", module, ".scales'"));
  l.dense = load_float(module + ".weight", {out_features, in_features});
  return l;
}

Gemma4FfnWeights Gemma4Checkpoint::layer(int n) const {
  EXPERTQMM_CHECK(n >= 0 && n < num_layers(), kOp, dir_, ": layer ", n, " out of range [0, ", num_layers(), ")");
  const Gemma4Config& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, Ie = c.moe_intermediate_size, E = c.num_experts;
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
  if (has(fused + ".weight")) {
    ex.gate_up = load_quantized(fused, 2 * Ie, H, E);
  } else {
    const std::string gate = name("experts.switch_glu.gate_proj");
    if (!has(gate + ".scales") && has(gate + ".weight"))
      fail(file_of(gate + ".weight"), "tensor '" + gate + "' is not quantized; expertqmm runs quantized experts only");
    ex.gate = load_quantized(gate, Ie, H, E);
    ex.up = load_quantized(name("experts.switch_glu.up_proj"), Ie, H, E);
  }
  ex.down = load_quantized(name("experts.switch_glu.down_proj"), H, Ie, E);
  return w;
}

}  // namespace expertqmm

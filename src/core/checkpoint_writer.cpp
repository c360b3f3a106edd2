// Writing Gemma 4 and Qwen3-MoE checkpoints in mlx-lm's format (include/expertqmm/checkpoint.h) and the
// synthetic layers for them. The shards are streamed: each header is computed from the tensor
// list up front (every layer has the structure of layer 0), then each layer is generated, written
// and dropped, so a 30-layer 26B-A4B checkpoint never needs more than one layer in memory. All files
// go into a temporary directory that one rename publishes (core/staged_dir.h).
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>

#include "core/float16.h"
#include "core/json.h"
#include "core/staged_dir.h"
#include "core/synthetic_fp.h"
#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"

namespace expertqmm {

namespace {

constexpr const char* kOp = "write_checkpoint";

// splitmix64: fast, deterministic per seed; one stream per tensor.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  double normal() {  // Box-Muller, one of the pair
    const double u1 = (double(next() >> 11) + 0.5) * 0x1.0p-53, u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

uint64_t stream_seed(uint64_t seed, int layer, int tensor) {
  SplitMix64 g{seed ^ (0x632be59bd9b4e019ull * uint64_t(layer + 1)) ^ (0xd1b54a32d192ed03ull * uint64_t(tensor + 1))};
  return g.next();
}

Tensor bf16_tensor(const std::vector<float>& v, const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::bf16);
  for (size_t i = 0; i < v.size(); ++i) t.data_as<uint16_t>()[i] = float_to_bf16(v[i]);
  return t;
}

// [E..., N, K] quantized with random codes. Affine: scale ±(0.01 + 0.002 n) * magnitude, bias =
// -scale * middle code; fp modes: detail::finish_synthetic_fp's scales (magnitude not applied: its
// E8M0 / E4M3 scales give weights of about 0.01 to 0.05), no biases.
QuantizedWeight random_quantized(int64_t experts, int64_t N, int64_t K, QuantSetting qs, uint64_t seed,
                                 double magnitude) {
  EXPERTQMM_CHECK(valid_quant_params(qs.mode, qs.bits, qs.group_size), kOp, "bits ", qs.bits, " / group_size ",
                  qs.group_size, " is not an MLX ", quant_mode_name(qs.mode), " pair");
  EXPERTQMM_CHECK(K % qs.group_size == 0 && (K * qs.bits) % 32 == 0, kOp, "K=", K,
                  " is not a multiple of group_size ", qs.group_size, " and of 32/bits");
  Shape wshape, gshape;
  if (experts > 0) wshape.push_back(experts), gshape.push_back(experts);
  wshape.insert(wshape.end(), {N, K * qs.bits / 32});
  gshape.insert(gshape.end(), {N, K / qs.group_size});
  QuantizedWeight q;
  q.bits = qs.bits;
  q.group_size = qs.group_size;
  q.mode = qs.mode;
  q.w = Tensor::empty(wshape, DType::u32);
  SplitMix64 words{seed};
  uint32_t* w = q.w.data_as<uint32_t>();
  const int64_t n = q.w.numel();
  for (int64_t i = 0; i + 1 < n; i += 2) {  // any bit pattern is a valid row of codes
    const uint64_t r = words.next();
    w[i] = uint32_t(r);
    w[i + 1] = uint32_t(r >> 32);
  }
  if (n % 2) w[n - 1] = uint32_t(words.next());
  const int64_t groups = shape_numel(gshape);
  if (qs.mode != QuantMode::affine) {
    q.scales = Tensor::empty(gshape, DType::u8);
    detail::finish_synthetic_fp(qs.mode, w, n, q.scales.data_as<uint8_t>(), groups, seed);
    return q;
  }
  q.scales = Tensor::empty(gshape, DType::bf16);
  q.biases = Tensor::empty(gshape, DType::bf16);
  SplitMix64 g{seed ^ 0x5bf03635f0b4f3a1ull};
  const double middle = std::ldexp(1.0, qs.bits - 1) - 0.5;
  for (int64_t i = 0; i < groups; ++i) {
    const double sign = (g.next() & 1) ? 1.0 : -1.0;
    const float s = round_to_bf16(float(sign * (0.01 + 0.002 * g.normal()) * magnitude));
    q.scales.data_as<uint16_t>()[i] = float_to_bf16(s);
    q.biases.data_as<uint16_t>()[i] = float_to_bf16(float(-double(s) * middle));
  }
  return q;
}

Tensor around(int64_t n, double centre, double spread, uint64_t seed) {
  SplitMix64 g{seed};
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = float(centre + spread * g.normal());
  return bf16_tensor(v, {n});
}

// A module of `experts` (0: none) x [N, K], quantized as the config says (mlx-lm's quantize_model
// for K inputs), else bf16 N(0, 0.02). Exactly one of *q and *dense is set. weight_std > 0: the
// values' standard deviation instead (the quantized codes' scale set to give it).
void random_module(const Gemma4Config& c, const std::string& module, int64_t experts, int64_t N, int64_t K,
                   uint64_t seed, QuantizedWeight* q, Tensor* dense, double weight_std = 0) {
  const QuantSetting qs = c.quant_for(module, K);
  if (qs.quantized()) {
    // Uniform codes have standard deviation 2^bits / sqrt(12), times the base scale 0.01.
    const double code_std = 0.01 * std::ldexp(1.0, qs.bits) / std::sqrt(12.0);
    *q = random_quantized(experts, N, K, qs, seed, weight_std > 0 ? weight_std / code_std : 1.0);
    return;
  }
  const int64_t n = (experts > 0 ? experts : 1) * N * K;
  const double spread = weight_std > 0 ? weight_std : 0.02;
  SplitMix64 g{seed};
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = float(spread * g.normal());
  *dense = bf16_tensor(v, experts > 0 ? Shape{experts, N, K} : Shape{N, K});
}

Linear random_linear(const Gemma4Config& c, const std::string& module, int64_t N, int64_t K, uint64_t seed) {
  Linear l;
  random_module(c, module, 0, N, K, seed, &l.quantized, &l.dense);
  return l;
}

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Appends a module's tensors under `base`: .weight/.scales/.biases when quantized, else .weight.
void add_module(NamedTensors& out, const std::string& base, const std::string& name, const QuantizedWeight& q,
                const Tensor& dense) {
  if (q.defined()) {
    out.push_back({base + name + ".weight", q.w});
    out.push_back({base + name + ".scales", q.scales});
    if (q.biases.defined()) out.push_back({base + name + ".biases", q.biases});  // affine only
  } else {
    out.push_back({base + name + ".weight", dense});
  }
}

void check_defined(const NamedTensors& out, int n) {
  for (const auto& [name, t] : out) EXPERTQMM_CHECK(t.defined(), kOp, "layer ", n, ": tensor '", name, "' is undefined");
}

// The (name, tensor) list of one Gemma 4 layer in mlx-lm's names, in a fixed order.
NamedTensors flatten(const Gemma4FfnWeights& w, const std::string& prefix, int n) {
  const std::string base = prefix + "layers." + std::to_string(n) + ".";
  NamedTensors out;
  auto module = [&](const std::string& name, const QuantizedWeight& q, const Tensor& dense) {
    add_module(out, base, name, q, dense);
  };
  auto linear = [&](const std::string& name, const Linear& l) { module(name, l.quantized, l.dense); };
  const SwitchGLUWeights& ex = w.moe.experts;
  if (ex.fused()) {
    module("experts.switch_glu.gate_up_proj", ex.gate_up, ex.gate_up_dense);
  } else {
    module("experts.switch_glu.gate_proj", ex.gate, ex.gate_dense);
    module("experts.switch_glu.up_proj", ex.up, ex.up_dense);
  }
  module("experts.switch_glu.down_proj", ex.down, ex.down_dense);
  out.push_back({base + "layer_scalar", w.layer_scalar});
  linear("mlp.down_proj", w.mlp.down);
  linear("mlp.gate_proj", w.mlp.gate);
  linear("mlp.up_proj", w.mlp.up);
  out.push_back({base + "post_feedforward_layernorm.weight", w.post_feedforward_layernorm});
  out.push_back({base + "post_feedforward_layernorm_1.weight", w.post_feedforward_layernorm_1});
  out.push_back({base + "post_feedforward_layernorm_2.weight", w.post_feedforward_layernorm_2});
  out.push_back({base + "pre_feedforward_layernorm.weight", w.pre_feedforward_layernorm});
  out.push_back({base + "pre_feedforward_layernorm_2.weight", w.pre_feedforward_layernorm_2});
  const RouterWeights& r = w.moe.router;
  module("router.proj", r.proj, r.proj_dense);
  out.push_back({base + "router.per_expert_scale", r.per_expert_scale});
  out.push_back({base + "router.scale", r.scale});
  check_defined(out, n);
  return out;
}

// The (name, tensor) list of one Qwen3-MoE layer's feed-forward part in mlx-lm's names (after
// qwen3_moe.Model.sanitize: the experts stacked under mlp.switch_mlp).
NamedTensors flatten(const Qwen3MoeFfnWeights& w, const std::string& prefix, int n) {
  const std::string base = prefix + "layers." + std::to_string(n) + ".";
  NamedTensors out;
  const RouterWeights& r = w.moe.router;
  const SwitchGLUWeights& ex = w.moe.experts;
  EXPERTQMM_CHECK(!ex.fused(), kOp, "layer ", n, ": mlx-lm's qwen3_moe stores gate and up separately, not fused");
  add_module(out, base, "mlp.gate", r.proj, r.proj_dense);
  add_module(out, base, "mlp.switch_mlp.down_proj", ex.down, ex.down_dense);
  add_module(out, base, "mlp.switch_mlp.gate_proj", ex.gate, ex.gate_dense);
  add_module(out, base, "mlp.switch_mlp.up_proj", ex.up, ex.up_dense);
  out.push_back({base + "post_attention_layernorm.weight", w.post_attention_layernorm});
  check_defined(out, n);
  return out;
}

const char* st_dtype(DType t) {
  switch (t) {
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::f32: return "F32";
    case DType::u32: return "U32";
    case DType::i32: return "I32";
    case DType::u8: return "U8";
  }
  return "?";
}

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  size_t bytes() const { return static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype); }
};

// The safetensors header of `entries` in order, padded with spaces to a multiple of 8 bytes.
std::string header_of(const std::vector<Entry>& entries) {
  std::ostringstream h;
  h << "{\"__metadata__\":{\"format\":\"mlx\"}";
  size_t offset = 0;
  for (const Entry& e : entries) {
    h << "," << json::quote(e.name) << ":{\"dtype\":\"" << st_dtype(e.dtype) << "\",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) h << (i ? "," : "") << e.shape[i];
    h << "],\"data_offsets\":[" << offset << "," << offset + e.bytes() << "]}";
    offset += e.bytes();
  }
  h << "}";
  std::string s = h.str();
  while (s.size() % 8) s += ' ';
  return s;
}

// An output file that is flushed to the disk (fsync) before it counts as written: the checkpoint is
// published by a rename, which must not reach the disk before the data it names.
class OutFile {
 public:
  explicit OutFile(std::string path) : path_(std::move(path)) {
    f_ = std::fopen(path_.c_str(), "wbx");
    if (!f_) throw Error(kOp, path_ + ": cannot create: " + std::strerror(errno));
  }
  ~OutFile() {
    if (f_) std::fclose(f_);
  }
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  void write(const void* data, size_t n) {
    if (n && std::fwrite(data, 1, n, f_) != n) throw Error(kOp, path_ + ": write failed: " + std::strerror(errno));
  }
  void close() {
    const bool ok = std::fflush(f_) == 0 && ::fsync(::fileno(f_)) == 0;
    const std::string why = ok ? "" : std::strerror(errno);
    const bool closed = std::fclose(f_) == 0;
    f_ = nullptr;
    if (!ok || !closed) throw Error(kOp, path_ + ": write failed: " + (ok ? std::strerror(errno) : why));
  }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

void write_text(const std::string& path, const std::string& text) {
  OutFile out(path);
  out.write(text.data(), text.size());
  out.close();
}

// The files a checkpoint directory holds; --force replaces a directory of nothing else.
bool checkpoint_file(const std::string& name) {
  auto ends_with = [&](const char* suffix) {
    const size_t n = std::strlen(suffix);
    return name.size() >= n && name.compare(name.size() - n, n, suffix) == 0;
  };
  return name == "config.json" || ends_with(".safetensors") || ends_with(".safetensors.index.json") ||
         ends_with(".safetensors.tmp");
}

// One shard: its file name, the layers [begin, end) it holds and its header.
struct ShardPlan {
  std::string name;
  int begin = 0, end = 0;
  std::vector<Entry> entries;
  std::string header;
  uint64_t bytes() const {
    uint64_t n = 8 + header.size();
    for (const Entry& e : entries) n += e.bytes();
    return n;
  }
};

std::string index_json(const std::vector<ShardPlan>& plan, uint64_t data_bytes) {
  std::map<std::string, std::string> weight_map;
  for (const ShardPlan& sp : plan)
    for (const Entry& e : sp.entries) weight_map[e.name] = sp.name;
  std::ostringstream idx;
  idx << "{\n  \"metadata\": {\"total_size\": " << data_bytes << "},\n  \"weight_map\": {";
  bool comma = false;
  for (const auto& [tname, file] : weight_map) {
    idx << (comma ? ",\n    " : "\n    ") << json::quote(tname) << ": " << json::quote(file);
    comma = true;
  }
  idx << "\n  }\n}\n";
  return idx.str();
}

std::string gb(uint64_t bytes) { return detail::cat(double(bytes) / 1e9, " GB (", bytes, " bytes)"); }

// A config the synthetic layers of `family` can be made from: that family, and a geometry with
// every size positive (Gemma 4's dense MLP width included) and top_k in [1, E].
void check_synthetic_config(const Gemma4Config& c, ModelFamily family) {
  EXPERTQMM_CHECK(c.family == family, kOp, "synthetic ", model_family_name(family), " layers need a ",
                  model_family_name(family), " config, got ", model_family_name(c.family));
  const bool dense_mlp = family == ModelFamily::gemma4;
  EXPERTQMM_CHECK(c.hidden_size > 0 && (!dense_mlp || c.intermediate_size > 0) && c.moe_intermediate_size > 0 &&
                      c.num_experts > 0 && c.top_k_experts > 0 && c.top_k_experts <= c.num_experts,
                  kOp, "config has an empty or inconsistent geometry (hidden ", c.hidden_size, ", intermediate ",
                  c.intermediate_size, ", moe_intermediate ", c.moe_intermediate_size, ", experts ", c.num_experts,
                  ", top_k ", c.top_k_experts, ")");
}

}  // namespace

Gemma4FfnWeights synthetic_gemma4_layer(const Gemma4Config& c, int layer, uint64_t seed, const std::string& prefix) {
  check_synthetic_config(c, ModelFamily::gemma4);
  const int64_t H = c.hidden_size, I = c.mlp_intermediate_size(layer), Ie = c.moe_intermediate_size, E = c.num_experts;
  const std::string base = prefix + "layers." + std::to_string(layer) + ".";
  int stream = 0;
  auto next_seed = [&] { return stream_seed(seed, layer, stream++); };
  Gemma4FfnWeights w;
  w.eps = c.rms_norm_eps;
  w.pre_feedforward_layernorm = around(H, 1.0, 0.1, next_seed());
  w.post_feedforward_layernorm_1 = around(H, 1.0, 0.1, next_seed());
  w.pre_feedforward_layernorm_2 = around(H, 1.0, 0.1, next_seed());
  w.post_feedforward_layernorm_2 = around(H, 1.0, 0.1, next_seed());
  w.post_feedforward_layernorm = around(H, 1.0, 0.1, next_seed());
  SplitMix64 ls{next_seed()};
  w.layer_scalar = bf16_tensor({float(0.75 + 0.5 * ls.uniform())}, {1});
  w.mlp.gate = random_linear(c, base + "mlp.gate_proj", I, H, next_seed());
  w.mlp.up = random_linear(c, base + "mlp.up_proj", I, H, next_seed());
  w.mlp.down = random_linear(c, base + "mlp.down_proj", H, I, next_seed());
  RouterWeights& r = w.moe.router;
  r.top_k = static_cast<int>(c.top_k_experts);
  r.eps = c.rms_norm_eps;
  const Linear proj = random_linear(c, base + "router.proj", E, H, next_seed());
  r.proj = proj.quantized;
  r.proj_dense = proj.dense;
  r.scale = around(H, 1.0, 0.05, next_seed());
  r.per_expert_scale = around(E, 1.0, 0.05, next_seed());
  SwitchGLUWeights& ex = w.moe.experts;
  ex.activation = Activation::geglu;
  random_module(c, base + "experts.switch_glu.gate_proj", E, Ie, H, next_seed(), &ex.gate, &ex.gate_dense);
  random_module(c, base + "experts.switch_glu.up_proj", E, Ie, H, next_seed(), &ex.up, &ex.up_dense);
  random_module(c, base + "experts.switch_glu.down_proj", E, H, Ie, next_seed(), &ex.down, &ex.down_dense);
  return w;
}

Qwen3MoeFfnWeights synthetic_qwen3_moe_layer(const Gemma4Config& c, int layer, uint64_t seed,
                                             const std::string& prefix) {
  check_synthetic_config(c, ModelFamily::qwen3_moe);
  const int64_t H = c.hidden_size, Ie = c.moe_intermediate_size, E = c.num_experts;
  const std::string base = prefix + "layers." + std::to_string(layer) + ".";
  int stream = 0;
  auto next_seed = [&] { return stream_seed(seed, layer, stream++); };
  Qwen3MoeFfnWeights w;
  w.eps = c.rms_norm_eps;
  w.post_attention_layernorm = around(H, 1.0, 0.1, next_seed());
  RouterWeights& r = w.moe.router;
  r.kind = RouterKind::softmax_topk;
  r.top_k = static_cast<int>(c.top_k_experts);
  r.norm_topk_prob = c.norm_topk_prob;
  // Router weights ~ 1/sqrt(H) (a trained router's scale): logits of the normalised input ~ N(0, 1),
  // so the softmax over E is not one-hot (Gemma 4's router scales its input by H^-1/2 instead).
  random_module(c, base + "mlp.gate", 0, E, H, next_seed(), &r.proj, &r.proj_dense, 1.0 / std::sqrt(double(H)));
  SwitchGLUWeights& ex = w.moe.experts;
  ex.activation = Activation::swiglu;
  random_module(c, base + "mlp.switch_mlp.gate_proj", E, Ie, H, next_seed(), &ex.gate, &ex.gate_dense);
  random_module(c, base + "mlp.switch_mlp.up_proj", E, Ie, H, next_seed(), &ex.up, &ex.up_dense);
  random_module(c, base + "mlp.switch_mlp.down_proj", E, H, Ie, next_seed(), &ex.down, &ex.down_dense);
  return w;
}

namespace {

// The writer behind both families: `layer(n)` gives layer n's named tensors.
void write_checkpoint(const std::string& dir, const Gemma4Config& config, int shards,
                      const std::function<NamedTensors(int)>& layer, const CheckpointWriteOptions& options) {
  const std::string& prefix = options.prefix;
  EXPERTQMM_CHECK(config.num_hidden_layers >= 1 && config.num_hidden_layers <= Gemma4Config::kMaxLayers, kOp,
                  "num_hidden_layers must be in [1, ", Gemma4Config::kMaxLayers, "], got ", config.num_hidden_layers);
  const int L = static_cast<int>(config.num_hidden_layers);
  EXPERTQMM_CHECK(shards >= 1 && shards <= L, kOp, "shards=", shards, " must be in [1, layers=", L, "]");
  EXPERTQMM_CHECK(prefix.empty() || prefix.back() == '.', kOp, "prefix '", prefix, "' must be empty or end in '.'");
  detail::StagedDir staged(dir, options.force, checkpoint_file, kOp);

  // Layer 0 sets the structure (names, dtypes, shapes) every layer must have.
  NamedTensors first = layer(0);
  std::vector<Entry> layout0;
  for (const auto& [name, t] : first) layout0.push_back({name, t.dtype(), t.shape()});
  const std::string base0 = prefix + "layers.0.";
  auto entries_of = [&](int n) {
    std::vector<Entry> e = layout0;
    for (Entry& x : e) x.name = prefix + "layers." + std::to_string(n) + "." + x.name.substr(base0.size());
    return e;
  };

  // Every header up front: the sizes are known before a byte is written, for the free-space check.
  std::vector<ShardPlan> plan(static_cast<size_t>(shards));
  uint64_t data_bytes = 0, total_bytes = 0;
  for (int s = 0; s < shards; ++s) {
    ShardPlan& sp = plan[static_cast<size_t>(s)];
    sp.begin = L * s / shards;
    sp.end = L * (s + 1) / shards;
    char name[64];
    if (shards == 1)
      std::snprintf(name, sizeof(name), "model.safetensors");
    else
      std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", s + 1, shards);
    sp.name = name;
    for (int n = sp.begin; n < sp.end; ++n) {
      const std::vector<Entry> e = entries_of(n);
      sp.entries.insert(sp.entries.end(), e.begin(), e.end());
    }
    sp.header = header_of(sp.entries);
    total_bytes += sp.bytes();
    data_bytes += sp.bytes() - 8 - sp.header.size();
  }
  const std::string config_text = config.to_json();
  const std::string index_text = shards > 1 ? index_json(plan, data_bytes) : "";
  total_bytes += config_text.size() + index_text.size();
  const uint64_t free = options.free_bytes ? options.free_bytes(staged.parent()) : detail::free_bytes(staged.parent(), kOp);
  if (free < total_bytes)
    throw Error(kOp, dir + ": the checkpoint needs " + gb(total_bytes) + " but " + staged.parent() + " has " +
                         gb(free) + " free");

  uint64_t written = 0;
  int layers_written = 0;
  for (const ShardPlan& sp : plan) {
    OutFile out(staged.path() + "/" + sp.name);
    const uint64_t header_len = sp.header.size();
    out.write(&header_len, 8);
    out.write(sp.header.data(), sp.header.size());
    written += 8 + header_len;
    size_t next = 0;
    for (int n = sp.begin; n < sp.end; ++n) {
      const NamedTensors tensors = n == 0 ? first : layer(n);
      EXPERTQMM_CHECK(tensors.size() == layout0.size(), kOp, "layer ", n, " has ", tensors.size(),
                      " tensors but layer 0 has ", layout0.size());
      for (size_t i = 0; i < tensors.size(); ++i) {
        const auto& [tname, t] = tensors[i];
        const Entry& e = sp.entries[next++];
        const Entry& e0 = layout0[i];
        EXPERTQMM_CHECK(tname == e.name && t.dtype() == e.dtype && t.shape() == e.shape, kOp, "layer ", n,
                        ": tensor '", tname, "' ", dtype_name(t.dtype()), shape_str(t.shape()),
                        " does not match layer 0's '", e0.name, "' ", dtype_name(e0.dtype), shape_str(e0.shape));
        if (t.device() == Device::cpu && t.is_contiguous()) {
          out.write(t.data(), t.nbytes());
        } else {
          const std::vector<uint8_t> bytes = t.to_host_bytes();
          out.write(bytes.data(), bytes.size());
        }
        written += e.bytes();
      }
      if (n == 0) first = NamedTensors();  // drop layer 0 once written
      ++layers_written;
      if (options.progress) options.progress(layers_written, L, written, total_bytes);
    }
    out.close();
  }
  write_text(staged.path() + "/config.json", config_text);
  if (shards > 1) write_text(staged.path() + "/model.safetensors.index.json", index_text);
  staged.publish();
}

}  // namespace

void write_gemma4_checkpoint(const std::string& dir, const Gemma4Config& config, int shards,
                             const std::function<Gemma4FfnWeights(int)>& layer, const CheckpointWriteOptions& options) {
  EXPERTQMM_CHECK(config.family == ModelFamily::gemma4, kOp, "write_gemma4_checkpoint needs a gemma4 config, got ",
                  model_family_name(config.family));
  write_checkpoint(dir, config, shards, [&](int n) { return flatten(layer(n), options.prefix, n); }, options);
}

void write_qwen3_moe_checkpoint(const std::string& dir, const Gemma4Config& config, int shards,
                                const std::function<Qwen3MoeFfnWeights(int)>& layer,
                                const CheckpointWriteOptions& options) {
  EXPERTQMM_CHECK(config.family == ModelFamily::qwen3_moe, kOp,
                  "write_qwen3_moe_checkpoint needs a qwen3_moe config, got ", model_family_name(config.family));
  write_checkpoint(dir, config, shards, [&](int n) { return flatten(layer(n), options.prefix, n); }, options);
}

}  // namespace expertqmm

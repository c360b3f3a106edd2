// Gemma 4 checkpoints and the feed-forward layer (checkpoint.h, gemma4.h) for expertqmm._core.
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "bind.h"
#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"

namespace expertqmm::python {

namespace nb = nanobind;
using nb::arg;

namespace {

PyGemma4Layer layer_to(const PyGemma4Layer& l, const std::string& device, int device_id) {
  const Device d = device == "cuda" ? Device::cuda : Device::cpu;
  EXPERTQMM_CHECK(device == "cuda" || device == "cpu", "Gemma4Layer.to", "device must be 'cpu' or 'cuda', got '",
                  device, "'");
  CudaScope scope(d, device_id, 0);
  nb::gil_scoped_release nogil;
  return PyGemma4Layer{l.weights.to(d), d, d == Device::cuda ? device_id : 0};
}

PyMoeWeights layer_moe(const PyGemma4Layer& l) {
  PyMoeWeights m;
  m.weights = l.weights.moe;
  m.device = l.device;
  m.device_id = l.device_id;
  return m;
}

void write_synthetic(const std::string& dir, const Gemma4Config& config, int shards, uint64_t seed,
                     const std::string& prefix, bool force) {
  CheckpointWriteOptions options;
  options.prefix = prefix;
  options.force = force;
  nb::gil_scoped_release nogil;
  write_gemma4_checkpoint(
      dir, config, shards, [&](int n) { return synthetic_gemma4_layer(config, n, seed, prefix); }, options);
}

}  // namespace

void bind_gemma4(nb::module_& m) {
  nb::class_<Gemma4Config>(m, "Gemma4Config", "The keys of a Gemma 4 config.json that the feed-forward part uses.")
      .def_static("gemma4_26b_a4b", &Gemma4Config::gemma4_26b_a4b, arg("layers"), arg("prefix") = "model.", arg("dense_mlp_8bit") = true,
                  "The 26B-A4B geometry with the QAT checkpoint's quantization (experts 4-bit, group 64; dense MLP and "
                  "router 8-bit, or with dense_mlp_8bit=False the dense MLP 4-bit as mlx-community's upload).")
      .def_static("parse", [](const std::string& text) { return parse_gemma4_config(text, "config.json"); },
                  arg("text"), "Parse config.json text as mlx-lm does.")
      .def("to_json", &Gemma4Config::to_json, "config.json text, as mlx-lm writes it.")
      .def_rw("hidden_size", &Gemma4Config::hidden_size, "H.")
      .def_rw("intermediate_size", &Gemma4Config::intermediate_size, "The dense MLP width.")
      .def_rw("moe_intermediate_size", &Gemma4Config::moe_intermediate_size, "The expert width I.")
      .def_rw("num_experts", &Gemma4Config::num_experts, "E.")
      .def_rw("top_k_experts", &Gemma4Config::top_k_experts, "k.")
      .def_rw("num_hidden_layers", &Gemma4Config::num_hidden_layers, "Layers.")
      .def_rw("rms_norm_eps", &Gemma4Config::rms_norm_eps, "The norms' epsilon.")
      .def_prop_rw("group_size", [](const Gemma4Config& c) { return c.default_quant.group_size; },
                   [](Gemma4Config& c, int g) { c.default_quant.group_size = g; }, "The default quantization's group size.")
      .def_prop_rw("bits", [](const Gemma4Config& c) { return c.default_quant.bits; },
                   [](Gemma4Config& c, int b) { c.default_quant.bits = b; }, "The default quantization's bits.");

  nb::class_<PyGemma4Layer>(m, "Gemma4Layer", "One layer's feed-forward weights (norms, dense MLP, router, experts).")
      .def("to", &layer_to, arg("device"), arg("device_id") = 0, "A copy on 'cpu' or 'cuda' (device ordinal device_id).")
      .def_prop_ro("nbytes", [](const PyGemma4Layer& l) { return l.weights.nbytes(); }, "Bytes of every tensor held.")
      .def_prop_ro("device", [](const PyGemma4Layer& l) { return std::string(device_name(l.device)); }, "'cpu' or 'cuda'.")
      .def_prop_ro("moe", &layer_moe, "The MoE block's weights (router and experts), sharing this layer's memory.");

  nb::class_<Gemma4Checkpoint>(m, "Gemma4Checkpoint",
                               "An MLX-format Gemma 4 checkpoint, memory-mapped and validated up front.")
      .def_static("open", [](const std::string& dir) {
        nb::gil_scoped_release nogil;
        return std::make_unique<Gemma4Checkpoint>(Gemma4Checkpoint::open(dir));
      }, arg("dir"), "Open dir (config.json and model*.safetensors).")
      .def_prop_ro("config", &Gemma4Checkpoint::config, nb::rv_policy::copy, "Its Gemma4Config.")
      .def_prop_ro("prefix", &Gemma4Checkpoint::prefix, "The tensor-name prefix ('model.' or 'language_model.model.').")
      .def_prop_ro("num_layers", &Gemma4Checkpoint::num_layers, "Layers.")
      .def_prop_ro("files", &Gemma4Checkpoint::files, "The safetensors files.")
      .def("layer", [](const Gemma4Checkpoint& c, int i) { return PyGemma4Layer{c.layer(i), Device::cpu, 0}; },
           arg("layer"), "Layer `layer`'s feed-forward weights: CPU views of the mapping (`.to('cuda')` copies).")
      .def("tensor", [](const Gemma4Checkpoint& c, const std::string& name) {
        return PyTensor::owning(c.tensor(name), 0);
      }, arg("name"), "A tensor by its full name (a CPU view of the mapping).")
      .def("has", &Gemma4Checkpoint::has, arg("name"), "Whether the checkpoint holds the tensor `name`.");

  m.def("synthetic_gemma4_layer", [](const Gemma4Config& c, int layer, uint64_t seed, const std::string& prefix) {
    nb::gil_scoped_release nogil;
    return PyGemma4Layer{synthetic_gemma4_layer(c, layer, seed, prefix), Device::cpu, 0};
  }, arg("config"), arg("layer") = 0, arg("seed") = 1, arg("prefix") = "model.",
        "Deterministic synthetic weights for one layer of `config` (CPU).");
  m.def("write_synthetic_gemma4_checkpoint", &write_synthetic, arg("dir"), arg("config"), arg("shards") = 1,
        arg("seed") = 1, arg("prefix") = "model.", arg("force") = false,
        "Write a synthetic MLX-format checkpoint of `config` to dir (absent or empty unless force).");
  m.def("gemma4_ffn", [](const PyTensor& h, const PyGemma4Layer& w, uintptr_t stream) {
    CudaScope scope(h, stream);
    nb::gil_scoped_release nogil;
    return PyTensor::owning(gemma4_ffn(h.tensor, w.weights), h.device_id);
  }, arg("h"), arg("weights"), arg("stream") = 0, "The layer's feed-forward part: h [T, H] -> [T, H].");
  m.def("gemma4_ffn_into", [](const PyTensor& out, const PyTensor& h, const PyGemma4Layer& w, Workspace& ws,
                              uintptr_t stream) {
    CudaScope scope(h, stream);
    nb::gil_scoped_release nogil;
    Tensor o = out.tensor;
    gemma4_ffn_into(o, h.tensor, w.weights, ws);
  }, arg("out"), arg("h"), arg("weights"), arg("workspace"), arg("stream") = 0,
        "gemma4_ffn into a caller-owned out; with a warmed-up workspace: no allocation, no host sync.");
}

}  // namespace expertqmm::python

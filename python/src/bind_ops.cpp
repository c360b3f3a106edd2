// The ops of ops.h / quant.h / moe.h, the MoE weights and the workspace, for expertqmm._core.
// Every op takes `stream`: the caller's cudaStream_t as an int, used when the inputs are on CUDA.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <tuple>

#include "bind.h"
#include "expertqmm/error.h"

namespace expertqmm::python {

namespace nb = nanobind;
using nb::arg;

namespace {

// A projection argument: None, a Quantized triple or a dense Tensor.
void set_projection(nb::handle obj, const char* name, QuantizedWeight* q, Tensor* dense, PyMoeWeights& out) {
  if (obj.is_none()) return;
  PyQuantized* pq = nullptr;
  PyTensor* pt = nullptr;
  if (nb::try_cast(obj, pq, false) && pq) {
    *q = pq->get();
    out.keep.insert(out.keep.end(), {pq->w, pq->scales, pq->biases});
  } else if (nb::try_cast(obj, pt, false) && pt) {
    *dense = pt->tensor;
    out.keep.push_back(*pt);
  } else {
    throw Error("MoeWeights", detail::cat(name, " must be a Quantized, a Tensor or None, got ",
                                          nb::type_name(obj.type()).c_str()));
  }
}

Activation parse_activation(const std::string& s) {
  if (s == "geglu") return Activation::geglu;
  if (s == "swiglu") return Activation::swiglu;
  throw Error("MoeWeights", "activation must be 'geglu' or 'swiglu', got '" + s + "'");
}

PyMoeWeights make_moe_weights(nb::handle router_proj, const PyTensor& router_scale, const PyTensor& per_expert_scale,
                              int top_k, double eps, nb::handle gate, nb::handle up, nb::handle gate_up,
                              nb::handle down, const std::string& activation) {
  PyMoeWeights m;
  RouterWeights& r = m.weights.router;
  set_projection(router_proj, "router_proj", &r.proj, &r.proj_dense, m);
  r.scale = router_scale.tensor;
  r.per_expert_scale = per_expert_scale.tensor;
  r.top_k = top_k;
  r.eps = static_cast<float>(eps);
  m.keep.insert(m.keep.end(), {router_scale, per_expert_scale});
  SwitchGLUWeights& e = m.weights.experts;
  set_projection(gate, "gate", &e.gate, &e.gate_dense, m);
  set_projection(up, "up", &e.up, &e.up_dense, m);
  set_projection(gate_up, "gate_up", &e.gate_up, &e.gate_up_dense, m);
  set_projection(down, "down", &e.down, &e.down_dense, m);
  e.activation = parse_activation(activation);
  m.device = router_scale.tensor.device();
  m.device_id = router_scale.device_id;
  return m;
}

// The float dtype a projection widens its input to (its scales', or its dense weight's).
DType projection_dtype(const QuantizedWeight& q, const Tensor& dense) {
  return q.defined() ? q.scales.dtype() : dense.dtype();
}

// What moe_layer returns for input dtype `x`: promote(promote(x, gate/up), down), as the op checks.
std::string moe_output_dtype(const PyMoeWeights& m, const std::string& x) {
  const SwitchGLUWeights& e = m.weights.experts;
  const DType in = parse_dtype(x, "MoeWeights.output_dtype");
  const DType gu = e.fused() ? projection_dtype(e.gate_up, e.gate_up_dense) : projection_dtype(e.gate, e.gate_dense);
  const DType hidden = promote_floating(in, gu);
  return dtype_name(promote_floating(hidden, projection_dtype(e.down, e.down_dense)));
}

QuantMode parse_mode(const char* op, const std::string& name) {
  QuantMode mode = QuantMode::affine;
  if (!parse_quant_mode(name, &mode)) throw Error(op, "mode must be affine, mxfp4, mxfp8 or nvfp4, got '" + name + "'");
  return mode;
}

Rounding parse_rounding(const std::string& s) {
  if (s == "cpu") return Rounding::cpu;
  if (s == "gpu") return Rounding::gpu;
  throw Error("quantize", "rounding must be 'cpu' or 'gpu', got '" + s + "'");
}

PyTensor result(Tensor t, const PyTensor& like) { return PyTensor::owning(std::move(t), like.device_id); }

}  // namespace

void bind_ops(nb::module_& m) {
  nb::class_<Workspace>(m, "Workspace",
                        "Scratch memory of the device MoE path: grows on first use at a size, then is reused, so "
                        "later calls at or below that size allocate nothing and can be captured in a CUDA graph.")
      .def(nb::init<>())
      .def_prop_ro("bytes_held", &Workspace::bytes_held, "Device bytes held.");

  nb::class_<PyQuantized>(m, "Quantized", "MLX's quantized weight: the (w, scales, biases) triple, group size, bits.")
      .def(nb::init<PyTensor, PyTensor, PyTensor, int, int>(), arg("w"), arg("scales"), arg("biases"),
           arg("group_size") = 64, arg("bits") = 4)
      .def_ro("w", &PyQuantized::w, "Packed codes [..., N, K*bits/32] uint32.")
      .def_ro("scales", &PyQuantized::scales, "[..., N, K/group_size].")
      .def_ro("biases", &PyQuantized::biases, "[..., N, K/group_size].")
      .def_ro("group_size", &PyQuantized::group_size, "Values per scale.")
      .def_ro("bits", &PyQuantized::bits, "Bits per code.");

  nb::class_<PyMoeWeights>(m, "MoeWeights",
                           "The router and SwitchGLU expert weights of one MoE block (views of the arrays given, "
                           "which it keeps alive).")
      .def(nb::new_(&make_moe_weights), arg("router_proj"), arg("router_scale"), arg("per_expert_scale"),
           arg("top_k"), arg("eps") = 1e-6, arg("gate").none() = nb::none(), arg("up").none() = nb::none(),
           arg("gate_up").none() = nb::none(), arg("down").none() = nb::none(), arg("activation") = "geglu",
           "Each projection is a Quantized or a dense Tensor; give gate and up, or gate_up (gate rows first).")
      .def("output_dtype", &moe_output_dtype, arg("x_dtype"), "The dtype moe_layer returns for input dtype x_dtype.")
      .def(
          "tile_experts",
          [](PyMoeWeights& w, uintptr_t stream) {
            CudaScope scope(w.device, w.device_id, stream);
            nb::gil_scoped_release nogil;
            return w.weights.tile_experts();
          },
          arg("stream") = 0,
          "Adds the tile layout (docs/tile-layout.md) to each 4-bit affine expert projection that lacks one, on "
          "the weights' device; returns how many it added. The CUDA prefill kernels then read it (17-19% faster "
          "layers at 512-2048 tokens on an H200), for the projections' bytes once more; the results are the same.")
      .def_prop_ro("device", [](const PyMoeWeights& w) { return std::string(device_name(w.device)); }, "'cpu' or 'cuda'.")
      .def_prop_ro("top_k", [](const PyMoeWeights& w) { return w.weights.router.top_k; }, "Experts per token.")
      .def_prop_ro("num_experts", [](const PyMoeWeights& w) { return w.weights.router.per_expert_scale.size(0); },
                   "E.");
  m.def("quantize", [](const PyTensor& w, std::optional<int> bits, std::optional<int> group_size,
                       const std::string& rounding, const std::string& mode, const PyTensor* global_scale,
                       uintptr_t stream) {
    QuantSpec spec = default_quant_spec(parse_mode("quantize", mode));
    if (bits) spec.bits = *bits;
    if (group_size) spec.group_size = *group_size;
    spec.rounding = parse_rounding(rounding);
    spec.global_scale = tensor_or_undefined(global_scale);
    CudaScope scope(w, stream);
    QuantizedWeight q;
    {
      nb::gil_scoped_release nogil;
      q = quantize(w.tensor, spec);
    }
    std::optional<PyTensor> biases;
    if (q.biases.defined()) biases = result(q.biases, w);
    return std::make_tuple(result(q.w, w), result(q.scales, w), biases);
  }, arg("w"), arg("bits").none() = nb::none(), arg("group_size").none() = nb::none(), arg("rounding") = "cpu",
        arg("mode") = "affine", arg("global_scale").none() = nb::none(), arg("stream") = 0,
        "mx.quantize(w, group_size, bits, mode, global_scale): (w, scales, biases); biases None in the fp modes.");
  m.def("dequantize", [](const PyTensor& w, const PyTensor& scales, const PyTensor* biases,
                         std::optional<int> group_size, std::optional<int> bits, const std::string& mode,
                         const PyTensor* global_scale, std::optional<std::string> dtype, uintptr_t stream) {
    QuantizedWeight q;
    q.mode = parse_mode("dequantize", mode);
    const QuantSpec defaults = default_quant_spec(q.mode);
    q.w = w.tensor;
    q.scales = scales.tensor;
    q.biases = tensor_or_undefined(biases);
    q.bits = bits ? *bits : defaults.bits;
    q.group_size = group_size ? *group_size : defaults.group_size;
    q.global_scale = tensor_or_undefined(global_scale);
    CudaScope scope(w, stream);
    nb::gil_scoped_release nogil;
    if (q.mode == QuantMode::affine && !dtype)  // MLX's affine form: checked as mx.dequantize checks it
      return result(dequantize(q.w, q.scales, q.biases, q.group_size, q.bits), w);
    return result(dtype ? dequantize(q, parse_dtype(*dtype, "dequantize")) : dequantize(q), w);
  }, arg("w"), arg("scales"), arg("biases").none(), arg("group_size").none() = nb::none(),
        arg("bits").none() = nb::none(), arg("mode") = "affine", arg("global_scale").none() = nb::none(),
        arg("dtype").none() = nb::none(), arg("stream") = 0,
        "mx.dequantize: scales * q + biases (affine, in the scales' dtype) or the fp modes' decode (bfloat16, "
        "float32 with a global scale); `dtype` picks another.");
  m.def("gather_qmm", [](const PyTensor& x, const PyTensor& w, const PyTensor& scales, const PyTensor* biases,
                         const PyTensor* lhs, const PyTensor* rhs, bool transpose, int group_size, int bits,
                         bool sorted_indices, const std::string& mode, uintptr_t stream) {
    const QuantMode quant_mode = parse_mode("gather_qmm", mode);
    CudaScope scope(x, stream);
    nb::gil_scoped_release nogil;
    return result(gather_qmm(x.tensor, w.tensor, scales.tensor, tensor_or_undefined(biases), tensor_or_undefined(lhs),
                             tensor_or_undefined(rhs), transpose, group_size, bits, sorted_indices, quant_mode),
                  x);
  }, arg("x"), arg("w"), arg("scales"), arg("biases").none(), arg("lhs_indices").none() = nb::none(),
        arg("rhs_indices").none() = nb::none(), arg("transpose") = true, arg("group_size") = 64, arg("bits") = 4,
        arg("sorted_indices") = false, arg("mode") = "affine", arg("stream") = 0,
        "mx.gather_qmm (mode: affine, or MLX's fp modes, whose biases are None).");
  m.def("gather_mm", [](const PyTensor& a, const PyTensor& b, const PyTensor* lhs, const PyTensor* rhs,
                        bool sorted_indices, uintptr_t stream) {
    CudaScope scope(a, stream);
    nb::gil_scoped_release nogil;
    return result(gather_mm(a.tensor, b.tensor, tensor_or_undefined(lhs), tensor_or_undefined(rhs), sorted_indices),
                  a);
  }, arg("a"), arg("b"), arg("lhs_indices").none() = nb::none(), arg("rhs_indices").none() = nb::none(),
        arg("sorted_indices") = false, arg("stream") = 0, "mx.gather_mm (16-bit experts).");
  m.def("route", [](const PyTensor& h, const PyMoeWeights& w, uintptr_t stream) {
    CudaScope scope(h, stream);
    Routing r;
    {
      nb::gil_scoped_release nogil;
      r = route(h.tensor, w.weights.router);
    }
    return std::make_pair(result(r.indices, h), result(r.weights, h));
  }, arg("h"), arg("weights"), arg("stream") = 0, "The Gemma 4 router: (indices [T, k] int32, weights [T, k]).");
  m.def("moe_layer", [](const PyTensor& h, const PyTensor& x, const PyMoeWeights& w, uintptr_t stream) {
    CudaScope scope(h, stream);
    nb::gil_scoped_release nogil;
    return result(moe_layer(h.tensor, x.tensor, w.weights), h);
  }, arg("h"), arg("x"), arg("weights"), arg("stream") = 0,
        "Route h, run the experts on x, combine: [T, H] (allocates its output and scratch).");
  m.def("moe_layer_into", [](const PyTensor& out, const PyTensor& h, const PyTensor& x, const PyMoeWeights& w,
                             Workspace& ws, uintptr_t stream) {
    CudaScope scope(h, stream);
    nb::gil_scoped_release nogil;
    Tensor o = out.tensor;
    moe_layer_into(o, h.tensor, x.tensor, w.weights, ws);
  }, arg("out"), arg("h"), arg("x"), arg("weights"), arg("workspace"), arg("stream") = 0,
        "moe_layer into a caller-owned contiguous out; with a warmed-up workspace: no allocation, no host sync.");
}

}  // namespace expertqmm::python

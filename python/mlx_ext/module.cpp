// expertqmm._mlx: the MLX primitives for Python (python/expertqmm/mlx.py wraps them). Built in
// nanobind's "mlx" domain, so mx.array arguments and results are MLX's own bound type. The ops run
// on MLX's default stream (`with mx.stream(...)` picks another).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>

#include "primitives.h"
#include "expertqmm/error.h"

namespace nb = nanobind;
using namespace expertqmm;
using namespace expertqmm::mlx_ext;
using nb::arg;

namespace {

// (quantized, group_size, bits), as the Python side describes a projection.
using ProjectionTuple = std::tuple<bool, int, int>;

ProjectionSpec projection(const ProjectionTuple& t) { return {std::get<0>(t), std::get<1>(t), std::get<2>(t)}; }

Activation parse_activation(const std::string& s) {
  if (s == "geglu") return Activation::geglu;
  if (s == "swiglu") return Activation::swiglu;
  throw Error("expertqmm.mlx", "activation must be 'geglu' or 'swiglu', got '" + s + "'");
}

RouterKind parse_router(const std::string& s) {
  if (s == "gemma4") return RouterKind::gemma4;
  if (s == "softmax_topk") return RouterKind::softmax_topk;
  throw Error("expertqmm.mlx", "router must be 'gemma4' or 'softmax_topk', got '" + s + "'");
}

ExpertsSpec experts_spec(const std::vector<ProjectionTuple>& p, const std::string& activation) {
  if (p.size() != 3) throw Error("expertqmm.mlx", "the experts need 3 projections (gate, up, down)");
  return {projection(p[0]), projection(p[1]), projection(p[2]), parse_activation(activation)};
}

}  // namespace

NB_MODULE(_mlx, m) {
  nb::module_::import_("mlx.core");  // registers mx.array in this domain
  m.doc() = "expertqmm's MLX custom primitives (use expertqmm.mlx)";
  m.def("gather_qmm", [](const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                         const mx::array& lhs, const mx::array& rhs, int group_size, int bits, bool sorted_indices) {
    return gather_qmm(x, w, scales, biases, lhs, rhs, group_size, bits, sorted_indices);
  }, arg("x"), arg("w"), arg("scales"), arg("biases"), arg("lhs_indices"), arg("rhs_indices"), arg("group_size"),
        arg("bits"), arg("sorted_indices"),
        "mx.gather_qmm(transpose=True, mode='affine') with both index arrays given (broadcastable).");
  m.def("switch_glu", [](const mx::array& x, const mx::array& indices, const std::vector<mx::array>& experts,
                         const std::vector<ProjectionTuple>& projections, const std::string& activation) {
    return switch_glu(x, indices, experts, experts_spec(projections, activation));
  }, arg("x"), arg("indices"), arg("experts"), arg("projections"), arg("activation"),
        "mlx-lm SwitchGLU: x [T, D], indices [T, k] -> [T, k, D]. experts: the gate, up and down arrays in order "
        "((w, scales, biases) or (weight,)); projections: (quantized, group_size, bits) for each.");
  m.def("moe_block", [](const mx::array& h, const mx::array& x, const std::vector<mx::array>& router,
                        const std::string& router_kind, const ProjectionTuple& router_projection, int top_k, double eps,
                        bool norm_topk_prob, const std::vector<mx::array>& experts,
                        const std::vector<ProjectionTuple>& projections, const std::string& activation) {
    RouterSpec r{parse_router(router_kind), projection(router_projection), top_k, static_cast<float>(eps),
                 norm_topk_prob};
    return moe_block(h, x, router, r, experts, experts_spec(projections, activation));
  }, arg("h"), arg("x"), arg("router"), arg("router_kind"), arg("router_projection"), arg("top_k"), arg("eps"),
        arg("norm_topk_prob"), arg("experts"), arg("projections"), arg("activation"),
        "The MoE block: route h, run the experts on x, combine -> [T, H]. router: the projection's arrays, then "
        "(gemma4) scale and per_expert_scale.");
}

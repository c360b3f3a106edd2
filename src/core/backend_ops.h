// The contract between the op front (src/ops: validation, empty cases, dispatch) and the backends
// (src/cpu, src/cuda): ONE list of backend ops. Each backend declares its functions from this list
// (EXPERTQMM_DECLARE_BACKEND_OPS in its namespace) and fills one BackendOps table with them; the
// front asks backend_ops() for the table of the inputs' device. Inputs arrive validated and
// non-empty, on the backend's device.
//
// Arrows run one way: include/expertqmm (API) -> src/ops (front) -> this table -> src/cpu, src/cuda
// (backends) -> src/cuda/device (device helpers). src/core holds what every layer shares (tensors,
// problem descriptions, the tile plan reference, counters, settings) and includes none of them.
#pragma once
#include "core/gather_mm_problem.h"
#include "core/gather_qmm_problem.h"
#include "expertqmm/gemma4.h"
#include "expertqmm/moe.h"
#include "expertqmm/qwen3_moe.h"

namespace expertqmm::detail {

// X(return type, name, parameter list). From gather_qmm_into on: the into-paths (into a caller's
// output) and the fused layer paths: a backend may leave them null, and the front then composes
// them from the ops above them (the CPU reference does, in mlx-lm's order, so the composition reads
// as the spec).
#define EXPERTQMM_BACKEND_OPS(X)                                                                           \
  X(QuantizedWeight, quantize, (const Tensor& w, QuantSpec spec))                                          \
  X(Tensor, dequantize, (const QuantizedWeight& q, DType dtype))                                          \
  X(TiledWeight, tile_weight, (const QuantizedWeight& q))                                                  \
  X(QuantizedWeight, untile_weight, (const TiledWeight& t, int64_t N))                                    \
  X(Tensor, gather_qmm, (const detail::GatherQmmProblem& p))                                              \
  X(Tensor, gather_mm, (const detail::GatherMmProblem& p))                                                \
  X(SortedRows, gather_sort, (const Tensor& x, const Tensor& indices))                                     \
  X(Tensor, scatter_unsort, (const Tensor& x, const Tensor& inv_order, const Shape& shape))               \
  X(Tensor, glu_product, (Activation act, const Tensor& gate, const Tensor& up))                           \
  X(Routing, route, (const Tensor& h, const RouterWeights& router))                                        \
  X(Tensor, weighted_combine, (const Tensor& y, const Tensor& weights))                                    \
  X(Tensor, rms_norm, (const Tensor& x, const Tensor& weight, float eps))                                  \
  X(Tensor, add, (const Tensor& a, const Tensor& b))                                                       \
  X(Tensor, add_scaled, (const Tensor& a, const Tensor& b, const Tensor& scalar))                          \
  X(Tensor, dense_linear, (const Tensor& x, const Tensor& w, DType out_dtype))                             \
  X(void, gather_qmm_into, (const detail::GatherQmmProblem& p, Tensor& out, Workspace* ws))               \
  X(Tensor, switch_glu, (const Tensor& x, const Tensor& indices, const SwitchGLUWeights& weights))        \
  X(void, switch_glu_into, (Tensor & out, const Tensor& x, const Tensor& indices, const SwitchGLUWeights& weights, \
                            Workspace& ws))                                                                \
  X(void, moe_layer_into, (Tensor & out, const Tensor& h, const Tensor& x, const MoeWeights& weights, Workspace& ws)) \
  X(void, gemma4_ffn_into, (Tensor & out, const Tensor& h, const Gemma4FfnWeights& weights, Workspace& ws))  \
  X(void, qwen3_moe_ffn_into, (Tensor & out, const Tensor& h, const Qwen3MoeFfnWeights& weights, Workspace& ws))

#define EXPERTQMM_BACKEND_OP_POINTER(ret, name, params) ret(*name) params = nullptr;
#define EXPERTQMM_BACKEND_OP_DECLARATION(ret, name, params) ret name params;
// Declares every op of the list (in the enclosing namespace): a backend's ops header.
#define EXPERTQMM_DECLARE_BACKEND_OPS() EXPERTQMM_BACKEND_OPS(EXPERTQMM_BACKEND_OP_DECLARATION)

struct BackendOps {
  const char* name = "";
  EXPERTQMM_BACKEND_OPS(EXPERTQMM_BACKEND_OP_POINTER)
};

// Each backend's table; the CUDA one is null in a build without it (src/core/no_cuda.cpp). The front
// picks one with backend_ops() (src/ops/op_checks.h).
const BackendOps& cpu_backend_ops();
const BackendOps* cuda_backend_ops();

}  // namespace expertqmm::detail

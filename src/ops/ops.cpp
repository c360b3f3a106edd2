// Public expert-path ops (include/expertqmm/ops.h): validate every argument, settle the empty
// cases here (valid no-ops, identical on every backend), then dispatch on the inputs' device.
// Backends receive validated, non-empty inputs.
#include "expertqmm/ops.h"

#include <climits>
#include <cstring>
#include <vector>

#include "core/gather_mm_problem.h"
#include "core/gather_qmm_problem.h"
#include "ops/op_checks.h"
#include "expertqmm/error.h"

namespace expertqmm {

using detail::check_floating;
using detail::backend_ops;

namespace {

void check_index_dtype(const std::string& op, const char* name, const Tensor& t) {
  EXPERTQMM_CHECK(t.defined(), op, name, " is undefined");
  EXPERTQMM_CHECK(is_integer(t.dtype()), op, name, " must be int32 or uint32, got ", t.describe());
}

void check_same_device(const std::string& op, const char* a_name, const Tensor& a, const char* b_name,
                       const Tensor& b) {
  EXPERTQMM_CHECK(a.device() == b.device(), op, a_name, " is on ", device_name(a.device()), " but ",
                  b_name, " is on ", device_name(b.device()));
}

// Integer index values (int32/uint32) as int64, row-major; host tensors only (no device sync).
std::vector<int64_t> host_index_values(const Tensor& t) {
  std::vector<uint8_t> bytes = t.to_host_bytes();
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, bytes.data() + 4 * i, 4);
    v[i] = t.dtype() == DType::i32 ? static_cast<int64_t>(static_cast<int32_t>(u)) : static_cast<int64_t>(u);
  }
  return v;
}

// A zero-filled tensor on `device` (sums over an empty axis).
Tensor zeros(const Shape& shape, DType dtype, Device device) {
  std::vector<uint8_t> bytes(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), 0);
  return Tensor::from_host(bytes.data(), shape, dtype, device);
}

}  // namespace

Tensor gather_qmm(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor& biases,
                  const Tensor& lhs_indices, const Tensor& rhs_indices, bool transpose, int group_size,
                  int bits, bool sorted_indices, QuantMode mode) {
  const detail::GatherQmmProblem p = detail::make_gather_qmm_problem(
      x, w, scales, biases, lhs_indices, rhs_indices, transpose, group_size, bits, sorted_indices, mode);
  Shape out_shape = p.batch;
  out_shape.push_back(p.M);
  out_shape.push_back(p.N);
  if (p.M == 0 || p.N == 0 || p.B == 0) return Tensor::empty(out_shape, p.dtype, p.device);
  if (p.K == 0) return zeros(out_shape, p.dtype, p.device);  // empty dot products
  return backend_ops("gather_qmm", p.device).gather_qmm(p);
}

void gather_qmm_into(Tensor& out, const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor& biases,
                     const Tensor& lhs_indices, const Tensor& rhs_indices, bool transpose, int group_size, int bits,
                     bool sorted_indices, QuantMode mode, Workspace* ws) {
  const char* op = "gather_qmm_into";
  const detail::GatherQmmProblem p = detail::make_gather_qmm_problem(
      x, w, scales, biases, lhs_indices, rhs_indices, transpose, group_size, bits, sorted_indices, mode);
  Shape out_shape = p.batch;
  out_shape.push_back(p.M);
  out_shape.push_back(p.N);
  EXPERTQMM_CHECK(out.defined() && out.shape() == out_shape && out.dtype() == p.dtype, op, "out must be ",
                  dtype_name(p.dtype), shape_str(out_shape), ", got ", out.describe());
  EXPERTQMM_CHECK(out.is_contiguous(), op, "out must be contiguous, got ", out.describe());
  check_same_device(op, "x", x, "out", out);
  if (p.M == 0 || p.N == 0 || p.B == 0) return;
  const detail::BackendOps& be = backend_ops(op, p.device);
  if (p.K > 0 && be.gather_qmm_into) return be.gather_qmm_into(p, out, ws);
  // Composed (the CPU reference, and empty dot products): compute, then copy in.
  const Tensor result = p.K == 0 ? zeros(out_shape, p.dtype, p.device) : be.gather_qmm(p);
  std::memcpy(out.data(), result.data(), result.nbytes());
}

Tensor gather_qmm(const Tensor& x, const QuantizedWeight& q, const Tensor& lhs_indices, const Tensor& rhs_indices,
                  bool transpose, bool sorted_indices) {
  EXPERTQMM_CHECK(!q.global_scale.defined(), "gather_qmm",
                  "an nvfp4 global scale is not supported (MLX 0.32 computes it on the GPU only); got ",
                  q.global_scale.describe());
  return gather_qmm(x, q.w, q.scales, q.biases, lhs_indices, rhs_indices, transpose, q.group_size, q.bits,
                    sorted_indices, q.mode);
}

Tensor gather_mm(const Tensor& a, const Tensor& b, const Tensor& lhs_indices, const Tensor& rhs_indices,
                 bool sorted_indices) {
  const detail::GatherMmProblem p = detail::make_gather_mm_problem(a, b, lhs_indices, rhs_indices, sorted_indices);
  Shape out_shape = p.batch;
  out_shape.push_back(p.M);
  out_shape.push_back(p.N);
  if (p.M == 0 || p.N == 0 || p.B == 0) return Tensor::empty(out_shape, p.dtype, p.device);
  if (p.K == 0) return zeros(out_shape, p.dtype, p.device);  // empty dot products
  return backend_ops("gather_mm", p.device).gather_mm(p);
}

SortedRows gather_sort(const Tensor& x, const Tensor& indices) {
  const std::string op = "gather_sort";
  check_floating(op, "x", x);
  check_index_dtype(op, "indices", indices);
  EXPERTQMM_CHECK(x.ndim() >= 1, op, "x must be [..., D], got ", x.describe());
  EXPERTQMM_CHECK(indices.ndim() >= 1, op, "indices must be [..., k], got ", indices.describe());
  check_same_device(op, "x", x, "indices", indices);
  const Shape x_tokens(x.shape().begin(), x.shape().end() - 1);
  const Shape idx_tokens(indices.shape().begin(), indices.shape().end() - 1);
  EXPERTQMM_CHECK(shape_numel(x_tokens) == shape_numel(idx_tokens), op, "x ", shape_str(x.shape()),
                  " holds ", shape_numel(x_tokens), " token rows but indices ", shape_str(indices.shape()),
                  " hold ", shape_numel(idx_tokens));
  const int64_t rows = indices.numel();
  EXPERTQMM_CHECK(rows <= INT32_MAX, op, "indices hold ", rows, " ids; at most ", INT32_MAX, " are supported");
  if (indices.device() == Device::cpu && indices.dtype() == DType::u32)
    for (int64_t v : host_index_values(indices))
      EXPERTQMM_CHECK(v <= INT32_MAX, op, "expert id ", v, " does not fit the int32 sorted ids");

  const int64_t D = x.size(-1);
  if (rows == 0) {
    SortedRows empty;
    empty.x = Tensor::empty({0, 1, D}, x.dtype(), x.device());
    empty.indices = Tensor::empty({0}, DType::i32, x.device());
    empty.inv_order = Tensor::empty({0}, DType::i32, x.device());
    return empty;
  }
  return backend_ops(op, x.device()).gather_sort(x.contiguous(), indices.contiguous());
}

Tensor scatter_unsort(const Tensor& x, const Tensor& inv_order, const Shape& shape) {
  const std::string op = "scatter_unsort";
  check_floating(op, "x", x);
  check_index_dtype(op, "inv_order", inv_order);
  EXPERTQMM_CHECK(x.ndim() >= 1, op, "x must have at least 1 dim, got ", x.describe());
  EXPERTQMM_CHECK(inv_order.ndim() == 1, op, "inv_order must be 1-D, got ", inv_order.describe());
  check_same_device(op, "x", x, "inv_order", inv_order);
  for (int64_t d : shape) EXPERTQMM_CHECK(d >= 0, op, "negative dimension in shape ", shape_str(shape));
  EXPERTQMM_CHECK(shape_numel(shape) == inv_order.numel(), op, "shape ", shape_str(shape), " holds ",
                  shape_numel(shape), " rows but inv_order has ", inv_order.numel());
  if (inv_order.device() == Device::cpu)
    for (int64_t v : host_index_values(inv_order))
      EXPERTQMM_CHECK(v >= 0 && v < x.size(0), op, "inv_order value ", v, " is out of range [0, ", x.size(0),
                      ") for x ", shape_str(x.shape()));

  Shape out_shape = shape;
  out_shape.insert(out_shape.end(), x.shape().begin() + 1, x.shape().end());
  if (shape_numel(out_shape) == 0) return Tensor::empty(out_shape, x.dtype(), x.device());
  return backend_ops(op, x.device()).scatter_unsort(x.contiguous(), inv_order.contiguous(), shape);
}

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::geglu: return "geglu";
    case Activation::swiglu: return "swiglu";
  }
  throw Error("activation_name", detail::cat("unknown activation value ", static_cast<int>(a)));
}

Tensor glu_product(Activation act, const Tensor& gate, const Tensor& up) {
  const std::string op = activation_name(act);
  check_floating(op, "gate", gate);
  check_floating(op, "up", up);
  EXPERTQMM_CHECK(gate.shape() == up.shape(), op, "gate ", shape_str(gate.shape()), " and up ",
                  shape_str(up.shape()), " must have the same shape");
  EXPERTQMM_CHECK(gate.dtype() == up.dtype(), op, "gate is ", dtype_name(gate.dtype()), " but up is ",
                  dtype_name(up.dtype()));
  check_same_device(op, "gate", gate, "up", up);
  if (gate.numel() == 0) return Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  return backend_ops(op, gate.device()).glu_product(act, gate.contiguous(), up.contiguous());
}

Tensor geglu(const Tensor& gate, const Tensor& up) { return glu_product(Activation::geglu, gate, up); }
Tensor swiglu(const Tensor& gate, const Tensor& up) { return glu_product(Activation::swiglu, gate, up); }

}  // namespace expertqmm

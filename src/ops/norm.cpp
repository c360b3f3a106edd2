// Public elementwise ops of the Gemma 4 feed-forward part and the Linear layer
// (include/expertqmm/gemma4.h): validate every argument, settle empty inputs here, dispatch on the
// inputs' device.
#include <cmath>
#include <cstring>

#include "core/float16.h"
#include "core/gather_qmm_problem.h"
#include "ops/op_checks.h"
#include "expertqmm/error.h"
#include "expertqmm/gemma4.h"

namespace expertqmm {

using detail::check_floating;
using detail::backend_ops;

namespace {

void check_same_device(const char* op, const char* a_name, const Tensor& a, const char* b_name, const Tensor& b) {
  EXPERTQMM_CHECK(a.device() == b.device(), op, a_name, " is on ", device_name(a.device()), " but ", b_name,
                  " is on ", device_name(b.device()));
}

void check_pair(const char* op, const Tensor& a, const Tensor& b) {
  check_floating(op, "a", a);
  check_floating(op, "b", b);
  EXPERTQMM_CHECK(a.shape() == b.shape(), op, "a ", shape_str(a.shape()), " and b ", shape_str(b.shape()),
                  " must have the same shape");
  EXPERTQMM_CHECK(a.dtype() == b.dtype(), op, "a is ", dtype_name(a.dtype()), " but b is ", dtype_name(b.dtype()));
  check_same_device(op, "a", a, "b", b);
}

}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps) {
  const char* op = "rms_norm";
  check_floating(op, "x", x);
  check_floating(op, "weight", weight);
  EXPERTQMM_CHECK(x.ndim() >= 1, op, "x must be [..., D], got ", x.describe());
  EXPERTQMM_CHECK(weight.shape() == Shape{x.size(-1)}, op, "weight must be [D=", x.size(-1), "], got ",
                  weight.describe());
  check_same_device(op, "x", x, "weight", weight);
  EXPERTQMM_CHECK(std::isfinite(eps) && eps >= 0.f, op, "eps must be finite and >= 0, got ", eps);
  if (x.numel() == 0) return Tensor::empty(x.shape(), x.dtype(), x.device());
  return backend_ops(op, x.device()).rms_norm(x, weight, eps);
}

Tensor add(const Tensor& a, const Tensor& b) {
  const char* op = "add";
  check_pair(op, a, b);
  if (a.numel() == 0) return Tensor::empty(a.shape(), a.dtype(), a.device());
  return backend_ops(op, a.device()).add(a, b);
}

Tensor add_scaled(const Tensor& a, const Tensor& b, const Tensor& scalar) {
  const char* op = "add_scaled";
  check_pair(op, a, b);
  check_floating(op, "scalar", scalar);
  EXPERTQMM_CHECK(scalar.numel() == 1, op, "scalar must hold one value, got ", scalar.describe());
  check_same_device(op, "a", a, "scalar", scalar);
  if (a.numel() == 0) return Tensor::empty(a.shape(), a.dtype(), a.device());
  return backend_ops(op, a.device()).add_scaled(a, b, scalar);
}

int64_t Linear::out_features() const {
  if (is_quantized()) return quantized.w.ndim() >= 2 ? quantized.w.size(-2) : 0;
  return dense.ndim() >= 2 ? dense.size(-2) : 0;
}

int64_t Linear::in_features() const {
  if (is_quantized()) return quantized.bits > 0 ? quantized.w.size(-1) * 32 / quantized.bits : 0;
  return dense.ndim() >= 1 ? dense.size(-1) : 0;
}

Tensor linear(const Tensor& x, const Linear& w) {
  const char* op = "linear";
  check_floating(op, "x", x);
  EXPERTQMM_CHECK(x.ndim() == 2, op, "x must be [T, K], got ", x.describe());
  EXPERTQMM_CHECK(w.quantized.defined() != w.dense.defined(), op,
                  "exactly one of the quantized and dense weight must be given (quantized: ", w.quantized.defined(),
                  ", dense: ", w.dense.defined(), ")");
  if (w.is_quantized()) {
    const QuantizedWeight& q = w.quantized;
    detail::check_quantized_weight(op, q);
    EXPERTQMM_CHECK(q.w.ndim() == 2, op, "quantized weight must be [N, K*bits/32], got ", q.w.describe());
    EXPERTQMM_CHECK(w.in_features() == x.size(1), op, "weight rows hold K=", w.in_features(), " values but x ",
                    shape_str(x.shape()), " has K=", x.size(1));
    check_same_device(op, "x", x, "weight", q.w);
    // One batch of M = T rows: x [T, K] @ W^T -> [T, N] (no batch dims: B = 1, identity indices).
    return gather_qmm(x, q, Tensor(), Tensor(), true);
  }
  check_floating(op, "dense weight", w.dense);
  EXPERTQMM_CHECK(w.dense.ndim() == 2 && w.dense.size(1) == x.size(1), op, "dense weight must be [N, K=", x.size(1),
                  "], got ", w.dense.describe());
  check_same_device(op, "x", x, "weight", w.dense);
  const DType out_dtype = promote_floating(x.dtype(), w.dense.dtype());
  if (x.size(0) == 0 || w.dense.size(0) == 0) return Tensor::empty({x.size(0), w.dense.size(0)}, out_dtype, x.device());
  return backend_ops(op, x.device()).dense_linear(x, w.dense, out_dtype);
}

}  // namespace expertqmm

// Public MoE entries (include/expertqmm/moe.h): router (either kind), weighted combine, SwitchGLU
// and the MoE expert layer. Each validates all of its inputs up front, settles T == 0 as a no-op and
// dispatches on the device of its inputs. On the CPU, switch_glu and moe_layer are composed from
// the public ops exactly as mlx-lm does it, so the reference path is the spec (mlx-semantics 3.1).
#include "expertqmm/moe.h"

#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "ops/op_checks.h"
#include "expertqmm/error.h"

namespace expertqmm {

using detail::check_floating;
using detail::backend_ops;

namespace {

// mlx-lm SwitchGLU sorts the (token, slot) rows by expert when there are at least this many.
constexpr int64_t kSortThreshold = 64;

void check_on_device(const char* op, const char* name, const Tensor& t, Device device) {
  EXPERTQMM_CHECK(t.device() == device, op, name, " is on ", device_name(t.device()), " but the input is on ",
                  device_name(device));
}

// A quantized [E, N, K*bits/32] expert weight (or [N, K*bits/32] when rank == 2); returns its
// logical K (values per row).
int64_t check_quantized(const char* op, const char* name, const QuantizedWeight& q, int rank, Device device) {
  EXPERTQMM_CHECK(q.defined(), op, name, " is undefined");
  detail::check_quantized_weight(op, q);
  EXPERTQMM_CHECK(!q.global_scale.defined(), op, name, ": an nvfp4 global scale is not supported in the layers");
  EXPERTQMM_CHECK(q.w.ndim() == rank, op, name, " must have rank ", rank, ", got ", q.w.describe());
  check_on_device(op, name, q.w, device);
  return q.w.size(-1) * 32 / q.bits;
}

// One expert projection, quantized [E, N, K*bits/32] or 16-bit [E, N, K] (exactly one given), on
// `device`, applied to inputs of dtype `in`.
struct ProjDims {
  int64_t E = 0, N = 0, K = 0;
  DType out_dtype = DType::bf16;  // promote(in, scales) or promote(in, w)
};
ProjDims check_projection(const char* op, const char* name, const QuantizedWeight& q, const Tensor& dense, DType in,
                          Device device) {
  EXPERTQMM_CHECK(q.defined() || dense.defined(), op, name, " is undefined (neither quantized nor 16-bit ", name,
                  "_dense given)");
  EXPERTQMM_CHECK(!(q.defined() && dense.defined()), op, name, ": give the quantized or the 16-bit ", name,
                  "_dense weight, not both");
  ProjDims p;
  if (q.defined()) {
    p.K = check_quantized(op, name, q, 3, device);
    p.E = q.w.size(0);
    p.N = q.w.size(1);
    p.out_dtype = q.mode == QuantMode::affine ? promote_floating(in, q.scales.dtype()) : in;  // fp modes: x's
    return p;
  }
  check_floating(op, name, dense);
  EXPERTQMM_CHECK(dense.ndim() == 3, op, name, " (16-bit) must be [E, N, K], got ", dense.describe());
  check_on_device(op, name, dense, device);
  p.E = dense.size(0);
  p.N = dense.size(1);
  p.K = dense.size(2);
  p.out_dtype = promote_floating(in, dense.dtype());
  return p;
}

// Dimensions of a SwitchGLU call, after its weights have been checked against each other.
struct ExpertDims {
  int64_t T = 0, D = 0, I = 0, E = 0;
  DType hidden_dtype = DType::bf16;  // gate/up outputs and the GLU product
  DType out_dtype = DType::bf16;     // down output
};

// x [T, D]; gate/up [E, I, D] (or gate_up [E, 2I, D]); down [E, D, I]; one device. Each projection
// quantized or 16-bit.
ExpertDims check_experts(const char* op, const Tensor& x, const SwitchGLUWeights& w) {
  check_floating(op, "x", x);
  EXPERTQMM_CHECK(x.ndim() == 2, op, "x must be [T, D], got ", x.describe());
  EXPERTQMM_CHECK(w.activation == Activation::geglu || w.activation == Activation::swiglu, op,
                  "unknown activation value ", static_cast<int>(w.activation));
  ExpertDims d;
  d.T = x.size(0);
  d.D = x.size(1);
  if (w.fused()) {
    const ProjDims gu = check_projection(op, "gate_up", w.gate_up, w.gate_up_dense, x.dtype(), x.device());
    EXPERTQMM_CHECK(gu.N % 2 == 0, op, "fused gate_up must have an even number of rows (gate then up), got ",
                    gu.N);
    EXPERTQMM_CHECK(gu.K == d.D, op, "gate_up rows hold K=", gu.K, " values but x ", shape_str(x.shape()),
                    " has D=", d.D);
    d.E = gu.E;
    d.I = gu.N / 2;
    d.hidden_dtype = gu.out_dtype;
  } else {
    const ProjDims g = check_projection(op, "gate", w.gate, w.gate_dense, x.dtype(), x.device());
    const ProjDims u = check_projection(op, "up", w.up, w.up_dense, x.dtype(), x.device());
    EXPERTQMM_CHECK(g.E == u.E && g.N == u.N, op, "gate [E=", g.E, ", I=", g.N, "] and up [E=", u.E, ", I=", u.N,
                    "] disagree on E or I");
    EXPERTQMM_CHECK(g.K == d.D && u.K == d.D, op, "gate and up rows hold K=", g.K, " and ", u.K,
                    " values but x ", shape_str(x.shape()), " has D=", d.D);
    // The GLU product takes two tensors of one dtype (what gate and up produce from x).
    EXPERTQMM_CHECK(g.out_dtype == u.out_dtype, op, "gate produces ", dtype_name(g.out_dtype), " but up produces ",
                    dtype_name(u.out_dtype), " (their scales or 16-bit weights must widen x alike)");
    d.E = g.E;
    d.I = g.N;
    d.hidden_dtype = g.out_dtype;
  }
  const ProjDims dn = check_projection(op, "down", w.down, w.down_dense, d.hidden_dtype, x.device());
  EXPERTQMM_CHECK(dn.E == d.E, op, "down has E=", dn.E, " experts but gate/up have E=", d.E);
  EXPERTQMM_CHECK(dn.N == d.D, op, "down [", dn.E, ", ", dn.N, ", ", dn.K, "] produces N=", dn.N, " but x has D=",
                  d.D);
  EXPERTQMM_CHECK(dn.K == d.I, op, "down rows hold K=", dn.K, " values but gate/up have I=", d.I);
  d.out_dtype = dn.out_dtype;
  return d;
}

// indices [T, k] int32/uint32 on x's device; on the CPU every id is checked against E here (on
// CUDA the kernels record out-of-range ids instead: reading them would synchronize).
int64_t check_expert_indices(const char* op, const Tensor& indices, int64_t T, int64_t E, Device device) {
  EXPERTQMM_CHECK(indices.defined(), op, "indices are undefined");
  EXPERTQMM_CHECK(is_integer(indices.dtype()), op, "indices must be int32 or uint32, got ", indices.describe());
  EXPERTQMM_CHECK(indices.ndim() == 2 && indices.size(0) == T, op, "indices must be [T, k] with T=", T,
                  ", got ", indices.describe());
  check_on_device(op, "indices", indices, device);
  if (device == Device::cpu) {
    std::vector<uint8_t> bytes = indices.to_host_bytes();
    for (int64_t i = 0; i < indices.numel(); ++i) {
      uint32_t u;
      std::memcpy(&u, bytes.data() + 4 * i, 4);
      const int64_t v =
          indices.dtype() == DType::i32 ? static_cast<int64_t>(static_cast<int32_t>(u)) : static_cast<int64_t>(u);
      EXPERTQMM_CHECK(v >= 0 && v < E, op, "expert index ", v, " at position ", i, " is out of range [0, ", E, ")");
    }
  }
  return indices.size(1);
}

struct RouterDims {
  int64_t T = 0, H = 0, E = 0;
};

// h [T, H]; proj quantized [E, H*bits/32] xor dense [E, H]; for a gemma4 router scale [H] and
// per_expert_scale [E], for softmax_topk neither.
RouterDims check_router(const char* op, const Tensor& h, const RouterWeights& r) {
  check_floating(op, "h", h);
  EXPERTQMM_CHECK(h.ndim() == 2, op, "h must be [T, H], got ", h.describe());
  RouterDims d;
  d.T = h.size(0);
  d.H = h.size(1);
  const Device dev = h.device();
  EXPERTQMM_CHECK(r.proj.defined() != r.proj_dense.defined(), op,
                  "exactly one of the quantized proj and proj_dense must be given (quantized: ",
                  r.proj.defined(), ", dense: ", r.proj_dense.defined(), ")");
  if (r.proj.defined()) {
    const int64_t K = check_quantized(op, "router proj", r.proj, 2, dev);
    EXPERTQMM_CHECK(K == d.H, op, "router proj rows hold K=", K, " values but h has H=", d.H);
    d.E = r.proj.w.size(0);
  } else {
    check_floating(op, "proj_dense", r.proj_dense);
    EXPERTQMM_CHECK(r.proj_dense.ndim() == 2 && r.proj_dense.size(1) == d.H, op, "proj_dense must be [E, H=",
                    d.H, "], got ", r.proj_dense.describe());
    check_on_device(op, "proj_dense", r.proj_dense, dev);
    d.E = r.proj_dense.size(0);
  }
  switch (r.kind) {
    case RouterKind::gemma4:
      check_floating(op, "router scale", r.scale);
      EXPERTQMM_CHECK(r.scale.shape() == Shape{d.H}, op, "router scale must be [H=", d.H, "], got ",
                      r.scale.describe());
      check_on_device(op, "router scale", r.scale, dev);
      check_floating(op, "per_expert_scale", r.per_expert_scale);
      EXPERTQMM_CHECK(r.per_expert_scale.shape() == Shape{d.E}, op, "per_expert_scale must be [E=", d.E,
                      "], got ", r.per_expert_scale.describe());
      check_on_device(op, "per_expert_scale", r.per_expert_scale, dev);
      break;
    case RouterKind::softmax_topk:
      // Weights of another kind given here would be silently ignored: refuse them.
      EXPERTQMM_CHECK(!r.scale.defined() && !r.per_expert_scale.defined(), op,
                      "a softmax_topk router has no scale or per_expert_scale (given: scale ", r.scale.defined(),
                      ", per_expert_scale ", r.per_expert_scale.defined(), ")");
      break;
    default:
      EXPERTQMM_CHECK(false, op, "unknown router kind value ", static_cast<int>(r.kind));
  }
  EXPERTQMM_CHECK(r.top_k >= 1 && r.top_k <= d.E, op, "top_k=", r.top_k, " must be in [1, E=", d.E, "]");
  EXPERTQMM_CHECK(std::isfinite(r.eps) && r.eps >= 0.f, op, "eps must be finite and >= 0, got ", r.eps);
  return d;
}

// The views of the first and second halves of the last axis of a contiguous tensor: the fused
// gate_up output [..., 2I] splits into gate [..., :I] and up [..., I:]. The views borrow `t`.
std::pair<Tensor, Tensor> split_last_axis(const Tensor& t) {
  Shape half = t.shape();
  const int64_t I = half.back() / 2;
  half.back() = I;
  const Shape strides = t.strides();
  uint8_t* base = static_cast<uint8_t*>(t.data());
  const size_t up_offset = static_cast<size_t>(I) * dtype_size(t.dtype());
  return {Tensor::view(base, half, t.dtype(), t.device(), strides),
          Tensor::view(base + up_offset, half, t.dtype(), t.device(), strides)};
}

// mlx-lm SwitchLinear.__call__ without bias: gather_qmm for a quantized weight, else
// gather_mm(x, weight.swapaxes(-1, -2)) for a 16-bit one.
Tensor switch_linear(const Tensor& x, const QuantizedWeight& q, const Tensor& dense, const Tensor& ids, bool sorted) {
  if (q.defined()) return gather_qmm(x, q, Tensor(), ids, true, sorted);
  return gather_mm(x, dense.swapaxes(-1, -2), Tensor(), ids, sorted);
}

// mlx-lm SwitchGLU.__call__ built from the public ops (spec 3.1):
//   sort when T*k >= 64 -> up, then gate (or the fused gate_up, split) -> act(gate) * up -> down
//   -> unsort. Returns [T, k, D].
Tensor switch_glu_composed(const Tensor& x, const Tensor& indices, const SwitchGLUWeights& w, const ExpertDims& d,
                           int64_t k) {
  const bool do_sort = d.T * k >= kSortThreshold;
  Tensor rows_x, ids, inv_order;
  if (do_sort) {
    SortedRows sorted = gather_sort(x, indices);  // x [T*k, 1, D], ids [T*k]
    rows_x = sorted.x;
    ids = sorted.indices;
    inv_order = sorted.inv_order;
  } else {
    // x [T, 1, 1, D] with ids [T, k]: the implied lhs arange(T).reshape(T, 1) broadcasts to [T, k].
    rows_x = x.contiguous().reshape({d.T, 1, 1, d.D});
    ids = indices;
  }
  Tensor gate, up, gate_up;
  if (w.fused()) {
    gate_up = switch_linear(rows_x, w.gate_up, w.gate_up_dense, ids, do_sort);  // [..., 1, 2I]
    std::tie(gate, up) = split_last_axis(gate_up);
  } else {
    up = switch_linear(rows_x, w.up, w.up_dense, ids, do_sort);  // mlx-lm computes up first
    gate = switch_linear(rows_x, w.gate, w.gate_dense, ids, do_sort);
  }
  const Tensor hidden = glu_product(w.activation, gate, up);              // [..., 1, I]
  Tensor y = switch_linear(hidden, w.down, w.down_dense, ids, do_sort);    // [..., 1, D]
  if (do_sort) y = scatter_unsort(y, inv_order, {d.T, k});                // [T, k, 1, D]
  return y.reshape({d.T, k, d.D});
}

// weights [T, k] float and y [T, k, D] float on one device.
void check_combine(const char* op, const Tensor& y, const Tensor& weights) {
  check_floating(op, "y", y);
  check_floating(op, "weights", weights);
  EXPERTQMM_CHECK(y.ndim() == 3, op, "y must be [T, k, D], got ", y.describe());
  EXPERTQMM_CHECK(weights.ndim() == 2 && weights.size(0) == y.size(0) && weights.size(1) == y.size(1), op,
                  "weights must be [T, k] = [", y.size(0), ", ", y.size(1), "] to match y, got ",
                  weights.describe());
  check_on_device(op, "weights", weights, y.device());
}

// The checks moe_layer and moe_layer_into share; returns the output dtype.
ExpertDims check_moe(const char* op, const Tensor& h, const Tensor& x, const MoeWeights& w) {
  const RouterDims rd = check_router(op, h, w.router);
  const ExpertDims ed = check_experts(op, x, w.experts);
  EXPERTQMM_CHECK(h.shape() == x.shape(), op, "h ", shape_str(h.shape()), " and x ", shape_str(x.shape()),
                  " must have the same shape");
  check_on_device(op, "x", x, h.device());
  EXPERTQMM_CHECK(rd.E == ed.E, op, "the router scores E=", rd.E, " experts but the experts have E=", ed.E);
  return ed;
}

}  // namespace

DType detail::check_moe_weights(const char* op, const Tensor& h, const MoeWeights& w) {
  return check_moe(op, h, h, w).out_dtype;
}

Routing route(const Tensor& h, const RouterWeights& router) {
  const RouterDims d = check_router("route", h, router);
  if (d.T == 0) {
    Routing empty;
    empty.indices = Tensor::empty({0, router.top_k}, DType::i32, h.device());
    empty.weights = Tensor::empty({0, router.top_k}, h.dtype(), h.device());
    return empty;
  }
  return backend_ops("route", h.device()).route(h.contiguous(), router);
}

Tensor weighted_combine(const Tensor& y, const Tensor& weights) {
  check_combine("weighted_combine", y, weights);
  const int64_t T = y.size(0), k = y.size(1), D = y.size(2);
  if (T * D == 0) return Tensor::empty({T, D}, y.dtype(), y.device());
  if (k == 0) {  // a sum over no slots
    std::vector<uint8_t> zero(static_cast<size_t>(T * D) * dtype_size(y.dtype()), 0);
    return Tensor::from_host(zero.data(), {T, D}, y.dtype(), y.device());
  }
  return backend_ops("weighted_combine", y.device()).weighted_combine(y.contiguous(), weights.contiguous());
}

Tensor switch_glu(const Tensor& x, const Tensor& indices, const SwitchGLUWeights& weights) {
  const char* op = "switch_glu";
  const ExpertDims d = check_experts(op, x, weights);
  const int64_t k = check_expert_indices(op, indices, d.T, d.E, x.device());
  if (d.T * k == 0) return Tensor::empty({d.T, k, d.D}, d.out_dtype, x.device());
  const detail::BackendOps& be = backend_ops(op, x.device());
  if (be.switch_glu) return be.switch_glu(x.contiguous(), indices.contiguous(), weights);
  return switch_glu_composed(x, indices, weights, d, k);
}

void switch_glu_into(Tensor& out, const Tensor& x, const Tensor& indices, const SwitchGLUWeights& weights,
                     Workspace& ws) {
  const char* op = "switch_glu_into";
  const ExpertDims d = check_experts(op, x, weights);
  const int64_t k = check_expert_indices(op, indices, d.T, d.E, x.device());
  const Shape shape{d.T, k, d.D};
  EXPERTQMM_CHECK(out.defined() && out.shape() == shape && out.dtype() == d.out_dtype, op, "out must be ",
                  dtype_name(d.out_dtype), shape_str(shape), ", got ", out.describe());
  EXPERTQMM_CHECK(out.is_contiguous(), op, "out must be contiguous, got ", out.describe());
  check_on_device(op, "out", out, x.device());
  if (d.T * k == 0) return;
  const detail::BackendOps& be = backend_ops(op, x.device());
  if (be.switch_glu_into) return be.switch_glu_into(out, x.contiguous(), indices.contiguous(), weights, ws);
  // Composed (the CPU reference): allocates as it goes.
  const Tensor result = switch_glu_composed(x, indices, weights, d, k);
  std::memcpy(out.data(), result.data(), result.nbytes());
}

Tensor moe_layer(const Tensor& h, const Tensor& x, const MoeWeights& weights) {
  const char* op = "moe_layer";
  const ExpertDims d = check_moe(op, h, x, weights);
  if (d.T == 0) return Tensor::empty({0, d.D}, d.out_dtype, h.device());
  const detail::BackendOps& be = backend_ops(op, h.device());
  if (be.moe_layer_into) {
    Tensor out = Tensor::empty({d.T, d.D}, d.out_dtype, h.device());
    Workspace ws;  // owned by this call: the allocating convenience path
    be.moe_layer_into(out, h.contiguous(), x.contiguous(), weights, ws);
    return out;
  }
  const Routing r = route(h, weights.router);
  const Tensor y = switch_glu(x, r.indices, weights.experts);
  return weighted_combine(y, r.weights);
}

void moe_layer_into(Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& weights, Workspace& ws) {
  const char* op = "moe_layer_into";
  const ExpertDims d = check_moe(op, h, x, weights);
  EXPERTQMM_CHECK(out.defined(), op, "out is undefined");
  EXPERTQMM_CHECK(out.shape() == (Shape{d.T, d.D}) && out.dtype() == d.out_dtype, op, "out must be ",
                  dtype_name(d.out_dtype), shape_str({d.T, d.D}), ", got ", out.describe());
  EXPERTQMM_CHECK(out.is_contiguous(), op, "out must be contiguous, got ", out.describe());
  check_on_device(op, "out", out, h.device());
  if (d.T == 0) return;
  const detail::BackendOps& be = backend_ops(op, h.device());
  if (be.moe_layer_into) return be.moe_layer_into(out, h.contiguous(), x.contiguous(), weights, ws);
  // Composed (the CPU reference): allocates as it goes.
  const Tensor result = moe_layer(h, x, weights);
  std::memcpy(out.data(), result.data(), result.nbytes());
}

}  // namespace expertqmm

#include "core/gather_mm_problem.h"

#include "expertqmm/error.h"

namespace expertqmm::detail {

namespace {
constexpr const char* kOp = "gather_mm";

// The one stride that steps through every batch matrix of t (dims [..., R, C]) in flat order, or
// -1 when its batch dims do not collapse to one stride.
int64_t collapsed_batch_stride(const Tensor& t) {
  int64_t stride = -1, expect = -1;
  for (int i = t.ndim() - 3; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (stride < 0) {
      stride = expect = t.stride(i);
    } else if (t.stride(i) != expect) {
      return -1;
    }
    expect *= t.size(i);
  }
  return stride < 0 ? 0 : stride;
}
}  // namespace

GatherMmProblem make_gather_mm_problem(const Tensor& a, const Tensor& b, const Tensor& lhs_indices,
                                       const Tensor& rhs_indices, bool sorted_indices) {
  EXPERTQMM_CHECK(a.defined(), kOp, "a is undefined");
  EXPERTQMM_CHECK(b.defined(), kOp, "b is undefined");
  EXPERTQMM_CHECK(is_floating(a.dtype()) && is_floating(b.dtype()), kOp,
                  "a and b must be bfloat16, float16 or float32, got a ", a.describe(), " and b ", b.describe());
  EXPERTQMM_CHECK(a.ndim() >= 2, kOp, "a must have at least 2 dims [..., M, K], got ", a.describe());
  EXPERTQMM_CHECK(b.ndim() >= 2, kOp, "b must have at least 2 dims [..., K, N], got ", b.describe());
  EXPERTQMM_CHECK(a.size(-1) == b.size(-2), kOp, "a ", shape_str(a.shape()), " has K=", a.size(-1), " but b ",
                  shape_str(b.shape()), " has K=", b.size(-2), " rows");
  EXPERTQMM_CHECK(a.device() == b.device(), kOp, "a is on ", device_name(a.device()), " but b is on ",
                  device_name(b.device()));
  GatherMmProblem p;
  p.M = a.size(-2);
  p.K = a.size(-1);
  p.N = b.size(-1);
  p.sorted_indices = sorted_indices;
  p.device = a.device();
  p.dtype = promote_floating(a.dtype(), b.dtype());
  static_cast<GatherBatch&>(p) =
      make_gather_batch(kOp, a, p.dtype, Shape(b.shape().begin(), b.shape().end() - 2), lhs_indices, rhs_indices);
  p.w = collapsed_batch_stride(b) < 0 ? b.contiguous() : b;
  p.w_batch_stride = collapsed_batch_stride(p.w);
  p.w_stride_k = p.w.stride(-2);
  p.w_stride_n = p.w.stride(-1);
  return p;
}

std::string GatherMmProblem::describe() const {
  return cat("gather_mm problem {M=", M, " N=", N, " K=", K, " sorted_indices=", sorted_indices,
             " batch=", shape_str(batch), " x_batch=", x_batch, " w_batch(E)=", w_batch, " dtype=", dtype_name(dtype),
             " device=", device_name(device), " x=", x.describe(), " w=", w.describe(), " w strides (batch, k, n)=(",
             w_batch_stride, ", ", w_stride_k, ", ", w_stride_n, ")}");
}

}  // namespace expertqmm::detail

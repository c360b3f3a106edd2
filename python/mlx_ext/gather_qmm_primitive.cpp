// mx.gather_qmm (affine, transpose=True) as an MLX primitive over expertqmm::gather_qmm_into: the
// result lands in MLX's output array (no copy).
#include "eval.h"
#include "expertqmm/error.h"
#include "expertqmm/ops.h"

namespace expertqmm::mlx_ext {

namespace {
// The task holds the parameters, not the primitive (MLX may release it before a CPU task runs). It
// writes MLX's output array directly; on CUDA with the stream's workspace.
Body gather_qmm_body(int group_size, int bits, bool sorted) {
  return [=](const std::vector<Tensor>& in, Tensor& out, Workspace* ws) {
    expertqmm::gather_qmm_into(out, in[0], in[1], in[2], in[3], in[4], in[5], /*transpose=*/true, group_size, bits,
                               sorted, QuantMode::affine, ws);
  };
}
}  // namespace

void GatherQmm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  eval_on_cpu(stream(), inputs, out, gather_qmm_body(group_size_, bits_, sorted_));
}

void GatherQmm::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  eval_on_cuda(stream(), inputs, out, gather_qmm_body(group_size_, bits_, sorted_));
}

bool GatherQmm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatherQmm&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && sorted_ == o.sorted_;
}

mx::array gather_qmm(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     const mx::array& lhs_indices, const mx::array& rhs_indices, int group_size, int bits,
                     bool sorted_indices, mx::StreamOrDevice s) {
  const char* op = "expertqmm.mlx.gather_qmm";
  EXPERTQMM_CHECK(x.ndim() >= 2 && w.ndim() >= 3, op, "x must be [..., M, K] and w [E, N, K*bits/32]");
  const mx::Stream stream = mx::to_stream(s);
  const mx::Shape batch = mx::broadcast_shapes(lhs_indices.shape(), rhs_indices.shape());
  mx::Shape out_shape = batch;
  out_shape.push_back(x.shape(-2));
  out_shape.push_back(w.shape(-2));
  const DType out_dtype = promote_floating(expertqmm_dtype(x.dtype(), op), expertqmm_dtype(scales.dtype(), op));
  auto contiguous = [&](const mx::array& a) { return row_contiguous(a, stream); };
  std::vector<mx::array> inputs = {contiguous(x), contiguous(w), contiguous(scales), contiguous(biases),
                                   contiguous(mx::broadcast_to(lhs_indices, batch, stream)),
                                   contiguous(mx::broadcast_to(rhs_indices, batch, stream))};
  return mx::array(out_shape, mlx_dtype(out_dtype), std::make_shared<GatherQmm>(stream, group_size, bits, sorted_indices),
                   std::move(inputs));
}

}  // namespace expertqmm::mlx_ext

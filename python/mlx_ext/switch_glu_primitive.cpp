// mlx-lm's SwitchGLU as an MLX primitive over expertqmm::switch_glu_into (no copy of the result).
#include "eval.h"
#include "expertqmm/error.h"
#include "weights.h"

namespace expertqmm::mlx_ext {

namespace {
// Into MLX's output array directly (on CUDA with the stream's workspace). The task holds the spec,
// not the primitive (MLX may release it before a CPU task runs).
Body switch_glu_body(const ExpertsSpec& spec) {
  return [spec](const std::vector<Tensor>& in, Tensor& out, Workspace* ws) {
    ViewCursor cursor{in, 2};
    Workspace local;  // the CPU path composes the ops and holds no device scratch
    switch_glu_into(out, in[0], in[1], experts_weights(cursor, spec), ws ? *ws : local);
  };
}
}  // namespace

void SwitchGlu::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  eval_on_cpu(stream(), inputs, out, switch_glu_body(spec_));
}

void SwitchGlu::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  eval_on_cuda(stream(), inputs, out, switch_glu_body(spec_));
}

bool SwitchGlu::is_equivalent(const mx::Primitive& other) const {
  return spec_ == static_cast<const SwitchGlu&>(other).spec_;
}

mx::array switch_glu(const mx::array& x, const mx::array& indices, const std::vector<mx::array>& experts,
                     const ExpertsSpec& spec, mx::StreamOrDevice s) {
  const char* op = "expertqmm.mlx.switch_glu";
  EXPERTQMM_CHECK(x.ndim() == 2 && indices.ndim() == 2 && indices.shape(0) == x.shape(0), op,
                  "x must be [T, D] and indices [T, k]");
  const size_t want = spec.gate.arrays() + spec.up.arrays() + spec.down.arrays();
  EXPERTQMM_CHECK(experts.size() == want, op, "the experts' spec reads ", want, " arrays, got ", experts.size());
  const mx::Stream stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {row_contiguous(x, stream), row_contiguous(indices, stream)};
  for (const mx::array& a : experts) inputs.push_back(row_contiguous(a, stream));
  const DType out_dtype = experts_output_dtype(expertqmm_dtype(x.dtype(), op), experts, spec);
  return mx::array({x.shape(0), indices.shape(1), x.shape(1)}, mlx_dtype(out_dtype),
                   std::make_shared<SwitchGlu>(stream, spec), std::move(inputs));
}

}  // namespace expertqmm::mlx_ext

// The MoE block (router, SwitchGLU experts, weighted combine) as an MLX primitive over
// expertqmm::moe_layer_into: on CUDA it writes MLX's output array directly, with the stream's
// workspace (no allocation after warm-up, no host sync).
#include "eval.h"
#include "expertqmm/error.h"
#include "weights.h"

namespace expertqmm::mlx_ext {

namespace {
// The task holds the specs, not the primitive (MLX may release it before a CPU task runs).
Body moe_block_body(const RouterSpec& router, const ExpertsSpec& experts) {
  return [router, experts](const std::vector<Tensor>& in, Tensor& out, Workspace* ws) {
    ViewCursor cursor{in, 2};
    MoeWeights weights;
    weights.router = router_weights(cursor, router);
    weights.experts = experts_weights(cursor, experts);
    Workspace local;  // the CPU path composes the ops and holds no device scratch
    moe_layer_into(out, in[0], in[1], weights, ws ? *ws : local);
  };
}
}  // namespace

void MoeBlock::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  eval_on_cpu(stream(), inputs, out, moe_block_body(router_, experts_));
}

void MoeBlock::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  eval_on_cuda(stream(), inputs, out, moe_block_body(router_, experts_));
}

bool MoeBlock::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const MoeBlock&>(other);
  return router_ == o.router_ && experts_ == o.experts_;
}

mx::array moe_block(const mx::array& h, const mx::array& x, const std::vector<mx::array>& router,
                    const RouterSpec& router_spec, const std::vector<mx::array>& experts,
                    const ExpertsSpec& experts_spec, mx::StreamOrDevice s) {
  const char* op = "expertqmm.mlx.moe_block";
  EXPERTQMM_CHECK(h.ndim() == 2 && h.shape() == x.shape(), op, "h and x must be the same [T, H]");
  EXPERTQMM_CHECK(router.size() == size_t(router_spec.arrays()), op, "the router's spec reads ",
                  router_spec.arrays(), " arrays, got ", router.size());
  const size_t want = experts_spec.gate.arrays() + experts_spec.up.arrays() + experts_spec.down.arrays();
  EXPERTQMM_CHECK(experts.size() == want, op, "the experts' spec reads ", want, " arrays, got ", experts.size());
  const mx::Stream stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {row_contiguous(h, stream), row_contiguous(x, stream)};
  for (const mx::array& a : router) inputs.push_back(row_contiguous(a, stream));
  for (const mx::array& a : experts) inputs.push_back(row_contiguous(a, stream));
  const DType out_dtype = experts_output_dtype(expertqmm_dtype(x.dtype(), op), experts, experts_spec);
  return mx::array(h.shape(), mlx_dtype(out_dtype), std::make_shared<MoeBlock>(stream, router_spec, experts_spec),
                   std::move(inputs));
}

}  // namespace expertqmm::mlx_ext

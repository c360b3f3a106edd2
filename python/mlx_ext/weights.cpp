#include "weights.h"

#include "eval.h"
#include "expertqmm/error.h"

namespace expertqmm::mlx_ext {

const Tensor& ViewCursor::next() {
  EXPERTQMM_CHECK(at < views.size(), "mlx", "the primitive has ", views.size(), " inputs, fewer than its spec reads");
  return views[at++];
}

namespace {

void read_projection(ViewCursor& in, const ProjectionSpec& spec, QuantizedWeight* q, Tensor* dense) {
  if (!spec.quantized) {
    *dense = in.next();
    return;
  }
  q->w = in.next();
  q->scales = in.next();
  q->biases = in.next();
  q->group_size = spec.group_size;
  q->bits = spec.bits;
  q->mode = QuantMode::affine;
}

}  // namespace

SwitchGLUWeights experts_weights(ViewCursor& in, const ExpertsSpec& spec) {
  SwitchGLUWeights w;
  read_projection(in, spec.gate, &w.gate, &w.gate_dense);
  read_projection(in, spec.up, &w.up, &w.up_dense);
  read_projection(in, spec.down, &w.down, &w.down_dense);
  w.activation = spec.activation;
  return w;
}

RouterWeights router_weights(ViewCursor& in, const RouterSpec& spec) {
  RouterWeights r;
  r.kind = spec.kind;
  read_projection(in, spec.proj, &r.proj, &r.proj_dense);
  if (spec.kind == RouterKind::gemma4) {
    r.scale = in.next();
    r.per_expert_scale = in.next();
  }
  r.top_k = spec.top_k;
  r.eps = spec.eps;
  r.norm_topk_prob = spec.norm_topk_prob;
  return r;
}

DType experts_output_dtype(DType x, const std::vector<mx::array>& experts, const ExpertsSpec& spec) {
  // A projection's float dtype is its scales' (quantized: w, scales, biases) or its weight's.
  auto projection_dtype = [&](size_t first, const ProjectionSpec& p) {
    return expertqmm_dtype(experts.at(first + (p.quantized ? 1 : 0)).dtype(), "mlx switch_glu");
  };
  const size_t up_at = spec.gate.arrays(), down_at = up_at + spec.up.arrays();
  const DType hidden = promote_floating(x, projection_dtype(0, spec.gate));
  return promote_floating(hidden, projection_dtype(down_at, spec.down));
}

}  // namespace expertqmm::mlx_ext

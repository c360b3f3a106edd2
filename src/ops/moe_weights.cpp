// MoeWeights' copy to a device and byte count (include/expertqmm/moe.h), and the router kinds'
// names: the one home of "every tensor of an MoE layer", which the family blocks (gemma4.h,
// qwen3_moe.h) and the CLI reuse.
#include "expertqmm/error.h"
#include "expertqmm/moe.h"

namespace expertqmm {

namespace {

Tensor tensor_to(const Tensor& t, Device device) { return t.defined() ? t.to(device) : Tensor(); }

QuantizedWeight quantized_to(const QuantizedWeight& q, Device device) {
  QuantizedWeight r = q;
  r.w = tensor_to(q.w, device);
  r.scales = tensor_to(q.scales, device);
  r.biases = tensor_to(q.biases, device);
  r.tiled.codes = tensor_to(q.tiled.codes, device);
  r.tiled.params = tensor_to(q.tiled.params, device);
  return r;
}

size_t bytes_of(const Tensor& t) { return t.defined() ? t.nbytes() : 0; }
size_t bytes_of(const QuantizedWeight& q) {
  return bytes_of(q.w) + bytes_of(q.scales) + bytes_of(q.biases) + bytes_of(q.tiled.codes) + bytes_of(q.tiled.params);
}

// q with its tile layout when tileable and not yet there; true when it added one.
bool add_tiles(QuantizedWeight& q) {
  if (q.tiled.defined() || !tileable(q)) return false;
  q.tiled = tile_weight(q);
  return true;
}

}  // namespace

const char* router_kind_name(RouterKind kind) {
  switch (kind) {
    case RouterKind::gemma4: return "gemma4";
    case RouterKind::softmax_topk: return "softmax_topk";
  }
  throw Error("router_kind_name", detail::cat("unknown router kind value ", static_cast<int>(kind)));
}

MoeWeights MoeWeights::to(Device device) const {
  MoeWeights r = *this;
  r.router.proj = quantized_to(router.proj, device);
  r.router.proj_dense = tensor_to(router.proj_dense, device);
  r.router.scale = tensor_to(router.scale, device);
  r.router.per_expert_scale = tensor_to(router.per_expert_scale, device);
  SwitchGLUWeights& ex = r.experts;
  ex.gate = quantized_to(experts.gate, device);
  ex.up = quantized_to(experts.up, device);
  ex.gate_up = quantized_to(experts.gate_up, device);
  ex.down = quantized_to(experts.down, device);
  ex.gate_dense = tensor_to(experts.gate_dense, device);
  ex.up_dense = tensor_to(experts.up_dense, device);
  ex.gate_up_dense = tensor_to(experts.gate_up_dense, device);
  ex.down_dense = tensor_to(experts.down_dense, device);
  return r;
}

int MoeWeights::tile_experts() {
  SwitchGLUWeights& ex = experts;
  return add_tiles(ex.gate) + add_tiles(ex.up) + add_tiles(ex.down);
}

size_t MoeWeights::nbytes() const {
  const SwitchGLUWeights& ex = experts;
  return bytes_of(router.proj) + bytes_of(router.proj_dense) + bytes_of(router.scale) +
         bytes_of(router.per_expert_scale) + bytes_of(ex.gate) + bytes_of(ex.up) + bytes_of(ex.gate_up) +
         bytes_of(ex.down) + bytes_of(ex.gate_dense) + bytes_of(ex.up_dense) + bytes_of(ex.gate_up_dense) +
         bytes_of(ex.down_dense);
}

}  // namespace expertqmm

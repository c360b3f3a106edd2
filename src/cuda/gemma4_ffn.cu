// The Gemma 4 feed-forward part on the device (include/expertqmm/gemma4.h, gemma4_ffn_into): a
// fixed sequence of launches on the current stream into one workspace arena, no host
// synchronization and, once the arena has grown to a size, no allocation (graph-capturable):
//   x1 = rms_norm(h, pre_ff) -> gate/up = x1 @ W^T (gather_qmm, M = T, B = 1) -> GLU product
//   -> d = a @ down^T -> h1 = rms_norm(d, post_ff_1);  x2 = rms_norm(h, pre_ff_2)
//   -> m = moe_layer_into(h, x2) -> h2 = rms_norm(m, post_ff_2) -> s = h1 + h2
//   -> f = rms_norm(s, post_ff) -> out = (h + f) * layer_scalar
// Every buffer is [T, H] or [T, I_dense] in h's dtype (validated by src/ops/gemma4_ffn.cpp).
#include "cuda/gather_qmm.h"
#include "cuda/norm.h"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

namespace {

size_t bytes_of(int64_t count, DType t) { return static_cast<size_t>(count) * dtype_size(t); }

// out [T, N] = x [T, K] @ W^T: quantized through the route selector as one batch of M = T rows
// (B = 1, identity indices: rhs_tiles for prefill, qmv for decode), dense through the plain kernel.
void linear_into(const Linear& l, DType dtype, const void* x, int64_t T, void* out, Workspace& ws) {
  const int64_t K = l.in_features(), N = l.out_features();
  if (!l.is_quantized()) {
    const Tensor w = l.dense.contiguous();
    launch_dense_linear(dtype, x, T, K, w.dtype(), w.data(), N, dtype, out);
    return;
  }
  gather_qmm_into(single_matrix_problem(x, T, K, dtype, l.quantized), out, &ws);
}

}  // namespace

void gemma4_ffn_into(Tensor& out, const Tensor& h, const Gemma4FfnWeights& w, Workspace& ws) {
  const char* op = "gemma4_ffn";
  EXPERTQMM_CHECK(h.device() == Device::cuda && out.device() == Device::cuda && h.is_contiguous(), op,
                  "cuda::gemma4_ffn_into needs contiguous device tensors, got h ", h.describe(), " and out ",
                  out.describe());
  const DType dt = h.dtype();
  const int64_t T = h.size(0), H = h.size(1), I = w.mlp.gate.out_features();
  const float eps = w.eps;

  ArenaLayout layout;
  const size_t x1_off = layout.reserve(bytes_of(T * H, dt));
  const size_t gate_off = layout.reserve(bytes_of(T * I, dt));
  const size_t up_off = layout.reserve(bytes_of(T * I, dt));
  const size_t act_off = layout.reserve(bytes_of(T * I, dt));
  const ProductMode mode = product_mode();  // read once: the plan and the launch agree
  const size_t inter_off = mode == ProductMode::separate ? layout.reserve(bytes_of(T * I, dt)) : 0;
  const size_t d_off = layout.reserve(bytes_of(T * H, dt));
  const size_t h1_off = layout.reserve(bytes_of(T * H, dt));
  const size_t x2_off = layout.reserve(bytes_of(T * H, dt));
  const size_t moe_off = layout.reserve(bytes_of(T * H, dt));
  const size_t h2_off = layout.reserve(bytes_of(T * H, dt));
  void* base = ws.get(detail::kSlotFfnArena, layout.bytes());
  auto at = [&](size_t off) { return arena_at(base, off); };
  auto norm = [&](const void* src, const Tensor& weight, void* dst) {
    const Tensor wc = weight.contiguous();
    launch_rms_norm(dt, src, T, H, wc.dtype(), wc.data(), eps, dst);
  };

  // Dense branch: h1 = post_ff_1(down(geglu(gate(x1), up(x1)))), x1 = pre_ff(h).
  norm(h.data(), w.pre_feedforward_layernorm, at(x1_off));
  linear_into(w.mlp.gate, dt, at(x1_off), T, at(gate_off), ws);
  linear_into(w.mlp.up, dt, at(x1_off), T, at(up_off), ws);
  launch_glu_product(Activation::geglu, mode, dt, at(gate_off), at(up_off), T, I, I, at(act_off),
                     mode == ProductMode::separate ? at(inter_off) : nullptr, current_stream());
  linear_into(w.mlp.down, dt, at(act_off), T, at(d_off), ws);
  norm(at(d_off), w.post_feedforward_layernorm_1, at(h1_off));

  // Expert branch: the router reads h itself, the experts read x2 = pre_ff_2(h).
  norm(h.data(), w.pre_feedforward_layernorm_2, at(x2_off));
  const Tensor x2 = Tensor::view(at(x2_off), {T, H}, dt, Device::cuda);
  Tensor moe_out = Tensor::view(at(moe_off), {T, H}, dt, Device::cuda);
  cuda::moe_layer_into(moe_out, h, x2, w.moe, ws);
  norm(at(moe_off), w.post_feedforward_layernorm_2, at(h2_off));

  // out = (h + post_ff(h1 + h2)) * layer_scalar; the sum reuses d, the norm reuses x1.
  launch_add(dt, at(h1_off), at(h2_off), T * H, at(d_off));
  norm(at(d_off), w.post_feedforward_layernorm, at(x1_off));
  const Tensor scalar = w.layer_scalar.contiguous();
  launch_add_scaled(dt, h.data(), at(x1_off), T * H, scalar.dtype(), scalar.data(), out.data());
}

}  // namespace expertqmm::cuda

// The Gemma 4 feed-forward part (include/expertqmm/gemma4.h). The CPU path is composed from the
// public ops in mlx-lm's order (gemma4_text.py DecoderLayer.__call__), so it reads as the spec;
// the CUDA path (src/cuda/gemma4_ffn.cu) runs the same sequence into workspace buffers.
#include <cmath>
#include <cstring>

#include "core/gather_qmm_problem.h"
#include "ops/op_checks.h"
#include "expertqmm/error.h"
#include "expertqmm/gemma4.h"

namespace expertqmm {

namespace {

constexpr const char* kOp = "gemma4_ffn";

void check_vector(const char* name, const Tensor& t, int64_t n, Device device) {
  EXPERTQMM_CHECK(t.defined(), kOp, name, " is undefined");
  EXPERTQMM_CHECK(is_floating(t.dtype()), kOp, name, " must be a float tensor, got ", t.describe());
  EXPERTQMM_CHECK(t.shape() == Shape{n}, kOp, name, " must be [", n, "], got ", t.describe());
  EXPERTQMM_CHECK(t.device() == device, kOp, name, " is on ", device_name(t.device()), " but h is on ",
                  device_name(device));
}

// A Linear [out, in]; on CUDA its output dtype must be h's (the device path writes into h-dtype
// buffers; MLX checkpoints have bf16 scales with bf16 activations).
void check_linear(const char* name, const Linear& l, int64_t out, int64_t in, const Tensor& h) {
  EXPERTQMM_CHECK(l.quantized.defined() != l.dense.defined(), kOp, name,
                  ": exactly one of the quantized and dense weight must be given (quantized: ",
                  l.quantized.defined(), ", dense: ", l.dense.defined(), ")");
  const Tensor& w = l.is_quantized() ? l.quantized.w : l.dense;
  DType out_dtype;
  if (l.is_quantized()) {
    const QuantizedWeight& q = l.quantized;
    detail::check_quantized_weight(kOp, q);
    EXPERTQMM_CHECK(!q.global_scale.defined(), kOp, name, ": an nvfp4 global scale is not supported in the layers");
    EXPERTQMM_CHECK(q.w.ndim() == 2, kOp, name, " must be [N, K*bits/32], got ", q.w.describe());
    out_dtype = q.mode == QuantMode::affine ? promote_floating(h.dtype(), q.scales.dtype()) : h.dtype();
  } else {
    EXPERTQMM_CHECK(is_floating(w.dtype()) && w.ndim() == 2, kOp, name, " dense weight must be a float [N, K], got ",
                    w.describe());
    out_dtype = promote_floating(h.dtype(), w.dtype());
  }
  EXPERTQMM_CHECK(l.out_features() == out && l.in_features() == in, kOp, name, " must map ", in, " -> ", out,
                  " features, got ", l.in_features(), " -> ", l.out_features(), " (", w.describe(), ")");
  EXPERTQMM_CHECK(w.device() == h.device(), kOp, name, " is on ", device_name(w.device()), " but h is on ",
                  device_name(h.device()));
  if (h.device() == Device::cuda)
    EXPERTQMM_CHECK(out_dtype == h.dtype(), kOp, name, " would produce ", dtype_name(out_dtype), " from h ",
                    dtype_name(h.dtype()), "; the CUDA path needs its scales (or dense weight) in h's dtype");
}

// Checks every input of the feed-forward part, the router and experts included.
void check_ffn(const Tensor& h, const Gemma4FfnWeights& w) {
  EXPERTQMM_CHECK(h.defined(), kOp, "h is undefined");
  EXPERTQMM_CHECK(is_floating(h.dtype()), kOp, "h must be bfloat16, float16 or float32, got ", h.describe());
  EXPERTQMM_CHECK(h.ndim() == 2, kOp, "h must be [T, H], got ", h.describe());
  const int64_t H = h.size(1);
  const Device dev = h.device();
  check_vector("pre_feedforward_layernorm", w.pre_feedforward_layernorm, H, dev);
  check_vector("post_feedforward_layernorm_1", w.post_feedforward_layernorm_1, H, dev);
  check_vector("pre_feedforward_layernorm_2", w.pre_feedforward_layernorm_2, H, dev);
  check_vector("post_feedforward_layernorm_2", w.post_feedforward_layernorm_2, H, dev);
  check_vector("post_feedforward_layernorm", w.post_feedforward_layernorm, H, dev);
  EXPERTQMM_CHECK(w.layer_scalar.defined() && is_floating(w.layer_scalar.dtype()) && w.layer_scalar.numel() == 1,
                  kOp, "layer_scalar must be a one-element float tensor, got ", w.layer_scalar.describe());
  EXPERTQMM_CHECK(w.layer_scalar.device() == dev, kOp, "layer_scalar is on ", device_name(w.layer_scalar.device()),
                  " but h is on ", device_name(dev));
  EXPERTQMM_CHECK(std::isfinite(w.eps) && w.eps >= 0.f, kOp, "eps must be finite and >= 0, got ", w.eps);
  const int64_t I = w.mlp.gate.out_features();
  EXPERTQMM_CHECK(I > 0, kOp, "mlp.gate_proj has no output features");
  check_linear("mlp.gate_proj", w.mlp.gate, I, H, h);
  check_linear("mlp.up_proj", w.mlp.up, I, H, h);
  check_linear("mlp.down_proj", w.mlp.down, H, I, h);
  // The router and experts, as moe_layer checks them (the CUDA block runs the layer without the front).
  const DType moe_out = detail::check_moe_weights(kOp, h, w.moe);
  if (dev == Device::cuda)
    EXPERTQMM_CHECK(moe_out == h.dtype(), kOp, "the experts would produce ", dtype_name(moe_out), " from h ",
                    dtype_name(h.dtype()), "; the CUDA path needs their scales (or 16-bit weights) in h's dtype");
}

QuantizedWeight quantized_to(const QuantizedWeight& q, Device device) {
  QuantizedWeight r = q;
  if (q.w.defined()) r.w = q.w.to(device);
  if (q.scales.defined()) r.scales = q.scales.to(device);
  if (q.biases.defined()) r.biases = q.biases.to(device);
  return r;
}
Tensor tensor_to(const Tensor& t, Device device) { return t.defined() ? t.to(device) : Tensor(); }
Linear linear_to(const Linear& l, Device device) {
  Linear r;
  r.quantized = quantized_to(l.quantized, device);
  r.dense = tensor_to(l.dense, device);
  return r;
}
size_t bytes_of(const Tensor& t) { return t.defined() ? t.nbytes() : 0; }
size_t bytes_of(const QuantizedWeight& q) { return bytes_of(q.w) + bytes_of(q.scales) + bytes_of(q.biases); }
size_t bytes_of(const Linear& l) { return bytes_of(l.quantized) + bytes_of(l.dense); }

}  // namespace

Gemma4FfnWeights Gemma4FfnWeights::to(Device device) const {
  Gemma4FfnWeights r = *this;
  r.pre_feedforward_layernorm = tensor_to(pre_feedforward_layernorm, device);
  r.post_feedforward_layernorm_1 = tensor_to(post_feedforward_layernorm_1, device);
  r.pre_feedforward_layernorm_2 = tensor_to(pre_feedforward_layernorm_2, device);
  r.post_feedforward_layernorm_2 = tensor_to(post_feedforward_layernorm_2, device);
  r.post_feedforward_layernorm = tensor_to(post_feedforward_layernorm, device);
  r.layer_scalar = tensor_to(layer_scalar, device);
  r.mlp.gate = linear_to(mlp.gate, device);
  r.mlp.up = linear_to(mlp.up, device);
  r.mlp.down = linear_to(mlp.down, device);
  r.moe = moe.to(device);
  return r;
}

size_t Gemma4FfnWeights::nbytes() const {
  return bytes_of(pre_feedforward_layernorm) + bytes_of(post_feedforward_layernorm_1) +
         bytes_of(pre_feedforward_layernorm_2) + bytes_of(post_feedforward_layernorm_2) +
         bytes_of(post_feedforward_layernorm) + bytes_of(layer_scalar) + bytes_of(mlp.gate) + bytes_of(mlp.up) +
         bytes_of(mlp.down) + moe.nbytes();
}

Tensor gemma4_ffn(const Tensor& h, const Gemma4FfnWeights& w) {
  check_ffn(h, w);
  if (h.size(0) == 0) return Tensor::empty(h.shape(), h.dtype(), h.device());
  const detail::BackendOps& be = detail::backend_ops(kOp, h.device());
  if (be.gemma4_ffn_into) {  // checked once above, so straight to the backend
    Tensor out = Tensor::empty(h.shape(), h.dtype(), h.device());
    Workspace ws;  // owned by this call: the allocating convenience path
    be.gemma4_ffn_into(out, h.contiguous(), w, ws);
    return out;
  }
  // h1 = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))
  const Tensor x1 = rms_norm(h, w.pre_feedforward_layernorm, w.eps);
  const Tensor gate = linear(x1, w.mlp.gate);
  const Tensor up = linear(x1, w.mlp.up);
  const Tensor h1 = rms_norm(linear(geglu(gate, up), w.mlp.down), w.post_feedforward_layernorm_1, w.eps);
  // h2 = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), route(h)))
  const Tensor x2 = rms_norm(h, w.pre_feedforward_layernorm_2, w.eps);
  const Tensor h2 = rms_norm(moe_layer(h, x2, w.moe), w.post_feedforward_layernorm_2, w.eps);
  // out = (h + post_feedforward_layernorm(h1 + h2)) * layer_scalar
  const Tensor f = rms_norm(add(h1, h2), w.post_feedforward_layernorm, w.eps);
  EXPERTQMM_CHECK(f.dtype() == h.dtype(), kOp, "the branches produce ", dtype_name(f.dtype()), " but h is ",
                  dtype_name(h.dtype()), "; give weights whose scales are in h's dtype or narrower");
  return add_scaled(h, f, w.layer_scalar);
}

void gemma4_ffn_into(Tensor& out, const Tensor& h, const Gemma4FfnWeights& w, Workspace& ws) {
  check_ffn(h, w);
  detail::check_block_out(kOp, out, h);
  if (h.size(0) == 0) return;
  const detail::BackendOps& be = detail::backend_ops(kOp, h.device());
  if (be.gemma4_ffn_into) return be.gemma4_ffn_into(out, h.contiguous(), w, ws);
  // Composed (the CPU reference): allocates as it goes.
  const Tensor result = gemma4_ffn(h, w);
  std::memcpy(out.data(), result.data(), result.nbytes());
}

}  // namespace expertqmm

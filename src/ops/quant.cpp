// Public quantize / dequantize: validation (spec 1.1) and dispatch to the backend of the input.
#include "expertqmm/quant.h"

#include "core/gather_qmm_problem.h"
#include "ops/op_checks.h"
#include "expertqmm/error.h"

namespace expertqmm {

QuantizedWeight quantize(const Tensor& w, QuantSpec spec) {
  constexpr const char* kOp = "quantize";
  detail::check_quant_params(kOp, spec.mode, spec.bits, spec.group_size);
  EXPERTQMM_CHECK(spec.rounding == Rounding::cpu || spec.rounding == Rounding::gpu, kOp,
                  "unknown rounding flavour ", static_cast<int>(spec.rounding));
  EXPERTQMM_CHECK(spec.mode == QuantMode::affine || spec.rounding == Rounding::cpu, kOp, "mode ",
                  quant_mode_name(spec.mode), " has one quantizer (MLX's CPU one): Rounding::gpu is affine only");
  detail::check_global_scale(kOp, spec.mode, spec.global_scale);
  EXPERTQMM_CHECK(w.defined(), kOp, "w is undefined");
  EXPERTQMM_CHECK(is_floating(w.dtype()), kOp, "w must be bfloat16, float16 or float32, got ", w.describe());
  EXPERTQMM_CHECK(w.ndim() >= 2, kOp, "w must have at least 2 dims [..., N, K], got ", w.describe());
  EXPERTQMM_CHECK(w.size(-1) % spec.group_size == 0, kOp, "the last dim K=", w.size(-1), " of ",
                  shape_str(w.shape()), " is not a multiple of group_size=", spec.group_size);
  const Tensor wc = w.contiguous();
  return detail::backend_ops(kOp, wc.device()).quantize(wc, spec);
}

Tensor dequantize(const Tensor& w, const Tensor& scales, const Tensor& biases, int group_size, int bits) {
  constexpr const char* kOp = "dequantize";
  detail::check_quantized_triple(kOp, w, scales, biases, group_size, bits);
  QuantizedWeight q;
  q.w = w.contiguous();
  q.scales = scales.contiguous();
  q.biases = biases.contiguous();
  q.group_size = group_size;
  q.bits = bits;
  return detail::backend_ops(kOp, q.w.device()).dequantize(q, q.scales.dtype());
}

Tensor dequantize(const QuantizedWeight& q_in, DType dtype) {
  constexpr const char* kOp = "dequantize";
  detail::check_quantized_weight(kOp, q_in);
  EXPERTQMM_CHECK(is_floating(dtype), kOp, "the output dtype must be bfloat16, float16 or float32, got ",
                  dtype_name(dtype));
  QuantizedWeight q = q_in;
  q.w = q.w.contiguous();
  q.scales = q.scales.contiguous();
  if (q.biases.defined()) q.biases = q.biases.contiguous();
  const Tensor out = detail::backend_ops(kOp, q.w.device()).dequantize(q, dtype);
  // Affine computes in the scales' dtype, then casts (MLX's astype); fp modes produce dtype.
  return q.mode == QuantMode::affine ? detail::cast_floating(out, dtype) : out;
}

}  // namespace expertqmm

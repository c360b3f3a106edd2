// Public quantize / dequantize: validation (spec 1.1) and dispatch to the backend of the input.
#include "expertqmm/quant.h"

#include "core/gather_qmm_problem.h"
#include "cpu/cpu_backend.h"
#include "expertqmm/error.h"
#ifdef EXPERTQMM_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace expertqmm {

QuantizedWeight quantize(const Tensor& w, QuantSpec spec) {
  constexpr const char* kOp = "quantize";
  detail::check_bits_group(kOp, spec.bits, spec.group_size);
  EXPERTQMM_CHECK(spec.rounding == Rounding::cpu || spec.rounding == Rounding::gpu, kOp,
                  "unknown rounding flavour ", static_cast<int>(spec.rounding));
  EXPERTQMM_CHECK(w.defined(), kOp, "w is undefined");
  EXPERTQMM_CHECK(is_floating(w.dtype()), kOp, "w must be bfloat16, float16 or float32, got ", w.describe());
  EXPERTQMM_CHECK(w.ndim() >= 2, kOp, "w must have at least 2 dims [..., N, K], got ", w.describe());
  EXPERTQMM_CHECK(w.size(-1) % spec.group_size == 0, kOp, "the last dim K=", w.size(-1), " of ",
                  shape_str(w.shape()), " is not a multiple of group_size=", spec.group_size);
  const Tensor wc = w.contiguous();
  if (wc.device() == Device::cpu) return cpu::quantize(wc, spec);
#ifdef EXPERTQMM_HAVE_CUDA
  return cuda::quantize(wc, spec);
#else
  throw Error(kOp, "w is on cuda but this build of expertqmm has no CUDA backend");
#endif
}

Tensor dequantize(const Tensor& w, const Tensor& scales, const Tensor& biases, int group_size, int bits) {
  constexpr const char* kOp = "dequantize";
  detail::check_quantized_triple(kOp, w, scales, biases, group_size, bits);
  const Tensor wc = w.contiguous(), sc = scales.contiguous(), bc = biases.contiguous();
  if (wc.device() == Device::cpu) return cpu::dequantize(wc, sc, bc, group_size, bits);
#ifdef EXPERTQMM_HAVE_CUDA
  return cuda::dequantize(wc, sc, bc, group_size, bits);
#else
  throw Error(kOp, "w is on cuda but this build of expertqmm has no CUDA backend");
#endif
}

}  // namespace expertqmm

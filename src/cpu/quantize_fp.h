// CPU reference of MLX's fp quantization modes (mxfp4, mxfp8, nvfp4): quantize_fp.cpp.
#pragma once
#include "expertqmm/quant.h"

namespace expertqmm::cpu {

// mx.quantize(w, mode=spec.mode, global_scale=spec.global_scale) on MLX's CPU stream, bit for bit.
QuantizedWeight quantize_fp(const Tensor& w, const QuantSpec& spec);
// mx.dequantize(..., mode, global_scale, dtype) on MLX's CPU stream, bit for bit. With a global
// scale the output is float32 whatever `dtype` says, as MLX's (its scale is a float32 array).
Tensor dequantize_fp(const QuantizedWeight& q, DType dtype);

// Weight i of a packed fp-mode row whose group scale code is `scale_code`, in fp32: the E2M1 /
// E4M3 value times the decoded scale (E8M0 or E4M3), exact in fp32. The gather_qmm reference reads
// the weights through this.
float fp_weight(QuantMode mode, const uint32_t* row, int64_t i, uint8_t scale_code);

}  // namespace expertqmm::cpu

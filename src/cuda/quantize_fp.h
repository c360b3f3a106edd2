// MLX's fp quantization modes on the GPU (quantize_fp.cu); cuda::quantize / dequantize hand the fp
// modes here.
#pragma once
#include "expertqmm/quant.h"

namespace expertqmm::cuda {

QuantizedWeight quantize_fp(const Tensor& w, const QuantSpec& spec);  // w on the device
Tensor dequantize_fp(const QuantizedWeight& q, DType dtype);          // float32 with a global scale

}  // namespace expertqmm::cuda

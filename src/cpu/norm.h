// CPU reference of the Gemma 4 feed-forward elementwise ops and the dense linear (include/
// expertqmm/gemma4.h). Inputs arrive validated by src/core/norm.cpp.
#pragma once
#include "expertqmm/gemma4.h"

namespace expertqmm::cpu {

Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps);
Tensor add(const Tensor& a, const Tensor& b);
Tensor add_scaled(const Tensor& a, const Tensor& b, float scalar);
// x [T, K] @ w [N, K]^T in fp32 (double accumulation), out in `out_dtype`.
Tensor dense_linear(const Tensor& x, const Tensor& w, DType out_dtype);

}  // namespace expertqmm::cpu

// Element access shared by the CPU reference ops.
#pragma once
#include <vector>

#include "expertqmm/tensor.h"

namespace expertqmm::cpu {

// Every element of a float tensor (any float dtype, any strides, any device) as fp32, row-major.
std::vector<float> to_f32(const Tensor& t);

// An fp32 value rounded to the precision of `dtype` and widened back (identity for f32).
float round_as(float v, DType dtype);

}  // namespace expertqmm::cpu

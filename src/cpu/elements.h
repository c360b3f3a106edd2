// Element access shared by the CPU reference ops.
#pragma once
#include <vector>

#include "expertqmm/tensor.h"

namespace expertqmm::cpu {

// Every element of a float tensor (any float dtype, any strides, any device) as fp32, row-major.
std::vector<float> to_f32(const Tensor& t);

// Element i of a contiguous float buffer of dtype t, widened to fp32 (throws naming `op` for a
// non-float dtype).
float load_float(const char* op, const void* base, DType t, int64_t i);
// Stores v rounded to nearest even in dtype t.
void store_float(const char* op, void* base, DType t, int64_t i, float v);
// An fp32 value rounded to the precision of `dtype` and widened back (identity for f32).
float round_as(float v, DType dtype);

}  // namespace expertqmm::cpu

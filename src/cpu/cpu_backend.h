// The CPU reference backend: scalar, readable, the executable spec. Inputs arrive validated by
// src/core (ops.cpp); these functions may assume valid shapes and dtypes.
#pragma once
#include "core/gather_mm_problem.h"
#include "core/gather_qmm_problem.h"
#include "expertqmm/moe.h"

namespace expertqmm::cpu {

QuantizedWeight quantize(const Tensor& w, QuantSpec spec);
Tensor dequantize(const Tensor& w, const Tensor& scales, const Tensor& biases, int group_size, int bits);
Tensor gather_qmm(const detail::GatherQmmProblem& p);
Tensor gather_mm(const detail::GatherMmProblem& p);
SortedRows gather_sort(const Tensor& x, const Tensor& indices);
Tensor scatter_unsort(const Tensor& x, const Tensor& inv_order, const Shape& shape);
Tensor glu_product(Activation act, const Tensor& gate, const Tensor& up);
Routing route(const Tensor& h, const RouterWeights& router);
Tensor weighted_combine(const Tensor& y, const Tensor& weights);

}  // namespace expertqmm::cpu

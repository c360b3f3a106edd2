// The CUDA backend as seen from host C++ (no CUDA header here). Inputs arrive validated by
// src/core (ops.cpp), on the device. Everything is issued on expertqmm::cuda_stream().
#pragma once
#include "core/gather_qmm_problem.h"
#include "expertqmm/moe.h"

namespace expertqmm::cuda {

QuantizedWeight quantize(const Tensor& w, QuantSpec spec);
Tensor dequantize(const Tensor& w, const Tensor& scales, const Tensor& biases, int group_size, int bits);
Tensor gather_qmm(const detail::GatherQmmProblem& p);
SortedRows gather_sort(const Tensor& x, const Tensor& indices);
Tensor scatter_unsort(const Tensor& x, const Tensor& inv_order, const Shape& shape);
Tensor glu_product(Activation act, const Tensor& gate, const Tensor& up);
Routing route(const Tensor& h, const RouterWeights& router);
Tensor weighted_combine(const Tensor& y, const Tensor& weights);
Tensor switch_glu(const Tensor& x, const Tensor& indices, const SwitchGLUWeights& weights);
void moe_layer_into(Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& weights, Workspace& ws);

}  // namespace expertqmm::cuda

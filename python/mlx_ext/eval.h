// Running an expertqmm op as a primitive's evaluation: the arrays become expertqmm Tensor views of
// their memory (no copy) and `Body` writes the result into the output array's memory.
#pragma once
#include <functional>
#include <vector>

#include "primitives.h"

namespace expertqmm::mlx_ext {

// in: views of the primitive's inputs, in order; out: a view of the output array (allocated by
// MLX's allocator); ws: scratch that lives with the stream (CUDA only, null on the CPU).
using Body = std::function<void(const std::vector<Tensor>& in, Tensor& out, Workspace* ws)>;

DType expertqmm_dtype(mx::Dtype t, const char* op);
mx::Dtype mlx_dtype(DType t);

// On the CPU stream's thread, after the inputs are computed (MLX's CPU command encoder).
void eval_on_cpu(const mx::Stream& s, const std::vector<mx::array>& inputs, mx::array& out, Body body);
// On MLX's CUDA stream, captured into MLX's graph; no host sync (cuda/mlx_stream.cpp). Without
// MLX's CUDA backend it raises.
void eval_on_cuda(const mx::Stream& s, const std::vector<mx::array>& inputs, mx::array& out, Body body);

// `a` itself when it is already computed and row-contiguous (weights), else mx::contiguous(a) on
// `s` (a graph node that copies only when it has to): the primitives view their inputs row-major.
mx::array row_contiguous(const mx::array& a, const mx::Stream& s);


}  // namespace expertqmm::mlx_ext

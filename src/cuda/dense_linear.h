// The one dense (unquantized) linear on CUDA: the router's 16-bit projection (router.cu), the
// Gemma 4 block's 16-bit dense MLP (gemma4_ffn.cu) and the public dense linear (the backend op)
// all go through it. It runs as a gather_mm problem (gather_mm.h), so gather_mm's selector picks
// the route: tiles above kGemvMaxRows rows, gemv at and below, simt for what they refuse.
#pragma once
#include <cstdint>

#include "expertqmm/tensor.h"
#include "expertqmm/moe.h"

namespace expertqmm::cuda {

// out [T, N] = x [T, K] (x_dtype, rows K apart) @ w^T, w [N, K] on the device in any float dtype
// and any strides, out in out_dtype = promote(x, w) (an Error otherwise); products of the widened
// values summed in fp32, each output rounded once to out_dtype. On the current stream; scratch from ws's slot kSlotDenseLinear (no allocation
// once warm, no host sync: graph-capturable).
void dense_linear_into(const void* x, DType x_dtype, int64_t T, const Tensor& w, DType out_dtype, void* out,
                       Workspace& ws);

}  // namespace expertqmm::cuda

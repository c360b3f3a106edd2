// The CUDA side of include/expertqmm/gemma4.h as seen from host C++ (no CUDA header here).
// Inputs arrive validated by src/core (norm.cpp, gemma4_ffn.cpp). Everything is issued on
// expertqmm::cuda_stream(); the launch_* entries allocate nothing and never synchronize.
#pragma once
#include "expertqmm/gemma4.h"

namespace expertqmm::cuda {

// norm.cu: the allocating ops behind the public entries.
Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps);
Tensor add(const Tensor& a, const Tensor& b);
Tensor add_scaled(const Tensor& a, const Tensor& b, const Tensor& scalar);
Tensor dense_linear(const Tensor& x, const Tensor& w, DType out_dtype);

// norm.cu launches, all pointers device memory, all arrays contiguous.
// x, out: [rows, D] in `dtype`; weight [D] in w_dtype.
void launch_rms_norm(DType dtype, const void* x, int64_t rows, int64_t D, DType w_dtype, const void* weight,
                     float eps, void* out);
// out = a + b over n values in `dtype`.
void launch_add(DType dtype, const void* a, const void* b, int64_t n, void* out);
// out = round(a + b) * scalar[0] over n values in `dtype`; scalar is one value in s_dtype.
void launch_add_scaled(DType dtype, const void* a, const void* b, int64_t n, DType s_dtype, const void* scalar,
                       void* out);
// out [T, N] (out_dtype) = x [T, K] (x_dtype) @ w [N, K]^T (w_dtype), fp32 accumulation.
void launch_dense_linear(DType x_dtype, const void* x, int64_t T, int64_t K, DType w_dtype, const void* w, int64_t N,
                         DType out_dtype, void* out);

// gemma4_ffn.cu: the whole feed-forward part, no allocation once `ws` has grown, no host sync.
void gemma4_ffn_into(Tensor& out, const Tensor& h, const Gemma4FfnWeights& weights, Workspace& ws);

}  // namespace expertqmm::cuda

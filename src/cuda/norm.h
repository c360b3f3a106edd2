// The launches of norm.cu that gemma4_ffn.cu strings together (no CUDA header here). Everything is
// issued on the calling thread's expertqmm::cuda_stream(); none allocates or synchronizes.
#pragma once
#include "cuda/cuda_backend.h"

namespace expertqmm::cuda {

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

}  // namespace expertqmm::cuda

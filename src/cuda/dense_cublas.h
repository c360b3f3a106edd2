// A quantized dense linear at prefill sizes as cuBLAS does it best: the weight dequantized into a
// 16-bit scratch (one fma rounded once to the activation dtype, the tensor-core routes' arithmetic:
// docs/numerics.md), then cuBLAS's dense GEMM (16-bit operands, fp32 accumulation, one rounding of
// each output). For the Gemma 4 block's dense MLP, whose single matrix leaves the expert tile
// kernel's 128-row tiles one wave and a few CTAs (bench/NOTES.md step 59).
#pragma once
#include <cstdint>

#include "expertqmm/moe.h"
#include "expertqmm/quant.h"
#include "expertqmm/tensor.h"

namespace expertqmm::cuda {

// Whether dequantize_for_gemm and cublas_linear take q for activations of x_dtype: affine codes of
// 4 or 8 bits, group 32 / 64 / 128, contiguous, scales and biases of x_dtype (bf16 or f16), the
// codes 16-byte aligned. `why` (when not null) gets the first rule that failed.
bool dense_cublas_fits(const QuantizedWeight& q, DType x_dtype, const char** why = nullptr);

// out [N, K] of the scales' dtype, row-major, 16-byte aligned: T(q * s + b) with one rounding.
void dequantize_for_gemm(const QuantizedWeight& q, void* out, cudaStream_t stream);

// out [T, N] (rows ldo apart) = x [T, K] (rows ldx apart) @ w^T, w [N, K] row-major; x, w and out
// of dtype (bf16 or f16), fp32 accumulation. On `stream`; cuBLAS's scratch from ws (slot
// kSlotCublas), so a warm workspace makes no allocation (graph-capturable). One cuBLAS handle per
// host thread and device, made on first use.
void cublas_linear(DType dtype, const void* w, const void* x, int64_t ldx, void* out, int64_t ldo, int64_t T,
                   int64_t N, int64_t K, Workspace& ws, cudaStream_t stream);

}  // namespace expertqmm::cuda

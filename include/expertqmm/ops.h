// The expert-path ops, with MLX names and semantics (shared/spec/mlx-semantics.md section 2-3).
// Every op runs on the device its inputs live on; mixing devices is an error.
#pragma once
#include "expertqmm/quant.h"
#include "expertqmm/tensor.h"

namespace expertqmm {

// mx.gather_qmm. x [*Bx, M, K]; w [*Bw, N, K*bits/32] (transpose) or [*Bw, K, N*bits/32];
// lhs_indices / rhs_indices: integer arrays of flat batch indices (undefined = arange over the
// batch), broadcast together to S. Output S + [M, N] in promote(x, scales) dtype (affine) or x's
// dtype (fp modes: scales uint8, biases undefined, as MLX). `sorted_indices` is a promise that is
// checked, never trusted. A global scale (nvfp4) is refused: MLX 0.32 runs it on the GPU only.
Tensor gather_qmm(const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor& biases,
                  const Tensor& lhs_indices, const Tensor& rhs_indices, bool transpose,
                  int group_size, int bits, bool sorted_indices = false,
                  QuantMode mode = QuantMode::affine);
Tensor gather_qmm(const Tensor& x, const QuantizedWeight& q, const Tensor& lhs_indices,
                  const Tensor& rhs_indices, bool transpose = true, bool sorted_indices = false);

class Workspace;  // moe.h
// gather_qmm writing into a caller-owned contiguous `out` (S + [M, N], the output dtype, x's device):
// for callers that own their output memory (a framework's array). On CUDA it runs on the library's
// stream with no host sync; `ws` (optional) holds the routes' scratch, so with a warmed-up workspace
// it allocates nothing. On the CPU it computes gather_qmm and copies the result in.
void gather_qmm_into(Tensor& out, const Tensor& x, const Tensor& w, const Tensor& scales, const Tensor& biases,
                     const Tensor& lhs_indices, const Tensor& rhs_indices, bool transpose, int group_size,
                     int bits, bool sorted_indices = false, QuantMode mode = QuantMode::affine,
                     Workspace* ws = nullptr);

// mx.gather_mm, the unquantized form (mlx-lm's SwitchLinear when experts stay 16-bit). a [*Ba, M, K];
// b [*Bb, K, N], any strides (mlx-lm passes weight.swapaxes(-1, -2) of an [E, N, K] weight);
// indices as gather_qmm. Output S + [M, N] in promote(a, b) dtype: fp32 accumulation, one rounding.
// On CUDA: a tensor-core route for sorted rows, a GEMV route for decode sizes and a simt route for
// everything else (src/cuda/gather_mm.h).
Tensor gather_mm(const Tensor& a, const Tensor& b, const Tensor& lhs_indices, const Tensor& rhs_indices,
                 bool sorted_indices = false);

// mlx-lm _gather_sort: indices [..., k] flattened; order = stable argsort; inv_order = argsort(order).
// x [..., D] (one row per token) -> x_sorted [T*k, 1, D] = x_flat[order / k].
struct SortedRows {
  Tensor x;          // [T*k, 1, D]
  Tensor indices;    // [T*k] int32, non-decreasing
  Tensor inv_order;  // [T*k] int32
};
SortedRows gather_sort(const Tensor& x, const Tensor& indices);

// mlx-lm _scatter_unsort: x[inv_order] unflattened to `shape` + x.shape[1:].
Tensor scatter_unsort(const Tensor& x, const Tensor& inv_order, const Shape& shape);

enum class Activation : uint8_t { geglu, swiglu };
const char* activation_name(Activation a);

// geglu(gate, up) = gelu_tanh(gate) * up; swiglu(gate, up) = silu(gate) * up. Elementwise, fp32
// math, output in the input dtype.
Tensor geglu(const Tensor& gate, const Tensor& up);
Tensor swiglu(const Tensor& gate, const Tensor& up);
Tensor glu_product(Activation act, const Tensor& gate, const Tensor& up);

}  // namespace expertqmm

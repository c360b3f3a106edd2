// The peer's own CUDA kernels (no CUTLASS): weight layout conversion at load, the affine form's bias
// term, the reference GEMM and the check. bf16 values travel as uint16_t bit patterns.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "peer_gemm.h"

namespace expertqmm::peer {

// Unsigned 4-bit codes q -> signed codes q - 8 (two's complement int4: q xor 8), in place.
void flip_code_sign(uint32_t* words, size_t count, cudaStream_t stream);

// [experts][n][groups] -> [experts][groups][n] (bf16): the per-group scales and biases n-contiguous.
void transpose_groups(const uint16_t* src, uint16_t* dst, int experts, int n, int groups, cudaStream_t stream);

// sums[r][g] = sum of x[r][g * group_size .. + group_size) in fp32 (x bf16 [rows][k]).
void group_sums(const uint16_t* x, int rows, int k, int group_size, float* sums, cudaStream_t stream);

// The affine form's bias term, c[r][j] = bf16(sum_g sums[r][g] * biases_t[expert_of_row[r]][g][j]).
void bias_term(const float* sums, const int32_t* expert_of_row, const uint16_t* biases_t, int rows, int n,
               int groups, uint16_t* c, cudaStream_t stream);

// out[r][j] = sum_k x[r][k] * w(expert_of_row[r], j, k) in fp32, w dequantized from MLX's layout
// (codes uint32 [experts][n][k / 8], scales and biases bf16 [experts][n][k / group_size]) as the
// form says: affine w = bf16(s * q + b); scale w = bf16(s * (q - 8)) (biases unused).
void reference_gemm(const uint16_t* x, const int32_t* expert_of_row, int rows, const uint32_t* codes,
                    const uint16_t* scales, const uint16_t* biases, int n, int k, int group_size, QuantForm form,
                    float* out, cudaStream_t stream);

// act[r][j] = bf16(f(gate_up[r][j]) * gate_up[r][i + j]) for j < i (gate columns first), f = gelu_tanh
// (GeGLU) or silu (SwiGLU): the down GEMM's input.
void glu_rows(const float* gate_up, int rows, int i, bool swiglu, uint16_t* act, cudaStream_t stream);

// Writes bf16 NaN everywhere, so that an element the GEMM does not write fails the check.
void fill_nan(uint16_t* d, size_t count, cudaStream_t stream);

// ||got - ref|| / ||ref|| over `count` elements (got bf16, ref fp32); NaN when any got is NaN.
double rel_error(const uint16_t* got, const float* ref, size_t count, cudaStream_t stream);

}  // namespace expertqmm::peer

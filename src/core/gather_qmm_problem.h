// The validated, backend-neutral description of one gather_qmm call. Every backend receives this
// and nothing else; all MLX shape rules (spec 2.1) are resolved here, once.
#pragma once
#include <string>

#include "expertqmm/quant.h"
#include "expertqmm/tensor.h"

namespace expertqmm::detail {

struct GatherQmmProblem {
  int64_t M = 0, N = 0, K = 0;  // out[b] = x[lhs[b]] (M x K) @ dequant(w[rhs[b]])^T (K x N)
  int bits = 4, group_size = 64;
  QuantMode mode = QuantMode::affine;  // fp modes: scales uint8, biases undefined
  bool transpose = true;        // w is [E, N, K*bits/32] (true) or [E, K, N*bits/32] (false)
  bool sorted_indices = false;  // the caller's promise; backends must stay correct if it is false
  Shape batch;                  // S: broadcast shape of the index arrays; output is S + [M, N]
  int64_t B = 0;                // numel(S)
  int64_t x_batch = 0;          // number of [M, K] matrices in x (prod of x's batch dims)
  int64_t w_batch = 0;          // E: number of weight matrices
  DType dtype = DType::bf16;    // activation = output dtype (affine: promote(x, scales); fp: x's)
  Device device = Device::cpu;

  // Operands, all on `device`. x: the x_batch matrices, each [M, K] row-major, x_batch_stride
  // elements apart. w, scales, biases: contiguous; affine: scales/biases in `dtype`; fp modes:
  // scales uint8 codes (E8M0 or E4M3) and no biases.
  Tensor x;
  int64_t x_batch_stride = 0;
  Tensor w, scales, biases;
  // lhs, rhs: contiguous int32 [B] (broadcast materialised). Values are range-checked here on the
  // CPU; on CUDA the kernels check them (out-of-range ids are recorded, never read).
  Tensor lhs, rhs;
  // Optional: w in the tile layout (quant.h TiledWeight; the layer passes a projection's own), which
  // the warp-specialized wgmma build reads instead of w, scales and biases when its parameters are
  // in `dtype` (cuda quant_view).
  TiledWeight tiled;
  bool rhs_is_identity = false;  // rhs[b] == b (no rhs given and no broadcast)
  bool lhs_is_identity = false;  // lhs[b] == b
  // CUDA expert tile route: a plan already built for rhs on the current stream (one plan serves
  // every GEMM of an MoE layer; the layer plan builds it, cuda/layer_plan.h); nullptr: the route builds one.
  const void* tile_plan = nullptr;
  // CUDA rhs_tiles split-K: caller-owned scratch of at least cuda::gather_qmm_split_k_bytes(B * M,
  // N, K) bytes for the fp32 slices (e.g. inside the router's arena, free while it runs); nullptr:
  // the route takes workspace slot 1, or a temporary without a workspace.
  void* split_k_scratch = nullptr;

  int64_t w_row_words() const { return (transpose ? K : N) * bits / 32; }  // uint32 per w row
  int64_t groups_per_row() const { return (transpose ? K : N) / group_size; }
  std::string describe() const;  // every field, for "no route" errors
};

// The batch side of a gathered matmul, shared by gather_qmm and gather_mm (spec 2.1): the index
// arrays (absent: arange over the batch) broadcast to S, and x in `dtype` with its [M, K] matrices
// x_batch_stride elements apart. Fields mean what GatherQmmProblem's fields of the same names mean.
struct GatherBatch {
  Shape batch;
  int64_t B = 0, x_batch = 0, w_batch = 0;
  Tensor x;
  int64_t x_batch_stride = 0;
  Tensor lhs, rhs;
  bool lhs_is_identity = false, rhs_is_identity = false;
};
// Checks the indices (integer, on x's device, in range where they can be read without a device
// sync) and builds the batch; errors name `op`. x must be a float tensor of rank >= 2 on its device.
GatherBatch make_gather_batch(const char* op, const Tensor& x, DType dtype, const Shape& w_batch_shape,
                              const Tensor& lhs_indices, const Tensor& rhs_indices);

// Validates every argument (throws Error naming "gather_qmm" and the values) and builds the problem.
GatherQmmProblem make_gather_qmm_problem(const Tensor& x, const Tensor& w, const Tensor& scales,
                                         const Tensor& biases, const Tensor& lhs_indices,
                                         const Tensor& rhs_indices, bool transpose, int group_size,
                                         int bits, bool sorted_indices, QuantMode mode = QuantMode::affine);

// Shared checks for quantized weights (used by quantize/dequantize/gather_qmm and the layers):
// shapes, dtypes (affine: float scales and biases of one dtype; fp modes: uint8 scales, no
// biases), devices, and the (mode, bits, group_size) combination.
void check_quantized(const char* op, const Tensor& w, const Tensor& scales, const Tensor& biases,
                     int group_size, int bits, QuantMode mode);
inline void check_quantized_triple(const char* op, const Tensor& w, const Tensor& scales,
                                   const Tensor& biases, int group_size, int bits) {
  check_quantized(op, w, scales, biases, group_size, bits, QuantMode::affine);
}
// An optional global scale: nvfp4 only, a float32 scalar.
void check_global_scale(const char* op, QuantMode mode, const Tensor& global_scale);
// check_quantized on q's fields, and check_global_scale on q's.
void check_quantized_weight(const char* op, const QuantizedWeight& q);
void check_quant_params(const char* op, QuantMode mode, int bits, int group_size);
inline void check_bits_group(const char* op, int bits, int group_size) {
  check_quant_params(op, QuantMode::affine, bits, group_size);
}

// Casts a float tensor to another float dtype (any device; device tensors go through the host).
Tensor cast_floating(const Tensor& t, DType to);

}  // namespace expertqmm::detail

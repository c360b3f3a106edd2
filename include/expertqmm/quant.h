// MLX quantization (mx.quantize's four modes). Codes in uint32 words along the last axis, one scale
// (and, for affine, one bias) per group of `group_size` consecutive values.
// Spec: shared/spec/mlx-semantics.md section 1 (affine); docs/numerics.md "fp modes" (mxfp4, mxfp8,
// nvfp4: E2M1 / E4M3 values, E8M0 / E4M3 scales).
#pragma once
#include <string>

#include "expertqmm/tensor.h"

namespace expertqmm {

// The two MLX quantizers (spec 1.3). They differ only on all-negative groups and exact .5 ties.
// Affine only: the fp modes have one quantizer (MLX's CPU one).
enum class Rounding : uint8_t {
  cpu,  // exact min/max, std::rint (ties to even): MLX's CPU backend
  gpu,  // w_max starts at 0, round half away from zero: MLX's Metal and CUDA backends
};

// mx.quantize's `mode`. Each fp mode has one bits and one group size (quant_mode_bits/_group_size).
enum class QuantMode : uint8_t {
  affine,  // bits 2..8, group 32/64/128; scales and biases in the weight's float dtype
  mxfp4,   // E2M1 values, group 32, uint8 E8M0 scales (2^(s-127)), no biases
  mxfp8,   // E4M3 values, group 32, uint8 E8M0 scales, no biases
  nvfp4,   // E2M1 values, group 16, uint8 E4M3 scales, no biases; optional float32 global scale
};

const char* quant_mode_name(QuantMode mode);                // "affine", "mxfp4", ... (MLX's strings)
bool parse_quant_mode(const std::string& name, QuantMode* mode);  // false for an unknown name
int quant_mode_bits(QuantMode mode);                        // mxfp8: 8, other fp modes: 4, affine: 4 (default)
int quant_mode_group_size(QuantMode mode);                  // nvfp4: 16, mx modes: 32, affine: 64 (default)

struct QuantSpec {
  QuantSpec(int bits_ = 4, int group_size_ = 64, Rounding rounding_ = Rounding::cpu,
            QuantMode mode_ = QuantMode::affine)
      : bits(bits_), group_size(group_size_), rounding(rounding_), mode(mode_) {}
  int bits = 4;         // affine: 2, 3, 4, 5, 6 or 8; fp modes: quant_mode_bits(mode)
  int group_size = 64;  // affine: 32, 64 or 128; fp modes: quant_mode_group_size(mode)
  Rounding rounding = Rounding::cpu;
  QuantMode mode = QuantMode::affine;
  Tensor global_scale;  // nvfp4 only, optional: float32 scalar (MLX's global_scale)
};
// The spec MLX uses for `mode` when bits and group_size are not given.
QuantSpec default_quant_spec(QuantMode mode);

// An affine 4-bit weight re-laid once at load for the tensor-core expert kernels (tile_weight()),
// kept beside the MLX tensors, which every other route reads. For w of logical shape [E, N, K]:
//   codes  uint32 [E, NB, K/64, 512], NB = ceil(N/64): per (expert, 64-row block, 64-wide k tile)
//          2 KB, one 16-byte word group per lane of the wgmma A fragments (one load per lane and
//          k tile, each register pair one shift and one mask away from its two codes);
//   params uint32 [E, NB, K/group_size, 64]: per (expert, block, group) each row's scale (low half)
//          and bias (high half) as one word, two rows a lane reads side by side.
// docs/tile-layout.md gives every index. Rows past N hold code 0, scale 0 and bias 0.
struct TiledWeight {
  Tensor codes;
  Tensor params;
  int group_size = 64;               // the weight's (64 or 128)
  DType param_dtype = DType::bf16;   // the scales' and biases' (bf16 or f16)
  int64_t rows = 0;                  // the weight's N (rows past it in the last block are padding)
  bool defined() const { return codes.defined(); }
};

// A quantized weight as MLX stores it, for w of logical shape [..., N, K]:
//   w      [..., N, K*bits/32] uint32, LSB-first bit stream per row
//   scales [..., N, K/group_size]: affine: the float dtype of the original weight; fp modes: uint8
//   biases [..., N, K/group_size] same dtype as scales (affine); undefined for the fp modes
//   global_scale: nvfp4 only, optional float32 scalar
struct QuantizedWeight {
  Tensor w;
  Tensor scales;
  Tensor biases;
  int bits = 4;
  int group_size = 64;
  QuantMode mode = QuantMode::affine;
  Tensor global_scale;
  // Optional: tile_weight(*this), which the wgmma expert kernels read instead of w, scales
  // and biases; make it again after changing them (a layout of another shape (E, N, K, group size,
  // dtype) is ignored, one of the same shape is trusted).
  TiledWeight tiled;
  bool defined() const { return w.defined(); }
};

bool valid_bits(int bits);              // affine
bool valid_group_size(int group_size);  // affine
// Whether (mode, bits, group_size) is a combination MLX accepts.
bool valid_quant_params(QuantMode mode, int bits, int group_size);

// mx.quantize(w, group_size, bits, mode, global_scale); affine with the chosen flavour of rounding.
QuantizedWeight quantize(const Tensor& w, QuantSpec spec = {});

// mx.dequantize (affine): s*q + b, output in the dtype of scales, shape [..., N, K].
Tensor dequantize(const Tensor& w, const Tensor& scales, const Tensor& biases, int group_size,
                  int bits);
// mx.dequantize(..., mode, global_scale, dtype) for any mode, output in `dtype`.
Tensor dequantize(const QuantizedWeight& q, DType dtype);
// Whether tile_weight() takes q: affine, 4-bit, group size 64 or 128, bf16 or f16 scales and biases,
// K a multiple of 64, w of rank >= 2 (leading dims are the experts). When not, *why (if given) says
// which rule failed.
bool tileable(const QuantizedWeight& q, std::string* why = nullptr);
// q's tile layout (see TiledWeight), on q's device; throws Error when !tileable(q).
TiledWeight tile_weight(const QuantizedWeight& q);
// The inverse: the MLX tensors of an [E, N, K] weight (N = t.rows) from its tile layout (w [E, N, K/8]
// uint32; scales and biases [E, N, K/group_size] in t.param_dtype), on t's device. The round trip is
// exact.
QuantizedWeight untile_weight(const TiledWeight& t);

// MLX's default output dtype: the scales' dtype (affine), bfloat16 (fp modes).
inline Tensor dequantize(const QuantizedWeight& q) {
  return dequantize(q, q.mode == QuantMode::affine ? q.scales.dtype() : DType::bf16);
}

}  // namespace expertqmm

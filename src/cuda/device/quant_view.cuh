// One MLX-quantized weight as every kernel reads it: the codes, the per-group scales and biases, and
// the row geometry. The argument struct of each route and decode kernel holds one QuantView per
// weight it reads (instead of repeating these fields). Built on the host by quant_view()
// (gather_qmm_routes.h).
#pragma once
#include <cstdint>

namespace expertqmm::cuda::device {

struct QuantView {
  const uint32_t* w = nullptr;       // codes, rows of words_per_row uint32 (MLX's LSB-first stream)
  const uint16_t* scales = nullptr;  // rows of groups_per_row raw values of the activation dtype
  const uint16_t* biases = nullptr;  //   (simt: of any float dtype; it reads them through load_param)
  int words_per_row = 0;             // K * bits / 32
  int groups_per_row = 0;            // K / group_size
  int group_shift = 0;               // log2(group_size)
  // MLX's fp modes (mxfp4, mxfp8, nvfp4): uint8 scale codes instead of scales and biases (both null
  // then); fp_mode is QuantMode's value (0: affine). Only the routes whose supports_* accept an fp
  // mode read these (simt).
  const uint8_t* fp_scales = nullptr;
  int fp_mode = 0;
  // Optional: the same weight in the tile layout (docs/tile-layout.md), codes [E, NB, K/64, 512]
  // and params [E, NB, K/group_size, 64] uint32, params in the call's dtype; read by the wgmma
  // expert kernels (both builds) instead of w, scales and biases.
  const uint32_t* tiled_codes = nullptr;
  const uint32_t* tiled_params = nullptr;
};

}  // namespace expertqmm::cuda::device

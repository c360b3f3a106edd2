// MLX's affine quantization table (include/expertqmm/quant.h): the bits and group sizes it takes.
// In src/core, beside the checkpoint reader that checks them, so that the reader (and its fuzzer)
// needs none of the quantizer.
#include "expertqmm/quant.h"

namespace expertqmm {

bool valid_bits(int bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8; }

bool valid_group_size(int group_size) { return group_size == 32 || group_size == 64 || group_size == 128; }

}  // namespace expertqmm

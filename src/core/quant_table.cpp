// MLX's quantization table (include/expertqmm/quant.h): the modes, and the bits and group sizes each
// takes. In src/core, beside the checkpoint reader that checks them, so that the reader (and its
// fuzzer) needs none of the quantizer.
#include "expertqmm/quant.h"

namespace expertqmm {

namespace {
struct ModeRow {
  QuantMode mode;
  const char* name;  // MLX's mode string (mx.quantize, config.json "mode")
  int bits;          // the only bits of an fp mode; affine: MLX's default
  int group_size;    // likewise
};
constexpr ModeRow kModes[] = {
    {QuantMode::affine, "affine", 4, 64},
    {QuantMode::mxfp4, "mxfp4", 4, 32},
    {QuantMode::mxfp8, "mxfp8", 8, 32},
    {QuantMode::nvfp4, "nvfp4", 4, 16},
};
const ModeRow& row_of(QuantMode mode) {
  for (const ModeRow& r : kModes)
    if (r.mode == mode) return r;
  return kModes[0];
}
}  // namespace

bool valid_bits(int bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8; }

bool valid_group_size(int group_size) { return group_size == 32 || group_size == 64 || group_size == 128; }

const char* quant_mode_name(QuantMode mode) {
  for (const ModeRow& r : kModes)
    if (r.mode == mode) return r.name;
  return "unknown";
}

bool parse_quant_mode(const std::string& name, QuantMode* mode) {
  for (const ModeRow& r : kModes)
    if (name == r.name) {
      *mode = r.mode;
      return true;
    }
  return false;
}

int quant_mode_bits(QuantMode mode) { return row_of(mode).bits; }
int quant_mode_group_size(QuantMode mode) { return row_of(mode).group_size; }

QuantSpec default_quant_spec(QuantMode mode) {
  return QuantSpec(quant_mode_bits(mode), quant_mode_group_size(mode), Rounding::cpu, mode);
}

bool valid_quant_params(QuantMode mode, int bits, int group_size) {
  if (mode == QuantMode::affine) return valid_bits(bits) && valid_group_size(group_size);
  const ModeRow& r = row_of(mode);
  return r.mode == mode && bits == r.bits && group_size == r.group_size;
}

}  // namespace expertqmm

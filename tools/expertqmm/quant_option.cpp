// --quant: the experts' MLX quantization mode for the synthetic presets (presets.h).
#include "presets.h"

namespace expertqmm::cli {

Preset with_quant_option(const Preset& p, const Args& args) {
  const std::string name = args.get_choice("quant", "affine", {"affine", "mxfp4", "mxfp8", "nvfp4"});
  Preset out = p;
  parse_quant_mode(name, &out.mode);
  if (out.mode != QuantMode::affine) {
    out.bits = quant_mode_bits(out.mode);
    out.group_size = quant_mode_group_size(out.mode);
  }
  return out;
}

}  // namespace expertqmm::cli

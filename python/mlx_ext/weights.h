// The expertqmm weight structs (moe.h) over a primitive's input views, read in the order the
// specs of primitives.h lay the arrays out.
#pragma once
#include <vector>

#include "primitives.h"

namespace expertqmm::mlx_ext {

// Reads views in order from `at`, advancing it.
struct ViewCursor {
  const std::vector<Tensor>& views;
  size_t at = 0;
  const Tensor& next();
};

SwitchGLUWeights experts_weights(ViewCursor& in, const ExpertsSpec& spec);
RouterWeights router_weights(ViewCursor& in, const RouterSpec& spec);

// The dtype each op returns (expertqmm's promotion), for the output array made at graph build time.
DType experts_output_dtype(DType x, const std::vector<mx::array>& experts, const ExpertsSpec& spec);

}  // namespace expertqmm::mlx_ext

// The offline shuffle of the 4-bit codes (cutlass::reorder_tensor with example 69's layout atom) and
// the headers' version.
#include <string>

#include "cutlass/version.h"
#include "cutlass_types.cuh"
#include "peer_gemm.h"

namespace expertqmm::peer {

void reorder_codes(const void* src, void* dst, int n, int k) {
  using namespace cutlass_types;
  using Code = cutlass::uint4b_t;  // a permutation of nibbles: the same for signed codes
  const auto shape = cute::make_shape(n, k, cute::Int<1>{});
  const auto layout_src = cute::make_layout(shape, cutlass::make_cute_packed_stride(StrideW{}, {n, k, 1}));
  const auto layout_dst = cute::tile_to_shape(LayoutAtomQuant{}, shape);
  cutlass::reorder_tensor(static_cast<const Code*>(src), layout_src, static_cast<Code*>(dst), layout_dst);
}

std::string cutlass_version() {
  return std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." + std::to_string(CUTLASS_PATCH);
}

}  // namespace expertqmm::peer

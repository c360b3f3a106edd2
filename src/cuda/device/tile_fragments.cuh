// The wgmma A fragments of one lane read from a ring stage that holds two 64-row blocks of the
// experts' tile layout (docs/tile-layout.md), for both wgmma expert kernels (the two-CTA kernel
// and the warp-specialized build).
#pragma once
#include <cstdint>

#include "core/tile_layout.h"
#include "cuda/device/dequant.cuh"

namespace expertqmm::cuda::device {

// Stage bytes: the two blocks' codes (2 x kTileWords uint32) at `codes`, their parameter words
// (2 x kTileRows uint32: scale | bias << 16, per row) at `params`. Lane (g, t) = (lane / 4, lane % 4)
// of the warp owning smem weight rows 16 * (m_lo / 16) .. + 15 (m_lo = 64 block + 16 slab + g): one
// 16-byte load of its four code words (word s: k16 step s), one 8-byte load of rows m_lo's and m_lo
// + 8's parameter words; register i of step s is pair i of biased_code_pairs (codes j and j + 4) with
// row m_lo's (i even) or m_lo + 8's (i odd) scale and bias: PackedDequant<T>::nibbles' bits on the
// MLX layout (SanitizeGpuExpertTiles.TileLayoutGivesTheMlxLayoutsBits).
template <class T>
__device__ __forceinline__ void tile_layout_fragments(const unsigned char* codes, const unsigned char* params,
                                                      int m_lo, int lane, uint32_t (&af)[4][4]) {
  constexpr int kCodeBlockBytes = detail::kTileWords * 4, kParamBlockBytes = detail::kTileRows * 4;
  const int block = m_lo >> 6, slab = (m_lo >> 4) & 3, g = m_lo & 7;
  const uint4 code = *reinterpret_cast<const uint4*>(codes + block * kCodeBlockBytes + (slab * 32 + lane) * 16);
  const uint2 prm = *reinterpret_cast<const uint2*>(params + block * kParamBlockBytes + (slab * 8 + g) * 8);
  const uint32_t s_lo = broadcast_half(prm.x, false), b_lo = broadcast_half(prm.x, true);
  const uint32_t s_hi = broadcast_half(prm.y, false), b_hi = broadcast_half(prm.y, true);
  const uint32_t words[4] = {code.x, code.y, code.z, code.w};
#pragma unroll
  for (int k16 = 0; k16 < 4; ++k16) {
    uint32_t pair[4];
    biased_code_pairs<T>(words[k16], pair);
    af[k16][0] = dequant_biased_pair<T>(pair[0], s_lo, b_lo);
    af[k16][1] = dequant_biased_pair<T>(pair[1], s_hi, b_hi);
    af[k16][2] = dequant_biased_pair<T>(pair[2], s_lo, b_lo);
    af[k16][3] = dequant_biased_pair<T>(pair[3], s_hi, b_hi);
  }
}

}  // namespace expertqmm::cuda::device

// The tile layout's geometry and index rules (docs/tile-layout.md), shared by both backends'
// tile_weight / untile_weight (src/cpu/tile_layout.cpp, src/cuda/tile_layout.cu) and the wgmma
// kernels that read the layout. Host and device.
#pragma once
#include <cstdint>

#include "core/float16.h"  // EXPERTQMM_HD
#include "expertqmm/tensor.h"

namespace expertqmm::detail {

constexpr int kTileRows = 64;    // weight rows per block: one consumer warpgroup's wgmma M
constexpr int kTileK = 64;       // k per tile: one stage of the kernels' ring
constexpr int kTileWords = 512;  // uint32 codes per (block, k tile): 64 x 64 x 4 bits

// Sizes and word offsets of one weight's layout, E experts of N rows and K columns.
struct TileGeometry {
  int64_t E = 0, N = 0, K = 0;
  int group_size = 64;
  int64_t row_blocks = 0, k_tiles = 0, groups = 0;
  EXPERTQMM_HD int64_t code_words() const { return E * row_blocks * k_tiles * kTileWords; }
  EXPERTQMM_HD int64_t param_words() const { return E * row_blocks * groups * kTileRows; }
  // The layout's tensors (uint32): codes [E, NB, K/64, 512], params [E, NB, K/group_size, 64]. Host.
  Shape codes_shape() const { return {E, row_blocks, k_tiles, kTileWords}; }
  Shape params_shape() const { return {E, row_blocks, groups, kTileRows}; }
  // First word of the codes of (expert e, block b, k tile kt) / of the params of (e, b, group).
  EXPERTQMM_HD int64_t code_block(int64_t e, int64_t b, int64_t kt) const {
    return ((e * row_blocks + b) * k_tiles + kt) * kTileWords;
  }
  EXPERTQMM_HD int64_t param_block(int64_t e, int64_t b, int64_t grp) const {
    return ((e * row_blocks + b) * groups + grp) * kTileRows;
  }
};
inline TileGeometry tile_geometry(int64_t E, int64_t N, int64_t K, int group_size) {
  TileGeometry g;
  g.E = E;
  g.N = N;
  g.K = K;
  g.group_size = group_size;
  g.row_blocks = (N + kTileRows - 1) / kTileRows;
  g.k_tiles = K / kTileK;
  g.groups = K / group_size;
  return g;
}

// Where code (r, kk) of a block's k tile lives: bits [shift, shift + 4) of word `word` (0..511).
// Lane (g, t) of the block's warp `slab` (rows 16 slab .. 16 slab + 15) owns words 4 (32 slab + 4g
// + t) + k16, k16 = 0..3; in word k16, register pair i = 0..3 of wgmma's A fragment (rows g, g + 8,
// g, g + 8 of the slab; k 2t, 2t, 2t + 8, 2t + 8 of the k16 step) sits at bits 4i (the lower k)
// and 16 + 4i (k + 1), so (word >> 4i) & 0x000F000F is the pair.
struct TileCodeSlot {
  int word = 0, shift = 0;
};
EXPERTQMM_HD TileCodeSlot tile_code_slot(int r, int kk) {
  const int slab = r / 16, rr = r % 16, g = rr % 8, row_hi = rr / 8;
  const int k16 = kk / 16, kin = kk % 16, k_hi = kin / 8, t = (kin % 8) / 2, elem = kin % 2;
  const int pair = row_hi + 2 * k_hi;
  return {(slab * 32 + g * 4 + t) * 4 + k16, 4 * pair + 16 * elem};
}

// Where row r's (scale, bias) word of a group block lives (0..63): lane (g, t) of warp `slab` reads
// words 2 (8 slab + g) and + 1 (its rows g and g + 8) as one 8-byte load.
EXPERTQMM_HD int tile_param_slot(int r) {
  const int slab = r / 16, rr = r % 16;
  return (slab * 8 + rr % 8) * 2 + rr / 8;
}

}  // namespace expertqmm::detail

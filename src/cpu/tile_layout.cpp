// The CPU backend's tile_weight / untile_weight (docs/tile-layout.md): the layout's index rules
// (core/tile_layout.h) applied on host memory. Inputs arrive validated and contiguous (src/ops).
#include <cstring>
#include <vector>

#include "core/tile_layout.h"
#include "cpu/cpu_backend.h"

namespace expertqmm::cpu {

namespace {

using detail::kTileK;
using detail::kTileRows;

// The code slot of every (row in block, k in tile), computed once: [64][64].
const std::vector<detail::TileCodeSlot>& code_slots() {
  static const std::vector<detail::TileCodeSlot> slots = [] {
    std::vector<detail::TileCodeSlot> s(kTileRows * kTileK);
    for (int r = 0; r < kTileRows; ++r)
      for (int kk = 0; kk < kTileK; ++kk) s[r * kTileK + kk] = detail::tile_code_slot(r, kk);
    return s;
  }();
  return slots;
}

Tensor zeros_u32(const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::u32);
  std::memset(t.data(), 0, t.nbytes());
  return t;
}

}  // namespace

TiledWeight tile_weight(const QuantizedWeight& q) {
  const int64_t N = q.w.size(-2), K = q.w.size(-1) * 8, E = q.w.numel() / (N * (K / 8));
  const detail::TileGeometry g = detail::tile_geometry(E, N, K, q.group_size);
  const uint32_t* w = q.w.data_as<const uint32_t>();
  const uint16_t* sc = q.scales.data_as<const uint16_t>();
  const uint16_t* bi = q.biases.data_as<const uint16_t>();
  TiledWeight t;
  t.codes = zeros_u32(g.codes_shape());  // rows past N stay zero
  t.params = zeros_u32(g.params_shape());
  uint32_t* codes = t.codes.data_as<uint32_t>();
  uint32_t* params = t.params.data_as<uint32_t>();
  const auto& slots = code_slots();
  const int64_t words_per_row = K / 8;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t b = n / kTileRows;
      const int r = static_cast<int>(n % kTileRows);
      const uint32_t* row = w + (e * N + n) * words_per_row;
      for (int64_t kt = 0; kt < g.k_tiles; ++kt) {
        uint32_t* block = codes + g.code_block(e, b, kt);
        for (int kw = 0; kw < kTileK / 8; ++kw) {  // the row's 8 MLX words of this k tile
          const uint32_t word = row[kt * (kTileK / 8) + kw];
          for (int i = 0; i < 8; ++i) {
            const detail::TileCodeSlot s = slots[r * kTileK + kw * 8 + i];
            block[s.word] |= ((word >> (4 * i)) & 0xFu) << s.shift;
          }
        }
      }
      for (int64_t grp = 0; grp < g.groups; ++grp) {
        const int64_t src = (e * N + n) * g.groups + grp;
        params[g.param_block(e, b, grp) + detail::tile_param_slot(r)] =
            static_cast<uint32_t>(sc[src]) | (static_cast<uint32_t>(bi[src]) << 16);
      }
    }
  return t;
}

QuantizedWeight untile_weight(const TiledWeight& t, int64_t N) {
  const int64_t E = t.codes.size(0), K = t.codes.size(2) * kTileK;
  const detail::TileGeometry g = detail::tile_geometry(E, N, K, t.group_size);
  const uint32_t* codes = t.codes.data_as<const uint32_t>();
  const uint32_t* params = t.params.data_as<const uint32_t>();
  const int64_t words_per_row = K / 8;
  QuantizedWeight q;
  q.w = zeros_u32({E, N, words_per_row});
  q.scales = Tensor::empty({E, N, g.groups}, t.param_dtype);
  q.biases = Tensor::empty({E, N, g.groups}, t.param_dtype);
  uint32_t* w = q.w.data_as<uint32_t>();
  uint16_t* sc = q.scales.data_as<uint16_t>();
  uint16_t* bi = q.biases.data_as<uint16_t>();
  const auto& slots = code_slots();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t b = n / kTileRows;
      const int r = static_cast<int>(n % kTileRows);
      uint32_t* row = w + (e * N + n) * words_per_row;
      for (int64_t kt = 0; kt < g.k_tiles; ++kt) {
        const uint32_t* block = codes + g.code_block(e, b, kt);
        for (int kk = 0; kk < kTileK; ++kk) {
          const detail::TileCodeSlot s = slots[r * kTileK + kk];
          const int64_t k = kt * kTileK + kk;
          row[k / 8] |= ((block[s.word] >> s.shift) & 0xFu) << (4 * (k % 8));
        }
      }
      for (int64_t grp = 0; grp < g.groups; ++grp) {
        const uint32_t word = params[g.param_block(e, b, grp) + detail::tile_param_slot(r)];
        const int64_t dst = (e * N + n) * g.groups + grp;
        sc[dst] = static_cast<uint16_t>(word & 0xFFFFu);
        bi[dst] = static_cast<uint16_t>(word >> 16);
      }
    }
  return q;
}

}  // namespace expertqmm::cpu

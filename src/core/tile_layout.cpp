// The tile layout of an affine 4-bit weight (include/expertqmm/quant.h TiledWeight,
// docs/tile-layout.md): tile_weight, untile_weight and the rule they share (tileable). Both run on
// host bytes; a device weight is copied down, re-laid and copied back, once at load.
#include <cstring>
#include <vector>

#include "core/tile_layout.h"
#include "expertqmm/error.h"
#include "expertqmm/quant.h"

namespace expertqmm {

namespace detail {

TileGeometry tile_geometry(int64_t E, int64_t N, int64_t K, int group_size) {
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

TileCodeSlot tile_code_slot(int r, int kk) {
  const int slab = r / 16, rr = r % 16, g = rr % 8, row_hi = rr / 8;
  const int k16 = kk / 16, kin = kk % 16, k_hi = kin / 8, t = (kin % 8) / 2, elem = kin % 2;
  const int pair = row_hi + 2 * k_hi;
  return {(slab * 32 + g * 4 + t) * 4 + k16, 4 * pair + 16 * elem};
}

int tile_param_slot(int r) {
  const int slab = r / 16, rr = r % 16;
  return (slab * 8 + rr % 8) * 2 + rr / 8;
}

}  // namespace detail

namespace {

using detail::kTileK;
using detail::kTileRows;
using detail::kTileWords;

void expect(bool ok, std::string* why, const std::string& reason) {
  if (!ok && why && why->empty()) *why = reason;
}

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

Tensor on_device(const std::vector<uint8_t>& host, const Shape& shape, DType dtype, Device device) {
  return Tensor::from_host(host.data(), shape, dtype, device);
}

}  // namespace

bool tileable(const QuantizedWeight& q, std::string* why) {
  std::string local;
  std::string* w = why ? why : &local;
  w->clear();
  expect(q.defined(), w, "the weight is undefined");
  if (!w->empty()) return false;
  expect(q.mode == QuantMode::affine, w, detail::cat("mode ", quant_mode_name(q.mode), " (affine only)"));
  expect(q.bits == 4, w, detail::cat("bits ", q.bits, " (4 only)"));
  expect(q.group_size == 64 || q.group_size == 128, w,
         detail::cat("group_size ", q.group_size, " (64 or 128)"));
  expect(q.w.dtype() == DType::u32 && q.w.ndim() >= 2, w, detail::cat("w ", q.w.describe(), " (uint32, rank >= 2)"));
  expect(q.scales.defined() && q.biases.defined() && q.scales.dtype() == q.biases.dtype() &&
             (q.scales.dtype() == DType::bf16 || q.scales.dtype() == DType::f16),
         w, "scales and biases must both be bf16 or both f16");
  if (!w->empty()) return false;
  const int64_t K = q.w.size(-1) * 8;
  expect(K % kTileK == 0, w, detail::cat("K ", K, " (a multiple of 64)"));
  expect(q.scales.ndim() == q.w.ndim() && q.scales.size(-2) == q.w.size(-2) && q.scales.size(-1) * q.group_size == K &&
             q.biases.shape() == q.scales.shape(),
         w, detail::cat("scales ", q.scales.describe(), " do not match w ", q.w.describe()));
  return w->empty();
}

TiledWeight tile_weight(const QuantizedWeight& q) {
  std::string why;
  EXPERTQMM_CHECK(tileable(q, &why), "tile_weight", why);
  const int64_t N = q.w.size(-2), K = q.w.size(-1) * 8, E = q.w.numel() / (N * (K / 8));
  const detail::TileGeometry g = detail::tile_geometry(E, N, K, q.group_size);
  const std::vector<uint8_t> w_bytes = q.w.to_host_bytes();
  const std::vector<uint8_t> s_bytes = q.scales.to_host_bytes();
  const std::vector<uint8_t> b_bytes = q.biases.to_host_bytes();
  const uint32_t* w = reinterpret_cast<const uint32_t*>(w_bytes.data());
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(s_bytes.data());
  const uint16_t* bi = reinterpret_cast<const uint16_t*>(b_bytes.data());

  std::vector<uint8_t> codes_bytes(static_cast<size_t>(g.code_words()) * 4, 0);
  std::vector<uint8_t> params_bytes(static_cast<size_t>(g.param_words()) * 4, 0);
  uint32_t* codes = reinterpret_cast<uint32_t*>(codes_bytes.data());
  uint32_t* params = reinterpret_cast<uint32_t*>(params_bytes.data());
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
  TiledWeight t;
  const Device dev = q.w.device();
  t.codes = on_device(codes_bytes, {E, g.row_blocks, g.k_tiles, kTileWords}, DType::u32, dev);
  t.params = on_device(params_bytes, {E, g.row_blocks, g.groups, kTileRows}, DType::u32, dev);
  t.group_size = q.group_size;
  t.param_dtype = q.scales.dtype();
  return t;
}

QuantizedWeight untile_weight(const TiledWeight& t, int64_t N) {
  const int group_size = t.group_size;
  const DType param_dtype = t.param_dtype;
  EXPERTQMM_CHECK(t.codes.defined() && t.params.defined() && t.codes.ndim() == 4 && t.params.ndim() == 4 &&
                      t.codes.dtype() == DType::u32 && t.params.dtype() == DType::u32 &&
                      t.codes.size(3) == kTileWords && t.params.size(3) == kTileRows,
                  "untile_weight", "codes ", t.codes.describe(), " and params ", t.params.describe(),
                  " are not a tile layout");
  EXPERTQMM_CHECK(group_size == 64 || group_size == 128, "untile_weight", "group_size ", group_size, " (64 or 128)");
  EXPERTQMM_CHECK(param_dtype == DType::bf16 || param_dtype == DType::f16, "untile_weight", "param dtype ",
                  dtype_name(param_dtype), " (bf16 or f16)");
  const int64_t E = t.codes.size(0), K = t.codes.size(2) * kTileK;
  const detail::TileGeometry g = detail::tile_geometry(E, N, K, group_size);
  EXPERTQMM_CHECK(N > 0 && t.codes.size(1) == g.row_blocks && t.params.size(0) == E && t.params.size(1) == g.row_blocks &&
                      t.params.size(2) == g.groups,
                  "untile_weight", "codes ", t.codes.describe(), " and params ", t.params.describe(),
                  " do not hold N=", N, " group_size=", group_size);
  const std::vector<uint8_t> codes_bytes = t.codes.to_host_bytes();
  const std::vector<uint8_t> params_bytes = t.params.to_host_bytes();
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(codes_bytes.data());
  const uint32_t* params = reinterpret_cast<const uint32_t*>(params_bytes.data());
  const int64_t words_per_row = K / 8;
  std::vector<uint8_t> w_bytes(static_cast<size_t>(E * N * words_per_row) * 4, 0);
  std::vector<uint8_t> s_bytes(static_cast<size_t>(E * N * g.groups) * 2), b_bytes(s_bytes.size());
  uint32_t* w = reinterpret_cast<uint32_t*>(w_bytes.data());
  uint16_t* sc = reinterpret_cast<uint16_t*>(s_bytes.data());
  uint16_t* bi = reinterpret_cast<uint16_t*>(b_bytes.data());
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
  QuantizedWeight q;
  const Device dev = t.codes.device();
  q.w = on_device(w_bytes, {E, N, words_per_row}, DType::u32, dev);
  q.scales = on_device(s_bytes, {E, N, g.groups}, param_dtype, dev);
  q.biases = on_device(b_bytes, {E, N, g.groups}, param_dtype, dev);
  q.bits = 4;
  q.group_size = group_size;
  return q;
}

}  // namespace expertqmm

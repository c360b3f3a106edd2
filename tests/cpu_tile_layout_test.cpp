// The tile layout of an affine 4-bit weight (quant.h TiledWeight, docs/tile-layout.md): every code,
// scale and bias where the wgmma kernels read it, checked against the MLX tensors from the fragment
// definition (not from the layout's own index rules); the exact round trip; the refusals.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "expertqmm/error.h"
#include "expertqmm/quant.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

std::vector<uint32_t> words(const Tensor& t) {
  const std::vector<uint8_t> b = t.to_host_bytes();
  std::vector<uint32_t> out(b.size() / 4);
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}
std::vector<uint16_t> halves(const Tensor& t) {
  const std::vector<uint8_t> b = t.to_host_bytes();
  std::vector<uint16_t> out(b.size() / 2);
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}

struct LayoutCase {
  int64_t E, N, K;
  int group_size;
  DType dtype;
};
std::string name_of(const LayoutCase& c) {
  return detail::cat("E", c.E, "_N", c.N, "_K", c.K, "_g", c.group_size, "_", dtype_name(c.dtype));
}

QuantizedWeight weight_of(const LayoutCase& c) {
  return quantize(test::random_tensor({c.E, c.N, c.K}, c.dtype, 0.05f), QuantSpec{4, c.group_size});
}

class TileLayout : public ::testing::TestWithParam<LayoutCase> {};

// Lane (g, t) of warp `slab` in a 64-row block holds, for each k16 step of a 64-wide k tile, one
// word whose register pair i (bits 4i: the lower k, bits 16 + 4i: k + 1) is wgmma's A fragment
// pair i: rows g, g + 8, g, g + 8 of the slab and k 2t, 2t, 2t + 8, 2t + 8 of the step.
TEST_P(TileLayout, EveryCodeSitsInItsLanesFragment) {
  const LayoutCase c = GetParam();
  SCOPED_TRACE(test::seed_note());
  const QuantizedWeight q = weight_of(c);
  const TiledWeight t = tile_weight(q);
  const int64_t NB = (c.N + 63) / 64, KT = c.K / 64, G = c.K / c.group_size;
  ASSERT_EQ(t.codes.shape(), (Shape{c.E, NB, KT, 512}));
  ASSERT_EQ(t.params.shape(), (Shape{c.E, NB, G, 64}));
  const std::vector<uint32_t> w = words(q.w), codes = words(t.codes), params = words(t.params);
  const std::vector<uint16_t> s = halves(q.scales), b = halves(q.biases);
  auto mlx_code = [&](int64_t e, int64_t n, int64_t k) -> uint32_t {
    if (n >= c.N) return 0;  // rows past N are zero
    return (w[(e * c.N + n) * (c.K / 8) + k / 8] >> (4 * (k % 8))) & 0xFu;
  };
  int mismatches = 0;
  for (int64_t e = 0; e < c.E; ++e)
    for (int64_t blk = 0; blk < NB; ++blk) {
      for (int64_t kt = 0; kt < KT; ++kt)
        for (int slab = 0; slab < 4; ++slab)
          for (int g = 0; g < 8; ++g)
            for (int tq = 0; tq < 4; ++tq)
              for (int k16 = 0; k16 < 4; ++k16) {
                const uint32_t word = codes[(((e * NB + blk) * KT + kt) * 512) + (slab * 32 + g * 4 + tq) * 4 + k16];
                for (int pair = 0; pair < 4; ++pair)
                  for (int elem = 0; elem < 2; ++elem) {
                    const int64_t n = blk * 64 + slab * 16 + g + 8 * (pair & 1);
                    const int64_t k = kt * 64 + k16 * 16 + 2 * tq + 8 * (pair >> 1) + elem;
                    const uint32_t got = (word >> (4 * pair + 16 * elem)) & 0xFu;
                    if (got != mlx_code(e, n, k) && ++mismatches <= 5)
                      ADD_FAILURE() << "code e=" << e << " n=" << n << " k=" << k << ": " << got << " vs MLX "
                                    << mlx_code(e, n, k);
                  }
              }
      for (int64_t grp = 0; grp < G; ++grp)
        for (int slab = 0; slab < 4; ++slab)
          for (int g = 0; g < 8; ++g)
            for (int h = 0; h < 2; ++h) {
              const int64_t n = blk * 64 + slab * 16 + g + 8 * h;
              const uint32_t word = params[((e * NB + blk) * G + grp) * 64 + (slab * 8 + g) * 2 + h];
              const uint32_t want = n < c.N ? static_cast<uint32_t>(s[(e * c.N + n) * G + grp]) |
                                                  (static_cast<uint32_t>(b[(e * c.N + n) * G + grp]) << 16)
                                            : 0u;
              if (word != want && ++mismatches <= 5)
                ADD_FAILURE() << "params e=" << e << " n=" << n << " group " << grp << ": " << std::hex << word
                              << " vs " << want;
            }
    }
  EXPECT_EQ(mismatches, 0);
}

TEST_P(TileLayout, RoundTripIsExact) {
  const LayoutCase c = GetParam();
  SCOPED_TRACE(test::seed_note());
  const QuantizedWeight q = weight_of(c);
  const TiledWeight t = tile_weight(q);
  EXPECT_EQ(t.rows, c.N);
  const QuantizedWeight back = untile_weight(t);
  EXPECT_EQ(back.w.shape(), q.w.shape());
  EXPECT_EQ(back.scales.shape(), q.scales.shape());
  EXPECT_EQ(back.scales.dtype(), c.dtype);
  EXPECT_EQ(back.bits, 4);
  EXPECT_EQ(back.group_size, c.group_size);
  EXPECT_EQ(words(back.w), words(q.w));
  EXPECT_EQ(halves(back.scales), halves(q.scales));
  EXPECT_EQ(halves(back.biases), halves(q.biases));
}

INSTANTIATE_TEST_SUITE_P(Shapes, TileLayout,
                         ::testing::Values(LayoutCase{2, 64, 64, 64, DType::bf16}, LayoutCase{3, 128, 192, 64, DType::bf16},
                                           LayoutCase{2, 70, 128, 128, DType::bf16}, LayoutCase{1, 200, 256, 64, DType::f16},
                                           LayoutCase{2, 96, 256, 128, DType::f16}),
                         [](const auto& info) { return name_of(info.param); });

// Leading dims beyond one are the experts, flattened.
TEST(TileLayoutShapes, LeadingDimsAreExperts) {
  const QuantizedWeight q = quantize(test::random_tensor({2, 3, 64, 128}, DType::bf16, 0.05f), QuantSpec{4, 64});
  const TiledWeight t = tile_weight(q);
  EXPECT_EQ(t.codes.shape(), (Shape{6, 1, 2, 512}));
  QuantizedWeight same = q;
  same.w = q.w.reshape({6, 64, 16});
  same.scales = q.scales.reshape({6, 64, 2});
  same.biases = q.biases.reshape({6, 64, 2});
  EXPECT_EQ(words(tile_weight(same).codes), words(t.codes));
  EXPECT_EQ(words(tile_weight(same).params), words(t.params));
}

TEST(TileLayoutShapes, RefusesWhatTheKernelsCannotRead) {
  std::string why;
  EXPECT_FALSE(tileable(QuantizedWeight{}, &why));
  EXPECT_NE(why.find("undefined"), std::string::npos) << why;
  const Tensor w = test::random_tensor({2, 64, 128}, DType::bf16, 0.05f);
  EXPECT_FALSE(tileable(quantize(w, QuantSpec{8, 64}), &why));
  EXPECT_NE(why.find("bits 8"), std::string::npos) << why;
  EXPECT_FALSE(tileable(quantize(w, QuantSpec{4, 32}), &why));
  EXPECT_NE(why.find("group_size 32"), std::string::npos) << why;
  EXPECT_FALSE(tileable(quantize(w, default_quant_spec(QuantMode::mxfp4)), &why));
  EXPECT_NE(why.find("mxfp4"), std::string::npos) << why;
  EXPECT_FALSE(tileable(quantize(test::random_tensor({2, 64, 128}, DType::f32, 0.05f), QuantSpec{4, 64}), &why));
  EXPECT_NE(why.find("bf16"), std::string::npos) << why;
  EXPECT_FALSE(tileable(quantize(test::random_tensor({2, 0, 128}, DType::bf16, 0.05f), QuantSpec{4, 64}), &why));
  EXPECT_NE(why.find("empty"), std::string::npos) << why;
  QuantizedWeight short_params = quantize(w, QuantSpec{4, 64});
  short_params.scales = quantize(test::random_tensor({1, 64, 128}, DType::bf16, 0.05f), QuantSpec{4, 64}).scales;
  EXPECT_FALSE(tileable(short_params, &why));  // scales for one expert of two
  EXPECT_NE(why.find("do not match"), std::string::npos) << why;
  EXPECT_TRUE(tileable(quantize(w, QuantSpec{4, 64}), &why)) << why;
  EXPECT_TRUE(why.empty());
  test::expect_error([&] { tile_weight(quantize(w, QuantSpec{3, 64})); }, "tile_weight", "bits 3");
}

TEST(TileLayoutShapes, UntileRefusesALayoutThatDoesNotMatch) {
  const TiledWeight t = tile_weight(quantize(test::random_tensor({2, 70, 128}, DType::bf16, 0.05f), QuantSpec{4, 64}));
  EXPECT_EQ(t.group_size, 64);
  EXPECT_EQ(t.param_dtype, DType::bf16);
  EXPECT_EQ(t.rows, 70);
  TiledWeight other = t;
  other.rows = 130;  // a third 64-row block
  test::expect_error([&] { untile_weight(other); }, "untile_weight", "N=130");
  other.rows = 0;
  test::expect_error([&] { untile_weight(other); }, "untile_weight", "N=0");
  other = t;
  other.group_size = 128;  // params for two groups per row, not one
  test::expect_error([&] { untile_weight(other); }, "untile_weight", "group_size=128");
  other = t;
  other.param_dtype = DType::f32;
  test::expect_error([&] { untile_weight(other); }, "untile_weight", "float32");
  test::expect_error([&] { untile_weight(TiledWeight{}); }, "untile_weight", "not a tile layout");
  other = t;
  other.rows = 65;  // the first 65 rows: the same two blocks
  EXPECT_EQ(untile_weight(other).w.size(1), 65);
}

}  // namespace

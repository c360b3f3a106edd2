// quantize / dequantize on the CPU: cases derived by hand from the spec (mlx-semantics.md 1.2-1.4),
// both rounding flavours, round-trip bounds and bad input. Bit-exactness against MLX itself is in
// cpu_golden_quant_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/float16.h"
#include "expertqmm/error.h"
#include "expertqmm/quant.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

constexpr int kAllBits[] = {2, 3, 4, 5, 6, 8};
constexpr int kAllGroups[] = {32, 64, 128};

Tensor f32(const std::vector<float>& v, const Shape& shape) { return test::from_float(v, shape, DType::f32); }
Tensor f32_row(const std::vector<float>& v) { return f32(v, {1, static_cast<int64_t>(v.size())}); }

std::vector<uint32_t> words(const Tensor& t) {
  std::vector<uint8_t> b = t.to_host_bytes();
  std::vector<uint32_t> out(t.numel());
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}

// A group of `size` copies of `fill` with the given leading values.
std::vector<float> group_of(std::vector<float> lead, int size, float fill) {
  lead.resize(size, fill);
  return lead;
}

QuantizedWeight quantize_with(const Tensor& w, int bits, int gs, Rounding r) {
  return quantize(w, QuantSpec{bits, gs, r});
}

// dequantize of hand-packed words with scale 1 and bias 0: the values are the codes themselves.
std::vector<float> unpack(const std::vector<uint32_t>& w, int bits, int gs) {
  const int64_t k = static_cast<int64_t>(w.size()) * 32 / bits;
  Tensor wt = Tensor::from_host(w.data(), {1, static_cast<int64_t>(w.size())}, DType::u32);
  Tensor ones = f32(std::vector<float>(k / gs, 1.0f), {1, k / gs});
  Tensor zeros = f32(std::vector<float>(k / gs, 0.0f), {1, k / gs});
  return test::to_float(dequantize(wt, ones, zeros, gs, bits));
}

// ---------------------------------------------------------------------------------------------
// Spec 1.3 worked example: 4-bit, min -0.3, max 0.2. |min| > |max| so scale0 = 0.5/15 is kept
// positive, q0 = rint(-0.3 / (0.5/15)) = -9, scale = -0.3 / -9, bias = -0.3; -0.3 -> code 0,
// 0.2 -> 15, 0.0 -> 9. Codes LSB first: word 0 = 0x999999F0, the other words 0x99999999.
TEST(Quantize, WorkedExampleOfTheSpec) {
  for (Rounding r : {Rounding::cpu, Rounding::gpu}) {
    QuantizedWeight q = quantize_with(f32_row(group_of({-0.3f, 0.2f}, 32, 0.0f)), 4, 32, r);
    EXPECT_EQ(words(q.w), (std::vector<uint32_t>{0x999999F0u, 0x99999999u, 0x99999999u, 0x99999999u}));
    EXPECT_EQ(test::to_float(q.scales)[0], -0.3f / -9.0f);
    EXPECT_EQ(test::to_float(q.biases)[0], -0.3f);
  }
}

// w_min = 0, w_max = 15/16: the larger-magnitude extreme is w_max, so the scale is NEGATIVE:
// scale = -1/16, bias = 15/16, code(w) = 15 - 16 w. Asking for codes 1..8 gives word 0x87654321.
TEST(Quantize, FourBitPackingAndNegativeScale) {
  std::vector<float> codes = {1, 2, 3, 4, 5, 6, 7, 8, 0, 15};
  std::vector<float> w;
  for (float c : codes) w.push_back((15 - c) / 16);
  QuantizedWeight q = quantize_with(f32_row(group_of(w, 32, 15.0f / 16)), 4, 32, Rounding::cpu);
  EXPECT_EQ(words(q.w), (std::vector<uint32_t>{0x87654321u, 0x000000F0u, 0u, 0u}));
  EXPECT_EQ(test::to_float(q.scales)[0], -0.0625f);
  EXPECT_EQ(test::to_float(q.biases)[0], 0.9375f);
  // Every value is exactly representable: the round trip is exact.
  EXPECT_EQ(test::to_float(dequantize(q)), group_of(w, 32, 15.0f / 16));
}

TEST(Dequantize, PowerOfTwoPacking) {
  // 4-bit: 0x87654321 holds 1..8, least significant nibble first.
  std::vector<float> v = unpack({0x87654321u, 0, 0, 0}, 4, 32);
  EXPECT_EQ(std::vector<float>(v.begin(), v.begin() + 9), (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 0}));
  // 8-bit: the same word holds the bytes 0x21, 0x43, 0x65, 0x87.
  v = unpack(std::vector<uint32_t>(8, 0x87654321u), 8, 32);
  EXPECT_EQ(std::vector<float>(v.begin(), v.begin() + 4), (std::vector<float>{0x21, 0x43, 0x65, 0x87}));
  // 2-bit: 0x39 = 0b00'11'10'01 -> 1, 2, 3, 0.
  v = unpack({0x39u, 0u}, 2, 32);
  EXPECT_EQ(std::vector<float>(v.begin(), v.begin() + 5), (std::vector<float>{1, 2, 3, 0, 0}));
}

// 3-bit codes 0..7 repeated: 8 codes fill 24 bits, P = 0xFAC688 (= sum c << 3c). Four copies of P
// make 96 bits: word0 = P | P << 24, word1 = P >> 8 | P << 16, word2 = P >> 16 | P << 8.
TEST(Quantize, ThreeBitPackingSpansWords) {
  const std::vector<uint32_t> expected = {0x88FAC688u, 0xC688FAC6u, 0xFAC688FAu};
  std::vector<float> codes, w;
  for (int i = 0; i < 32; ++i) codes.push_back(static_cast<float>(i % 8));
  // n = 7; w_min = 0 (code 7), w_max = 7/8 (code 0): scale = -1/8, code(w) = 7 - 8 w.
  for (float c : codes) w.push_back((7 - c) / 8);
  QuantizedWeight q = quantize_with(f32_row(w), 3, 32, Rounding::cpu);
  EXPECT_EQ(words(q.w), expected);
  EXPECT_EQ(unpack(expected, 3, 32), codes);
}

// One element straddling words 0 and 1 (bits 30.. of the row stream), every other code 0.
struct SpanCase {
  int bits, index;
  uint32_t word0, word1;
};
TEST(Quantize, OddBitWidthsStraddleWordBoundaries) {
  // 3-bit element 10: bits 30..32; 5-bit element 6: bits 30..34; 6-bit element 5: bits 30..35.
  // The code n (all ones) puts two bits at the top of word 0 and the rest at the bottom of word 1.
  for (SpanCase c : {SpanCase{3, 10, 0xC0000000u, 0x1u}, SpanCase{5, 6, 0xC0000000u, 0x7u},
                     SpanCase{6, 5, 0xC0000000u, 0xFu}}) {
    SCOPED_TRACE(c.bits);
    const float n = static_cast<float>((1 << c.bits) - 1);
    // code(w) = n - 16 w with w_min = 0 (code n) and w_max = n/16 (code 0).
    std::vector<float> w(32, n / 16);
    w[c.index] = 0.0f;
    QuantizedWeight q = quantize_with(f32_row(w), c.bits, 32, Rounding::cpu);
    std::vector<uint32_t> got = words(q.w);
    ASSERT_EQ(got.size(), static_cast<size_t>(c.bits));
    EXPECT_EQ(got[0], c.word0);
    EXPECT_EQ(got[1], c.word1);
    for (size_t i = 2; i < got.size(); ++i) EXPECT_EQ(got[i], 0u);
    std::vector<float> expect(32, 0.0f);
    expect[c.index] = n;
    std::vector<uint32_t> packed(c.bits, 0u);
    packed[0] = c.word0;
    packed[1] = c.word1;
    EXPECT_EQ(unpack(packed, c.bits, 32), expect);
  }
  // 5-bit 22 = 0b10110 at element 6: low bits 0b10 on top of word 0, 0b101 at the bottom of word 1.
  std::vector<uint32_t> packed(5, 0u);
  packed[0] = 0x80000000u;
  packed[1] = 0x5u;
  std::vector<float> expect(32, 0.0f);
  expect[6] = 22;
  EXPECT_EQ(unpack(packed, 5, 32), expect);
}

// All-zero group: w_min = w_max = 0, side false, scale = -eps, q0 = 0, bias 0, codes 0. Both flavours.
TEST(Quantize, AllZeroGroup) {
  for (DType t : {DType::bf16, DType::f16, DType::f32})
    for (Rounding r : {Rounding::cpu, Rounding::gpu}) {
      QuantizedWeight q = quantize_with(test::from_float(std::vector<float>(64, 0.0f), {1, 64}, t), 4, 64, r);
      for (uint32_t word : words(q.w)) EXPECT_EQ(word, 0u);
      EXPECT_EQ(test::to_float(q.scales)[0], test::to_float(test::from_float({-1e-7f}, {1}, t))[0]);
      EXPECT_EQ(test::to_float(q.biases)[0], 0.0f);
      for (float v : test::to_float(dequantize(q))) EXPECT_EQ(v, 0.0f);
    }
  // In fp16, -1e-7 is subnormal: 1e-7 / 2^-24 = 1.68 rounds to mantissa 2 -> 0x8002.
  QuantizedWeight q = quantize_with(test::from_float(std::vector<float>(32, 0.0f), {1, 32}, DType::f16), 2, 32,
                                    Rounding::cpu);
  EXPECT_EQ(q.scales.data_as<uint16_t>()[0], 0x8002u);
}

// Constant group c on the CPU: range 0 so scale = -eps; edge = c; q0 = rint(c / -eps) (-5e6 for
// 0.5, +7.5e6 for -0.75); scale = c / q0 ~ -1e-7; bias = c; every code 0; dequantizes to c exactly.
// On the GPU a negative constant has range [c, 0]: scale = |c|/15, q0 = -15, scale = c/-15, bias c.
TEST(Quantize, ConstantGroups) {
  {
    QuantizedWeight q = quantize_with(test::from_float(std::vector<float>(64, 0.5f), {1, 64}, DType::bf16), 4,
                                      64, Rounding::cpu);
    for (uint32_t word : words(q.w)) EXPECT_EQ(word, 0u);
    EXPECT_EQ(test::to_float(q.scales)[0], round_to_bf16(0.5f / -5000000.0f));
    EXPECT_EQ(test::to_float(q.biases)[0], 0.5f);
    for (float v : test::to_float(dequantize(q))) EXPECT_EQ(v, 0.5f);
  }
  const Tensor neg = test::from_float(std::vector<float>(64, -0.75f), {1, 64}, DType::bf16);
  QuantizedWeight cpu = quantize_with(neg, 4, 64, Rounding::cpu);
  QuantizedWeight gpu = quantize_with(neg, 4, 64, Rounding::gpu);
  EXPECT_EQ(test::to_float(cpu.scales)[0], round_to_bf16(-0.75f / 7500000.0f));
  EXPECT_EQ(test::to_float(gpu.scales)[0], round_to_bf16(0.75f / 15.0f));
  for (const QuantizedWeight* q : {&cpu, &gpu}) {
    for (uint32_t word : words(q->w)) EXPECT_EQ(word, 0u);
    EXPECT_EQ(test::to_float(q->biases)[0], -0.75f);
    for (float v : test::to_float(dequantize(*q))) EXPECT_EQ(v, -0.75f);
  }
}

// |w_min| == |w_max| = 15/32: the tie picks w_max as the edge, scale0 = 1/16 negated, q0 =
// rint(-7.5) = round(-7.5) = -8, scale = (15/32) / -8 = -0.05859375, bias = 15/32. The minimum
// then lands on (-15/16) / -0.05859375 = 16 and is clamped to 15.
TEST(Quantize, NegativeScaleAndClampAtTheFarExtreme) {
  for (Rounding r : {Rounding::cpu, Rounding::gpu}) {
    QuantizedWeight q = quantize_with(f32_row(group_of({-0.46875f, 0.46875f}, 32, 0.46875f)), 4, 32, r);
    EXPECT_EQ(test::to_float(q.scales)[0], -0.05859375f);
    EXPECT_EQ(test::to_float(q.biases)[0], 0.46875f);
    EXPECT_EQ(words(q.w)[0], 0x0000000Fu);
    EXPECT_EQ(test::to_float(dequantize(q))[0], 15 * -0.05859375f + 0.46875f);
  }
}

// All-negative group {-0.9375, -0.25, -0.5 ...}:
//   CPU: range [-0.9375, -0.25], scale0 = 0.6875/15, q0 = rint(-20.45) = -20, scale = 0.046875,
//        bias = -0.9375; codes 0, rint(14.67) = 15, rint(9.33) = 9 -> 0x999999F0.
//   GPU: w_max starts at 0 so the range is [-0.9375, 0]: scale0 = 1/16, q0 = -15, scale = 0.0625,
//        bias = -0.9375; codes 0, 11, 7 -> 0x777777B0.
TEST(Quantize, GpuFlavourOnAnAllNegativeGroup) {
  const Tensor w = f32_row(group_of({-0.9375f, -0.25f}, 32, -0.5f));
  QuantizedWeight cpu = quantize_with(w, 4, 32, Rounding::cpu);
  QuantizedWeight gpu = quantize_with(w, 4, 32, Rounding::gpu);
  EXPECT_EQ(test::to_float(cpu.scales)[0], 0.046875f);
  EXPECT_EQ(test::to_float(gpu.scales)[0], 0.0625f);
  EXPECT_EQ(test::to_float(cpu.biases)[0], -0.9375f);
  EXPECT_EQ(test::to_float(gpu.biases)[0], -0.9375f);
  EXPECT_EQ(words(cpu.w)[0], 0x999999F0u);
  EXPECT_EQ(words(gpu.w)[0], 0x777777B0u);
  // The GPU's codes reconstruct the group exactly; the CPU's are off by a fraction of a step.
  EXPECT_EQ(test::to_float(dequantize(gpu)), test::to_float(w));
}

// Exact .5 code ties: w_min = 0, w_max = 15/16 give scale -1/16 and bias 15/16 in both flavours,
// and w = 15/16 - (c + 0.5)/16 lands on c + 0.5 exactly:
//   element: 0 (w=0)  1 (w_max)  2 (2.5)  3 (0.5)  4 (4.5)  5 (3.5)
//   CPU rint:  15        0          2        0        4        4     -> 0x0044020F
//   GPU round: 15        0          3        1        5        4     -> 0x0045130F
TEST(Quantize, GpuFlavourOnHalfwayCodes) {
  const Tensor w = f32_row(group_of({0.0f, 0.9375f, 0.78125f, 0.90625f, 0.65625f, 0.71875f}, 32, 0.9375f));
  QuantizedWeight cpu = quantize_with(w, 4, 32, Rounding::cpu);
  QuantizedWeight gpu = quantize_with(w, 4, 32, Rounding::gpu);
  for (const QuantizedWeight* q : {&cpu, &gpu}) {
    EXPECT_EQ(test::to_float(q->scales)[0], -0.0625f);
    EXPECT_EQ(test::to_float(q->biases)[0], 0.9375f);
  }
  EXPECT_EQ(words(cpu.w)[0], 0x0044020Fu);
  EXPECT_EQ(words(gpu.w)[0], 0x0045130Fu);
}

// A tie in q0 itself: range [-0.53125, 0.40625] = 15/16 so scale0 = 1/16 exactly, edge = w_min and
// edge / scale0 = -8.5:
//   CPU: q0 = -8, scale = 0.53125/8 = 0.06640625; codes 0, rint(14.12) = 14, 0.0 -> 8 -> 0x888888E0
//   GPU: q0 = -9, scale = 0.53125/9; codes 0, round(15.88) = 16 clamped to 15, 0.0 -> 9 -> 0x999999F0
TEST(Quantize, GpuFlavourOnAHalfwayZeroPoint) {
  const Tensor w = f32_row(group_of({-0.53125f, 0.40625f}, 32, 0.0f));
  QuantizedWeight cpu = quantize_with(w, 4, 32, Rounding::cpu);
  QuantizedWeight gpu = quantize_with(w, 4, 32, Rounding::gpu);
  EXPECT_EQ(test::to_float(cpu.scales)[0], 0.06640625f);
  EXPECT_EQ(test::to_float(gpu.scales)[0], -0.53125f / -9.0f);
  EXPECT_EQ(test::to_float(cpu.biases)[0], -0.53125f);
  EXPECT_EQ(test::to_float(gpu.biases)[0], -0.53125f);
  EXPECT_EQ(words(cpu.w)[0], 0x888888E0u);
  EXPECT_EQ(words(gpu.w)[0], 0x999999F0u);
}

// On groups that are neither all-negative nor hit a .5 tie the two flavours agree bit for bit.
TEST(Quantize, FlavoursAgreeAwayFromTheirDifferences) {
  std::vector<float> v = test::to_float(test::random_tensor({16, 256}, DType::f32));
  for (size_t i = 0; i < v.size(); i += 64) v[i] = 1.0f;  // every group has a positive element
  const Tensor w = f32(v, {16, 256});
  for (int bits : kAllBits) {
    QuantizedWeight a = quantize_with(w, bits, 64, Rounding::cpu);
    QuantizedWeight b = quantize_with(w, bits, 64, Rounding::gpu);
    EXPECT_EQ(test::to_float(a.scales), test::to_float(b.scales)) << "bits=" << bits;
    // The codes agree except where (w - bias) / scale is an exact tie k + 0.5 (rint: to even; round:
    // away from zero). With 8-bit codes near 128 only 16 fraction bits are left, so random data meets
    // such a tie in about one run in 20: those elements (computed in fp32 as code_of does; f32 scales
    // and biases are stored unrounded) are the only ones left out.
    const std::vector<float> ca = test::to_float(dequantize(a.w, f32(std::vector<float>(a.scales.numel(), 1.0f), a.scales.shape()),
                                                            f32(std::vector<float>(a.scales.numel(), 0.0f), a.scales.shape()), 64, bits));
    const std::vector<float> cb = test::to_float(dequantize(b.w, f32(std::vector<float>(b.scales.numel(), 1.0f), b.scales.shape()),
                                                            f32(std::vector<float>(b.scales.numel(), 0.0f), b.scales.shape()), 64, bits));
    const std::vector<float> s = test::to_float(a.scales), bias = test::to_float(a.biases);
    int ties = 0, differ = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      const float x = (v[i] - bias[i / 64]) / s[i / 64];
      if (x - std::floor(x) == 0.5f) {
        ++ties;
        continue;
      }
      if (ca[i] != cb[i] && differ++ < 3)
        ADD_FAILURE() << "bits=" << bits << " element " << i << ": cpu code " << ca[i] << ", gpu code " << cb[i] << " "
                      << test::seed_note();
    }
    EXPECT_EQ(differ, 0) << "bits=" << bits << " (" << ties << " exact ties left out)";
  }
}

// Unit roundoff of the storage dtype.
float unit_roundoff(DType t) { return t == DType::bf16 ? 0x1p-8f : t == DType::f16 ? 0x1p-11f : 0x1p-24f; }

// |w_hat - w| <= |s| + rounding: a code is at most half a step off, except at the far extreme which
// can sit up to one step past code n when q0 rounded away from it (see the clamp test above); scale,
// bias, the product and the sum are each rounded once to the storage dtype.
TEST(Quantize, RoundTripErrorIsBoundedForEveryBitsAndGroup) {
  for (DType t : {DType::bf16, DType::f16, DType::f32})
    for (Rounding r : {Rounding::cpu, Rounding::gpu})
      for (int bits : kAllBits)
        for (int gs : kAllGroups) {
          SCOPED_TRACE(::testing::Message() << dtype_name(t) << " bits=" << bits << " gs=" << gs << " rounding="
                                            << (r == Rounding::cpu ? "cpu" : "gpu") << " " << test::seed_note());
          const Tensor w = test::random_tensor({8, 256}, t, 0.5f);
          const QuantizedWeight q = quantize_with(w, bits, gs, r);
          const std::vector<float> x = test::to_float(w), y = test::to_float(dequantize(q));
          const std::vector<float> s = test::to_float(q.scales), b = test::to_float(q.biases);
          const float u = unit_roundoff(t), n = static_cast<float>((1 << bits) - 1);
          int bad = 0;
          for (size_t i = 0; i < x.size(); ++i) {
            const size_t g = i / gs;
            const float step = std::fabs(s[g]);
            const float bound = step * (1 + 4 * u) + 2 * u * (n * step + std::fabs(b[g]) + std::fabs(x[i])) + 1e-30f;
            if (!(std::fabs(y[i] - x[i]) <= bound) && bad++ < 3)
              ADD_FAILURE() << "element " << i << ": w " << x[i] << " w_hat " << y[i] << " bound " << bound;
          }
          EXPECT_EQ(bad, 0);
        }
}

TEST(Quantize, LeadingBatchDimsAreRows) {
  const Tensor w3 = test::random_tensor({2, 3, 128}, DType::bf16);
  const QuantizedWeight a = quantize(w3, QuantSpec{5, 64, Rounding::cpu});
  const QuantizedWeight b = quantize(w3.reshape({6, 128}), QuantSpec{5, 64, Rounding::cpu});
  EXPECT_EQ(a.w.shape(), (Shape{2, 3, 20}));
  EXPECT_EQ(a.scales.shape(), (Shape{2, 3, 2}));
  EXPECT_EQ(a.scales.dtype(), DType::bf16);
  EXPECT_EQ(words(a.w), words(b.w));
  EXPECT_EQ(test::to_float(a.scales), test::to_float(b.scales));
  EXPECT_EQ(test::to_float(a.biases), test::to_float(b.biases));
  const Tensor d = dequantize(a);
  EXPECT_EQ(d.shape(), (Shape{2, 3, 128}));
  EXPECT_EQ(test::to_float(d), test::to_float(dequantize(b)));
}

TEST(Quantize, StridedInputEqualsItsContiguousCopy) {
  const Tensor base = test::random_tensor({64, 32}, DType::f32);
  const Tensor transposed = Tensor::view(base.data(), {32, 64}, DType::f32, Device::cpu, {1, 32});
  ASSERT_FALSE(transposed.is_contiguous());
  const QuantizedWeight a = quantize(transposed, QuantSpec{4, 32, Rounding::cpu});
  const QuantizedWeight b = quantize(transposed.contiguous(), QuantSpec{4, 32, Rounding::cpu});
  EXPECT_EQ(words(a.w), words(b.w));
  EXPECT_EQ(test::to_float(a.scales), test::to_float(b.scales));
}

TEST(Quantize, ZeroRowsIsAValidNoOp) {
  const QuantizedWeight q = quantize(Tensor::empty({0, 64}, DType::bf16), QuantSpec{4, 64, Rounding::cpu});
  EXPECT_EQ(q.w.shape(), (Shape{0, 8}));
  EXPECT_EQ(q.scales.shape(), (Shape{0, 1}));
  EXPECT_EQ(dequantize(q).shape(), (Shape{0, 64}));
}

// Dequantize rounds twice in the scales dtype: T(T(q * s) + b). With bf16 s = 1 + 2^-7 and q = 3,
// q * s = 3.0234375 rounds to 3.03125 (ties to even), plus b = 2^-6 gives 3.046875 exactly in bf16;
// one rounding of the exact 3.0390625 would give 3.03125 (tie, even) instead.
TEST(Dequantize, TwoRoundingsInTheScalesDtype) {
  std::vector<uint32_t> words8(8, 0u);
  words8[0] = 3u;  // element 0 = 3, the rest 0
  const Tensor wq = Tensor::from_host(words8.data(), {1, 8}, DType::u32);
  const Tensor s = test::from_float({1.0078125f}, {1, 1}, DType::bf16);
  const Tensor b = test::from_float({0.015625f}, {1, 1}, DType::bf16);
  const std::vector<float> out = test::to_float(dequantize(wq, s, b, 64, 4));
  EXPECT_EQ(out[0], 3.046875f);
  EXPECT_EQ(out[1], 0.015625f);
}

// ---------------------------------------------------------------------------------------------
// Bad input: an Error naming the op and the offending value.
using test::expect_error;

TEST(Quantize, BadInputIsAnError) {
  const Tensor w = test::random_tensor({4, 64}, DType::bf16);
  expect_error([&] { quantize(Tensor::empty({4, 64}, DType::u32)); }, "quantize", "uint32");
  expect_error([&] { quantize(Tensor::empty({4, 64}, DType::i32)); }, "quantize", "int32");
  expect_error([&] { quantize(test::random_tensor({4, 48}, DType::bf16), QuantSpec{4, 32}); }, "quantize",
               "K=48");
  expect_error([&] { quantize(w, QuantSpec{7, 64}); }, "quantize", "bits=7");
  expect_error([&] { quantize(w, QuantSpec{1, 64}); }, "quantize", "bits=1");
  expect_error([&] { quantize(w, QuantSpec{4, 16}); }, "quantize", "group_size=16");
  expect_error([&] { quantize(w, QuantSpec{4, 256}); }, "quantize", "group_size=256");
  expect_error([&] { quantize(test::random_tensor({64}, DType::bf16)); }, "quantize", "at least 2 dims");
  expect_error([&] { quantize(Tensor()); }, "quantize", "undefined");
  expect_error([&] { quantize(w, QuantSpec{4, 64, static_cast<Rounding>(7)}); }, "quantize", "rounding");
}

TEST(Dequantize, BadInputIsAnError) {
  const QuantizedWeight q = quantize(test::random_tensor({4, 128}, DType::bf16), QuantSpec{4, 64});
  expect_error([&] { dequantize(q.scales, q.scales, q.biases, 64, 4); }, "dequantize", "uint32");
  expect_error([&] { dequantize(q.w, q.scales, q.biases, 64, 7); }, "dequantize", "bits=7");
  expect_error([&] { dequantize(q.w, q.scales, q.biases, 48, 4); }, "dequantize", "group_size=48");
  expect_error([&] { dequantize(q.w, q.scales, q.biases, 32, 4); }, "dequantize", "group_size=32");
  expect_error([&] { dequantize(q.w, q.scales, q.biases, 64, 8); }, "dequantize", "bits=8");
  expect_error([&] { dequantize(q.w, q.scales, test::random_tensor({4, 2}, DType::f32), 64, 4); }, "dequantize",
               "float32");
  expect_error([&] { dequantize(q.w, q.scales, test::random_tensor({4, 3}, DType::bf16), 64, 4); },
               "dequantize", "same shape");
  expect_error([&] { dequantize(q.w.reshape({4 * 16}), q.scales, q.biases, 64, 4); }, "dequantize", "2 dims");
  expect_error([&] { dequantize(q.w, q.scales, Tensor(), 64, 4); }, "dequantize", "biases");
}

}  // namespace

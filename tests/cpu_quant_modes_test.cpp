// The fp quantization modes (mxfp4, mxfp8, nvfp4) beyond the MLX goldens: the element and scale
// codecs over every code, the mode table, and the errors for combinations MLX refuses.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/fp_codes.h"
#include "expertqmm/error.h"
#include "expertqmm/moe.h"
#include "expertqmm/ops.h"
#include "expertqmm/quant.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

using test::expect_error;

TEST(QuantModes, E2m1TableIsTheOcpGrid) {
  const float expected[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1_value(c), expected[c]) << "code " << c;
    EXPECT_EQ(std::signbit(e2m1_value(c)), c >= 8) << "code " << c;
  }
}

// Every finite E4M3 code decodes to sign * 2^(e-7) * (1 + m/8) (e > 0) or 2^-6 * m/8 (e = 0) and
// encodes back to itself; 0x7F / 0xFF are NaN.
TEST(QuantModes, E4m3RoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 15, m = c & 7;
    if ((c & 127) == 127) {
      EXPECT_TRUE(std::isnan(e4m3_value(static_cast<uint8_t>(c)))) << c;
      continue;
    }
    const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
    EXPECT_EQ(e4m3_value(static_cast<uint8_t>(c)), static_cast<float>(c & 128 ? -mag : mag)) << c;
    if (c != 128) EXPECT_EQ(e4m3_code(e4m3_value(static_cast<uint8_t>(c))), c) << c;  // -0 encodes as 0x80 too
  }
  EXPECT_EQ(e4m3_code(-0.0f), 0x80);
  EXPECT_EQ(e4m3_code(1000.0f), 0x7E);                     // saturates at 448
  EXPECT_EQ(e4m3_code(-INFINITY), 0xFE);
  EXPECT_EQ(e4m3_code(1.0625f), 0x38);                     // tie between 1 and 1.125: even
  EXPECT_EQ(e4m3_code(1.1875f), 0x3A);                     // tie between 1.125 and 1.25: even
  EXPECT_EQ(e4m3_code(std::ldexp(1.5f, -10)), 0x01);      // subnormal tie: 0.75 * 2^-9 -> 2^-9
}

TEST(QuantModes, E8m0IsAPowerOfTwo) {
  for (int s = 1; s < 255; ++s) EXPECT_EQ(e8m0_value(static_cast<uint8_t>(s)), std::ldexp(1.0f, s - 127)) << s;
  EXPECT_EQ(e8m0_value(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isinf(e8m0_value(255)));
}

TEST(QuantModes, TableAndNames) {
  for (QuantMode m : {QuantMode::affine, QuantMode::mxfp4, QuantMode::mxfp8, QuantMode::nvfp4}) {
    QuantMode parsed;
    ASSERT_TRUE(parse_quant_mode(quant_mode_name(m), &parsed));
    EXPECT_EQ(parsed, m);
    const QuantSpec d = default_quant_spec(m);
    EXPECT_TRUE(valid_quant_params(m, d.bits, d.group_size)) << quant_mode_name(m);
  }
  QuantMode unused;
  EXPECT_FALSE(parse_quant_mode("fp4", &unused));
  EXPECT_TRUE(valid_quant_params(QuantMode::mxfp4, 4, 32));
  EXPECT_FALSE(valid_quant_params(QuantMode::mxfp4, 4, 64));
  EXPECT_FALSE(valid_quant_params(QuantMode::mxfp8, 4, 32));
  EXPECT_TRUE(valid_quant_params(QuantMode::nvfp4, 4, 16));
  EXPECT_FALSE(valid_quant_params(QuantMode::nvfp4, 4, 32));
  EXPECT_FALSE(valid_quant_params(QuantMode::affine, 4, 16));
}

// A quantize -> dequantize round trip stays within half the format's step of each value's scale.
TEST(QuantModes, RoundTripIsClose) {
  const Tensor w = test::random_tensor({8, 128}, DType::f32);
  for (QuantMode m : {QuantMode::mxfp4, QuantMode::mxfp8, QuantMode::nvfp4}) {
    const QuantizedWeight q = quantize(w, default_quant_spec(m));
    const Tensor back = dequantize(q, DType::f32);
    const double err = test::rel_error(test::to_float(back), test::to_float(w));
    EXPECT_LT(err, m == QuantMode::mxfp8 ? 0.05 : 0.2) << quant_mode_name(m);
    EXPECT_GT(err, 0.0) << quant_mode_name(m);
  }
}

TEST(QuantModes, BadCombinationsAreErrors) {
  const Tensor w = test::random_tensor({4, 64}, DType::bf16);
  expect_error([&] { quantize(w, QuantSpec{4, 64, Rounding::cpu, QuantMode::mxfp4}); }, "quantize",
               "mode mxfp4 takes bits=4 and group_size=32 only; got bits=4 group_size=64");
  expect_error([&] { quantize(w, QuantSpec{4, 32, Rounding::cpu, QuantMode::mxfp8}); }, "quantize",
               "mode mxfp8 takes bits=8");
  expect_error([&] { quantize(w, QuantSpec{4, 16, Rounding::gpu, QuantMode::nvfp4}); }, "quantize",
               "Rounding::gpu is affine only");
  QuantSpec with_global = default_quant_spec(QuantMode::mxfp4);
  with_global.global_scale = test::random_tensor({1}, DType::f32);
  expect_error([&] { quantize(w, with_global); }, "quantize", "only supported for mode nvfp4");
  QuantSpec bad_global = default_quant_spec(QuantMode::nvfp4);
  bad_global.global_scale = test::random_tensor({2}, DType::f32);
  expect_error([&] { quantize(w, bad_global); }, "quantize", "float32 scalar");

  const QuantizedWeight q = quantize(w, default_quant_spec(QuantMode::mxfp4));
  QuantizedWeight with_biases = q;
  with_biases.biases = test::random_tensor({4, 2}, DType::bf16);
  expect_error([&] { dequantize(with_biases); }, "dequantize", "mode mxfp4 has no biases");
  QuantizedWeight float_scales = q;
  float_scales.scales = test::random_tensor({4, 2}, DType::bf16);
  expect_error([&] { dequantize(float_scales); }, "dequantize", "needs uint8 scales");
  QuantizedWeight as_affine = q;
  as_affine.mode = QuantMode::affine;
  expect_error([&] { dequantize(as_affine); }, "dequantize", "biases are required");

  const Tensor x = test::random_tensor({2, 1, 64}, DType::bf16);
  const Tensor w3 = test::random_tensor({3, 8, 64}, DType::bf16);
  QuantSpec nv = default_quant_spec(QuantMode::nvfp4);
  nv.global_scale = Tensor::from_host(std::vector<float>{2.0f}.data(), {}, DType::f32, Device::cpu);
  const QuantizedWeight q3 = quantize(w3, nv);
  const Tensor ids = Tensor::from_host(std::vector<int32_t>{0, 2}.data(), {2}, DType::i32, Device::cpu);
  expect_error([&] { gather_qmm(x, q3, Tensor(), ids); }, "gather_qmm", "global scale is not supported");
  expect_error([&] { gather_qmm(x, q3.w, q3.scales, Tensor(), Tensor(), ids, true, 32, 4, false, QuantMode::nvfp4); },
               "gather_qmm", "mode nvfp4 takes bits=4 and group_size=16");
}

// The fp modes compute in x's dtype (MLX: no promotion with the uint8 scales).
TEST(QuantModes, GatherQmmOutputsXsDtype) {
  const QuantizedWeight q = quantize(test::random_tensor({3, 8, 64}, DType::bf16), default_quant_spec(QuantMode::mxfp8));
  const Tensor ids = Tensor::from_host(std::vector<int32_t>{1, 2}.data(), {2}, DType::i32, Device::cpu);
  for (DType t : {DType::bf16, DType::f16, DType::f32})
    EXPECT_EQ(gather_qmm(test::random_tensor({2, 1, 64}, t), q, Tensor(), ids).dtype(), t);
}

// switch_glu with experts in each fp mode equals switch_glu with the same experts dequantized to
// float32 16-bit weights (gather_mm), at decode (unsorted) and prefill (sorted) sizes: the composed
// layer reads the codes, scales and layouts the way dequantize does.
TEST(QuantModes, SwitchGluMatchesItsDequantizedExperts) {
  const int64_t E = 6, D = 64, I = 32;
  for (QuantMode m : {QuantMode::mxfp4, QuantMode::mxfp8, QuantMode::nvfp4})
    for (int64_t T : {3, 40}) {
      SwitchGLUWeights q, dense;
      q.activation = dense.activation = Activation::swiglu;
      q.gate = quantize(test::random_tensor({E, I, D}, DType::bf16, 0.1f), default_quant_spec(m));
      q.up = quantize(test::random_tensor({E, I, D}, DType::bf16, 0.1f), default_quant_spec(m));
      q.down = quantize(test::random_tensor({E, D, I}, DType::bf16, 0.1f), default_quant_spec(m));
      dense.gate_dense = dequantize(q.gate, DType::f32);
      dense.up_dense = dequantize(q.up, DType::f32);
      dense.down_dense = dequantize(q.down, DType::f32);
      const Tensor x = test::random_tensor({T, D}, DType::f32);
      const Tensor ids = test::random_ids({T, 2}, E);
      const Tensor a = switch_glu(x, ids, q), b = switch_glu(x, ids, dense);
      ASSERT_EQ(a.dtype(), DType::f32);
      EXPECT_LE(test::rel_error(test::to_float(a), test::to_float(b)), 1e-5) << quant_mode_name(m) << " T=" << T;
    }
}

}  // namespace

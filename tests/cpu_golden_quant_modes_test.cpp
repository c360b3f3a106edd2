// quantize / dequantize in MLX's fp modes (mxfp4, mxfp8, nvfp4) against MLX bit for bit (goldens
// from tests/golden/make_quant_goldens.py, MLX's CPU stream). A missing golden file fails.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "expertqmm/quant.h"
#include "support/golden.h"

using namespace expertqmm;

namespace {

struct FileSpec {
  const char* file;
  DType dtype;
};

constexpr FileSpec kFiles[] = {
    {"quant_modes_bf16.safetensors", DType::bf16},
    {"quant_modes_f16.safetensors", DType::f16},
    {"quant_modes_f32.safetensors", DType::f32},
};

class GoldenQuantModes : public ::testing::TestWithParam<FileSpec> {};

TEST_P(GoldenQuantModes, MatchesMlxBitForBit) {
  const FileSpec spec = GetParam();
  SafetensorsFile f;
  ASSERT_NO_FATAL_FAILURE(test::open_golden(spec.file, &f));
  const std::vector<test::GoldenCase> cases = test::golden_cases(f);
  ASSERT_FALSE(cases.empty()) << f.path() << " holds no cases";

  // Per mode, the kinds seen: every mode needs random, edge and dequantize cases; nvfp4 a global one.
  std::set<std::pair<std::string, std::string>> seen;
  for (const test::GoldenCase& c : cases) {
    SCOPED_TRACE(std::string(spec.file) + " case " + c.name);
    QuantMode mode;
    ASSERT_TRUE(parse_quant_mode(c.params.at("mode"), &mode)) << c.params.at("mode");
    const int bits = c.int_param("bits"), gs = c.int_param("group_size");
    ASSERT_TRUE(valid_quant_params(mode, bits, gs));
    EXPECT_EQ(bits, quant_mode_bits(mode));
    EXPECT_EQ(gs, quant_mode_group_size(mode));
    const std::string kind = c.params.at("kind");
    QuantizedWeight golden;
    golden.mode = mode;
    golden.bits = bits;
    golden.group_size = gs;
    Tensor w_hat;
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, c.name + ".wq", &golden.w));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, c.name + ".scales", &golden.scales));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, c.name + ".w_hat", &w_hat));
    EXPECT_EQ(golden.scales.dtype(), DType::u8);
    if (kind == "global")
      ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, c.name + ".global_scale", &golden.global_scale));

    if (kind != "dequantize") {
      Tensor w;
      ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, c.name + ".w", &w));
      ASSERT_EQ(w.dtype(), spec.dtype);
      QuantSpec qs = default_quant_spec(mode);
      qs.global_scale = golden.global_scale;
      const QuantizedWeight q = quantize(w, qs);
      EXPECT_EQ(q.mode, mode);
      EXPECT_FALSE(q.biases.defined());
      EXPECT_EQ(test::bitwise_difference(q.w, golden.w), "") << "codes";
      EXPECT_EQ(test::bitwise_difference(q.scales, golden.scales), "") << "scales";
    }
    // MLX returns float32 when a global scale is given, the requested dtype otherwise.
    EXPECT_EQ(w_hat.dtype(), kind == "global" ? DType::f32 : spec.dtype);
    EXPECT_EQ(test::bitwise_difference(dequantize(golden, spec.dtype), w_hat), "") << "dequantize";
    seen.insert({c.params.at("mode"), kind.substr(0, kind.find(':'))});
  }
  for (const char* mode : {"mxfp4", "mxfp8", "nvfp4"})
    for (const char* kind : {"random", "edge", "dequantize"})
      EXPECT_TRUE(seen.count({mode, kind})) << spec.file << " has no " << kind << " case for " << mode;
  EXPECT_TRUE(seen.count({"nvfp4", "global"})) << spec.file << " has no nvfp4 global-scale case";
}

INSTANTIATE_TEST_SUITE_P(Files, GoldenQuantModes, ::testing::ValuesIn(kFiles),
                         [](const ::testing::TestParamInfo<FileSpec>& info) {
                           return std::string(dtype_name(info.param.dtype));
                         });

}  // namespace

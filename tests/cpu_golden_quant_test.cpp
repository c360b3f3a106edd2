// quantize / dequantize against MLX bit for bit (goldens from tests/golden/make_quant_goldens.py,
// MLX's CPU stream, i.e. Rounding::cpu). A missing golden file fails.
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
  int min_random_pairs;  // distinct (bits, group) pairs with a random case
  int min_edge_pairs;
  int min_dequant_pairs;
};

// What make_quant_goldens.py writes; a regenerated file with fewer cases fails the coverage check.
constexpr FileSpec kFiles[] = {
    {"quant_bf16.safetensors", DType::bf16, 18, 18, 18},
    {"quant_f16.safetensors", DType::f16, 6, 18, 6},
    {"quant_f32.safetensors", DType::f32, 6, 6, 6},
};

class GoldenQuant : public ::testing::TestWithParam<FileSpec> {};

TEST_P(GoldenQuant, MatchesMlxBitForBit) {
  const FileSpec spec = GetParam();
  SafetensorsFile f;
  ASSERT_NO_FATAL_FAILURE(test::open_golden(spec.file, &f));
  const std::vector<test::GoldenCase> cases = test::golden_cases(f);
  ASSERT_FALSE(cases.empty()) << f.path() << " holds no cases";

  std::set<std::pair<int, int>> random_pairs, edge_pairs, dequant_pairs;
  int quantize_checks = 0, dequantize_checks = 0;
  for (const test::GoldenCase& c : cases) {
    SCOPED_TRACE(std::string(spec.file) + " case " + c.name);
    const int bits = c.int_param("bits"), gs = c.int_param("group_size");
    const std::string kind = c.params.at("kind");
    Tensor wq, scales, biases, w_hat;
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, c.name + ".wq", &wq));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, c.name + ".scales", &scales));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, c.name + ".biases", &biases));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, c.name + ".w_hat", &w_hat));
    EXPECT_EQ(scales.dtype(), spec.dtype);

    if (kind != "dequantize") {
      Tensor w;
      ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, c.name + ".w", &w));
      ASSERT_EQ(w.dtype(), spec.dtype);
      const QuantizedWeight q = quantize(w, QuantSpec{bits, gs, Rounding::cpu});
      EXPECT_EQ(test::bitwise_difference(q.w, wq), "") << "codes";
      EXPECT_EQ(test::bitwise_difference(q.scales, scales), "") << "scales";
      EXPECT_EQ(test::bitwise_difference(q.biases, biases), "") << "biases";
      ++quantize_checks;
      if (kind == "random") random_pairs.insert({bits, gs});
      if (kind.rfind("edge:", 0) == 0) edge_pairs.insert({bits, gs});
    } else {
      dequant_pairs.insert({bits, gs});
    }
    EXPECT_EQ(test::bitwise_difference(dequantize(wq, scales, biases, gs, bits), w_hat), "") << "dequantize";
    ++dequantize_checks;
  }
  EXPECT_GE(static_cast<int>(random_pairs.size()), spec.min_random_pairs);
  EXPECT_GE(static_cast<int>(edge_pairs.size()), spec.min_edge_pairs);
  EXPECT_GE(static_cast<int>(dequant_pairs.size()), spec.min_dequant_pairs);
  RecordProperty("quantize_cases", quantize_checks);
  RecordProperty("dequantize_cases", dequantize_checks);
}

INSTANTIATE_TEST_SUITE_P(Files, GoldenQuant, ::testing::ValuesIn(kFiles),
                         [](const ::testing::TestParamInfo<FileSpec>& info) {
                           return std::string(dtype_name(info.param.dtype));
                         });

// The spec's worked example (1.3) as MLX computed it: codes 0 (-0.3), 15 (0.2), 9 (0.0).
TEST(GoldenQuantWorkedExample, CodesScaleAndBias) {
  SafetensorsFile f;
  ASSERT_NO_FATAL_FAILURE(test::open_golden("quant_f32.safetensors", &f));
  Tensor wq, scales, biases;
  ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, "worked_example_b4_g32.wq", &wq));
  ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, "worked_example_b4_g32.scales", &scales));
  ASSERT_NO_FATAL_FAILURE(test::golden_tensor(f, "worked_example_b4_g32.biases", &biases));
  EXPECT_EQ(wq.data_as<uint32_t>()[0], 0x999999F0u);
  EXPECT_EQ(scales.data_as<float>()[0], -0.3f / -9.0f);
  EXPECT_EQ(biases.data_as<float>()[0], -0.3f);
}

}  // namespace

#include <gtest/gtest.h>

#include "core/float16.h"
#include "expertqmm/error.h"
#include "support/test_util.h"

using namespace expertqmm;

TEST(Tensor, ContiguousStridesAndReshape) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::f32);
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.size(-1), 4);
  Tensor r = t.reshape({6, 4});
  EXPECT_EQ(r.data(), t.data());
  EXPECT_THROW(t.reshape({5, 5}), Error);
}

TEST(Tensor, StridedViewGathersInRowMajorOrder) {
  std::vector<float> v = {0, 1, 2, 3, 4, 5};  // [2, 3]
  Tensor base = Tensor::from_host(v.data(), {2, 3}, DType::f32);
  Tensor transposed = Tensor::view(base.data(), {3, 2}, DType::f32, Device::cpu, {1, 3});
  EXPECT_FALSE(transposed.is_contiguous());
  EXPECT_EQ(test::to_float(transposed), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(test::to_float(transposed.contiguous()), (std::vector<float>{0, 3, 1, 4, 2, 5}));
}

TEST(Tensor, NegativeDimensionIsAnError) { EXPECT_THROW(Tensor::empty({2, -1}, DType::f32), Error); }

// Runs f, expecting an Error whose message holds `part`.
template <class F>
void expect_error(F&& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// Element counts or byte sizes past int64 are errors, never a wrapped (0-byte) allocation.
TEST(Tensor, OverflowingShapesAreErrors) {
  const int64_t big = int64_t(1) << 32;
  expect_error([&] { Tensor::empty({big, big}, DType::f32); }, "too large");      // 2^64 elements
  expect_error([&] { Tensor::empty({int64_t(1) << 62, 1}, DType::f32); }, "too large");  // 2^64 bytes
  expect_error([&] { Tensor::empty({INT64_MAX, 2}, DType::bf16); }, "too large");
  // No element, but the strides of the non-zero dims would still overflow.
  expect_error([&] { Tensor::view(nullptr, {0, int64_t(1) << 62, int64_t(1) << 62}, DType::u32); }, "too large");
  expect_error([&] { shape_numel({big, big}); }, "int64");
  expect_error([&] { contiguous_strides({1, big, big}); }, "overflows");
  Tensor t = Tensor::empty({4}, DType::f32);
  expect_error([&] { t.reshape({big, big, 0}); }, "too large");
  // Fits in int64 but not in memory: an Error naming the size, not std::bad_alloc.
  expect_error([] { Tensor::empty({int64_t(1) << 45}, DType::f32); }, "cannot allocate");
  // The largest shapes that fit are fine when they hold nothing.
  EXPECT_EQ(Tensor::empty({0, int64_t(1) << 30, int64_t(1) << 30}, DType::f32).nbytes(), 0u);
}

TEST(Float16, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3f82);  // halfway, odd below: rounds up
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.5f)), -2.5f);
}

TEST(Float16, F16RoundTripAndSubnormals) {
  for (float f : {0.0f, 1.0f, -2.0f, 65504.0f, 6.103515625e-05f, 5.9604644775390625e-08f, 0.333251953125f})
    EXPECT_EQ(f16_to_float(float_to_f16(f)), f) << f;
  EXPECT_EQ(float_to_f16(1e6f), 0x7c00);                    // overflow to inf
  EXPECT_EQ(float_to_f16(2.98023223876953125e-08f), 0x0000);  // half the smallest subnormal: ties to even (0)
  EXPECT_EQ(float_to_f16(1.0f + 1.0f / 2048.0f), 0x3c00);     // tie: even mantissa
}

TEST(Backend, CudaAvailabilityIsConsistent) {
  if (!cuda_built()) EXPECT_FALSE(cuda_available());
  EXPECT_EQ(best_device(), cuda_available() ? Device::cuda : Device::cpu);
}

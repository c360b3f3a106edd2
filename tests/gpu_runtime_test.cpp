#include <gtest/gtest.h>

#include "support/test_util.h"

using namespace expertqmm;

TEST(GpuRuntime, RoundTripThroughDevice) {
  EXPERTQMM_REQUIRE_GPU();
  Tensor h = test::random_tensor({5, 7}, DType::bf16);
  Tensor d = h.to(Device::cuda);
  EXPECT_EQ(d.device(), Device::cuda);
  EXPECT_EQ(test::to_float(d), test::to_float(h));
  cuda_check();
}

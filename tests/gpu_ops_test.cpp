// CUDA ops beyond the backend-ops table (gpu_backend_ops_test.cpp checks quantize, gather_sort,
// glu_product, weighted_combine and route against the CPU backend row by row): the router's tie
// rule on logits that tie exactly.
#include <gtest/gtest.h>

#include <vector>

#include "support/moe_case.h"
#include "support/test_util.h"

using namespace expertqmm;

TEST(GpuRoute, ExactTiesGoToTheHigherExpertId) {
  EXPERTQMM_REQUIRE_GPU();
  // proj rows 0..7 identical in pairs: logits tie exactly between experts 2i and 2i+1.
  const int64_t E = 8, H = 64;
  std::vector<float> proj = test::to_float(test::random_tensor({E / 2, H}, DType::f32));
  std::vector<float> doubled;
  for (int64_t e = 0; e < E; ++e) doubled.insert(doubled.end(), proj.begin() + (e / 2) * H, proj.begin() + (e / 2 + 1) * H);
  RouterWeights r = test::random_router(E, H, 3, DType::f32, 0);
  r.proj_dense = test::from_float(doubled, {E, H}, DType::f32);
  const Tensor h = test::random_tensor({6, H}, DType::f32);
  const Routing g = route(h.to(Device::cuda), test::router_to(r, Device::cuda));
  const std::vector<int32_t> gi = test::to_i32(g.indices);
  const std::vector<int32_t> ci = test::to_i32(route(h, r).indices);
  EXPECT_EQ(gi, ci);
  for (int64_t t = 0; t < 6; ++t) {
    // MLX's rule: the best pair is picked higher id first; the third slot is the higher id of the
    // second pair.
    EXPECT_EQ(gi[t * 3] % 2, 1) << "token " << t;
    EXPECT_EQ(gi[t * 3 + 1], gi[t * 3] - 1) << "token " << t;
    EXPECT_EQ(gi[t * 3 + 2] % 2, 1) << "token " << t;
  }
  cuda_check();
}

// The cross-backend table (tests/support/backend_cases.h): every row checked on CUDA against the
// float64 reference or the CPU backend. Sanitize/GpuBackendOps.Matches/<row> holds the rows small
// enough for compute-sanitizer, Large/GpuBackendOps.Matches/<row> the others; each row runs once.
// Each row draws its inputs from a generator seeded by EXPERTQMM_TEST_SEED and the row's name, so a
// failing row replays alone: EXPERTQMM_TEST_SEED=<seed> --gtest_filter='*/<row>'.
#include <gtest/gtest.h>

#include <functional>
#include <variant>

#include "support/backend_cases.h"
#include "support/gather_case.h"
#include "support/moe_case.h"
#include "support/op_cases.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

class GpuBackendOps : public ::testing::TestWithParam<test::BackendCase> {};

std::string row_name(const ::testing::TestParamInfo<test::BackendCase>& info) { return info.param.name(); }

}  // namespace

TEST_P(GpuBackendOps, Matches) {
  EXPERTQMM_REQUIRE_GPU();
  const test::BackendCase& row = GetParam();
  test::rng().seed(test::test_seed() ^ std::hash<std::string>{}(row.name()));
  std::visit([](const auto& c) { test::check(c); }, row.spec);
}

INSTANTIATE_TEST_SUITE_P(Sanitize, GpuBackendOps, ::testing::ValuesIn(test::backend_cases(test::Subset::sanitize)),
                         row_name);
INSTANTIATE_TEST_SUITE_P(Large, GpuBackendOps, ::testing::ValuesIn(test::backend_cases(test::Subset::large)),
                         row_name);

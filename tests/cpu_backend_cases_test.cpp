// The cross-backend table itself (tests/support/backend_cases.h), checked where no GPU is needed:
// every row has a unique gtest-safe name, the sanitizer subset covers every op and stays small,
// and each ids pattern gives the rows its case counts, in range and sorted where it promises so.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <set>
#include <string>
#include <variant>

#include "support/backend_cases.h"

using namespace expertqmm;
using test::BackendCase;
using test::Subset;

namespace {

// Multiply-adds of the largest gather_qmm row under compute-sanitizer: one expert owning 300 rows of
// a 712 x 640 weight (the tile kernels' widest edge shape).
constexpr double kSanitizeWork = 1.4e8;

}  // namespace

TEST(BackendCases, NamesAreUniqueAndGtestSafe) {
  std::set<std::string> seen;
  for (Subset s : {Subset::sanitize, Subset::large})
    for (const BackendCase& c : test::backend_cases(s)) {
      const std::string name = c.name();
      EXPECT_TRUE(seen.insert(name).second) << "two rows named " << name;
      EXPECT_TRUE(std::all_of(name.begin(), name.end(), [](char ch) { return std::isalnum(ch) || ch == '_'; }))
          << name;
    }
  EXPECT_GT(seen.size(), 100u);
}

TEST(BackendCases, SanitizeSubsetCoversEveryOp) {
  std::set<size_t> ops;
  for (const BackendCase& c : test::backend_cases(Subset::sanitize)) ops.insert(c.spec.index());
  EXPECT_EQ(ops.size(), std::variant_size_v<test::CaseSpec>) << "an op with no row under compute-sanitizer";
  EXPECT_FALSE(test::backend_cases(Subset::large).empty());
}

TEST(BackendCases, SanitizeRowsAreCheap) {
  for (const BackendCase& c : test::backend_cases(Subset::sanitize))
    if (const auto* g = std::get_if<test::GatherQmmCase>(&c.spec)) EXPECT_LE(g->work(), kSanitizeWork) << c.name();
}

TEST(BackendCases, IdsPatternsGiveTheRowsTheyCount) {
  for (Subset s : {Subset::sanitize, Subset::large})
    for (const BackendCase& c : test::backend_cases(s)) {
      const auto* g = std::get_if<test::GatherQmmCase>(&c.spec);
      if (!g || g->form != test::Form::rows) continue;
      const std::vector<int32_t> ids = test::make_ids(g->ids, g->E);
      EXPECT_EQ(static_cast<int64_t>(ids.size()), g->rows()) << c.name();
      for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < g->E) << c.name() << ": id " << id;
      if (g->ids.sorted()) EXPECT_TRUE(std::is_sorted(ids.begin(), ids.end())) << c.name();
    }
}

// The bench's choice of the tokens it checks against its float64 reference
// (tools/expertqmm/reference.h checked_tokens): the first and last candidates whose k-th place is not a
// near-tie of the router's logits, where the layer's router and route() may pick differently.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "reference.h"

namespace {

using expertqmm::cli::checked_tokens;

// E = 4 logits per row, k = 2: a clear row (k-th 2.0, next 1.0) or a near-tie (2.0 and 1.99).
constexpr int64_t kE = 4;
constexpr int kK = 2;
std::vector<float> rows(const std::vector<bool>& tie) {
  std::vector<float> logits;
  for (bool t : tie) logits.insert(logits.end(), {3.0f, 2.0f, t ? 1.99f : 1.0f, -1.0f});
  return logits;
}

TEST(BenchReference, CheckedTokensAreTheEndsWithoutNearTies) {
  EXPECT_EQ(checked_tokens(rows({false, false, false}), {0, 1, 2}, kE, kK), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(checked_tokens(rows({false}), {0}, kE, kK), (std::vector<int64_t>{0}));
  // Candidates are token ids: the first and last 8 of a long call.
  EXPECT_EQ(checked_tokens(rows({false, false}), {0, 2047}, kE, kK), (std::vector<int64_t>{0, 2047}));
}

TEST(BenchReference, CheckedTokensMoveInwardPastNearTies) {
  EXPECT_EQ(checked_tokens(rows({true, false, false, true}), {0, 1, 2, 3}, kE, kK), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(checked_tokens(rows({true, true, false, true}), {0, 1, 14, 15}, kE, kK), (std::vector<int64_t>{14}));
  // Only near-ties: the ends, as before (the check then may fail on a tie, and says so by its error).
  EXPECT_EQ(checked_tokens(rows({true, true, true}), {0, 1, 2}, kE, kK), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(checked_tokens(rows({true}), {0}, kE, kK), (std::vector<int64_t>{0}));
  // An exact tie at the k-th place is a near-tie.
  EXPECT_EQ(checked_tokens({3.0f, 2.0f, 2.0f, 0.0f, 3.0f, 2.0f, 1.0f, 0.0f}, {0, 1}, kE, kK), (std::vector<int64_t>{1}));
}

}  // namespace

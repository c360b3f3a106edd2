// The bench commands' JSON helpers (tools/expertqmm/json_out.h), which the CLI's bench and the peer
// programs under bench/peers write their results with.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <regex>
#include <string>

#include "json_out.h"

namespace {

using namespace expertqmm::cli;

TEST(JsonOut, NumbersAreNullForNanAndInfinity) {
  EXPECT_EQ(json_number(NAN), "null");
  EXPECT_EQ(json_number(INFINITY), "null");
  EXPECT_EQ(json_number(-INFINITY), "null");
  EXPECT_EQ(json_number(1.5), "1.5");
  EXPECT_EQ(json_number(-0.25), "-0.25");
  EXPECT_EQ(json_number(123456789.0), "1.23457e+08");  // %.6g
}

TEST(JsonOut, StringsEscapeQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(json_string("plain"), "\"plain\"");
  EXPECT_EQ(json_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(json_string("line\nnext\t"), "\"line\\u000anext\\u0009\"");
  EXPECT_EQ(json_string("H200 \xc2\xb5s"), "\"H200 \xc2\xb5s\"");  // UTF-8 passes unchanged
}

TEST(JsonOut, UtcNowIsIso8601Seconds) {
  EXPECT_TRUE(std::regex_match(utc_now(), std::regex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z")))
      << utc_now();
}

TEST(JsonOut, CommitComesFromTheEnvironmentFirst) {
  const char* before = std::getenv("EXPERTQMM_COMMIT");
  const std::string saved = before ? before : "";
  setenv("EXPERTQMM_COMMIT", "0123abc", 1);
  EXPECT_EQ(commit_id(), "0123abc");
  if (before) setenv("EXPERTQMM_COMMIT", saved.c_str(), 1);
  else unsetenv("EXPERTQMM_COMMIT");
}

}  // namespace

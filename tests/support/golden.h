// MLX golden files (tests/golden/*.safetensors, written by tests/golden/make_*.py).
#pragma once
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "expertqmm/safetensors.h"

namespace expertqmm::test {

// $EXPERTQMM_GOLDEN_DIR when set (e.g. freshly regenerated goldens), else the source tree's
// tests/golden (the compile definition EXPERTQMM_GOLDEN_DIR).
std::string golden_dir();

// Opens golden_dir()/file. A missing or unreadable golden is a test failure, never a skip: the
// caller gets a fatal gtest failure (use ASSERT_NO_FATAL_FAILURE around it) and an empty result.
void open_golden(const std::string& file, SafetensorsFile* out);

// The named tensor of a golden file; a fatal failure if absent.
void golden_tensor(const SafetensorsFile& f, const std::string& name, Tensor* out);

// One "case.<name>" metadata entry: "key=value key=value ..." parsed into a map.
struct GoldenCase {
  std::string name;
  std::map<std::string, std::string> params;
  int int_param(const std::string& key) const;  // a fatal-style error (throws) when missing
};
// Every case of the file, in name order.
std::vector<GoldenCase> golden_cases(const SafetensorsFile& f);

// Empty when a and b have the same dtype, shape and bytes; otherwise a description of the first
// difference (index and both values as hex words).
std::string bitwise_difference(const Tensor& a, const Tensor& b);

}  // namespace expertqmm::test

// Fixtures of the checkpoint reader and writer tests: a tiny Gemma 4 config, fresh directories,
// file bytes, and the expected-error helper.
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"

namespace expertqmm::test {

// H=128, I=192, 8 experts x 64, top-2; experts 4-bit g64, dense MLP and router 8-bit g64.
Gemma4Config tiny_config(int layers, const std::string& prefix = "model.");
// A path under the test temp dir that does not exist yet (removed if it did).
std::string fresh_dir(const std::string& tag);
// Writes (replacing) a tiny checkpoint with seed 7.
void write_tiny(const std::string& dir, int layers, int shards, const std::string& prefix = "model.");

std::string read_all(const std::string& path);
void write_all(const std::string& path, const std::string& text);
// Sorted entry names of a directory (empty when it does not exist).
std::vector<std::string> list_dir(const std::string& dir);

// Same dtype, shape and bytes, tensor by tensor (gtest failures name `what`).
void expect_same(const Tensor& a, const Tensor& b, const std::string& what);
void expect_same(const QuantizedWeight& a, const QuantizedWeight& b, const std::string& what);
void expect_same_layer(const Gemma4FfnWeights& a, const Gemma4FfnWeights& b, const std::string& what);

// Runs f, expecting an expertqmm::Error whose message holds every one of `parts`.
template <class F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning " << parts[0];
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

}  // namespace expertqmm::test

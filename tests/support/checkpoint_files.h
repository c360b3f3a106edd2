// Fixtures of the checkpoint reader and writer tests: configs (a tiny Gemma 4), scratch directories,
// whole-file edits, re-saved safetensors, layer comparisons and an "expect an Error mentioning all
// of these" check.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"
#include "expertqmm/tensor.h"

namespace expertqmm::test {

// A Gemma 4 config of this geometry, quantized 4-bit group 64 by default, with no per-module entries.
Gemma4Config gemma4_config(int64_t hidden, int64_t intermediate, int64_t moe_intermediate, int64_t experts,
                           int64_t top_k, int64_t layers);

// H=128, I=192, 8 experts x 64, top-2; experts 4-bit g64, dense MLP and router 8-bit g64.
Gemma4Config tiny_config(int layers, const std::string& prefix = "model.");
// Writes (replacing) a tiny checkpoint with seed 7.
void write_tiny(const std::string& dir, int layers, int shards, const std::string& prefix = "model.");

// A path under the gtest temp dir, unique per tag and process, that does not exist yet (removed,
// with its writer lock, if it did).
std::string fresh_dir(const std::string& tag);
// Sorted entry names of a directory (empty when it does not exist).
std::vector<std::string> list_dir(const std::string& dir);
std::string read_all(const std::string& path);
void write_all(const std::string& path, const std::string& text);
// Replaces the first `from` in s (a fatal gtest failure when absent).
void replace_once(std::string& s, const std::string& from, const std::string& to);
// Re-saves the safetensors `file` with `edit` applied to its (name, tensor) list.
void rewrite_safetensors(const std::string& file,
                         const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit);

// Same dtype, shape and bytes, tensor by tensor (gtest failures name `what`).
void expect_same(const Tensor& a, const Tensor& b, const std::string& what);
void expect_same(const QuantizedWeight& a, const QuantizedWeight& b, const std::string& what);
void expect_same_layer(const Gemma4FfnWeights& a, const Gemma4FfnWeights& b, const std::string& what);
void expect_same_layer(const Qwen3MoeFfnWeights& a, const Qwen3MoeFfnWeights& b, const std::string& what);

// Runs f, expecting an Error whose message holds every one of `parts`.
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

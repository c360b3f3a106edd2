// Helpers of the checkpoint tests: scratch directories, whole-file edits, re-saved safetensors and
// an "expect an Error mentioning all of these" check.
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

// An empty scratch directory path under the gtest temp dir, unique per tag and process.
std::string fresh_dir(const std::string& tag);
std::string read_all(const std::string& path);
void write_all(const std::string& path, const std::string& text);
// Replaces the first `from` in s (a fatal gtest failure when absent).
void replace_once(std::string& s, const std::string& from, const std::string& to);
// Re-saves the safetensors `file` with `edit` applied to its (name, tensor) list.
void rewrite_safetensors(const std::string& file,
                         const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit);

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

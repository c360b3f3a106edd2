// The decoder-layer feed-forward goldens (tests/golden/make_layer_goldens.py,
// make_checkpoint_goldens.py, make_qwen3_goldens.py): a checkpoint mlx-lm saved, loaded through our
// reader, against mlx-lm's DecoderLayer outputs.
#pragma once
#include <functional>
#include <string>

#include "expertqmm/checkpoint.h"

namespace expertqmm::test {

// docs/numerics.md, "MLX goldens": bf16 layer vs the float32 mlx-lm twin, and vs MLX's own bf16.
constexpr double kTolFfnF32Twin = 1e-2;
constexpr double kTolFfnMlxBf16 = 5e-2;
// A routing weight (bf16) vs the f32 twin's: two bf16 roundings of values in [0, 1].
constexpr double kTolRoutingWeight = 1e-2;

// One layer's feed-forward output on h and the routing its router gives h.
struct FfnRun {
  Tensor out;
  Routing routing;
};
using FfnRunner = std::function<FfnRun(int layer, const Tensor& h)>;

// For every case "l<L>_t<T>" of golden_dir()/golden_file (expected_cases of them): run(L, h) within
// kTolFfnF32Twin of .<variant>f32_out and, for the plain variant unless the case says mlx_bf16=0,
// within kTolFfnMlxBf16 of MLX's bf16 .out; the router picks .indices' experts (as sets), and when
// the golden has .<variant>weights, each expert's weight within kTolRoutingWeight of MLX's.
void expect_layer_matches_mlx(const std::string& golden_file, size_t expected_cases, int64_t H, int k,
                              const FfnRunner& run, const std::string& variant = "");

// expect_layer_matches_mlx with gemma4_ffn and route() on the layers of a Gemma 4 checkpoint.
void expect_ffn_matches_mlx(const Gemma4Checkpoint& ck, const std::string& golden_file, size_t expected_cases);

}  // namespace expertqmm::test

// The Gemma 4 feed-forward goldens (tests/golden/make_layer_goldens.py, make_checkpoint_goldens.py):
// a checkpoint mlx-lm saved, loaded through our reader, against mlx-lm's DecoderLayer outputs.
#pragma once
#include <string>

#include "expertqmm/checkpoint.h"

namespace expertqmm::test {

// docs/numerics.md, "MLX goldens": bf16 layer vs the float32 mlx-lm twin, and vs MLX's own bf16.
constexpr double kTolFfnF32Twin = 1e-2;
constexpr double kTolFfnMlxBf16 = 5e-2;

// For every case "l<L>_t<T>" of golden_dir()/golden_file (expected_cases of them): gemma4_ffn on
// layer L of `ck` within kTolFfnF32Twin of .f32_out and, unless the case says mlx_bf16=0, within
// kTolFfnMlxBf16 of MLX's bf16 .out; and the router picks .indices' experts (as sets).
void expect_ffn_matches_mlx(const Gemma4Checkpoint& ck, const std::string& golden_file, size_t expected_cases);

}  // namespace expertqmm::test

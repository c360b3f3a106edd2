// `expertqmm write-checkpoint`: writes a synthetic Gemma 4 or Qwen3-MoE checkpoint in mlx-lm's format (random
// codes, no quantizer run, so the 30-layer 26B-A4B geometry takes seconds plus disk time).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "cli.h"
#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"
#include "presets.h"

namespace expertqmm::cli {

namespace {

constexpr int64_t kMaxLayers = 1000;

void print_usage() {
  std::printf(
      "usage: expertqmm write-checkpoint --out DIR [--preset gemma4-26b-a4b|tiny|qwen3-30b-a3b|qwen3-tiny]\n"
      "                                  [--layers 30|48] [--seed 1]\n"
      "                                  [--shards N] [--prefix model.] [--group-size 64]\n"
      "                                  [--quant affine|mxfp4|mxfp8|nvfp4] [--dense-mlp 8bit|default] [--force]\n"
      "Writes config.json and model.safetensors (or N shards and model.safetensors.index.json) with\n"
      "synthetic weights: experts 4-bit g64, dense MLP and router.proj 8-bit g64 (as the QAT checkpoint).\n"
      "--dense-mlp default: the Gemma 4 dense MLP at the default quantization instead, the router alone\n"
      "8-bit (as mlx-community's 4-bit upload).\n"
      "--group-size 32|64|128 sets the default (the experts'); as mlx-lm's quantize_model, a module whose\n"
      "input width is not a multiple of it stays bf16 (at 128: the experts' down_proj, 704 inputs).\n"
      "--quant sets the default's mode (the experts'; config.json quantization.mode): mxfp4 (4-bit\n"
      "g32), mxfp8 (8-bit g32), nvfp4 (4-bit g16), each with uint8 scales and no biases; the dense MLP\n"
      "and router.proj stay affine 8-bit g64. An fp mode has one group size: no --group-size with it.\n"
      "gemma4-26b-a4b: H=2816, I=2112, 128 experts x 704, top-8 (~0.45 GB a layer); tiny: H=128, I=192,\n"
      "8 experts x 64, top-2. qwen3-30b-a3b: mlx-lm qwen3_moe names, H=2048, 128 experts x 768, top-8,\n"
      "48 layers, experts 4-bit and the router mlp.gate 8-bit g64 (~0.34 GB a layer); qwen3-tiny: H=128,\n"
      "8 experts x 64, top-2. Default shards: one per 5 GB, as mlx-lm.\n"
      "DIR must not exist or be empty; --force replaces a checkpoint there (a directory holding other\n"
      "files is still refused). The files are written into a temporary directory beside DIR and moved\n"
      "into place at the end, so an interrupted or failed write leaves DIR as it was.\n");
}

}  // namespace

int run_write_checkpoint(int argc, char** argv) {
  Args args(argc, argv);
  if (args.has("help")) return print_usage(), 0;
  args.check_known({"out", "preset", "layers", "seed", "shards", "prefix", "group-size", "quant", "dense-mlp", "force"});
  const std::string out = args.get_required("out", "DIR");
  const std::string preset =
      args.get_choice("preset", "gemma4-26b-a4b", {"gemma4-26b-a4b", "tiny", "qwen3-30b-a3b", "qwen3-tiny"});
  const bool qwen3 = preset.rfind("qwen3", 0) == 0, tiny = preset == "tiny" || preset == "qwen3-tiny";
  const int64_t layers = args.get_int("layers", tiny ? 2 : qwen3 ? 48 : 30, 1, kMaxLayers);
  const uint64_t seed = uint64_t(args.get_int("seed", 1, 0, kMaxSeed));
  const std::string prefix = args.get_choice("prefix", "model.", {"model.", "language_model.model."});
  const bool force = args.get_flag("force");
  const int group_size = std::stoi(args.get_choice("group-size", "64", {"32", "64", "128"}));
  QuantMode mode = QuantMode::affine;
  parse_quant_mode(args.get_choice("quant", "affine", {"affine", "mxfp4", "mxfp8", "nvfp4"}), &mode);
  if (mode != QuantMode::affine && args.has("group-size"))
    usage_error(detail::cat("--group-size: mode ", quant_mode_name(mode), " has one group size (",
                            quant_mode_group_size(mode), "); give --group-size with --quant affine only"));
  const bool dense_8bit = args.get_choice("dense-mlp", "8bit", {"8bit", "default"}) == "8bit";
  if (qwen3 && args.has("dense-mlp")) usage_error("--dense-mlp: the Qwen3-MoE presets have no dense MLP");
  Gemma4Config c =
      qwen3 ? Gemma4Config::qwen3_30b_a3b(layers, prefix) : Gemma4Config::gemma4_26b_a4b(layers, prefix, dense_8bit);
  c.default_quant.group_size = int(group_size);
  if (mode != QuantMode::affine) c.default_quant = {quant_mode_bits(mode), quant_mode_group_size(mode), mode};
  if (tiny) {
    c.hidden_size = 128;
    c.intermediate_size = 192;
    c.moe_intermediate_size = 64;
    c.num_experts = 8;
    c.top_k_experts = 2;
  }
  const size_t layer_bytes = qwen3 ? synthetic_qwen3_moe_layer(c, 0, seed, prefix).nbytes()
                                   : synthetic_gemma4_layer(c, 0, seed, prefix).nbytes();
  const int64_t default_shards =
      std::max<int64_t>(1, std::min<int64_t>(layers, int64_t((layer_bytes * size_t(layers)) / (5ull << 30)) + 1));
  const int64_t shards = args.get_int("shards", default_shards, 1, layers);
  std::fprintf(stderr, "writing %lld layers (%.2f GB) in %lld file(s) to %s ...\n", (long long)layers,
               double(layer_bytes) * double(layers) / 1e9, (long long)shards, out.c_str());

  CheckpointWriteOptions options;
  options.prefix = prefix;
  options.force = force;
  const auto t0 = std::chrono::steady_clock::now();
  options.progress = [&](int done, int all, uint64_t written, uint64_t total) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "  layer %d/%d written, %.2f of %.2f GB, %.0f s\n", done, all, double(written) / 1e9,
                 double(total) / 1e9, s);
    std::fflush(stderr);
  };
  if (qwen3)
    write_qwen3_moe_checkpoint(
        out, c, int(shards), [&](int n) { return synthetic_qwen3_moe_layer(c, n, seed, prefix); }, options);
  else
    write_gemma4_checkpoint(
        out, c, int(shards), [&](int n) { return synthetic_gemma4_layer(c, n, seed, prefix); }, options);
  std::printf("wrote %s: %lld layers, %lld file(s)\n", out.c_str(), (long long)layers, (long long)shards);
  return 0;
}

}  // namespace expertqmm::cli

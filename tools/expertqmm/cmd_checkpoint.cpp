// `expertqmm write-checkpoint`: writes a synthetic Gemma 4 checkpoint in mlx-lm's format (random
// codes, no quantizer run, so the 30-layer 26B-A4B geometry takes seconds plus disk time).
#include <algorithm>
#include <cstdio>
#include <string>

#include "cli.h"
#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"

namespace expertqmm::cli {

namespace {

void print_usage() {
  std::printf(
      "usage: expertqmm write-checkpoint --out DIR [--preset gemma4-26b-a4b|tiny] [--layers 30] [--seed 1]\n"
      "                                  [--shards N] [--prefix model.]\n"
      "Writes config.json and model.safetensors (or N shards and model.safetensors.index.json) with\n"
      "synthetic weights: experts 4-bit g64, dense MLP and router.proj 8-bit g64 (as the QAT checkpoint).\n"
      "gemma4-26b-a4b: H=2816, I=2112, 128 experts x 704, top-8 (~0.45 GB a layer); tiny: H=128, I=192,\n"
      "8 experts x 64, top-2. Default shards: one per 5 GB, as mlx-lm.\n");
}

}  // namespace

int run_write_checkpoint(int argc, char** argv) {
  Args args(argc, argv);
  if (args.has("help")) return print_usage(), 0;
  args.check_known({"out", "preset", "layers", "seed", "shards", "prefix"});
  const std::string out = args.get("out");
  EXPERTQMM_CHECK(!out.empty(), "write-checkpoint", "--out DIR is required");
  const std::string preset = args.get("preset", "gemma4-26b-a4b");
  const long layers = args.get_int("layers", preset == "tiny" ? 2 : 30);
  EXPERTQMM_CHECK(layers >= 1 && layers <= 1000, "write-checkpoint", "--layers must be in [1, 1000], got ", layers);
  const long seed = args.get_int("seed", 1);
  EXPERTQMM_CHECK(seed >= 0, "write-checkpoint", "--seed must be >= 0, got ", seed);
  const std::string prefix = args.get("prefix", "model.");
  EXPERTQMM_CHECK(prefix == "model." || prefix == "language_model.model.", "write-checkpoint",
                  "--prefix expects model. or language_model.model., got '", prefix, "'");
  Gemma4Config c = Gemma4Config::gemma4_26b_a4b(layers, prefix);
  if (preset == "tiny") {
    c.hidden_size = 128;
    c.intermediate_size = 192;
    c.moe_intermediate_size = 64;
    c.num_experts = 8;
    c.top_k_experts = 2;
  } else {
    EXPERTQMM_CHECK(preset == "gemma4-26b-a4b", "write-checkpoint", "--preset expects gemma4-26b-a4b or tiny, got '",
                    preset, "'");
  }
  const size_t layer_bytes = synthetic_gemma4_layer(c, 0, uint64_t(seed), prefix).nbytes();
  const long default_shards = std::max<long>(1, std::min<long>(layers, long((layer_bytes * size_t(layers)) / (5ull << 30)) + 1));
  const long shards = args.get_int("shards", default_shards);
  EXPERTQMM_CHECK(shards >= 1 && shards <= layers, "write-checkpoint", "--shards must be in [1, layers=", layers,
                  "], got ", shards);
  std::fprintf(stderr, "writing %ld layers (%.2f GB) in %ld file(s) to %s ...\n", layers,
               double(layer_bytes) * double(layers) / 1e9, shards, out.c_str());
  write_gemma4_checkpoint(
      out, c, int(shards),
      [&](int n) {
        std::fprintf(stderr, "  layer %d\n", n);
        return synthetic_gemma4_layer(c, n, uint64_t(seed), prefix);
      },
      CheckpointWriteOptions{prefix});
  std::printf("wrote %s: %ld layers, %ld file(s)\n", out.c_str(), layers, shards);
  return 0;
}

}  // namespace expertqmm::cli

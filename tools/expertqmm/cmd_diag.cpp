// `expertqmm diag`: runs one MoE layer of a preset and prints the route selector's counters
// (expertqmm::diagnostics) for exactly that call.
#include <cstdio>
#include <string>

#include "cli.h"
#include "expertqmm/backend.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "expertqmm/moe.h"
#include "presets.h"
#include "synthetic.h"

namespace expertqmm::cli {

int run_diag(int argc, char** argv) {
  Args args(argc, argv);
  if (args.has("help")) {
    std::printf(
        "usage: expertqmm diag [--preset gemma4-26b-a4b] [--quant affine|mxfp4|mxfp8|nvfp4] [--tokens 64]\n"
        "                      [--backend auto|cpu|cuda] [--seed S]\n"
        "                      [--expert-tiles auto|on|off|both] [--product fused|separate]\n"
        "Runs one moe_layer call and prints the route selector's counters for exactly that call (both:\n"
        "one call with the tile route at its default, one with it off). The counters count the CUDA\n"
        "routes; on the CPU backend they stay 0.\n");
    return 0;
  }
  args.check_known({"preset", "quant", "tokens", "backend", "seed", "expert-tiles", "product"});
  const Preset preset = with_quant_option(find_preset(args.get("preset", "gemma4-26b-a4b")), args);
  const int64_t T = args.get_int("tokens", 64, 1, kMaxTokens);
  const uint64_t seed = uint64_t(args.get_int("seed", 1, 0, kMaxSeed));
  const std::vector<RouteSwitch> tile_settings = expert_tile_settings(args);
  const std::string product = args.get_choice("product", "fused", {"fused", "separate"});
  const Device device = resolve_backend(args.get("backend", "auto"));
  const Progress progress;  // the 26B-A4B layer takes seconds on the CPU

  progress.say("generating weights");
  set_product_mode(product == "separate" ? ProductMode::separate : ProductMode::fused);
  MoeWeights host;
  host.experts = synthetic_experts(preset, seed);
  host.router = synthetic_router(preset, seed);
  const MoeWeights weights = device == Device::cpu ? host : host.to(device);
  const Tensor x = random_tokens(T, preset.hidden, seed).to(device);

  const RouteSwitch tiles_before = expert_tiles_setting();
  for (RouteSwitch tiles : tile_settings) {
    set_expert_tiles(tiles);
    progress.say(detail::cat("running the layer on ", device_name(device), " (expert tiles ", expert_tiles_name(tiles),
                             ")").c_str());
    diagnostics::reset();
    Tensor out = moe_layer(x, weights);
    if (device == Device::cuda) cuda_check();
    std::printf("preset %s, backend %s (%s), tokens %lld, expert tiles %s, product %s\n", preset.name,
                device_name(device), device_label(device).c_str(), static_cast<long long>(T),
                expert_tiles_name(tiles), product.c_str());
    std::printf("%s", diagnostics::format(diagnostics::snapshot()).c_str());
    if (device == Device::cpu)
      std::printf("(the counters count the CUDA routes' selections; the CPU backend has no routes, so they are 0)\n");
  }
  set_expert_tiles(tiles_before);
  return 0;
}

}  // namespace expertqmm::cli

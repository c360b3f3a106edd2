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
        "usage: expertqmm diag [--preset gemma4-26b-a4b] [--tokens 64] [--backend auto|cpu|cuda] [--seed S]\n"
        "                      [--expert-tiles auto|on|off] [--product fused|separate]\n"
        "Runs one moe_layer call and prints the route selector's counters for exactly that call.\n");
    return 0;
  }
  args.check_known({"preset", "tokens", "backend", "seed", "expert-tiles", "product"});
  const Preset& preset = find_preset(args.get("preset", "gemma4-26b-a4b"));
  const int64_t T = args.get_int("tokens", 64);
  EXPERTQMM_CHECK(T >= 1, "diag", "--tokens must be >= 1, got ", T);
  const long seed = args.get_int("seed", 1);
  EXPERTQMM_CHECK(seed >= 0, "diag", "--seed must be >= 0, got ", seed);
  const std::string tiles = args.get("expert-tiles", "auto");
  EXPERTQMM_CHECK(tiles == "auto" || tiles == "on" || tiles == "off", "diag",
                  "--expert-tiles expects auto, on or off, got '", tiles, "'");
  const std::string product = args.get("product", "fused");
  EXPERTQMM_CHECK(product == "fused" || product == "separate", "diag", "--product expects fused or separate, got '",
                  product, "'");
  const Device device = resolve_backend(args.get("backend", "auto"));

  set_expert_tiles(tiles == "on" ? RouteSwitch::on : tiles == "off" ? RouteSwitch::off : RouteSwitch::automatic);
  set_product_mode(product == "separate" ? ProductMode::separate : ProductMode::fused);
  MoeWeights host;
  host.experts = synthetic_experts(preset, uint64_t(seed));
  host.router = synthetic_router(preset, uint64_t(seed));
  const MoeWeights weights = device == Device::cpu ? host : to_device(host, device);
  const Tensor x = random_tokens(T, preset.hidden, uint64_t(seed)).to(device);

  diagnostics::reset();
  Tensor out = moe_layer(x, weights);
  if (device == Device::cuda) cuda_check();
  std::printf("preset %s, backend %s (%s), tokens %lld, expert tiles %s, product %s\n", preset.name,
              device_name(device), device_label(device).c_str(), static_cast<long long>(T), tiles.c_str(),
              product.c_str());
  std::printf("%s", diagnostics::format(diagnostics::snapshot()).c_str());
  return 0;
}

}  // namespace expertqmm::cli

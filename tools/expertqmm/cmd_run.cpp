// `expertqmm run`: the main job. Builds a preset's synthetic weights, runs expertqmm::moe_layer on a
// backend, times it, and checks sampled tokens against a float64 reference.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cli.h"
#include "expertqmm/backend.h"
#include "expertqmm/error.h"
#include "expertqmm/moe.h"
#include "presets.h"
#include "reference.h"
#include "synthetic.h"

namespace expertqmm::cli {

namespace {

constexpr double kTolerance = 1e-2;  // docs/numerics.md: bf16 in, bf16 out vs float64
constexpr double kZipfExponent = 1.1;

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

std::string sci(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3e", v);
  return buf;
}

// C distinct token ids in [0, T), ascending, drawn with the seed.
std::vector<int64_t> sample_tokens(int64_t T, int64_t C, uint64_t seed) {
  std::vector<int64_t> all(T);
  for (int64_t t = 0; t < T; ++t) all[t] = t;
  SplitMix64 g(derive_seed(seed, 70));
  for (int64_t i = 0; i < C; ++i) std::swap(all[i], all[i + int64_t(g.next() % uint64_t(T - i))]);
  all.resize(C);
  std::sort(all.begin(), all.end());
  return all;
}

void print_table(const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t width = 0;
  for (auto& r : rows) width = std::max(width, r.first.size());
  for (auto& r : rows) std::printf("%-*s  %s\n", int(width), r.first.c_str(), r.second.c_str());
  std::fflush(stdout);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int run_run(int argc, char** argv) {
  Args args(argc, argv);
  if (args.has("help")) {
    std::printf(
        "usage: expertqmm run --tokens N [--preset gemma4-26b-a4b] [--quant affine|mxfp4|mxfp8|nvfp4]\n"
        "                     [--backend auto|cpu|cuda] [--seed S] [--routing uniform|zipf] [--check-tokens C]\n"
        "                     [--tiled]\n"
        "Runs expertqmm::moe_layer on synthetic weights of the preset and random bf16 tokens, times it,\n"
        "and checks C sampled tokens (default min(N, 4)) against a float64 reference: PASS when the\n"
        "relative error is <= 1e-2 (exit 0), else FAIL (exit 1). zipf routing samples the experts\n"
        "(Zipf s=1.1) and calls switch_glu + weighted_combine instead of the router. --tiled adds the\n"
        "experts' tile layout at load (MoeWeights::tile_experts, docs/tile-layout.md).\npresets:\n");
    for (const Preset& p : presets()) std::printf("  %-22s %s\n", p.name, p.description);
    return 0;
  }
  args.check_known({"preset", "quant", "tokens", "backend", "seed", "routing", "check-tokens", "tiled"});
  const Preset preset = with_quant_option(find_preset(args.get("preset", "gemma4-26b-a4b")), args);
  args.get_required("tokens", "N");
  const int64_t T = args.get_int("tokens", 0, 1, kMaxTokens);
  const uint64_t seed = uint64_t(args.get_int("seed", 1, 0, kMaxSeed));
  const std::string routing = args.get_choice("routing", "uniform", {"uniform", "zipf"});
  const int64_t C = args.get_int("check-tokens", std::min<int64_t>(T, 4), 1, T);
  const Device device = resolve_backend(args.get("backend", "auto"));
  const int64_t H = preset.hidden, k = preset.top_k;
  // Only for presets big enough that a stage takes seconds.
  const Progress progress{preset.expert_bytes() > (int64_t(64) << 20)};

  progress.say("generating weights");
  MoeWeights host;
  host.experts = synthetic_experts(preset, seed);
  host.router = synthetic_router(preset, seed);
  const Tensor x_host = random_tokens(T, H, seed);
  MoeWeights weights = device == Device::cpu ? host : host.to(device);
  // Only the CUDA kernels read the tile layout: on the CPU it would be a second copy of the experts for nothing.
  if (args.get_flag("tiled") && device == Device::cuda) weights.tile_experts();
  const Tensor x = x_host.to(device);

  // Zipf routing bypasses the learned router: sampled indices and weights go straight into the
  // expert path. Uniform routing is what the synthetic router does with random tokens.
  std::vector<int32_t> zipf_idx;
  std::vector<uint16_t> zipf_w;
  Tensor idx_t, w_t;
  if (routing == "zipf") {
    zipf_idx = zipf_routing(T, preset.experts, int(k), kZipfExponent, seed);
    zipf_w = random_routing_weights(T, int(k), seed);
    idx_t = Tensor::from_host(zipf_idx.data(), {T, k}, DType::i32, device);
    w_t = Tensor::from_host(zipf_w.data(), {T, k}, DType::bf16, device);
  }
  auto layer = [&]() -> Tensor {
    if (routing == "zipf") return weighted_combine(switch_glu(x, idx_t, weights.experts), w_t);
    return moe_layer(x, weights);
  };

  progress.say("running");
  Tensor out;
  double seconds = 0;
  if (device == Device::cuda) {
    layer();  // warm-up: first-use setup and the allocator's cache stay out of the timing
    cuda_check();
    const auto t0 = std::chrono::steady_clock::now();
    out = layer();
    cuda_check();  // synchronizes the stream, so the clock covers the device work
    seconds = seconds_since(t0);
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    out = layer();
    seconds = seconds_since(t0);
  }

  // The reference needs the routing moe_layer used. It is recomputed with expertqmm::route on the
  // SAME backend: route is deterministic on a device, so these are the indices and weights
  // moe_layer saw. Re-routing on the CPU instead could flip a near-tie of the bf16 logits and
  // blame the expert path for a router rounding difference; the CPU router is compared below,
  // for information only.
  std::vector<int32_t> indices;
  std::vector<float> route_w;
  if (routing == "zipf") {
    indices = zipf_idx;
    route_w = host_floats(w_t);
  } else {
    Routing r = route(x, weights.router);
    indices = host_i32(r.indices);
    route_w = host_floats(r.weights);
  }
  EXPERTQMM_CHECK(int64_t(indices.size()) == T * k, "run", "routing returned ", indices.size(),
                  " indices, expected ", T * k);
  const int64_t experts_hit = int64_t(std::set<int32_t>(indices.begin(), indices.end()).size());

  progress.say("checking");
  const std::vector<int64_t> checked = sample_tokens(T, C, seed);
  const std::vector<float> out_host = host_floats(out);
  const std::vector<float> x_f = host_floats(x_host);
  const std::vector<double> ref = reference_tokens(host.experts, x_f, H, checked, indices, route_w, k);
  EXPERTQMM_CHECK(int64_t(out_host.size()) == T * H, "run", "moe_layer returned ", out.describe(), ", expected [",
                  T, ", ", H, "]");
  double worst = 0;
  for (size_t n = 0; n < checked.size(); ++n) {
    const double e = rel_error(out_host.data() + checked[n] * H, ref.data() + n * H, H);
    worst = (e != e || e > worst) ? e : worst;
  }
  const bool pass = worst <= kTolerance;  // NaN fails

  std::string router_note;
  if (routing == "uniform" && device != Device::cpu) {
    std::vector<uint16_t> rows(C * H);
    const std::vector<uint8_t> xb = x_host.to_host_bytes();
    for (int64_t n = 0; n < C; ++n)
      std::copy_n(reinterpret_cast<const uint16_t*>(xb.data()) + checked[n] * H, H, rows.data() + n * H);
    Routing cpu = route(Tensor::from_host(rows.data(), {C, H}, DType::bf16), host.router);
    const std::vector<int32_t> cpu_idx = host_i32(cpu.indices);
    int64_t same = 0;
    for (int64_t n = 0; n < C; ++n) {
      std::set<int32_t> a(cpu_idx.begin() + n * k, cpu_idx.begin() + (n + 1) * k);
      std::set<int32_t> b(indices.begin() + checked[n] * k, indices.begin() + (checked[n] + 1) * k);
      same += a == b;
    }
    router_note = detail::cat(same, "/", C, " checked tokens pick the same experts");
  }

  const double flops = double(T * k) * preset.flops_per_assignment();
  std::vector<std::pair<std::string, std::string>> rows = {
      {"preset", preset.name},
      {"quant", detail::cat(quant_mode_name(preset.mode), " ", preset.bits, "-bit g", preset.group_size)},
      {"backend", device_name(device)},
      {"device", device_label(device)},
      {"routing", routing == "zipf" ? "zipf (s=1.1, sampled)" : "uniform (synthetic router)"},
      {"tokens", std::to_string(T)},
      {"assignments", std::to_string(T * k)},
      {"experts hit", detail::cat(experts_hit, "/", preset.experts)},
      {"time ms", fixed(seconds * 1e3, 3)},
      {"GFLOP/s", fixed(flops / seconds / 1e9, 1)},
      {"checked tokens", std::to_string(C)},
      {"rel error", sci(worst)},
  };
  if (!router_note.empty()) rows.push_back({"cpu router", router_note});
  rows.push_back({"status", pass ? "PASS" : detail::cat("FAIL (rel error > ", kTolerance, ")")});
  print_table(rows);
  return pass ? 0 : 1;
}

}  // namespace expertqmm::cli

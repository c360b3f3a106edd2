// `expertqmm bench --model DIR`: the feed-forward part of every layer of a checkpoint, run back to
// back as one CUDA graph per token count. Gemma 4: dense GeGLU MLP, router, experts, the five norms,
// residual and layer_scalar (gemma4_ffn); Qwen3-MoE: post_attention_layernorm, router, experts and
// residual (qwen3_moe_ffn). Attention is not run (it is not part of expertqmm) and the output says
// so. Reports µs per layer, tokens/s for prefill (T > 64) and decode (T <= 64) token counts, with the
// fused and the separate GLU product, and the GPU memory the loaded layers and workspace take. With
// --versus VAR=VALUE[,...] each size also runs with those settings (set_setting) in the same process,
// replays of the two graphs alternating, so that a setting's A/B is free of the ~1-2 µs per layer
// that separate processes differ by at decode sizes (bench/NOTES.md step 34).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "cli.h"
#include "expertqmm/backend.h"
#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"
#include "expertqmm/settings.h"
#include "presets.h"
#include "synthetic.h"
#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/check.cuh"
#endif

namespace expertqmm::cli {

namespace {

constexpr int64_t kDecodeMaxTokens = 64;  // token counts up to this are reported as decode steps

struct ModelBenchOptions {
  std::string dir;
  std::vector<int64_t> tokens;
  std::vector<ProductMode> products;
  int replays = 20;
  std::string json_path;
  uint64_t seed = 1;
  std::vector<std::pair<std::string, std::string>> versus;  // (variable, value): the second configuration
  std::string versus_text;                                   // as given: "EXPERTQMM_X=1,EXPERTQMM_Y=0"
  bool tiled = false;  // --tiled: each layer's experts with their tile layout (MoeWeights::tile_experts)
};

void print_model_usage() {
  std::printf(
      "usage: expertqmm bench --model DIR [--tokens 1,8,16,32,64,512,1024,2048] [--product fused|separate|both]\n"
      "                       [--replays 20] [--json FILE] [--seed S] [--versus VAR=VALUE[,VAR=VALUE...]]\n"
      "                       [--tiled]\n"
      "Loads every layer of the Gemma 4 or Qwen3-MoE checkpoint in DIR to the GPU and times the feed-forward part of\n"
      "all layers back to back (attention excluded) as one CUDA graph per token count: median of the\n"
      "replays, µs per layer, tokens/s (T <= 64: decode, else prefill), fused and separate GLU product.\n"
      "--versus: also each size with those EXPERTQMM_* settings (`expertqmm info` lists them), the two graphs'\n"
      "replays alternating in this process; the rows say which configuration, and the change.\n"
      "--tiled: each layer's experts also in their tile layout (docs/tile-layout.md), made at load.\n");
}

ModelBenchOptions parse_model_options(int argc, char** argv) {
  Args args(argc, argv);
  args.check_known({"model", "tokens", "product", "replays", "json", "seed", "versus", "tiled"});
  ModelBenchOptions o;
  o.dir = args.get_required("model", "DIR");
  o.tokens = args.get_int_list("tokens", {1, 8, 16, 32, 64, 512, 1024, 2048}, 1, kMaxTokens);
  o.products = product_modes(args, "both");
  o.replays = int(args.get_int("replays", 20, 1, 10000));
  o.json_path = args.get_optional("json", "a file name");
  o.seed = uint64_t(args.get_int("seed", 1, 0, kMaxSeed));
  o.versus_text = args.get_optional("versus", "VAR=VALUE[,VAR=VALUE...]");
  o.tiled = args.get_flag("tiled");
  size_t at = 0;
  while (!o.versus_text.empty() && at <= o.versus_text.size()) {
    const size_t end = std::min(o.versus_text.find(',', at), o.versus_text.size());
    const std::string item = o.versus_text.substr(at, end - at);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) usage_error("--versus: '" + item + "' is not VAR=VALUE");
    o.versus.emplace_back(item.substr(0, eq), item.substr(eq + 1));
    at = end + 1;
  }
  // A bad variable or value fails here, before any loading (the process has no overrides yet).
  for (const auto& [variable, value] : o.versus) {
    try {
      set_setting(variable, value);
    } catch (const Error& e) {
      usage_error(std::string("--versus: ") + e.what());
    }
    set_setting(variable, std::nullopt);
  }
  return o;
}

}  // namespace

#ifndef EXPERTQMM_HAVE_CUDA

int run_bench_model(int argc, char** argv) {
  if (Args(argc, argv).has("help")) return print_model_usage(), 0;
  const ModelBenchOptions o = parse_model_options(argc, argv);
  (void)Gemma4Checkpoint::open(o.dir);  // a bad checkpoint is reported as such even here
  throw Error("bench", "--model needs the CUDA backend; this build has none (configure with -DEXPERTQMM_CUDA=ON)");
}

#else

namespace {

struct Row {
  int64_t tokens = 0;
  ProductMode product = ProductMode::fused;
  bool versus = false;  // measured with --versus's settings
  double median_us = 0, min_us = 0, max_us = 0;
};

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

const char* product_label(ProductMode m) { return m == ProductMode::fused ? "fused" : "separate"; }

// The 16-bit (unquantized) weights of layer l's MoE part, by module name ("l0.experts.down").
void sixteen_bit_moe_weights(const MoeWeights& w, const std::string& p, std::vector<std::string>& names) {
  const SwitchGLUWeights& e = w.experts;
  const std::pair<const char*, bool> all[] = {{"router.proj", w.router.proj_dense.defined()},
                                              {"experts.gate", e.gate_dense.defined()},
                                              {"experts.up", e.up_dense.defined()},
                                              {"experts.gate_up", e.gate_up_dense.defined()},
                                              {"experts.down", e.down_dense.defined()}};
  for (const auto& [name, dense] : all)
    if (dense) names.push_back(p + name);
}

// Every layer of a checkpoint on the GPU, of its family (exactly one list is filled).
struct DeviceLayers {
  std::vector<Gemma4FfnWeights> gemma4;
  std::vector<Qwen3MoeFfnWeights> qwen3;
  size_t weight_bytes = 0;
  std::vector<std::string> sixteen_bit;  // by module name, "l0.mlp.gate"

  void load(const Gemma4Checkpoint& ck, bool tiled) {
    for (int l = 0; l < ck.num_layers(); ++l) {
      const std::string p = "l" + std::to_string(l) + ".";
      if (ck.family() == ModelFamily::qwen3_moe) {
        qwen3.push_back(ck.qwen3_moe_layer(l).to(Device::cuda));
        if (tiled) qwen3.back().moe.tile_experts();  // on the device (the CUDA backend's kernels)
        weight_bytes += qwen3.back().nbytes();
        sixteen_bit_moe_weights(qwen3.back().moe, p, sixteen_bit);
        continue;
      }
      gemma4.push_back(ck.layer(l).to(Device::cuda));
      if (tiled) gemma4.back().moe.tile_experts();
      const Gemma4FfnWeights& w = gemma4.back();
      weight_bytes += w.nbytes();
      for (const auto& [name, l16] : {std::pair<const char*, const Linear*>{"mlp.gate", &w.mlp.gate},
                                      {"mlp.up", &w.mlp.up},
                                      {"mlp.down", &w.mlp.down}})
        if (l16->defined() && !l16->is_quantized()) sixteen_bit.push_back(p + name);
      sixteen_bit_moe_weights(w.moe, p, sixteen_bit);
    }
  }
  size_t size() const { return gemma4.size() + qwen3.size(); }
  void ffn_into(size_t l, Tensor& out, const Tensor& in, Workspace& ws) const {
    if (!qwen3.empty()) qwen3_moe_ffn_into(out, in, qwen3[l], ws);
    else gemma4_ffn_into(out, in, gemma4[l], ws);
  }
};

// Runs all layers: layer 0 reads x0 (kept intact so every replay starts from the same input),
// the others ping-pong between a and b. Returns the buffer holding the last layer's output.
Tensor* run_layers(const DeviceLayers& layers, const Tensor& x0, Tensor& a, Tensor& b, Workspace& ws) {
  const Tensor* in = &x0;
  Tensor* out = &a;
  for (size_t l = 0; l < layers.size(); ++l) {
    layers.ffn_into(l, *out, *in, ws);
    in = out;
    out = out == &a ? &b : &a;
  }
  return const_cast<Tensor*>(in);
}

}  // namespace

int run_bench_model(int argc, char** argv) {
  if (Args(argc, argv).has("help")) return print_model_usage(), 0;
  const ModelBenchOptions o = parse_model_options(argc, argv);
  EXPERTQMM_CHECK(cuda_available(), "bench", "needs a usable CUDA device; none was found");
  const Gemma4Checkpoint ck = Gemma4Checkpoint::open(o.dir);
  const Gemma4Config& c = ck.config();
  const int64_t H = c.hidden_size;

  cudaStream_t stream = nullptr;
  EXPERTQMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ProductMode mode;
    ~StreamGuard() {
      set_product_mode(mode);
      set_cuda_stream(nullptr);
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
  } guard{stream, product_mode()};
  set_cuda_stream(stream);

  size_t free_before = 0, total = 0;
  EXPERTQMM_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  std::fprintf(stderr, "loading %d layers of %s to the GPU ...\n", ck.num_layers(), o.dir.c_str());
  DeviceLayers layers;
  layers.load(ck, o.tiled);
  const size_t weight_bytes = layers.weight_bytes;
  const std::vector<std::string>& dense_weights = layers.sixteen_bit;

  std::vector<Row> rows;
  Workspace ws;
  cudaEvent_t start, stop;
  EXPERTQMM_CUDA_CHECK(cudaEventCreate(&start));
  EXPERTQMM_CUDA_CHECK(cudaEventCreate(&stop));
  for (long T : o.tokens) {
    const Tensor x0 = random_tokens(T, H, derive_seed(o.seed, uint64_t(T))).to(Device::cuda);
    Tensor a = Tensor::empty({T, H}, DType::bf16, Device::cuda), b = Tensor::empty({T, H}, DType::bf16, Device::cuda);
    for (ProductMode mode : o.products) {
      set_product_mode(mode);
      // Configuration 0: the settings as they are; 1: with --versus's overrides on top.
      const int configs = o.versus.empty() ? 1 : 2;
      auto configure = [&](int config) {
        for (const auto& [variable, value] : o.versus)
          set_setting(variable, config == 1 ? std::optional<std::string>(value) : std::nullopt);
      };
      // Both warmed before either is captured: the workspace grows to the larger one's needs, and
      // neither graph then points at memory the other's warm-up freed.
      for (int config = 0; config < configs; ++config) {
        configure(config);
        run_layers(layers, x0, a, b, ws);
      }
      cuda_check();
      cudaGraphExec_t exec[2] = {nullptr, nullptr};
      for (int config = 0; config < configs; ++config) {
        configure(config);
        cudaGraph_t graph = nullptr;
        EXPERTQMM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        try {
          run_layers(layers, x0, a, b, ws);
        } catch (...) {
          cudaStreamEndCapture(stream, &graph);
          if (graph) cudaGraphDestroy(graph);
          configure(0);
          throw;
        }
        EXPERTQMM_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        EXPERTQMM_CUDA_CHECK(cudaGraphInstantiate(&exec[config], graph, 0));
        EXPERTQMM_CUDA_CHECK(cudaGraphDestroy(graph));
      }
      configure(0);
      for (int config = 0; config < configs; ++config)
        EXPERTQMM_CUDA_CHECK(cudaGraphLaunch(exec[config], stream));  // warm-up replays
      EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<double> us[2];
      for (int r = 0; r < o.replays; ++r)
        for (int config = 0; config < configs; ++config) {  // alternating: drift hits both alike
          EXPERTQMM_CUDA_CHECK(cudaEventRecord(start, stream));
          EXPERTQMM_CUDA_CHECK(cudaGraphLaunch(exec[config], stream));
          EXPERTQMM_CUDA_CHECK(cudaEventRecord(stop, stream));
          EXPERTQMM_CUDA_CHECK(cudaEventSynchronize(stop));
          float ms = 0;
          EXPERTQMM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
          us[config].push_back(double(ms) * 1e3);
        }
      cuda_check();
      for (int config = 0; config < configs; ++config) {
        EXPERTQMM_CUDA_CHECK(cudaGraphExecDestroy(exec[config]));
        Row row;
        row.tokens = T;
        row.product = mode;
        row.versus = config == 1;
        row.median_us = median_of(us[config]);
        row.min_us = *std::min_element(us[config].begin(), us[config].end());
        row.max_us = *std::max_element(us[config].begin(), us[config].end());
        rows.push_back(row);
      }
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  size_t free_after = 0;
  EXPERTQMM_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  const double used_gib = double(free_before - std::min(free_before, free_after)) / double(1ull << 30);

  const int L = ck.num_layers();
  std::printf("model %s (%s): %d layers, H=%lld, dense I=%lld, %lld experts x I=%lld, top-%lld (attention excluded: "
              "feed-forward part only)\n",
              o.dir.c_str(), model_family_name(c.family), L, (long long)H,
              (long long)(c.family == ModelFamily::gemma4 ? c.intermediate_size : 0), (long long)c.num_experts,
              (long long)c.moe_intermediate_size, (long long)c.top_k_experts);
  std::printf("device %s: layer weights %.2f GiB, GPU memory used %.2f GiB (weights + workspace + buffers)\n",
              cuda_device_name(), double(weight_bytes) / double(1ull << 30), used_gib);
  std::printf("16-bit weights: %zu%s\n", dense_weights.size(),
              dense_weights.empty() ? " (every projection quantized)"
                                    : (" (first: " + dense_weights.front() + ")").c_str());
  if (!o.versus.empty()) std::printf("configurations: as set (default), and with %s (versus)\n", o.versus_text.c_str());
  std::printf("%-8s %6s %-8s %12s %12s %14s%s\n", "phase", "tokens", "product", "all layers", "per layer", "tokens/s",
              o.versus.empty() ? "" : "  config     change");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf("%-8s %6lld %-8s %10.1f us %10.1f us %14.1f", r.tokens <= kDecodeMaxTokens ? "decode" : "prefill",
                (long long)r.tokens, product_label(r.product), r.median_us, r.median_us / L,
                double(r.tokens) / (r.median_us * 1e-6));
    if (o.versus.empty()) std::printf("\n");
    else if (!r.versus) std::printf("  default\n");
    else std::printf("  versus  %+7.1f%%\n", 100.0 * (r.median_us / rows[i - 1].median_us - 1.0));
  }

  if (!o.json_path.empty()) {
    std::ofstream js(o.json_path);
    EXPERTQMM_CHECK(bool(js), "bench", "cannot write --json file '", o.json_path, "'");
    js << "{\n  \"bench\": \"model_ffn\",\n  \"commit\": " << json_string(commit_id()) << ",\n  \"gpu\": "
       << json_string(cuda_device_name()) << ",\n  \"note\": \"attention excluded: feed-forward part of every layer\",\n"
       << "  \"model\": " << json_string(o.dir) << ",\n  \"family\": " << json_string(model_family_name(c.family))
       << ",\n  \"device\": " << json_string(cuda_device_name()) << ",\n"
       << "  \"layers\": " << L << ",\n  \"hidden\": " << H << ",\n  \"weight_bytes\": " << weight_bytes
       << ",\n  \"gpu_memory_used_bytes\": " << (free_before - std::min(free_before, free_after))
       << ",\n  \"replays\": " << o.replays << ",\n  \"tiled\": " << (o.tiled ? "true" : "false");
    if (!o.versus.empty()) js << ",\n  \"versus\": " << json_string(o.versus_text);
    js << ",\n  \"sixteen_bit_weights\": [";
    for (size_t i = 0; i < dense_weights.size(); ++i) js << (i ? ", " : "") << '"' << dense_weights[i] << '"';
    js << "],\n  \"results\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      js << (i ? "," : "") << "\n    {\"phase\": \"" << (r.tokens <= kDecodeMaxTokens ? "decode" : "prefill")
         << "\", \"tokens\": " << r.tokens << ", \"product\": \"" << product_label(r.product)
         << "\", \"median_us\": " << r.median_us << ", \"min_us\": " << r.min_us << ", \"max_us\": " << r.max_us
         << ", \"us_per_layer\": " << r.median_us / L << ", \"tokens_per_s\": " << double(r.tokens) / (r.median_us * 1e-6);
      if (!o.versus.empty()) js << ", \"config\": \"" << (r.versus ? "versus" : "default") << '"';
      js << "}";
    }
    js << "\n  ]\n}\n";
  }
  return 0;
}

#endif

}  // namespace expertqmm::cli

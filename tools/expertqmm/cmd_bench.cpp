// `expertqmm bench`: the benchmark protocol of DESIGN.md, as documented in bench/README.md.
// The whole MoE layer (expertqmm::moe_layer_into with a warmed Workspace) is captured in a CUDA
// graph per weight copy; 4 copies are replayed round robin with an L2 flush before each replay
// (outside the timed region); each replay has its own event pair. The floor is measured in the
// same run: device-to-device copy bandwidth and the cuBLAS bf16 tensor-core rate.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "core/settings.h"
#include "expertqmm/backend.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "expertqmm/moe.h"
#include "presets.h"

#ifdef EXPERTQMM_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <filesystem>
#include <memory>

#include "core/float16.h"
#include "core/gather_qmm_problem.h"  // detail::cast_floating
#include "cpu/cpu_backend.h"
#include "cuda/check.cuh"
#include "expertqmm/safetensors.h"
#include "reference.h"
#include "replay_timing.h"
#include "synthetic.h"
#endif

namespace expertqmm::cli {

namespace {

struct BenchOptions {
  Preset preset{};  // with --quant applied
  std::vector<int64_t> tokens;
  std::string routing;
  std::vector<ProductMode> products;
  std::vector<RouteSwitch> tile_settings;  // expert tile route: auto (its default), on, off, or auto and off
  std::string json_path;
  std::string export_dir;
  int replays = 100;
  bool gated = true;  // --ungated: replays without host gates (under a profiler)
  bool tiled = false;  // --tiled: the experts' tile layout made at load (MoeWeights::tile_experts)
  uint64_t seed = 1;
};

void print_usage() {
  std::printf(
      "usage: expertqmm bench [--preset gemma4-26b-a4b] [--quant affine|mxfp4|mxfp8|nvfp4]\n"
      "                       [--tokens 1,8,64,512,1024,2048] [--routing uniform|zipf]\n"
      "                       [--product fused|separate|both] [--expert-tiles auto|on|off|both] [--json FILE]\n"
      "                       [--replays 100] [--export-dir DIR]\n"
      "                       [--seed S] [--ungated] [--tiled]\n"
      "Times the whole MoE layer as CUDA graph replays (4 weight copies round robin, L2 flushed between\n"
      "replays, median of the replays) against a floor measured in the same run; bench/README.md has\n"
      "the protocol. --ungated enqueues the replays without holding them until all are queued, for\n"
      "profilers that serialize launches (ncu: scripts/profile-layer); its times include launch latency.\n"
      "--tiled adds the experts' tile layout at load (docs/tile-layout.md), which the warp-specialized\n"
      "wgmma build reads (EXPERTQMM_WGMMA_WS=1).\n"
      "CUDA only.\n");
}

BenchOptions parse_options(int argc, char** argv) {
  Args args(argc, argv);
  args.check_known(
      {"preset", "quant", "tokens", "routing", "product", "expert-tiles", "json", "replays", "export-dir", "seed",
       "ungated", "tiled"});
  BenchOptions o;
  o.preset = with_quant_option(find_preset(args.get("preset", "gemma4-26b-a4b")), args);
  o.tokens = args.get_int_list("tokens", {1, 8, 64, 512, 1024, 2048}, 1, kMaxTokens);
  o.routing = args.get_choice("routing", "uniform", {"uniform", "zipf"});
  o.products = product_modes(args, "fused");
  // --expert-tiles off (or both) also times the layer with the sorted tile route switched off, so one
  // run shows the tile route against the generic routes it falls back to.
  o.tile_settings = expert_tile_settings(args);
  o.json_path = args.get_optional("json", "a file name");
  o.export_dir = args.get_optional("export-dir", "a directory");
  o.replays = int(args.get_int("replays", 100, 1, 100000));
  o.seed = uint64_t(args.get_int("seed", 1, 0, kMaxSeed));
  o.gated = !args.get_flag("ungated");
  o.tiled = args.get_flag("tiled");
  return o;
}

}  // namespace

int run_bench_model(int argc, char** argv);  // cmd_bench_model.cpp: bench --model DIR

#ifndef EXPERTQMM_HAVE_CUDA

int run_bench(int argc, char** argv) {
  if (Args(argc, argv).has("model")) return run_bench_model(argc, argv);
  if (Args(argc, argv).has("help")) return print_usage(), 0;
  parse_options(argc, argv);  // bad options are reported as such even here
  throw Error("bench", "needs the CUDA backend; this build has none (configure with -DEXPERTQMM_CUDA=ON)");
}

#else

namespace {

constexpr int kWeightCopies = 4;      // distinct weight copies replayed round robin
constexpr double kTolerance = 1e-2;   // docs/numerics.md, bf16 vs float64
constexpr double kZipfExponent = 1.1;
constexpr int kMinProtocolReplays = 50;

#define BENCH_CUBLAS_CHECK(call)                                                                       \
  do {                                                                                                 \
    cublasStatus_t st_ = (call);                                                                       \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                  \
      throw ::expertqmm::Error("bench", ::expertqmm::detail::cat(#call, " failed: cuBLAS status ", int(st_))); \
  } while (0)

using timing::DeviceBuffer;
using timing::EventPairs;
using timing::Stats;
using timing::stats_of;

struct Ceilings {
  double copy_gbps = 0;    // bytes read + written per second / 1e9
  double bf16_tflops = 0;  // dense 8192^3 bf16 GEMM, fp32 accumulation
};

// Device-to-device copy of 1 GiB, median of 10 after a warm-up; counts bytes read and written.
double measure_copy_gbps(cudaStream_t stream) {
  const size_t bytes = size_t(1) << 30;
  DeviceBuffer src(bytes), dst(bytes);
  EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(src.ptr, 1, bytes, stream));
  const int reps = 10;
  EventPairs ev(reps);
  EXPERTQMM_CUDA_CHECK(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, stream));
  for (int r = 0; r < reps; ++r) {
    EXPERTQMM_CUDA_CHECK(cudaEventRecord(ev.start[r], stream));
    EXPERTQMM_CUDA_CHECK(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, stream));
    EXPERTQMM_CUDA_CHECK(cudaEventRecord(ev.stop[r], stream));
  }
  EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return 2.0 * double(bytes) / (stats_of(ev.elapsed_us()).median * 1e-6) / 1e9;
}

// cublasGemmEx 8192^3, bf16 in and out, fp32 compute, on random data (zeros would flatter the
// rate through lower power draw); median of 10 after 3 warm-ups.
double measure_bf16_tflops(cudaStream_t stream) {
  const int n = 8192;
  const size_t elems = size_t(n) * n, bytes = elems * 2;
  std::vector<uint16_t> host(elems);
  SplitMix64 g(12345);
  for (size_t i = 0; i + 4 <= elems; i += 4) {
    uint64_t r = g.next();
    for (int j = 0; j < 4; ++j) {
      // Random sign and mantissa, exponent in [2^-8, 2^0): values of a few 1e-3 .. 1.
      const uint16_t bits = uint16_t(r >> (16 * j));
      host[i + j] = uint16_t((bits & 0x807f) | ((0x77 + (bits >> 7) % 8) << 7));
    }
  }
  DeviceBuffer a(bytes), b(bytes), c(bytes);
  EXPERTQMM_CUDA_CHECK(cudaMemcpy(a.ptr, host.data(), bytes, cudaMemcpyHostToDevice));
  EXPERTQMM_CUDA_CHECK(cudaMemcpy(b.ptr, host.data(), bytes, cudaMemcpyHostToDevice));
  cublasHandle_t handle = nullptr;
  BENCH_CUBLAS_CHECK(cublasCreate(&handle));
  struct HandleGuard {
    cublasHandle_t h;
    ~HandleGuard() { cublasDestroy(h); }
  } guard{handle};
  BENCH_CUBLAS_CHECK(cublasSetStream(handle, stream));
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&] {
    BENCH_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.ptr, CUDA_R_16BF, n, b.ptr,
                                    CUDA_R_16BF, n, &beta, c.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
  };
  for (int i = 0; i < 3; ++i) gemm();
  const int reps = 10;
  EventPairs ev(reps);
  for (int r = 0; r < reps; ++r) {
    EXPERTQMM_CUDA_CHECK(cudaEventRecord(ev.start[r], stream));
    gemm();
    EXPERTQMM_CUDA_CHECK(cudaEventRecord(ev.stop[r], stream));
  }
  EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return 2.0 * double(n) * n * n / (stats_of(ev.elapsed_us()).median * 1e-6) / 1e12;
}

struct NodeCounts {
  int kernels = 0, memsets = 0, memcpys = 0, other = 0;
  int total() const { return kernels + memsets + memcpys + other; }
};

void count_nodes(cudaGraph_t graph, NodeCounts& c) {
  size_t n = 0;
  EXPERTQMM_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  if (n) EXPERTQMM_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    EXPERTQMM_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeKernel) ++c.kernels;
    else if (type == cudaGraphNodeTypeMemset) ++c.memsets;
    else if (type == cudaGraphNodeTypeMemcpy) ++c.memcpys;
    else if (type == cudaGraphNodeTypeGraph) {
      cudaGraph_t child = nullptr;
      EXPERTQMM_CUDA_CHECK(cudaGraphChildGraphNodeGetGraph(node, &child));
      count_nodes(child, c);
    } else {
      ++c.other;  // events, host nodes, conditional nodes (their bodies are not walked)
    }
  }
}

using timing::Graphs;

struct Measurement {
  Stats us;
  NodeCounts nodes;
  size_t workspace_bytes = 0;  // scratch the layer holds beyond weights, input and output
  std::vector<RouteCounters> counters;
};

// Captures moe_layer_into for every copy and times `replays` replays round robin.
Measurement time_layer(Tensor& out, const Tensor& h, const std::vector<MoeWeights>& copies, int replays,
                       bool gated, cudaStream_t stream, const DeviceBuffer& flush) {
  Workspace ws;
  diagnostics::reset();
  // Warm-up: grows the workspace to this token count and runs first-use setup, so that the
  // captured calls allocate nothing and never synchronize.
  for (const MoeWeights& w : copies) moe_layer_into(out, h, h, w, ws);
  cuda_check();

  Graphs g;
  for (const MoeWeights& w : copies)
    timing::capture_into(g, stream, "moe_layer_into", [&] { moe_layer_into(out, h, h, w, ws); });
  Measurement m;
  count_nodes(g.graphs[0], m.nodes);
  m.workspace_bytes = ws.bytes_held();

  const int n_copies = int(copies.size());
  for (int r = 0; r < 2 * n_copies; ++r) EXPERTQMM_CUDA_CHECK(cudaGraphLaunch(g.execs[r % n_copies], stream));
  cuda_check();

  const std::vector<double> us = timing::timed_replays(g.execs, replays, stream, flush, gated);
  cuda_check();
  m.us = stats_of(us);
  m.counters = diagnostics::snapshot();
  return m;
}

// ---- JSON (json_out.h has the writer's helpers) ----

std::string counters_json(const std::vector<RouteCounters>& counters) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < counters.size(); ++i) {
    const RouteCounters& c = counters[i];
    s << (i ? ", " : "") << "{\"primitive\": " << json_string(c.primitive) << ", \"attempts\": " << c.attempts
      << ", \"requested\": " << c.requested << ", \"available\": " << c.available << ", \"hits\": " << c.hits
      << ", \"fallbacks\": {";
    for (int f = 0; f < kFallbackCount; ++f)
      s << (f ? ", " : "") << json_string(fallback_name(Fallback(f))) << ": " << c.fallbacks[f];
    s << "}}";
  }
  return s.str() + "]";
}


const char* product_name(ProductMode m) { return m == ProductMode::fused ? "fused" : "separate"; }

// ---- export for the torch peer (bench/peers/torch_grouped.py) ----

void export_weights(const std::string& dir, const Preset& p, const SwitchGLUWeights& ex, const std::string& routing) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  auto add = [&](const std::string& name, const QuantizedWeight& q) {
    tensors.push_back({"switch_glu." + name + ".weight", q.w});
    tensors.push_back({"switch_glu." + name + ".scales", q.scales});
    if (q.biases.defined()) tensors.push_back({"switch_glu." + name + ".biases", q.biases});  // affine only
  };
  if (ex.fused()) {
    add("gate_up_proj", ex.gate_up);
  } else {
    add("gate_proj", ex.gate);
    add("up_proj", ex.up);
  }
  add("down_proj", ex.down);
  save_safetensors(dir + "/weights.safetensors", tensors,
                   {{"preset", p.name},
                    {"routing", routing},
                    {"experts", std::to_string(p.experts)},
                    {"top_k", std::to_string(p.top_k)},
                    {"hidden", std::to_string(p.hidden)},
                    {"intermediate", std::to_string(p.intermediate)},
                    {"mode", quant_mode_name(p.mode)},
                    {"bits", std::to_string(p.bits)},
                    {"group_size", std::to_string(p.group_size)},
                    {"activation", activation_name(p.activation)},
                    {"fused_gate_up", ex.fused() ? "1" : "0"}});
}

}  // namespace

int run_bench(int argc, char** argv) {
  if (Args(argc, argv).has("model")) return run_bench_model(argc, argv);
  if (Args(argc, argv).has("help")) return print_usage(), 0;
  const BenchOptions o = parse_options(argc, argv);
  EXPERTQMM_CHECK(cuda_available(), "bench", "needs a usable CUDA device; none was found");
  const Preset& p = o.preset;
  const int64_t H = p.hidden, k = p.top_k;
  if (o.replays < kMinProtocolReplays)
    std::fprintf(stderr, "warning: %d replays is below the protocol's %d; numbers are indicative only\n", o.replays,
                 kMinProtocolReplays);

  cudaStream_t stream = nullptr;
  EXPERTQMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamGuard {  // hands the library back the default stream, also on errors
    cudaStream_t s;
    ~StreamGuard() {
      set_cuda_stream(nullptr);
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
  } stream_guard{stream};
  set_cuda_stream(stream);
  const ProductMode product_before = product_mode();
  const RouteSwitch tiles_before = expert_tiles_setting();

  std::fprintf(stderr, "measuring the ceilings ...\n");
  Ceilings ceilings;
  ceilings.copy_gbps = measure_copy_gbps(stream);
  ceilings.bf16_tflops = measure_bf16_tflops(stream);
  std::printf("device %s: copy %.0f GB/s (read + write), bf16 GEMM %.0f TFLOP/s\n", cuda_device_name(),
              ceilings.copy_gbps, ceilings.bf16_tflops);

  const size_t flush_bytes = timing::l2_flush_bytes();
  DeviceBuffer flush(flush_bytes);

  size_t free_bytes = 0, total_bytes = 0;
  EXPERTQMM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t need = size_t(kWeightCopies) * size_t(p.expert_bytes()) * (o.tiled ? 2 : 1) + (size_t(1) << 30);
  EXPERTQMM_CHECK(free_bytes >= need, "bench", kWeightCopies, " weight copies of ", p.name, " need about ",
                  need >> 20, " MiB; the device has ", free_bytes >> 20, " MiB free");

  std::fprintf(stderr, "generating weights ...\n");
  // uniform: the synthetic router on random tokens; zipf: a router that follows a planned
  // Zipf(1.1) routing, so the graph still holds the whole layer, router included.
  MoeWeights host;
  host.experts = synthetic_experts(p, o.seed);
  host.router = o.routing == "zipf" ? steering_router(p, o.seed) : synthetic_router(p, o.seed);
  std::vector<MoeWeights> copies;
  copies.push_back(host.to(Device::cuda));
  if (o.tiled) copies[0].tile_experts();  // on the device; the other copies carry it
  for (int c = 1; c < kWeightCopies; ++c) copies.push_back(copies[0].to(Device::cuda));
  if (!o.export_dir.empty()) {
    std::filesystem::create_directories(o.export_dir);
    export_weights(o.export_dir, p, host.experts, o.routing);
  }

  std::ostringstream rows_json, deltas_json;
  bool all_pass = true;
  int n_rows = 0, n_deltas = 0;
  for (long T : o.tokens) {
    std::fprintf(stderr, "tokens %ld ...\n", T);
    const uint64_t case_seed = derive_seed(o.seed, uint64_t(T));
    std::vector<int32_t> planned;
    Tensor x_host;
    if (o.routing == "zipf") {
      planned = zipf_routing(T, p.experts, int(k), kZipfExponent, case_seed);
      x_host = steering_tokens(planned, T, p, case_seed);
    } else {
      x_host = random_tokens(T, H, case_seed);
    }
    const Tensor h = x_host.to(Device::cuda);

    // The routing the layer computes (route is deterministic on the device): experts hit, the
    // reference check and the export all use it.
    const Routing routing = route(h, copies[0].router);
    const std::vector<int32_t> indices = host_i32(routing.indices);
    const std::vector<float> route_w = host_floats(routing.weights);
    const int64_t experts_hit = int64_t(std::set<int32_t>(indices.begin(), indices.end()).size());
    int64_t off_plan = 0;
    for (int64_t t = 0; t < int64_t(planned.size()) / k; ++t)
      off_plan += std::set<int32_t>(planned.begin() + t * k, planned.begin() + (t + 1) * k) !=
                  std::set<int32_t>(indices.begin() + t * k, indices.begin() + (t + 1) * k);

    // Checked: a token near each end whose routing is not decided by a near-tie (checked_tokens),
    // from the first and last 8 tokens' router logits on the host.
    std::vector<int64_t> candidates;
    for (int64_t t = 0; t < T; ++t)
      if (t < 8 || t >= T - 8) candidates.push_back(t);
    const std::vector<float> x_floats = host_floats(x_host);
    std::vector<float> candidate_rows;
    for (int64_t t : candidates)
      candidate_rows.insert(candidate_rows.end(), x_floats.begin() + t * H, x_floats.begin() + (t + 1) * H);
    const Tensor candidate_h = detail::cast_floating(
        Tensor::from_host(candidate_rows.data(), {int64_t(candidates.size()), H}, DType::f32, Device::cpu), x_host.dtype());
    const std::vector<int64_t> checked =
        checked_tokens(host_floats(cpu::router_logits(candidate_h, host.router)), candidates, p.experts, int(k));
    const std::vector<double> ref =
        reference_tokens(host.experts, x_floats, H, checked, indices, route_w, k);

    const double flops = double(T * k) * p.flops_per_assignment();
    const double bytes = double(experts_hit) * double(p.bytes_per_expert()) + 2.0 * double(T * H) * 2.0;
    const double floor_us = std::max(flops / (ceilings.bf16_tflops * 1e12), bytes / (ceilings.copy_gbps * 1e9)) * 1e6;

    std::printf("\ntokens %ld: assignments %ld, experts hit %" PRId64 "/%d, %.3f GFLOP, %.1f MB, floor %.1f us\n", T,
                T * long(k), experts_hit, p.experts, flops / 1e9, bytes / 1e6, floor_us);
    if (o.routing == "zipf")
      std::printf("  routing follows the Zipf plan on %" PRId64 "/%ld tokens\n", T - off_plan, T);
    std::printf("  %-16s %10s %9s %9s %8s %8s %10s %10s %7s %10s %8s\n", "product", "median us", "p10", "p90", "TFLOP/s",
                "GB/s", "floor us", "time/floor", "kernels", "rel error", "extra MB");

    Tensor out = Tensor::empty({T, H}, DType::bf16, Device::cuda);
    Tensor exported_out;
    std::vector<double> medians;
    for (RouteSwitch tiles : o.tile_settings)
    for (ProductMode mode : o.products) {
      set_product_mode(mode);
      set_expert_tiles(tiles);
      const Measurement m = time_layer(out, h, copies, o.replays, o.gated, stream, flush);
      const std::vector<float> got = host_floats(out);
      double err = 0;
      for (size_t n = 0; n < checked.size(); ++n) {
        const double e = rel_error(got.data() + checked[n] * H, ref.data() + n * H, H);
        err = (e != e || e > err) ? e : err;
      }
      const bool pass = err <= kTolerance;
      all_pass = all_pass && pass;
      if (!exported_out.defined()) exported_out = out.to(Device::cpu);
      const double sec = m.us.median * 1e-6;
      const std::string label = tiles == RouteSwitch::automatic
                                    ? std::string(product_name(mode))
                                    : std::string(product_name(mode)) + "/tiles-" + expert_tiles_name(tiles);
      std::printf("  %-16s %10.1f %9.1f %9.1f %8.1f %8.0f %10.1f %10.2f %7d %10.2e %8.1f%s\n", label.c_str(),
                  m.us.median, m.us.p10, m.us.p90, flops / sec / 1e12, bytes / sec / 1e9, floor_us,
                  m.us.median / floor_us, m.nodes.kernels, err, m.workspace_bytes / 1e6, pass ? "" : "  FAIL");
      std::printf("    route counters (%s; host calls: %d warm-up + %d captured):\n%s", label.c_str(),
                  kWeightCopies, kWeightCopies, diagnostics::format(m.counters).c_str());
      if (tiles == o.tile_settings.front()) medians.push_back(m.us.median);

      rows_json << (n_rows++ ? ",\n    " : "") << "{\"tokens\": " << T << ", \"product\": \"" << product_name(mode)
                << "\", \"expert_tiles\": \"" << expert_tiles_name(tiles) << "\", \"assignments\": " << T * k << ", \"experts_hit\": " << experts_hit
                << ", \"replays\": " << o.replays << ", \"us_median\": " << json_number(m.us.median)
                << ", \"us_p10\": " << json_number(m.us.p10) << ", \"us_p90\": " << json_number(m.us.p90)
                << ", \"tflops\": " << json_number(flops / sec / 1e12) << ", \"gbps\": " << json_number(bytes / sec / 1e9)
                << ", \"flops\": " << json_number(flops) << ", \"bytes\": " << json_number(bytes)
                << ", \"floor_us\": " << json_number(floor_us)
                << ", \"time_over_floor\": " << json_number(m.us.median / floor_us)
                << ", \"kernel_nodes\": " << m.nodes.kernels << ", \"graph_nodes\": " << m.nodes.total()
                << ", \"workspace_mb\": " << m.workspace_bytes / 1e6
                << ", \"rel_error\": " << json_number(err) << ", \"check\": \"" << (pass ? "PASS" : "FAIL") << "\""
                << ", \"tokens_off_plan\": " << off_plan << ", \"route_counters\": " << counters_json(m.counters)
                << "}";
    }
    if (medians.size() == 2) {
      const double delta = medians[1] - medians[0];
      std::printf("  fused vs separate: fused is %.1f us (%.1f%%) %s\n", std::abs(delta),
                  std::abs(delta) / medians[1] * 100.0, delta >= 0 ? "faster" : "slower");
      deltas_json << (n_deltas++ ? ",\n    " : "") << "{\"tokens\": " << T
                  << ", \"fused_us\": " << json_number(medians[0]) << ", \"separate_us\": " << json_number(medians[1])
                  << ", \"separate_minus_fused_us\": " << json_number(delta)
                  << ", \"separate_minus_fused_pct\": " << json_number(delta / medians[1] * 100.0) << "}";
    }
    std::fflush(stdout);

    if (!o.export_dir.empty()) {
      char name[64];
      std::snprintf(name, sizeof(name), "/case_T%ld.safetensors", T);
      // The tokens the bench checked (none decided by a router near-tie): a peer that compares our
      // output with its own reference on the exported routing checks these, since at a near-tie the
      // layer's own router may pick another expert than route() exported.
      std::string checked_list;
      for (int64_t t : checked) checked_list += (checked_list.empty() ? "" : ",") + std::to_string(t);
      save_safetensors(o.export_dir + name,
                       {{"x", x_host},
                        {"indices", routing.indices.to(Device::cpu)},
                        {"weights", routing.weights.to(Device::cpu)},
                        {"out", exported_out}},
                       {{"tokens", std::to_string(T)},
                        {"checked_tokens", checked_list},
                        {"routing", o.routing},
                        {"preset", p.name},
                        {"out_product", product_name(o.products[0])}});
    }
  }
  set_product_mode(product_before);
  set_expert_tiles(tiles_before);

  if (!o.json_path.empty()) {
    std::ofstream f(o.json_path);
    EXPERTQMM_CHECK(f.good(), "bench", "cannot write --json file '", o.json_path, "'");
    f << "{\n  \"commit\": " << json_string(commit_id()) << ",\n  \"gpu\": " << json_string(cuda_device_name())
      << ",\n  \"date\": " << json_string(utc_now()) << ",\n  \"ceilings\": {\"copy_gbps\": "
      << json_number(ceilings.copy_gbps) << ", \"bf16_tflops\": " << json_number(ceilings.bf16_tflops)
      << "},\n  \"preset\": " << json_string(p.name) << ",\n  \"quant\": " << json_string(quant_mode_name(p.mode))
      << ",\n  \"routing\": " << json_string(o.routing)
      << ",\n  \"protocol\": {\"weight_copies\": " << kWeightCopies << ", \"l2_flush_bytes\": " << flush_bytes
      << ", \"replays\": " << o.replays << ", \"gated\": " << (o.gated ? "true" : "false")
      << ", \"tiled\": " << (o.tiled ? "true" : "false")
      << ", \"statistic\": \"median\"}"
      << ",\n  \"rows\": [\n    " << rows_json.str() << "\n  ],\n  \"product_deltas\": [\n    " << deltas_json.str()
      << "\n  ]\n}\n";
    EXPERTQMM_CHECK(f.good(), "bench", "writing --json file '", o.json_path, "' failed");
  }
  if (!all_pass) std::fprintf(stderr, "bench: some outputs differ from the float64 reference by more than %g\n", kTolerance);
  return all_pass ? 0 : 1;
}

#endif  // EXPERTQMM_HAVE_CUDA

}  // namespace expertqmm::cli

// Probe (issue 15, bench/NOTES.md steps 47-50): the expert tile route's GEMMs at Gemma 4's prefill
// shapes, with the two-CTA wgmma kernel and with the route's warp-specialized build
// (EXPERTQMM_WGMMA_WS, gather_qmm_expert_tiles_ws.cu) on MLX's layout and on the tile layout
// (docs/tile-layout.md), each GEMM alone.
//
// Problem: plain form, bf16, 4-bit affine g64 codes in MLX's layout ([E, N, K/8] words, [E, N, K/64]
// bf16 scales and biases), rows sorted by expert from a uniform top-8 routing of T tokens:
//   gate/up  out [T*8, 1408] = x[lhs] [T*8, 2816] @ W^T   (x rows gathered by token, as the layer does)
//   down     out [T*8, 2816] = h [T*8, 704] @ W^T          (the GLU rows in sorted order)
// Variants: route (gather_qmm: tile plan + the two-CTA wgmma kernel), route_tiled (that kernel reading
// the weight's tile layout, step 51: "+tiled" in the JSON), route_ws (the same call with the
// warp-specialized build: "+ws") and route_ws_tiled (that build on the tile layout: "+ws+tiled"). Each output is checked against a plain fp32 kernel on the same dequantized
// weights (bf16(fma(q, s, b)), MLX's tile dequantization) before it is timed with the bench protocol
// (one launch captured as a graph, L2 flushed before each of 50 replays, median). Step 47's own
// warp-specialized kernels (n128 / n256, one-shot / persistent) lost to the route build everywhere
// (NOTES "Steps 46-49 measured") and were removed.
//
// Built as ws_tiles_probe with the CUDA build (sm_90a only does the work); run by hand (the device
// calls of NOTES steps 47-52 did; they are in git history): prints JSON.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "cuda/gather_qmm.h"
#include "expertqmm/backend.h"
#include "expertqmm/settings.h"
#include "probe_check.cuh"
#include "replay_timing.h"

namespace timing = expertqmm::timing;
using namespace expertqmm;
using bf16 = __nv_bfloat16;

namespace {

// The reference's operands.
struct RefArgs {
  const bf16* x;          // [x_rows, K]
  const int32_t* lhs;     // x row of each sorted row (null: the row itself)
  const uint32_t* w;      // [E, N, K/8]
  const uint16_t* scales; // [E, N, K/64] bf16 bits
  const uint16_t* biases;
  int N, K;
};

// Plain fp32 reference: one thread per output, weights dequantized as MLX's tiles do (fp32 fma, bf16).
__global__ void reference_kernel(RefArgs a, const int32_t* rhs, int rows, float* ref) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<int64_t>(rows) * a.N) return;
  const int r = static_cast<int>(i / a.N), n = static_cast<int>(i % a.N);
  const int64_t w_row = static_cast<int64_t>(rhs[r]) * a.N + n;
  const bf16* x = a.x + static_cast<int64_t>(a.lhs ? a.lhs[r] : r) * a.K;
  float sum = 0.f;
  for (int k = 0; k < a.K; ++k) {
    const uint32_t q = (a.w[w_row * (a.K / 8) + k / 8] >> (4 * (k % 8))) & 15u;
    const float s = __uint_as_float(uint32_t(a.scales[w_row * (a.K / 64) + k / 64]) << 16);
    const float b = __uint_as_float(uint32_t(a.biases[w_row * (a.K / 64) + k / 64]) << 16);
    sum += __bfloat162float(x[k]) * __bfloat162float(__float2bfloat16_rn(__fmaf_rn(s, float(q), b)));
  }
  ref[i] = sum;
}

// Deterministic pseudo-random fill: codes uniform, scales ~1/64, biases ~ -8 scales, x ~ N(0, 1)-ish.
__global__ void fill_kernel(uint32_t* w, int64_t words, uint16_t* scales, uint16_t* biases, int64_t groups,
                            bf16* x, int64_t xn, uint32_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  auto hash = [&](int64_t i) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    return h;
  };
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words; i += stride) w[i] = hash(i);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < groups; i += stride) {
    const float s = (1.f + (hash(i + words) & 255) / 256.f) / 64.f;
    const bf16 sb = __float2bfloat16_rn(s), bb = __float2bfloat16_rn(-8.f * s);
    scales[i] = *reinterpret_cast<const uint16_t*>(&sb);
    biases[i] = *reinterpret_cast<const uint16_t*>(&bb);
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < xn; i += stride)
    x[i] = __float2bfloat16_rn((static_cast<int>(hash(i + 7 * words) & 1023) - 512) / 256.f);
}

template <class Call>
double median_us(const timing::DeviceBuffer& flush, cudaStream_t s, Call call) {
  call();
  CHECK(cudaStreamSynchronize(s));
  timing::Graphs g;
  timing::capture_into(g, s, "the probe's GEMM", call);
  CHECK(cudaGraphLaunch(g.execs[0], s));
  return timing::stats_of(timing::timed_replays(g.execs, 50, s, flush)).median;
}

// ‖out − ref‖ / ‖ref‖ over every output.
double rel_error(const bf16* out_d, const float* ref_d, int64_t n) {
  std::vector<bf16> out(n);
  std::vector<float> ref(n);
  CHECK(cudaMemcpy(out.data(), out_d, n * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(ref.data(), ref_d, n * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = double(__bfloat162float(out[i])) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace

int main(int argc, char** argv) {
  // argv[1]: one variant only (route, route_tiled, route_ws, route_ws_tiled), so that a script can give each its
  // own time limit; none: all.
  const std::string only = argc > 1 ? argv[1] : "";
  auto wanted = [&](const std::string& v) { return only.empty() || only == v; };
  if (!only.empty() && only != "route" && only != "route_tiled" && only != "route_ws" && only != "route_ws_tiled") {
    std::fprintf(stderr, "ws_tiles_probe: unknown variant '%s' (route, route_tiled, route_ws, route_ws_tiled)\n",
                 only.c_str());
    return 2;
  }
  constexpr int E = 128, top_k = 8;
  struct Gemm {
    const char* name;
    int N, K;
    bool gathered;
  };
  const Gemm gemms[] = {{"gate_up", 1408, 2816, true}, {"down", 2816, 704, false}};
  const int token_counts[] = {512, 1024, 2048};
  const timing::DeviceBuffer flush(timing::l2_flush_bytes());
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CudaStreamScope scope(0, stream);
  std::printf("{\"probe\": \"ws_tiles\", \"rows\": [\n");
  bool first_row = true;
  for (const Gemm& gm : gemms) {
    const int64_t words = int64_t(E) * gm.N * gm.K / 8, groups = int64_t(E) * gm.N * gm.K / 64;
    const Tensor w = Tensor::empty({E, gm.N, gm.K / 8}, DType::u32, Device::cuda);
    const Tensor scales = Tensor::empty({E, gm.N, gm.K / 64}, DType::bf16, Device::cuda);
    const Tensor biases = Tensor::empty({E, gm.N, gm.K / 64}, DType::bf16, Device::cuda);
    for (int T : token_counts) {
      // Uniform top-8 routing, rows sorted by expert (stable in token order).
      std::mt19937 rng(1234 + T);
      std::vector<std::pair<int, int>> pairs;  // (expert, token)
      std::vector<int> ids(E);
      for (int tok = 0; tok < T; ++tok) {
        std::iota(ids.begin(), ids.end(), 0);
        for (int j = 0; j < top_k; ++j) {
          std::swap(ids[j], ids[j + rng() % (E - j)]);
          pairs.push_back({ids[j], tok});
        }
      }
      std::stable_sort(pairs.begin(), pairs.end(), [](auto& l, auto& r) { return l.first < r.first; });
      const int rows = T * top_k;
      std::vector<int32_t> lhs_h(rows), rhs_h(rows);
      for (int r = 0; r < rows; ++r) {
        lhs_h[r] = gm.gathered ? pairs[r].second : r;
        rhs_h[r] = pairs[r].first;
      }
      const int x_rows = gm.gathered ? T : rows;
      const Tensor x = Tensor::empty({x_rows, 1, gm.K}, DType::bf16, Device::cuda);
      fill_kernel<<<1024, 256, 0, stream>>>(w.data_as<uint32_t>(), words, scales.data_as<uint16_t>(),
                                            biases.data_as<uint16_t>(), groups, x.data_as<bf16>(),
                                            int64_t(x_rows) * gm.K, 77u + T);
      CHECK(cudaGetLastError());
      const Tensor lhs = Tensor::from_host(lhs_h.data(), {rows}, DType::i32, Device::cuda);
      const Tensor rhs = Tensor::from_host(rhs_h.data(), {rows}, DType::i32, Device::cuda);
      Tensor out = Tensor::empty({rows, gm.N}, DType::bf16, Device::cuda);
      const Tensor ref = Tensor::empty({rows, gm.N}, DType::f32, Device::cuda);
      const RefArgs a{x.data_as<bf16>(), gm.gathered ? lhs.data_as<int32_t>() : nullptr, w.data_as<uint32_t>(),
                      scales.data_as<uint16_t>(), biases.data_as<uint16_t>(), gm.N, gm.K};
      const int64_t outputs = int64_t(rows) * gm.N;
      reference_kernel<<<static_cast<unsigned>((outputs + 255) / 256), 256, 0, stream>>>(a, rhs.data_as<int32_t>(), rows,
                                                                                       ref.data_as<float>());
      CHECK(cudaGetLastError());
      const double flops = 2.0 * rows * gm.N * gm.K;

      auto report = [&](const char* variant, double us, double err) {
        std::printf("%s  {\"gemm\": \"%s\", \"tokens\": %d, \"variant\": \"%s\", \"us_median\": %.2f, "
                    "\"tflops\": %.1f, \"rel_error\": %.2e}",
                    first_row ? "" : ",\n", gm.name, T, variant, us, flops / us / 1e6, err);
        first_row = false;
        std::fflush(stdout);
      };
      // The route, on MLX's layout and on the tile layout; the same call with the warp-specialized
      // build (persistent, n128 + n32 tails merged), which the selector takes for the 128-token build
      // (above 32 rows per expert), on both layouts.
      struct Variant {
        const char* name;
        bool ws, tiled;
      };
      for (const Variant v : {Variant{"route", false, false}, Variant{"route_tiled", false, true},
                              Variant{"route_ws", true, false}, Variant{"route_ws_tiled", true, true}}) {
        if (!wanted(v.name)) continue;
        set_wgmma_ws(v.ws ? RouteSwitch::on : RouteSwitch::off);
        detail::GatherQmmProblem p =
            detail::make_gather_qmm_problem(x, w, scales, biases,
                                            gm.gathered ? lhs : Tensor(), rhs, true, 64, 4, true);
        TiledWeight tiled;
        if (v.tiled) {
          QuantizedWeight q;
          q.w = w;
          q.scales = scales;
          q.biases = biases;
          tiled = tile_weight(q);
          p.tiled = tiled;
        }
        Workspace ws;
        CHECK(cudaMemsetAsync(out.data(), 0xff, outputs * 2, stream));
        cuda::gather_qmm_into(p, out.data(), &ws);
        CHECK(cudaStreamSynchronize(stream));
        const double err = rel_error(out.data_as<bf16>(), ref.data_as<float>(), outputs);
        const double us = median_us(flush, stream, [&] { cuda::gather_qmm_into(p, out.data(), &ws); });
        set_wgmma_ws(RouteSwitch::automatic);
        const std::string name = cuda::gather_qmm_selected_route(p) + (v.ws ? "+ws" : "") + (v.tiled ? "+tiled" : "");
        report(name.c_str(), us, err);
      }
    }
  }
  std::printf("\n]}\n");
  CHECK(cudaStreamDestroy(stream));
  return 0;
}

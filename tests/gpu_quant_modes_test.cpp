// MLX's fp quantization modes on CUDA against the CPU: nvfp4 with a global scale bit for bit, and a
// whole Gemma 4 feed-forward block whose every quantized module is in an fp mode (its GEMMs on qmv,
// the tile routes or simt, the router on uint8 scales), allocating and _into alike, plus one layer
// captured in a CUDA graph; the fp modes on the tensor-core routes (a Gemma-4-shaped layer with its
// routes counted, every scale code on the tile kernels).
// The per-op rows (gather_qmm routes and refusals, quantize, switch_glu, moe_layer) are in the
// backend table.
#include <gtest/gtest.h>

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "expertqmm/checkpoint.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "expertqmm/quant.h"
#include "support/backend_cases.h"
#include "support/checkpoint_files.h"
#include "support/gather_case.h"
#include "support/graph_capture.h"
#include "support/moe_case.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

TEST(GpuQuantModes, Nvfp4GlobalScaleMatchesTheCpuBitForBit) {
  EXPERTQMM_REQUIRE_GPU();
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    const Tensor w = test::random_tensor({6, 96}, dtype, 3.0f);
    QuantSpec spec = default_quant_spec(QuantMode::nvfp4);
    const float g = 0.0123f;
    spec.global_scale = Tensor::from_host(&g, {}, DType::f32, Device::cpu);
    const QuantizedWeight c = quantize(w, spec), d = quantize(w.to(Device::cuda), spec);
    EXPECT_EQ(d.w.to_host_bytes(), c.w.to_host_bytes()) << dtype_name(dtype);
    EXPECT_EQ(d.scales.to_host_bytes(), c.scales.to_host_bytes()) << dtype_name(dtype);
    const Tensor dc = dequantize(c, dtype), dd = dequantize(d, dtype);
    EXPECT_EQ(dd.dtype(), DType::f32);  // MLX promotes with the float32 global scale
    EXPECT_EQ(dd.to_host_bytes(), dc.to_host_bytes()) << dtype_name(dtype);
  }
}

// Experts mxfp4, dense MLP mxfp8, router nvfp4.
Gemma4Config fp_modes_config() {
  Gemma4Config c = test::gemma4_config(256, 384, 128, 16, 4, 1);
  c.default_quant = {4, 32, QuantMode::mxfp4};
  for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
    c.overrides[std::string("model.layers.0.") + m] = {8, 32, QuantMode::mxfp8};
  c.overrides["model.layers.0.router.proj"] = {4, 16, QuantMode::nvfp4};
  return c;
}

// float32 activations, so the two backends' routers agree but for fp32 summation order.
TEST(GpuQuantModes, Gemma4FfnInFpModesMatchesTheCpu) {
  EXPERTQMM_REQUIRE_GPU();
  const Gemma4FfnWeights cpu_w = synthetic_gemma4_layer(fp_modes_config(), 0, 21);
  const Gemma4FfnWeights gpu_w = cpu_w.to(Device::cuda);
  for (int64_t T : {1, 5, 70}) {
    const Tensor h = test::random_tensor({T, 256}, DType::f32, 1.0f);
    const Tensor expected = gemma4_ffn(h, cpu_w);
    const Tensor hd = h.to(Device::cuda);
    const Tensor got = gemma4_ffn(hd, gpu_w);
    ASSERT_EQ(got.device(), Device::cuda);
    EXPECT_LE(test::rel_error(test::to_float(got), test::to_float(expected)), 1e-4) << "T=" << T << test::seed_note();
    Tensor into = Tensor::empty({T, 256}, DType::f32, Device::cuda);
    Workspace ws;
    gemma4_ffn_into(into, hd, gpu_w, ws);
    EXPECT_EQ(into.to_host_bytes(), got.to_host_bytes()) << "T=" << T;
  }
}

// What `bench --quant` needs: the fp-mode layer captured in a CUDA graph (no allocation, no host
// sync) replays the output of the direct call, at decode and prefill sizes.
TEST(GpuQuantModes, FpModeLayerCapturedInACudaGraphReplaysTheSameOutput) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  const Gemma4FfnWeights w = synthetic_gemma4_layer(fp_modes_config(), 0, 5).to(Device::cuda);
  const test::CaptureStream stream;
  Workspace ws;
  for (int64_t T : {100, 6}) {
    const std::string what = detail::cat("T=", T);
    const Tensor h = test::random_tensor({T, 256}, DType::bf16, 1.0f, Device::cuda);
    Tensor expected = Tensor::empty({T, 256}, DType::bf16, Device::cuda);
    gemma4_ffn_into(expected, h, w, ws);
    cuda_check();
    Tensor replayed = Tensor::empty({T, 256}, DType::bf16, Device::cuda);
    cudaGraph_t graph = test::capture_graph(stream.get(), [&] { gemma4_ffn_into(replayed, h, w, ws); }, what);
    ASSERT_NE(graph, nullptr) << what;
    test::expect_replays_match(graph, stream.get(), replayed, expected, 2, what);
  }
#endif
}

// An mxfp4 MoE layer at Gemma 4's expert geometry (H 2816, I 704, top-8; 16 experts keep the CPU
// quantization short) through moe_layer at T = 1, 8, 64 and 512, with the routes that served it
// counted: the decode layer (its tensor-core kernels' kFp form) must serve T = 1 and 8 (one hit, no
// tile-route hit), and T = 64 and 512 (512 and 4096 sorted rows) must run gate, up and down on the
// expert tile route (at least three hits; a silent fallback counts none). T <= 64 against float64
// (the table's layer check); T = 512 against the same layer with the expert tile route switched off
// (its GEMMs then on rhs_tiles' 16-row tiles, without the plan), within the route-agreement bound.
TEST(GpuQuantModes, Mxfp4Gemma4LayerTakesTheTileRouteAtPrefillSizes) {
  EXPERTQMM_REQUIRE_GPU();
  test::MoeGeometry g{2816, 704, 16, 8, 4, 32, 8, false, Activation::geglu, DType::bf16};
  g.mode = QuantMode::mxfp4;
  auto counters = [](const char* primitive) {
    for (const RouteCounters& r : diagnostics::snapshot())
      if (r.primitive == primitive) return r;
    ADD_FAILURE() << "no " << primitive << " row in snapshot()";
    return RouteCounters();
  };
  struct Expect {
    int64_t T;
    uint64_t decode_hits, min_tile_hits;
  };
  for (const Expect& e : {Expect{1, 1, 0}, Expect{8, 1, 0}, Expect{64, 0, 3}}) {
    const std::string what = detail::cat("T=", e.T);
    diagnostics::reset();
    test::check(test::MoeLayerCase{g, e.T, test::MoePath::automatic});
    const RouteCounters decode = counters("moe_decode_layer"), qmm = counters("gather_qmm");
    const std::string table = diagnostics::format(diagnostics::snapshot());
    EXPECT_EQ(decode.hits, e.decode_hits) << what << "\n" << table;
    if (e.min_tile_hits == 0) EXPECT_EQ(qmm.hits, 0u) << what << "\n" << table;
    else EXPECT_GE(qmm.hits, e.min_tile_hits) << what << ": the expert tile route did not serve the experts\n" << table;
  }
  const test::Layer l = test::make_layer(g);
  const int64_t T = 512;
  const Tensor h = test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda);
  const Tensor x = test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda);
  Workspace ws;
  diagnostics::reset();
  const Tensor got = test::run_layer(h, x, l.gpu, ws);
  cuda_check();
  const RouteCounters qmm = counters("gather_qmm");
  EXPECT_GE(qmm.hits, 3u) << "T=512: the expert tile route did not serve the experts\n"
                          << diagnostics::format(diagnostics::snapshot());
  const RouteSwitch saved = expert_tiles_setting();
  set_expert_tiles(RouteSwitch::off);
  Workspace ws_generic;
  const Tensor generic = test::run_layer(h, x, l.gpu, ws_generic);
  cuda_check();
  set_expert_tiles(saved);
  EXPECT_LE(test::rel_error(test::to_float(got), test::to_float(generic)), test::kRouteAgreement)
      << "T=512 vs the expert tile route switched off";
}

// The tile route's fp decoding over every code: random E2M1 / E4M3 words (every element code but
// E4M3's NaN 0x7F / 0xFF), mx scales over E8M0 40..200 (2^-87 .. 2^73: products stay normal in
// fp32) and nvfp4 scales over every E4M3 code but NaN (subnormal, negative and 448 included), on
// the mma.sync kernel (and on the wgmma one for the 4-bit modes, compute capability 9.0) against
// the CPU backend. Output column n reads scale codes near its own
// (codes[n], codes[n + 1], codes[n + 2] by group; N rounded up to whole 8-column blocks, the list
// repeated), so each column's error is compared on its own
// and a wrong decode of any code shows. Both read exact weights (value times scale, exact in bf16
// and fp32 here) and the same bf16 x and accumulate in fp32: only the summation order and one output
// rounding differ.
TEST(GpuQuantModes, ExpertTilesDecodeEveryCodeAsTheCpu) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  for (QuantMode mode : {QuantMode::mxfp4, QuantMode::mxfp8, QuantMode::nvfp4}) {
    const int bits = quant_mode_bits(mode), group = quant_mode_group_size(mode);
    std::vector<uint8_t> codes;  // the scale codes under test
    if (mode == QuantMode::nvfp4) {
      for (int c = 0; c < 256; ++c)
        if ((c & 0x7F) != 0x7F) codes.push_back(static_cast<uint8_t>(c));
    } else {
      for (int c = 40; c <= 200; ++c) codes.push_back(static_cast<uint8_t>(c));
    }
    const int64_t C = static_cast<int64_t>(codes.size());
    const int64_t E = 2, N = (C + 7) / 8 * 8, K = 448, groups = K / group;
    QuantizedWeight q = test::random_codes(E, N, K, bits, group, DType::bf16, mode);
    std::vector<uint8_t> scales(static_cast<size_t>(E * N * groups));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < groups; ++j) scales[(e * N + n) * groups + j] = codes[(n + j % 3) % C];
    q.scales = Tensor::from_host(scales.data(), {E, N, groups}, DType::u8);
    std::vector<int32_t> ids(70, 0);
    ids.insert(ids.end(), 90, 1);
    const test::GatherCall call = test::rows_call(q, DType::bf16, ids, true);
    const std::vector<float> want =
        test::to_float(gather_qmm(call.x_host, call.q_host, call.lhs_host, call.rhs_host, true, true));
    int device = 0, major = 0;
    ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
    std::vector<std::string> routes = {"expert_tiles_mma_sync"};
    if (major == 9 && mode != QuantMode::mxfp8) routes.push_back("expert_tiles_wgmma");
    for (const std::string& route : routes) {
      const std::vector<float> got = test::run_route(call, route);
      const int64_t R = static_cast<int64_t>(ids.size());
      for (int64_t n = 0; n < N; ++n) {
        std::vector<float> g, w;
        for (int64_t r = 0; r < R; ++r) {
          g.push_back(got[r * N + n]);
          w.push_back(want[r * N + n]);
        }
        EXPECT_LE(test::rel_error(g, w), 2e-3) << route << " " << quant_mode_name(mode) << " scale code "
                                              << int(codes[n % C]) << test::seed_note();
      }
    }
  }
#endif
}

}  // namespace
}  // namespace expertqmm

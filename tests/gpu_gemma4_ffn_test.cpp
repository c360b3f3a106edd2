// The Gemma 4 feed-forward part on CUDA against the CPU reference (same weights, same input), in
// both GLU product modes and across the decode / unsorted / sorted / prefill sizes (520 tokens: the
// quantized dense MLP as rows of one expert); and one layer
// captured in a CUDA graph (global capture mode: any host sync or allocation fails the capture).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/gather_qmm_routes.h"  // wgmma_available
#endif

#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"
#include "support/checkpoint_files.h"
#include "support/graph_capture.h"
#include "support/moe_case.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

// dense_bits: the dense MLP's bits (8: mlx-vlm's and the QAT uploads' 8-bit dense MLP; 4: mlx-lm's
// default), which pick the decode gate/up kernel of the block's dense branch at T <= 8; 0: a 16-bit
// dense MLP (bf16 checkpoints), on the dense linear. router_bits: 8, or 0 for a 16-bit router.
Gemma4Config small_config(int dense_bits = 8, int router_bits = 8) {
  Gemma4Config c = test::gemma4_config(256, 384, 128, 16, 4, 1);
  for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
    c.overrides[std::string("model.layers.0.") + m] = {dense_bits, dense_bits ? 64 : 0};
  c.overrides["model.layers.0.router.proj"] = {router_bits, router_bits ? 64 : 0};
  return c;
}

RouteCounters counters_of(const char* primitive) {
  for (const RouteCounters& r : diagnostics::snapshot())
    if (r.primitive == primitive) return r;
  return RouteCounters{};
}

// Whether the block's quantized dense MLP runs on cuBLAS (gemma4_ffn.cu: 4- or 8-bit g64 bf16, fused
// product, T >= 512 with EXPERTQMM_DENSE_CUBLAS unset, T >= 2 with it on; the decode ways first).
bool dense_mlp_on_cublas(int dense_bits, ProductMode mode, int64_t T) {
  const RouteSwitch s = dense_cublas_setting();
  return (dense_bits == 4 || dense_bits == 8) && mode == ProductMode::fused && s != RouteSwitch::off &&
         T >= (s == RouteSwitch::on ? 2 : 512) && !(dense_bits == 4 && T <= 8) && !(dense_bits == 8 && T == 1);
}

// Whether the block's dense MLP runs as T rows of one expert on the wgmma tile route (gemma4_ffn.cu:
// 4-bit, or 8-bit in bf16 (T rows of one expert pass the 8-bit build's 32 rows per expert), fused
// product, T >= 512, an sm_90a build on compute capability 9.0, not on cuBLAS). The tests here run bf16.
bool dense_mlp_on_expert_rows(int dense_bits, ProductMode mode, int64_t T) {
#ifdef EXPERTQMM_HAVE_CUDA
  const bool bits_taken = dense_bits == 4 || dense_bits == 8;
  return bits_taken && mode == ProductMode::fused && T >= 512 && expert_tiles_setting() != RouteSwitch::off &&
         cuda::wgmma_available() && !dense_mlp_on_cublas(dense_bits, mode, T);
#else
  (void)dense_bits, (void)mode, (void)T;
  return false;
#endif
}

// Whether the block's dense MLP runs gate, up and the GLU product as one launch (gemma4_ffn.cu
// plan_dense_mlp, counted as dense_mlp_glu hits): 4-bit at T <= 8 (the decode GLU kernel), 8-bit at
// T = 1 (qmv's GeGLU epilogue), on cuBLAS (gate and up as one GEMM and the fused GLU product), or as
// expert rows; the fused product mode only.
bool dense_glu_fused(int dense_bits, ProductMode mode, int64_t T) {
  if (mode != ProductMode::fused || dense_bits == 0) return false;
  return (dense_bits == 4 && T <= 8) || (dense_bits == 8 && T == 1) || dense_mlp_on_cublas(dense_bits, mode, T) ||
         dense_mlp_on_expert_rows(dense_bits, mode, T);
}

// The CPU and GPU routers work on bf16 logits with different summation orders, so a token whose
// k-th and (k+1)-th logits sit within rounding of each other may pick a different expert on each
// backend (tests/gpu_ops_test.cpp pins the router itself). Such tokens are left out, each only where
// the experts the two backends disagree on sit at that near-tie of the CPU's scores
// (expect_close_where_routed_alike); every other token must match within the tolerance.
TEST(GpuGemma4Ffn, MatchesTheCpuReferenceInBothProductModes) {
  EXPERTQMM_REQUIRE_GPU();
  const ProductMode saved = product_mode();
  // gather_qmm's tile-route hits with the 16-bit dense MLP (gather_mm: none of them), by (mode, T):
  // a quantized one adds its three GEMMs where it runs as expert rows.
  std::map<std::pair<int, int64_t>, uint64_t> qmm_hits_16bit;
  for (int dense_bits : {0, 8, 4}) {
    const Gemma4FfnWeights cpu_w = synthetic_gemma4_layer(small_config(dense_bits), 0, 11);
    const Gemma4FfnWeights gpu_w = cpu_w.to(Device::cuda);
    for (ProductMode mode : {ProductMode::fused, ProductMode::separate}) {
      set_product_mode(mode);
      for (int64_t T : {1, 3, 8, 40, 300, 520}) {
        const std::string what = detail::cat("T=", T, " mode=", mode == ProductMode::fused ? "fused" : "separate",
                                             " dense MLP ", dense_bits, "-bit");
        const Tensor h = test::random_tensor({T, 256}, DType::bf16, 1.0f);
        const Tensor expected = gemma4_ffn(h, cpu_w);
        diagnostics::reset();
        const Tensor got = gemma4_ffn(h.to(Device::cuda), gpu_w);
        // A 16-bit dense MLP is three dense linears (gather_mm calls, on the tile route above 64
        // rows); the experts and the router are quantized.
        const RouteCounters mm = counters_of("gather_mm");
        EXPECT_EQ(mm.attempts, dense_bits ? 0u : 3u) << what;
        EXPECT_EQ(mm.hits, !dense_bits && T > 64 && expert_tiles_setting() != RouteSwitch::off ? 3u : 0u) << what;
        const RouteCounters glu = counters_of("dense_mlp_glu");
        EXPECT_EQ(glu.attempts, 1u) << what;
        EXPECT_EQ(glu.hits, dense_glu_fused(dense_bits, mode, T) ? 1u : 0u) << what;
        const uint64_t qmm_hits = counters_of("gather_qmm").hits;
        const auto key = std::make_pair(static_cast<int>(mode), T);
        if (dense_bits == 0) qmm_hits_16bit[key] = qmm_hits;
        else
          EXPECT_EQ(qmm_hits, qmm_hits_16bit[key] + (dense_mlp_on_expert_rows(dense_bits, mode, T) ? 3u : 0u)) << what;
        // Which tokens did the two routers send to the same experts?
        test::expect_close_where_routed_alike(expected, got, h, cpu_w.moe.router,
                                              test::to_i32(route(h.to(Device::cuda), gpu_w.moe.router).indices), what);
      }
    }
  }
  set_product_mode(saved);
}

// The wgmma kernel's 8-bit build by its rows-per-expert rule (kWgmma8BitMinRowsPerExpert = 32):
// 8-bit experts (16 of them, top-4) at 40 tokens (10 rows per expert: mma.sync unless
// EXPERTQMM_WGMMA=1), 300 (75: the 8-bit build, gate/up with the GeGLU in the epilogue, down with the
// combine) and 520, where the 8-bit dense MLP also runs as rows of one expert (a dense_mlp_glu hit and
// three tile-route hits) under both settings. Both settings against the CPU reference.
TEST(GpuGemma4Ffn, EightBitWgmmaBuildByRowsPerExpert) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  if (!cuda::wgmma_available()) GTEST_SKIP() << "no sm_90a wgmma kernels on this device";
#endif
  using WgmmaGuard = test::SettingGuard<RouteSwitch, wgmma_setting, set_wgmma>;
  test::ProductModeGuard fused(ProductMode::fused);
  // The dense MLP as rows of one expert, not on cuBLAS (its own test below).
  test::SettingGuard<RouteSwitch, dense_cublas_setting, set_dense_cublas> no_cublas(RouteSwitch::off);
  Gemma4Config c = small_config(8);
  c.default_quant = {8, 64};  // the experts 8-bit too
  const Gemma4FfnWeights cpu_w = synthetic_gemma4_layer(c, 0, 13);
  const Gemma4FfnWeights gpu_w = cpu_w.to(Device::cuda);
  for (int64_t T : {40, 300, 520}) {
    const Tensor h = test::random_tensor({T, 256}, DType::bf16, 1.0f);
    const Tensor expected = gemma4_ffn(h, cpu_w);
    uint64_t hits[2] = {0, 0};
    for (RouteSwitch s : {RouteSwitch::automatic, RouteSwitch::on}) {
      const std::string what = detail::cat("T=", T, " EXPERTQMM_WGMMA=", s == RouteSwitch::on ? "1" : "unset");
      WgmmaGuard wgmma(s);
      diagnostics::reset();
      const Tensor got = gemma4_ffn(h.to(Device::cuda), gpu_w);
      hits[s == RouteSwitch::on] = counters_of("gather_qmm").hits;
      EXPECT_EQ(counters_of("dense_mlp_glu").hits, T >= 512 ? 1u : 0u) << what;
      test::expect_close_where_routed_alike(expected, got, h, cpu_w.moe.router,
                                            test::to_i32(route(h.to(Device::cuda), gpu_w.moe.router).indices), what);
    }
    EXPECT_EQ(hits[1], hits[0]) << "T=" << T;  // the same GEMMs on the tile route, whichever kernel
  }
}

// The quantized dense MLP on cuBLAS (EXPERTQMM_DENSE_CUBLAS): 4- and 8-bit, at 2 / 40 tokens (the
// setting on) and 520 / 1030 (its default from 512), against the CPU reference and against the same block
// with the setting off (rhs_tiles, or the expert tile route from 512: route against route, 1e-2); the
// selector counts a dense_mlp_glu hit and no gather_qmm call for the dense linears. Then a graph
// captured after a warm call replays the uncaptured bytes (cuBLAS on its scratch slot, no allocation).
TEST(GpuGemma4Ffn, DenseMlpOnCublas) {
  EXPERTQMM_REQUIRE_GPU();
  using CublasGuard = test::SettingGuard<RouteSwitch, dense_cublas_setting, set_dense_cublas>;
  test::ProductModeGuard fused(ProductMode::fused);
  for (int dense_bits : {8, 4}) {
    const Gemma4FfnWeights cpu_w = synthetic_gemma4_layer(small_config(dense_bits), 0, 17);
    const Gemma4FfnWeights gpu_w = cpu_w.to(Device::cuda);
    for (int64_t T : {2, 40, 520, 1030}) {
      const std::string what = detail::cat("T=", T, " dense MLP ", dense_bits, "-bit");
      const Tensor h = test::random_tensor({T, 256}, DType::bf16, 1.0f);
      const Tensor hd = h.to(Device::cuda);
      const Tensor expected = gemma4_ffn(h, cpu_w);
      uint64_t qmm_attempts[2] = {0, 0};
      Tensor outs[2];
      for (RouteSwitch s : {RouteSwitch::off, T >= 512 ? RouteSwitch::automatic : RouteSwitch::on}) {
        CublasGuard guard(s);
        const bool on = s != RouteSwitch::off;
        diagnostics::reset();
        outs[on] = gemma4_ffn(hd, gpu_w);
        qmm_attempts[on] = counters_of("gather_qmm").attempts;
        const bool fused_off = (dense_bits == 4 && T <= 8) || dense_mlp_on_expert_rows(dense_bits, ProductMode::fused, T);
        EXPECT_EQ(counters_of("dense_mlp_glu").hits, on || fused_off ? 1u : 0u) << what << (on ? " on" : " off");
        test::expect_close_where_routed_alike(expected, outs[on], h, cpu_w.moe.router,
                                              test::to_i32(route(hd, gpu_w.moe.router).indices),
                                              what + (on ? " cuBLAS" : " off"));
      }
      // Off, the dense linears are three gather_qmm calls; where the decode GLU kernel takes gate and
      // up (4-bit, T <= 8) it does so in both configurations.
      const uint64_t dense_calls = (dense_bits == 4 && T <= 8) ? 0 : 3;
      EXPECT_EQ(qmm_attempts[0], qmm_attempts[1] + dense_calls) << what;
      EXPECT_LE(test::rel_error(test::to_float(outs[1]), test::to_float(outs[0])), 1e-2)
          << what << ": cuBLAS against the setting off";
    }
    // A graph of the cuBLAS block (warm at 520 tokens, then 40) replays the uncaptured call's bytes.
#ifdef EXPERTQMM_HAVE_CUDA
    CublasGuard on(RouteSwitch::on);
    test::expect_block_capture_replays(
        [&](Tensor& out, const Tensor& h, Workspace& ws) { gemma4_ffn_into(out, h, gpu_w, ws); }, 256, {520, 40}, 6);
#endif
  }
}

// The entry and exit norm kernels (gemma4_ffn_norms.cu) at row widths that take 2, 4 and 8 units
// per thread, with the five norm weights in bf16 (16-byte units) and in f32 (two per unit), and a
// norm weight one element off 16-byte alignment (element loads).
TEST(GpuGemma4Ffn, NormKernelsHoldEveryRowWidthAndWeightLayout) {
  EXPERTQMM_REQUIRE_GPU();
  for (int64_t H : {256, 4160, 8256}) {  // units per thread 2, 4, 8 (512 / 1024 units per 256 threads)
    Gemma4Config c = test::gemma4_config(H, 64, 64, 4, 2, 1);
    const Gemma4FfnWeights base = synthetic_gemma4_layer(c, 0, 5);
    for (int layout = 0; layout < 3; ++layout) {  // bf16 weights, f32 weights, a misaligned bf16 weight
      Gemma4FfnWeights cpu_w = base;
      std::vector<Tensor> keep;  // the misaligned weight's storage
      for (Tensor* n : {&cpu_w.pre_feedforward_layernorm, &cpu_w.post_feedforward_layernorm_1,
                        &cpu_w.pre_feedforward_layernorm_2, &cpu_w.post_feedforward_layernorm_2,
                        &cpu_w.post_feedforward_layernorm}) {
        if (layout == 1) *n = test::from_float(test::to_float(*n), {H}, DType::f32);
      }
      Gemma4FfnWeights gpu_w = cpu_w.to(Device::cuda);
      if (layout == 2) {  // post_ff as the view [1, H + 1) of an H + 1 buffer: 2 bytes past 16-byte alignment
        std::vector<float> v = test::to_float(cpu_w.post_feedforward_layernorm);
        v.insert(v.begin(), 0.f);
        keep.push_back(test::from_float(v, {H + 1}, cpu_w.post_feedforward_layernorm.dtype(), Device::cuda));
        gpu_w.post_feedforward_layernorm =
            Tensor::view(static_cast<char*>(keep.back().data()) + dtype_size(keep.back().dtype()), {H},
                         keep.back().dtype(), Device::cuda);
      }
      for (int64_t T : {1, 3}) {
        const std::string what = detail::cat("H=", H, " layout=", layout, " T=", T);
        const Tensor h = test::random_tensor({T, H}, DType::bf16, 1.0f);
        const Tensor expected = gemma4_ffn(h, cpu_w);
        const Tensor got = gemma4_ffn(h.to(Device::cuda), gpu_w);
        test::expect_close_where_routed_alike(expected, got, h, cpu_w.moe.router,
                                              test::to_i32(route(h.to(Device::cuda), gpu_w.moe.router).indices), what);
      }
    }
  }
}

// EXPERTQMM_CHAINED_LAUNCH: the router and the exit kernel as programmatic dependent launches
// compute the same bytes as plain launches (decode and prefill sizes), run after run, and a captured
// block replays to them.
TEST(GpuGemma4Ffn, ChainedLaunchesGiveTheSameBytes) {
  EXPERTQMM_REQUIRE_GPU();
  const Gemma4FfnWeights w = synthetic_gemma4_layer(small_config(4), 0, 9).to(Device::cuda);
  for (int64_t T : {1, 3, 8, 40}) {
    const std::string what = detail::cat("T=", T);
    const Tensor h = test::random_tensor({T, 256}, DType::bf16, 1.0f, Device::cuda);
    std::vector<uint8_t> plain;
    {
      test::ChainedLaunchGuard off(RouteSwitch::off);
      plain = gemma4_ffn(h, w).to_host_bytes();
    }
    test::ChainedLaunchGuard on(RouteSwitch::on);
    for (int call = 0; call < 2; ++call) EXPECT_EQ(gemma4_ffn(h, w).to_host_bytes(), plain) << what << " call " << call;
  }
#ifdef EXPERTQMM_HAVE_CUDA
  test::ChainedLaunchGuard on(RouteSwitch::on);
  test::expect_block_capture_replays(
      [&](Tensor& out, const Tensor& h, Workspace& ws) { gemma4_ffn_into(out, h, w, ws); }, 256, {6, 1}, 6,
      [](cudaGraph_t, const std::string&) {});
#endif
}

TEST(GpuGemma4Ffn, ElementwiseOpsMatchTheCpu) {
  EXPERTQMM_REQUIRE_GPU();
  const Tensor x = test::random_tensor({37, 200}, DType::bf16, 2.0f);
  const Tensor y = test::random_tensor({37, 200}, DType::bf16, 1.0f);
  const Tensor w = test::random_tensor({200}, DType::f32, 1.0f);
  const Tensor s = test::random_tensor({1}, DType::bf16, 1.0f);
  const Tensor xd = x.to(Device::cuda), yd = y.to(Device::cuda);
  EXPECT_LE(test::rel_error(test::to_float(rms_norm(xd, w.to(Device::cuda), 1e-6f)), test::to_float(rms_norm(x, w, 1e-6f))), 1e-2);
  EXPECT_EQ(add(xd, yd).to_host_bytes(), add(x, y).to_host_bytes());
  EXPECT_EQ(add_scaled(xd, yd, s.to(Device::cuda)).to_host_bytes(), add_scaled(x, y, s).to_host_bytes());
  // dense linear on the device against the CPU
  Linear dense;
  dense.dense = test::random_tensor({48, 200}, DType::bf16, 0.1f);
  Linear dense_d;
  dense_d.dense = dense.dense.to(Device::cuda);
  EXPECT_LE(test::rel_error(test::to_float(linear(xd, dense_d)), test::to_float(linear(x, dense))), 1e-2);
}

TEST(GpuGemma4Ffn, OneLayerCapturedInACudaGraphReplaysTheSameOutput) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  // The dense MLP and the experts are two parallel paths: the entry norms fan out to both, and the
  // exit waits for both. (The edges are read with their data: a graph whose edges are not all plain
  // full dependencies, e.g. programmatic ones, refuses a query without it as lossy.)
  auto two_branches = [](cudaGraph_t graph, const std::string& what) {
    size_t edges = 0;
    ASSERT_EQ(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &edges), cudaSuccess);
    std::vector<cudaGraphNode_t> from(edges), to(edges);
    std::vector<cudaGraphEdgeData> edge_data(edges);
    ASSERT_EQ(cudaGraphGetEdges(graph, from.data(), to.data(), edge_data.data(), &edges), cudaSuccess);
    size_t fan_out = 0, fan_in = 0;
    for (size_t i = 0; i < edges; ++i) {
      fan_out = std::max<size_t>(fan_out, std::count(from.begin(), from.end(), from[i]));
      fan_in = std::max<size_t>(fan_in, std::count(to.begin(), to.end(), to[i]));
    }
    EXPECT_GE(fan_out, 2u) << what << ": the dense MLP should branch off beside the experts";
    EXPECT_GE(fan_in, 2u) << what << ": the exit should wait for both branches";
  };
  // Warm at the larger size; the smaller one must not grow anything. At least 7 nodes: entry norms;
  // dense gate/up (+ GLU) and down; router, gate/up and down of the experts; exit. Both with 8-bit
  // and with 16-bit dense MLP and router (the dense linear: memset or id kernel, tile plan, GEMM).
  for (int bits : {8, 0}) {
    const Gemma4FfnWeights w = synthetic_gemma4_layer(small_config(bits, bits), 0, 5).to(Device::cuda);
    test::expect_block_capture_replays(
        [&](Tensor& out, const Tensor& h, Workspace& ws) { gemma4_ffn_into(out, h, w, ws); }, 256, {100, 6}, 6,
        two_branches);
  }
#endif
}

TEST(GpuGemma4Ffn, MixedDevicesAreAnError) {
  EXPERTQMM_REQUIRE_GPU();
  const Gemma4FfnWeights cpu_w = synthetic_gemma4_layer(small_config(), 0, 3);
  const Tensor h = test::random_tensor({2, 256}, DType::bf16, 1.0f, Device::cuda);
  try {
    (void)gemma4_ffn(h, cpu_w);
    ADD_FAILURE() << "no error for cuda h with cpu weights";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gemma4_ffn"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace expertqmm

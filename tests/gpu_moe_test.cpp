// The device MoE path beyond the backend-ops table (gpu_backend_ops_test.cpp checks switch_glu and
// moe_layer_into against float64 over experts, top-k, token counts and product modes): the
// properties the benchmark relies on (a warmed-up call is capturable in a CUDA graph, with no host
// sync and no allocation, and replays to the same bytes; the workspace stops growing), down and the
// combine in column windows, zero tokens, out-of-range expert ids, and a Gemma 4 layer whose router
// projection is 16-bit.
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/gather_qmm_routes.h"
#include "cuda/gather_qmm_ws_hooks.h"
#include "cuda/layer_plan_hooks.h"
#endif

#include "expertqmm/backend.h"
#include "expertqmm/error.h"
#include "expertqmm/settings.h"
#include "support/gather_case.h"
#include "support/graph_capture.h"
#include "support/moe_case.h"
#include "support/reference.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

// 4-bit g64 experts of hidden size 256 and width 128 over E experts, an 8-bit router choosing k.
test::Layer layer(int64_t E, int k, bool fused, Activation act) {
  test::MoeGeometry g;
  g.E = E;
  g.k = k;
  g.fused = fused;
  g.act = act;
  return test::make_layer(g);
}

}  // namespace

// The warp-specialized wgmma build (EXPERTQMM_WGMMA_WS=1) in the layer: at 75 rows per expert the
// gate/up GEMM with its GLU epilogue (both activations) and the plain down GEMM run on it, also
// with one CTA for all items; the answer is the two-CTA build's within rounding
// and float64's. The warp-specialized runs go first, on a fresh workspace, so that rows they failed
// to write cannot hold the two-CTA run's values.
TEST(GpuMoe, WarpSpecializedBuildGivesTheLayersAnswer) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  if (!cuda::wgmma_available()) GTEST_SKIP() << "no sm_90a kernels on this device";
  for (Activation act : {Activation::geglu, Activation::swiglu}) {
    const test::Layer l = layer(16, 4, false, act);
    const int64_t T = 300, D = l.cpu.experts.down.w.size(1);
    const Tensor h = test::random_tensor({T, D}, DType::bf16, 1.0f, Device::cuda);
    auto run_layer = [&](RouteSwitch ws_build, int max_ctas) {
      const test::WsBuildGuard build(ws_build, max_ctas);
      Workspace ws;
      Tensor out = Tensor::empty({T, D}, DType::bf16, Device::cuda);
      moe_layer_into(out, h, h, l.gpu, ws);
      cuda_check();
      return test::to_float(out);
    };
    const std::string what = activation_name(act);
    const uint64_t launches_before = cuda::wgmma_ws_launches();
    const std::vector<float> one_cta = run_layer(RouteSwitch::on, 1), ws = run_layer(RouteSwitch::on, 0);
    EXPECT_GE(cuda::wgmma_ws_launches() - launches_before, 4u)
        << what << ": gate/up and down should have run on the warp-specialized kernel";
    const std::vector<float> two_cta = run_layer(RouteSwitch::off, 0);
    EXPECT_LE(test::rel_error(ws, two_cta), 1e-3) << what << " " << test::seed_note();
    EXPECT_LE(test::rel_error(one_cta, ws), 1e-3) << what << " one CTA";
    const Routing r = route(h, l.gpu.router);
    const std::vector<double> ref = test::reference_switch_glu_combine(
        test::to_float(h), T, D, test::to_i32(r.indices), test::to_float(r.weights), 4, l.cpu.experts);
    EXPECT_LE(test::rel_error(ws, ref), 1e-2) << what << " " << test::seed_note();
  }
#endif
}

// MoeWeights::tile_experts (docs/tile-layout.md) in the layer, with the two-CTA kernel and with the
// warp-specialized build: gate/up (GLU epilogue) and down read it, through the layer plan, and give
// the MLX layout's bits. The tile layout is counted in nbytes.
TEST(GpuMoe, TiledExpertsGiveTheMlxLayoutsBits) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  if (!cuda::wgmma_available()) GTEST_SKIP() << "no sm_90a kernels on this device";
  const test::Layer l = layer(16, 4, false, Activation::geglu);
  MoeWeights tiled = l.gpu;
  EXPECT_EQ(tiled.tile_experts(), 3);
  EXPECT_EQ(tiled.tile_experts(), 0) << "a second call adds nothing";
  EXPECT_GT(tiled.nbytes(), l.gpu.nbytes());
  const int64_t T = 300, D = l.cpu.experts.down.w.size(1);
  const Tensor h = test::random_tensor({T, D}, DType::bf16, 1.0f, Device::cuda);
  for (const RouteSwitch build : {RouteSwitch::off, RouteSwitch::on}) {
    const std::string what = build == RouteSwitch::on ? "warp-specialized" : "two-CTA";
    auto run_layer = [&](const MoeWeights& w) {
      const test::WsBuildGuard guard(build, 0);
      Workspace ws;
      Tensor out = Tensor::empty({T, D}, DType::bf16, Device::cuda);
      moe_layer_into(out, h, h, w, ws);
      cuda_check();
      return test::to_float(out);
    };
    auto tiled_launches = [&] {
      return build == RouteSwitch::on ? cuda::wgmma_ws_tiled_launches() : cuda::wgmma_tiled_launches();
    };
    const uint64_t tiled_before = tiled_launches();
    const std::vector<float> with_tiles = run_layer(tiled);
    EXPECT_EQ(tiled_launches() - tiled_before, 2u) << what << ": gate/up and down should have read the tile layout";
    const std::vector<float> mlx = run_layer(l.gpu);
    EXPECT_EQ(tiled_launches() - tiled_before, 2u) << what << ": the MLX layout read a tile layout";
    size_t differing = 0;
    for (size_t i = 0; i < mlx.size(); ++i) differing += !(with_tiles[i] == mlx[i]);
    EXPECT_EQ(differing, 0u) << what << " " << test::seed_note();
  }
#endif
}

// Where the down output would pass the plan's kDownWindowBytes (24 MiB) whole, moe_layer_into runs
// down and the combine per window of output columns: here H = 1472 and 8,800 (token, slot) rows give
// 25.9 MB, so windows of 1408 and 64 columns. The same bits on a repeat, float64's answer on a
// spread of tokens, and the plan's window width.
TEST(GpuMoe, DownWindowsMatchTheReference) {
  EXPERTQMM_REQUIRE_GPU();
  test::MoeGeometry g;
  g.H = 1472;
  g.E = 16;
  g.k = 8;
  const test::Layer l = test::make_layer(g);
  const int64_t T = 1100, H = g.H, k = g.k;
  const Tensor h = test::random_tensor({T, H}, DType::bf16, 1.0f, Device::cuda);
  auto run_layer = [&]() {
    Workspace ws;
    Tensor out = Tensor::empty({T, H}, DType::bf16, Device::cuda);
    test::poison(out);
    moe_layer_into(out, h, h, l.gpu, ws);
    cuda_check();
    return test::to_float(out);
  };
  const std::vector<float> windowed = run_layer();
  const std::vector<float> again = run_layer();
  EXPECT_EQ(std::memcmp(windowed.data(), again.data(), windowed.size() * sizeof(float)), 0)
      << "the windowed layer gave different bits";
#ifdef EXPERTQMM_HAVE_CUDA
  {
    Tensor out = Tensor::empty({T, H}, DType::bf16, Device::cuda);
    EXPECT_EQ(cuda::planned_down_window_cols(out, h, h, l.gpu), 1408) << "the plan should make windows";
  }
#endif
  // float64 on 16 tokens spread over the call (the routing is the GPU's).
  const Routing r = route(h, l.gpu.router);
  const std::vector<float> h_all = test::to_float(h), w_all = test::to_float(r.weights);
  const std::vector<int32_t> ids_all = test::to_i32(r.indices);
  std::vector<float> h_some, w_some, got;
  std::vector<int32_t> ids_some;
  constexpr int64_t kPicks = 16;
  for (int64_t i = 0; i < kPicks; ++i) {
    const int64_t t = i * (T - 1) / (kPicks - 1);
    h_some.insert(h_some.end(), h_all.begin() + t * H, h_all.begin() + (t + 1) * H);
    w_some.insert(w_some.end(), w_all.begin() + t * k, w_all.begin() + (t + 1) * k);
    ids_some.insert(ids_some.end(), ids_all.begin() + t * k, ids_all.begin() + (t + 1) * k);
    got.insert(got.end(), windowed.begin() + t * H, windowed.begin() + (t + 1) * H);
  }
  const std::vector<double> ref =
      test::reference_switch_glu_combine(h_some, kPicks, H, ids_some, w_some, k, l.cpu.experts);
  EXPECT_LE(test::rel_error(got, ref), 1e-2) << test::seed_note();
}

#ifdef EXPERTQMM_HAVE_CUDA
namespace {
// The down windows' test layer: H = 320, 16 experts, k = 4 (small enough to window under small caps).
constexpr int64_t kWindowTestH = 320;
test::Layer window_test_layer() {
  test::MoeGeometry g;
  g.H = kWindowTestH;
  g.E = 16;
  g.k = 4;
  return test::make_layer(g);
}
}  // namespace
#endif

// The windows at small shapes (the plan's cap shrunk through its test hook): H = 320 and 1,200
// (token, slot) rows under a 300 KB cap make windows of 128, 128 and 64 columns, whose output is the
// unwindowed layer's, byte for byte (the same arithmetic per element). A workspace warmed at that
// size serves a smaller call below the cap (whole y, the same slot) without growing, inside a CUDA
// graph capture whose replays give the call's bytes.
TEST(GpuMoe, DownWindowsGiveTheUnwindowedBytesAndCaptureBelowThem) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  const test::Layer l = window_test_layer();
  struct WindowCap {
    explicit WindowCap(size_t bytes) { cuda::set_down_window_bytes(bytes); }
    ~WindowCap() { cuda::set_down_window_bytes(0); }
  };
  const int64_t T = 300, H = kWindowTestH;
  const Tensor h = test::random_tensor({T, H}, DType::bf16, 1.0f, Device::cuda);
  auto run_layer = [&](const Tensor& hh, Workspace& ws) {
    Tensor out = Tensor::empty({hh.size(0), H}, DType::bf16, Device::cuda);
    test::poison(out);
    moe_layer_into(out, hh, hh, l.gpu, ws);
    cuda_check();
    return out;
  };
  Workspace plain_ws;
  const std::vector<uint8_t> unwindowed = run_layer(h, plain_ws).to_host_bytes();
  const WindowCap cap(300000);
  Tensor probe = Tensor::empty({T, H}, DType::bf16, Device::cuda);
  ASSERT_EQ(cuda::planned_down_window_cols(probe, h, h, l.gpu), 128);
  Workspace ws;
  EXPECT_EQ(run_layer(h, ws).to_host_bytes(), unwindowed) << "the windows changed the output";

  const int64_t small = 100;  // 400 rows: 256 KB of y, under the cap
  const Tensor hs = test::random_tensor({small, H}, DType::bf16, 1.0f, Device::cuda);
  Tensor small_probe = Tensor::empty({small, H}, DType::bf16, Device::cuda);
  ASSERT_EQ(cuda::planned_down_window_cols(small_probe, hs, hs, l.gpu), 0);
  const Tensor expected = run_layer(hs, ws);
  const size_t held = ws.bytes_held();
  const test::CaptureStream stream;
  Tensor replayed = Tensor::empty({small, H}, DType::bf16, Device::cuda);
  cudaGraph_t graph = test::capture_graph(stream.get(), [&] { moe_layer_into(replayed, hs, hs, l.gpu, ws); }, "T=100");
  ASSERT_NE(graph, nullptr);
  EXPECT_EQ(ws.bytes_held(), held) << "the workspace grew below the windowed size";
  test::expect_replays_match(graph, stream.get(), replayed, expected, 2, "T=100 after windows");
#endif
}

// EXPERTQMM_DOWN_WINDOW_MIB (through set_setting, as bench --versus sets it): 2,400 (token, slot) rows
// of H = 320 bf16 are 1.5 MB of down output, so a 1 MiB cap makes 128-column windows and the
// default (24 MiB) none; the windowed output is the unwindowed one, byte for byte.
TEST(GpuMoe, DownWindowSettingSetsTheWindows) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  const test::Layer l = window_test_layer();
  const int64_t T = 600, H = kWindowTestH;
  const Tensor h = test::random_tensor({T, H}, DType::bf16, 1.0f, Device::cuda);
  auto run_layer = [&] {
    Workspace ws;
    Tensor out = Tensor::empty({T, H}, DType::bf16, Device::cuda);
    test::poison(out);
    moe_layer_into(out, h, h, l.gpu, ws);
    cuda_check();
    return out.to_host_bytes();
  };
  Tensor probe = Tensor::empty({T, H}, DType::bf16, Device::cuda);
  ASSERT_EQ(cuda::planned_down_window_cols(probe, h, h, l.gpu), 0);
  const std::vector<uint8_t> unwindowed = run_layer();
  struct Setting {
    Setting() { set_setting("EXPERTQMM_DOWN_WINDOW_MIB", "1"); }
    ~Setting() { set_setting("EXPERTQMM_DOWN_WINDOW_MIB", std::nullopt); }
  };
  {
    const Setting one_mib;
    ASSERT_EQ(cuda::planned_down_window_cols(probe, h, h, l.gpu), 128);
    EXPECT_EQ(run_layer(), unwindowed) << "the windows changed the output";
  }
  EXPECT_EQ(cuda::planned_down_window_cols(probe, h, h, l.gpu), 0) << "dropping the setting should drop the windows";
#endif
}

// A warmed-up moe_layer_into, captured in a CUDA graph on a non-default stream and replayed, writes
// the uncaptured call's bytes. Global capture mode rejects any synchronizing or allocating CUDA call
// made during the capture, so a successful capture proves the path has none; the workspace must not
// grow either.
TEST(GpuMoe, MoeLayerIntoCapturedInACudaGraphReplaysTheSameOutput) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  const test::Layer l = layer(128, 8, false, Activation::geglu);
  const int64_t D = l.cpu.experts.down.w.size(1);
  const test::CaptureStream stream;
  {
    Workspace ws;
    // Warm up at the largest size; then the smaller (unsorted) size must not grow the workspace.
    for (int64_t T : {64, 5}) {
      const std::string what = detail::cat("T=", T);
      const Tensor h = test::random_tensor({T, D}, DType::bf16, 1.0f, Device::cuda);
      const Tensor x = test::random_tensor({T, D}, DType::bf16, 1.0f, Device::cuda);
      Tensor expected = Tensor::empty({T, D}, DType::bf16, Device::cuda);
      moe_layer_into(expected, h, x, l.gpu, ws);
      cuda_check();
      const size_t held = ws.bytes_held();
      ASSERT_GT(held, 0u) << what;

      Tensor replayed = Tensor::empty({T, D}, DType::bf16, Device::cuda);
      cudaGraph_t graph =
          test::capture_graph(stream.get(), [&] { moe_layer_into(replayed, h, x, l.gpu, ws); }, what);
      ASSERT_NE(graph, nullptr) << what;
      EXPECT_EQ(ws.bytes_held(), held) << what << ": the workspace grew during the captured call";
      size_t nodes = 0;
      ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
      // T=5 (T*k = 40) is served by the three-kernel decode layer (moe_decode_layer.cu: one CTA sums a
      // token's k slots), T=64 by the general path.
      EXPECT_GE(nodes, 3u) << what << ": the graph should hold the whole layer";
      test::expect_replays_match(graph, stream.get(), replayed, expected, 2, what);
    }
  }
#endif
}

// A Gemma 4 layer with a bf16 router projection [128, 2816] (torch state dicts, bf16 checkpoints)
// at T = 512 against the CPU: the projection is one gather_mm call on the tile route (the experts
// are quantized, so it is the only gather_mm call). Experts 64 wide keep the CPU reference quick.
TEST(GpuMoe, GemmaLayerWithA16BitRouterMatchesTheCpu) {
  EXPERTQMM_REQUIRE_GPU();
  test::MoeGeometry g;
  g.H = 2816;
  g.I = 64;
  g.E = 128;
  g.k = 8;
  g.router_bits = 0;
  const test::Layer l = test::make_layer(g);
  ASSERT_TRUE(l.gpu.router.proj_dense.defined() && l.gpu.router.proj_dense.dtype() == DType::bf16);
  const int64_t T = 512;
  const Tensor h = test::random_tensor({T, g.H}, DType::bf16, 1.0f);
  const Tensor hd = h.to(Device::cuda);
  const Tensor expected = moe_layer(h, l.cpu);
  diagnostics::reset();
  const Tensor got = moe_layer(hd, l.gpu);
  cuda_check();
  uint64_t attempts = 0, hits = 0;
  for (const RouteCounters& r : diagnostics::snapshot())
    if (r.primitive == "gather_mm") attempts = r.attempts, hits = r.hits;
  EXPECT_EQ(attempts, 1u);
  EXPECT_EQ(hits, expert_tiles_setting() == RouteSwitch::off ? 0u : 1u);
  test::expect_close_where_routed_alike(expected, got, h, l.cpu.router, test::to_i32(route(hd, l.gpu.router).indices),
                                        "bf16 router T=512");
}

TEST(GpuMoe, WarmWorkspaceDoesNotGrowAtEqualOrSmallerSizes) {
  EXPERTQMM_REQUIRE_GPU();
  const test::Layer l = layer(8, 2, true, Activation::swiglu);
  const int64_t D = l.cpu.experts.down.w.size(1);
  Workspace ws;
  size_t held = 0;
  for (int64_t T : {100, 100, 64, 31, 1}) {
    const Tensor h = test::random_tensor({T, D}, DType::bf16, 1.0f, Device::cuda);
    Tensor out = Tensor::empty({T, D}, DType::bf16, Device::cuda);
    moe_layer_into(out, h, h, l.gpu, ws);
    if (held == 0) held = ws.bytes_held();
    EXPECT_EQ(ws.bytes_held(), held) << "T=" << T;
    // And the result is the allocating path's.
    EXPECT_EQ(out.to_host_bytes(), moe_layer(h, h, l.gpu).to_host_bytes()) << "T=" << T;
  }
  cuda_check();
}

// switch_glu_into on CUDA (the MLX extension's SwitchGLU path): switch_glu's bytes in the caller's
// memory, unsorted and sorted, and a warmed workspace serves an equal or smaller call without growing.
TEST(GpuMoe, SwitchGluIntoWritesTheCallersOutput) {
  EXPERTQMM_REQUIRE_GPU();
  const test::Layer l = layer(8, 2, false, Activation::geglu);
  const int64_t D = l.cpu.experts.down.w.size(1);
  Workspace ws;
  size_t held = 0;
  for (int64_t T : {40, 40, 5}) {  // T*k = 80 (sorted) twice, then 10 (unsorted)
    const Tensor x = test::random_tensor({T, D}, DType::bf16, 1.0f, Device::cuda);
    const Tensor idx = test::random_ids({T, 2}, 8, Device::cuda);
    const Tensor want = switch_glu(x, idx, l.gpu.experts);
    Tensor out = Tensor::empty(want.shape(), want.dtype(), Device::cuda);
    test::poison(out);
    switch_glu_into(out, x, idx, l.gpu.experts, ws);
    cuda_check();
    EXPECT_EQ(out.to_host_bytes(), want.to_host_bytes()) << "T=" << T;
    if (held == 0) held = ws.bytes_held();
    EXPECT_EQ(ws.bytes_held(), held) << "T=" << T;
  }
}

TEST(SanitizeGpuMoe, ZeroTokensIsANoOp) {
  EXPERTQMM_REQUIRE_GPU();
  const test::Layer l = layer(4, 2, false, Activation::geglu);
  const int64_t D = l.cpu.experts.down.w.size(1);
  const Tensor empty = Tensor::empty({0, D}, DType::bf16, Device::cuda);
  Workspace ws;
  Tensor out = Tensor::empty({0, D}, DType::bf16, Device::cuda);
  EXPECT_NO_THROW(moe_layer_into(out, empty, empty, l.gpu, ws));
  EXPECT_EQ(ws.bytes_held(), 0u);
  EXPECT_EQ(moe_layer(empty, empty, l.gpu).shape(), (Shape{0, D}));
  const Tensor no_ids = Tensor::empty({0, 2}, DType::i32, Device::cuda);
  EXPECT_EQ(switch_glu(empty, no_ids, l.gpu.experts).shape(), (Shape{0, 2, D}));
  const Routing r = route(empty, l.gpu.router);
  EXPECT_EQ(r.indices.shape(), (Shape{0, 2}));
  cuda_check();
}

// An expert id out of range on the device is recorded and reported by cuda_check(), never read out
// of bounds (run under compute-sanitizer), and leaves nothing behind: the next call is clean and
// right. Sorted path: the bad id also aliases a valid id in the sort's key bits, so the GEMMs get
// unsorted ids.
TEST(SanitizeGpuMoe, OutOfRangeExpertIdIsReported) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t E = 8;
  const test::Layer l = layer(E, 2, false, Activation::geglu);
  const int64_t D = l.cpu.experts.down.w.size(1);
  for (int64_t T : {2, 16}) {
    const int64_t k = T == 2 ? 2 : 4;
    const std::string what = detail::cat("T=", T, " k=", k, T * k >= 64 ? " (sorted)" : " (unsorted)");
    std::vector<int32_t> ids;
    std::vector<float> weights;
    test::random_routing(T, k, E, ids, weights);
    std::vector<int32_t> bad = ids;
    bad[1] = static_cast<int32_t>(E + 8);  // low bits alias a valid id
    const Tensor x = test::random_tensor({T, D}, DType::bf16);
    Tensor y = switch_glu(x.to(Device::cuda), test::ids_tensor(bad, {T, k}, Device::cuda), l.gpu.experts);
    EXPECT_THROW(cuda_check(), Error) << what;
    EXPECT_NO_THROW(cuda_check()) << what << ": the fault must be reported once and cleared";
    bad[1] = -3;
    y = switch_glu(x.to(Device::cuda), test::ids_tensor(bad, {T, k}, Device::cuda), l.gpu.experts);
    EXPECT_THROW(cuda_check(), Error) << what << " negative id";
    test::expect_switch_glu_matches(x, ids, k, l, "valid call after a fault, " + what);
  }
}

// The MoE layer's weighted combine inside the down GEMM's epilogue (EXPERTQMM_COMBINE_IN_DOWN,
// src/cuda/device/token_combine.cuh) against the combine kernel it replaces: the same bytes in every
// element (the same slot-order fp32 arithmetic), into a poisoned output so that a token the epilogue
// never finished shows as NaN. Geometries cover k below, at and above the 8-slot batch, column
// windows (the plan's cap shrunk) with a narrower last window, f16 activations, SwiGLU and the tile
// layout; then repeated calls and CUDA graph replays (the counters are zeroed every call), and the
// plan's choice (on the two-CTA wgmma kernel only).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "expertqmm/backend.h"
#include "expertqmm/error.h"
#include "expertqmm/settings.h"
#include "support/gather_case.h"
#include "support/moe_case.h"
#include "support/test_util.h"

#ifdef EXPERTQMM_HAVE_CUDA
#include "cuda/gather_qmm_routes.h"
#include "cuda/gather_qmm_ws_hooks.h"
#include "cuda/layer_plan_hooks.h"
#include "support/graph_capture.h"
#endif

using namespace expertqmm;

namespace {

using CombineGuard = test::SettingGuard<RouteSwitch, combine_in_down_setting, set_combine_in_down>;

#ifdef EXPERTQMM_HAVE_CUDA
// The plan's down-window cap (bytes of down output held at once) for a scope; 0 restores the default.
struct WindowCap {
  explicit WindowCap(size_t bytes) { cuda::set_down_window_bytes(bytes); }
  ~WindowCap() { cuda::set_down_window_bytes(0); }
};
#endif

struct CombineCase {
  std::string name;
  test::MoeGeometry g;
  int64_t T;
  size_t window_cap = 0;  // > 0: down runs in column windows
  bool tiled = false;     // the experts' tile layout
};

std::vector<CombineCase> cases() {
  std::vector<CombineCase> out;
  test::MoeGeometry g;  // H 256, I 128, GeGLU, bf16
  g.E = 16;
  g.k = 4;
  out.push_back({"k=4", g, 300});
  g.E = 128;
  g.k = 8;
  out.push_back({"E=128 k=8 T=32", g, 32});
  out.push_back({"E=128 k=8 T=300", g, 300});
  g.E = 16;
  g.k = 10;  // two slot batches, the second partial
  out.push_back({"k=10", g, 120});
  g.k = 4;
  g.H = 320;  // windows of 128, 128 and 64 columns under a 300 KB cap
  out.push_back({"windows", g, 300, 300000});
  out.push_back({"windows tiled", g, 300, 300000, true});
  g.H = 256;
  g.dtype = DType::f16;
  out.push_back({"f16", g, 200});
  g.dtype = DType::bf16;
  g.act = Activation::swiglu;
  g.fused = true;
  out.push_back({"swiglu fused gate_up", g, 200});
  return out;
}

}  // namespace

TEST(SanitizeGpuCombineInDown, GivesTheCombineKernelsBytes) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  if (!cuda::wgmma_available()) GTEST_SKIP() << "no sm_90a kernels on this device: the combine stays a kernel";
  for (const CombineCase& c : cases()) {
    const std::string what = c.name + " " + test::seed_note();
    test::Layer l = test::make_layer(c.g);
    MoeWeights w = l.gpu;
    if (c.tiled) ASSERT_GT(w.tile_experts(), 0) << what;
    const int64_t H = l.cpu.experts.down.w.size(1);
    const WindowCap cap(c.window_cap);
    const Tensor h = test::random_tensor({c.T, H}, c.g.dtype, 1.0f, Device::cuda);
    auto run_layer = [&](RouteSwitch combine) {
      const CombineGuard guard(combine);
      Workspace ws;
      Tensor out = Tensor::empty({c.T, H}, c.g.dtype, Device::cuda);
      EXPECT_EQ(cuda::planned_combine_in_down(out, h, h, w), combine != RouteSwitch::off) << what;
      if (c.window_cap) EXPECT_GT(cuda::planned_down_window_cols(out, h, h, w), 0) << what;
      test::poison(out);
      moe_layer_into(out, h, h, w, ws);
      cuda_check();
      return out.to_host_bytes();
    };
    const std::vector<uint8_t> kernel = run_layer(RouteSwitch::off);
    EXPECT_EQ(run_layer(RouteSwitch::automatic), kernel) << what;
  }
#endif
}

// The counters are zeroed by every call: repeated calls on one workspace, and replays of a captured
// call, give the first call's bytes.
TEST(GpuCombineInDown, RepeatsAndGraphReplaysGiveTheSameBytes) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  if (!cuda::wgmma_available()) GTEST_SKIP() << "no sm_90a kernels on this device";
  test::MoeGeometry g;
  g.E = 16;
  g.k = 4;
  g.H = 320;
  const test::Layer l = test::make_layer(g);
  const WindowCap cap(300000);
  const CombineGuard guard(RouteSwitch::on);
  const int64_t T = 300, H = g.H;
  const Tensor h = test::random_tensor({T, H}, DType::bf16, 1.0f, Device::cuda);
  Workspace ws;
  Tensor first = Tensor::empty({T, H}, DType::bf16, Device::cuda);
  ASSERT_TRUE(cuda::planned_combine_in_down(first, h, h, l.gpu));
  moe_layer_into(first, h, h, l.gpu, ws);
  cuda_check();
  for (int repeat = 0; repeat < 2; ++repeat) {
    Tensor again = Tensor::empty({T, H}, DType::bf16, Device::cuda);
    test::poison(again);
    moe_layer_into(again, h, h, l.gpu, ws);
    cuda_check();
    EXPECT_EQ(again.to_host_bytes(), first.to_host_bytes()) << "repeat " << repeat << " " << test::seed_note();
  }
  const test::CaptureStream stream;
  Tensor replayed = Tensor::empty({T, H}, DType::bf16, Device::cuda);
  cudaGraph_t graph = test::capture_graph(stream.get(), [&] { moe_layer_into(replayed, h, h, l.gpu, ws); }, "T=300");
  ASSERT_NE(graph, nullptr);
  test::expect_replays_match(graph, stream.get(), replayed, first, 3, "combine in down");
#endif
}

// The plan combines in down only where the two-CTA wgmma kernel runs it: not with the setting off,
// not under the warp-specialized build, not at decode sizes (the decode layer), and never for an
// output of another dtype than the GEMM's.
TEST(GpuCombineInDown, PlanTakesItOnTheTwoCtaKernelOnly) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  test::MoeGeometry g;
  g.E = 16;
  g.k = 4;
  const test::Layer l = test::make_layer(g);
  const int64_t H = g.H;
  auto planned = [&](int64_t T, RouteSwitch combine, DType out_dtype = DType::bf16) {
    const CombineGuard guard(combine);
    const Tensor h = Tensor::empty({T, H}, DType::bf16, Device::cuda);
    const Tensor out = Tensor::empty({T, H}, out_dtype, Device::cuda);
    return cuda::planned_combine_in_down(out, h, h, l.gpu);
  };
  const bool wgmma = cuda::wgmma_available();
  EXPECT_EQ(planned(300, RouteSwitch::automatic), wgmma);
  EXPECT_EQ(planned(300, RouteSwitch::on), wgmma);
  EXPECT_FALSE(planned(300, RouteSwitch::off));
  EXPECT_FALSE(planned(2, RouteSwitch::on)) << "decode sizes run the decode layer";
  EXPECT_FALSE(planned(300, RouteSwitch::on, DType::f32)) << "an f32 output takes the combine kernel";
  {
    const test::WsBuildGuard ws_build(RouteSwitch::on, 0);
    EXPECT_FALSE(planned(300, RouteSwitch::on)) << "the warp-specialized build has no combine epilogue";
  }
#endif
}

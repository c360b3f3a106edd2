// The decode layer (src/cuda/moe_decode_layer.cu: moe_layer_into in three kernels up to 16 tokens) beyond
// the backend-ops table (gpu_backend_ops_test.cpp checks it against float64 and the general path at
// Gemma 4's geometry and at small odd ones, with its hits counted and runs bit-identical): calls it
// does not take, and CUDA graph capture + replay as three kernel nodes.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/moe_decode_select.h"
#endif

#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "support/backend_cases.h"  // gemm_tolerance
#include "support/graph_capture.h"
#include "support/moe_case.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {
using RouteInGateUpGuard =
    test::SettingGuard<RouteSwitch, decode_route_in_gate_up_setting, set_decode_route_in_gate_up>;
// A decode call's inputs at T tokens of g, and `other`: an input the reference path routes into the
// same workspace before each measured call, so scratch the measured path failed to write shows as
// other's routing.
struct DecodeInputs {
  Tensor h, x, other;
  DecodeInputs(const test::MoeGeometry& g, int64_t T)
      : h(test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda)),
        x(test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda)),
        other(test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda)) {}
};
}  // namespace

#ifdef EXPERTQMM_HAVE_CUDA
// Who ranks a one-token call's experts (host selection only, no GPU needed): the gate/up CTAs in the
// layer alone, the router's last CTA when the router is chained (the Gemma 4 block: bench/NOTES.md
// step 33), at two or more tokens, for 8-bit experts, E > 256 and k > 8; the setting forces either
// way.
TEST(GpuMoeDecode, RouteInGateUpIsChosenForTheLayerAloneAtOneToken) {
  {
    RouteInGateUpGuard who(RouteSwitch::automatic);
    EXPECT_TRUE(cuda::decode_routes_in_gate_up(1, 4, 128, 8, /*router_chained=*/false));
    EXPECT_TRUE(cuda::decode_routes_in_gate_up(1, 4, 256, 1, false));
    EXPECT_FALSE(cuda::decode_routes_in_gate_up(1, 4, 128, 8, /*router_chained=*/true));
    EXPECT_FALSE(cuda::decode_routes_in_gate_up(2, 4, 128, 8, false));
    EXPECT_FALSE(cuda::decode_routes_in_gate_up(1, 8, 128, 8, false));
    EXPECT_FALSE(cuda::decode_routes_in_gate_up(1, 4, 257, 8, false));
    EXPECT_FALSE(cuda::decode_routes_in_gate_up(1, 4, 128, 9, false));
  }
  {
    RouteInGateUpGuard who(RouteSwitch::on);
    EXPECT_TRUE(cuda::decode_routes_in_gate_up(1, 4, 128, 8, /*router_chained=*/true));
    EXPECT_FALSE(cuda::decode_routes_in_gate_up(2, 4, 128, 8, true));
  }
  {
    RouteInGateUpGuard who(RouteSwitch::off);
    EXPECT_FALSE(cuda::decode_routes_in_gate_up(1, 4, 128, 8, /*router_chained=*/false));
  }
}
#endif

// Calls the decode layer does not take go to the general path.
TEST(GpuMoeDecode, UnsupportedCallsFallBack) {
  EXPERTQMM_REQUIRE_GPU();
  test::DecodeSwitchGuard on(RouteSwitch::on);
  // T = 17 > 16 tokens (T*k = 68 is still under the row bound); 8-bit experts at T = 9 > 8 (the
  // scalar kernels take one pass of at most 8 rows per expert).
  for (int bits : {4, 8}) {
    const test::Layer l = test::make_layer({320, 96, 16, 4, bits, 32, 8, false, Activation::geglu, DType::bf16});
    const int64_t T = bits == 4 ? 17 : 9;
    Workspace ws;
    const uint64_t before = test::decode_hits();
    const Tensor h = test::random_tensor({T, 320}, DType::bf16, 1.0f, Device::cuda);
    const Tensor out = test::run_layer(h, h, l.gpu, ws);
    cuda_check();
    EXPECT_EQ(test::decode_hits(), before) << bits << "-bit experts, T=" << T;
    // And the result is still right (general path): compare with the switch forced off.
    test::DecodeSwitchGuard off(RouteSwitch::off);
    Workspace ws2;
    EXPECT_EQ(out.to_host_bytes(), test::run_layer(h, h, l.gpu, ws2).to_host_bytes()) << bits << "-bit experts";
  }
}

#ifdef EXPERTQMM_HAVE_CUDA
// The gate/up grid's group rows (host only): one per (token, slot) row at most, the experts hit up
// to T = 8, and one more per 8 rows beyond (an expert's rows come in plan groups of at most 8).
TEST(GpuMoeDecode, GroupRowsBoundThePlansGroups) {
  EXPECT_EQ(cuda::decode_group_rows(1, 8, 128), 8);
  EXPECT_EQ(cuda::decode_group_rows(8, 8, 128), 64);
  EXPECT_EQ(cuda::decode_group_rows(8, 8, 16), 16);    // T <= 8: no expert has more than 8 rows
  EXPECT_EQ(cuda::decode_group_rows(16, 8, 128), 128);
  EXPECT_EQ(cuda::decode_group_rows(16, 8, 16), 32);   // 16 experts + 128 / 8
  EXPECT_EQ(cuda::decode_group_rows(16, 8, 8), 24);    // every expert's 16 rows: 2 groups each (16) fit
  EXPECT_EQ(cuda::decode_group_rows(9, 2, 8), 10);     // 8 + 18 / 8
  // The bound holds for every split of the n = T*k rows over E experts (each expert <= T rows, one
  // per token): the most groups any split gives (sum of ceil(c_e / 8)), by dynamic programming over
  // the experts, never exceeds the grid's rows.
  for (int64_t E : {8, 16, 40, 128})
    for (int64_t k : {1, 2, 8})
      for (int64_t T = 1; T <= 16; ++T) {
        const int64_t n = T * k;
        if (k > E) continue;
        std::vector<int64_t> most(n + 1, -1);  // most groups over the experts so far holding r rows
        most[0] = 0;
        for (int64_t e = 0; e < E; ++e)
          for (int64_t r = n; r >= 1; --r)
            for (int64_t c = 1; c <= std::min(T, r); ++c)
              if (most[r - c] >= 0) most[r] = std::max(most[r], most[r - c] + (c + 7) / 8);
        const std::string what = detail::cat("T=", T, " k=", k, " E=", E);
        EXPECT_GE(cuda::decode_group_rows(T, k, E), most[n]) << what;
        EXPECT_LE(cuda::decode_group_rows(T, k, E), n) << what;
      }
}
#endif

// A warmed-up decode call captured in a CUDA graph (global mode: any host sync or allocation fails
// the capture) holds exactly three kernel nodes and replays to the uncaptured bytes, twice (the
// down per token at every T here; the down groups' four nodes: DownGroupsMatchThePerTokenDown).
TEST(GpuMoeDecode, CapturedInACudaGraphAsThreeKernels) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  test::DecodeSwitchGuard on(RouteSwitch::on);
  test::SettingGuard<RouteSwitch, decode_down_groups_setting, set_decode_down_groups> per_token(RouteSwitch::off);
  const test::MoeGeometry g{2816, 704, 16, 8, 4, 64, 8, false, Activation::geglu, DType::bf16};
  const test::Layer l = test::make_layer(g);
  const test::CaptureStream stream;
  Workspace ws;
  for (int64_t T : {8, 1, 3, 16}) {
    const std::string what = detail::cat("T=", T);
    if (!cuda::decode_router_fits(T, g.H)) continue;  // sm_80: T = 16 at H = 2816 takes the general path
    const Tensor h = test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda);
    const Tensor x = test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda);
    const Tensor expected = test::run_layer(h, x, l.gpu, ws);
    cuda_check();
    const size_t held = ws.bytes_held();
    Tensor replayed = Tensor::empty({T, g.H}, g.dtype, Device::cuda);
    cudaGraph_t graph = test::capture_graph(stream.get(), [&] { moe_layer_into(replayed, h, x, l.gpu, ws); }, what);
    ASSERT_NE(graph, nullptr) << what;
    EXPECT_EQ(ws.bytes_held(), held) << what << ": the workspace grew during the captured call";
    EXPECT_EQ(test::kernel_nodes(graph), 3) << what << ": the decode layer should be three kernels";
    // The gate/up grid: 16-column blocks x decode_group_rows (T = 16 at E = 16: 32 group rows, the
    // experts' rows in groups of at most 8).
    const dim3 gate_up(static_cast<unsigned>(g.I / 16), static_cast<unsigned>(cuda::decode_group_rows(T, g.k, g.E)));
    bool found = false;
    for (const dim3& d : test::kernel_grids(graph)) found |= d.x == gate_up.x && d.y == gate_up.y && d.z == 1;
    EXPECT_TRUE(found) << what << ": no gate/up grid of " << gate_up.x << " x " << gate_up.y;
    test::expect_replays_match(graph, stream.get(), replayed, expected, 3, what);
  }
#endif
}


// The decode router's one-token top-k (the last CTA ranks every expert's key, device::key_rank)
// breaks exact ties as MLX and the CPU do: router rows duplicated in pairs make experts 2i and 2i+1
// tie exactly, and with top-3 the third slot falls inside a tied pair, so a wrong rule would pick an
// expert the CPU did not (its weights differ: an O(1) error). Gemma's router and Qwen3's softmax
// top-k (equal logits: equal probabilities), dense bf16 and 8-bit projections, several tokens' h one
// at a time.
TEST(GpuMoeDecode, OneTokenTopkBreaksExactTiesLikeTheCpu) {
  EXPERTQMM_REQUIRE_GPU();
  test::DecodeSwitchGuard on(RouteSwitch::on);
  for (RouterKind kind : {RouterKind::gemma4, RouterKind::softmax_topk})
  for (RouteSwitch in_gate_up : {RouteSwitch::off, RouteSwitch::on})  // who ranks: the router, or gate/up
  for (int router_bits : {0, 8}) {
    RouteInGateUpGuard who(in_gate_up);
    const bool softmax = kind == RouterKind::softmax_topk;
    test::MoeGeometry g{256, 128, 16, 3, 4, 64, router_bits, false, softmax ? Activation::swiglu : Activation::geglu,
                        DType::bf16};
    g.router = kind;
    test::Layer l = test::make_layer(g);
    RouterWeights& r = l.cpu.router;
    auto pair_rows = [&](Tensor& t) {  // row 2i + 1 := row 2i of a [E, ...] tensor
      std::vector<uint8_t> bytes = t.to_host_bytes();
      const size_t row = bytes.size() / static_cast<size_t>(g.E);
      for (int64_t e = 1; e < g.E; e += 2)
        std::copy(bytes.begin() + (e - 1) * row, bytes.begin() + e * row, bytes.begin() + e * row);
      t = Tensor::from_host(bytes.data(), t.shape(), t.dtype(), Device::cpu);
    };
    if (router_bits == 0) {
      pair_rows(r.proj_dense);
    } else {
      pair_rows(r.proj.w);
      pair_rows(r.proj.scales);
      pair_rows(r.proj.biases);
    }
    l.gpu.router = test::router_to(r, Device::cuda);
    for (int trial = 0; trial < 4; ++trial) {
      const std::string what = detail::cat(softmax ? "softmax_topk" : "gemma4", " router_bits=", router_bits, " trial ",
                                           trial, " EXPERTQMM_DECODE_ROUTE_IN_GATE_UP=",
                                           in_gate_up == RouteSwitch::on ? "1" : "0");
      const Tensor h = test::random_tensor({1, g.H}, g.dtype, 1.0f);
      const Tensor x = test::random_tensor({1, g.H}, g.dtype, 1.0f);
      const std::vector<int32_t> ci = test::to_i32(route(h, r).indices);
      EXPECT_EQ(ci[2] % 2, 1) << what << ": the CPU's third slot should be a tied pair's higher id";
      const uint64_t before = test::decode_hits();
      Workspace ws;
      const Tensor got = test::run_layer(h.to(Device::cuda), x.to(Device::cuda), l.gpu, ws);
      cuda_check();
      EXPECT_EQ(test::decode_hits(), before + 1) << what << ": the decode layer did not serve the call";
      const std::vector<float> expected = test::to_float(moe_layer(h, x, l.cpu));
      EXPECT_LE(test::rel_error(test::to_float(got), expected), test::gemm_tolerance(g.dtype)) << what;
    }
  }
}

// EXPERTQMM_DECODE_ROUTE_IN_GATE_UP=1 (the gate/up CTAs rank the router's logits themselves, the
// router ends at them): at one token the same output bits as the router's own top-k and plan (the
// same order, the same weight arithmetic), captured in a graph too; Gemma 4's shape, E = 128 and 256
// (one key per thread up to the CTA's 256), separate and fused gate_up, bf16 / f16, groups 32-128, a
// dense router, mxfp4 experts, and Qwen3-MoE's softmax top-k router (renormalised or not). At T = 2
// the setting changes nothing (the router routes).
TEST(GpuMoeDecode, RouteInGateUpIsBitIdenticalAtOneToken) {
  EXPERTQMM_REQUIRE_GPU();
  test::DecodeSwitchGuard on(RouteSwitch::on);
  std::vector<test::MoeGeometry> geometries = {
      {2816, 704, 16, 8, 4, 64, 8, false, Activation::geglu, DType::bf16},
      {2816, 704, 16, 8, 4, 64, 8, true, Activation::geglu, DType::f16},
      {512, 256, 128, 8, 4, 64, 8, false, Activation::geglu, DType::bf16},
      {256, 128, 256, 8, 4, 128, 8, true, Activation::swiglu, DType::bf16},
      {320, 96, 16, 4, 4, 32, 0, false, Activation::geglu, DType::bf16}};
  test::MoeGeometry fp4{512, 256, 32, 4, 4, 32, 8, false, Activation::geglu, DType::bf16};
  fp4.mode = QuantMode::mxfp4;
  geometries.push_back(fp4);
  // Qwen3-MoE's router (softmax_topk: the gate/up CTAs rank the rounded probabilities), its geometry
  // renormalised, and smaller ones without renormalising, f16 and a dense router.
  for (test::MoeGeometry q : {test::MoeGeometry{2048, 768, 128, 8, 4, 64, 8, false, Activation::swiglu, DType::bf16},
                              test::MoeGeometry{512, 256, 64, 8, 4, 64, 8, true, Activation::swiglu, DType::f16},
                              test::MoeGeometry{256, 128, 256, 4, 4, 32, 0, false, Activation::swiglu, DType::bf16},
                              test::MoeGeometry{512, 256, 60, 4, 4, 64, 8, false, Activation::swiglu, DType::bf16},
                              test::MoeGeometry{256, 128, 20, 4, 4, 64, 8, false, Activation::swiglu, DType::bf16}}) {
    q.router = RouterKind::softmax_topk;
    q.norm_topk_prob = q.H == 2048;
    geometries.push_back(q);
  }
  for (const test::MoeGeometry& g : geometries) {
    const test::Layer l = test::make_layer(g);
    for (int64_t T : {1, 2}) {
      const std::string what = g.name() + detail::cat(" T=", T);
      const DecodeInputs in(g, T);
      std::vector<uint8_t> bytes[2];
      Workspace ws;  // one arena: before each measured call the router's path routes `other` into it,
                     // so a routing the gate/up CTAs failed to write would show as other's
      for (RouteSwitch s : {RouteSwitch::off, RouteSwitch::on}) {
        {
          RouteInGateUpGuard router_ranks(RouteSwitch::off);
          (void)test::run_layer(in.other, in.x, l.gpu, ws);
        }
        RouteInGateUpGuard who(s);
        const uint64_t before = test::decode_hits();
        bytes[s == RouteSwitch::on] = test::run_layer(in.h, in.x, l.gpu, ws).to_host_bytes();
        cuda_check();
        EXPECT_EQ(test::decode_hits(), before + 1) << what << ": the decode layer did not serve the call";
      }
      EXPECT_EQ(bytes[1], bytes[0]) << what << ": the gate/up CTAs' routing differs from the router's";
#ifdef EXPERTQMM_HAVE_CUDA
      RouteInGateUpGuard who(RouteSwitch::on);  // the call above took the gate/up CTAs' ranking
      EXPECT_EQ(cuda::decode_routes_in_gate_up(T, g.bits, g.E, g.k, /*router_chained=*/false), T == 1) << what;
#endif
    }
  }
#ifdef EXPERTQMM_HAVE_CUDA
  // Captured: the router then holds no ticket, and replays match the uncaptured call.
  RouteInGateUpGuard who(RouteSwitch::on);
  const test::MoeGeometry g{2816, 704, 16, 8, 4, 64, 8, false, Activation::geglu, DType::bf16};
  const test::Layer l = test::make_layer(g);
  const test::CaptureStream stream;
  Workspace ws;
  const Tensor h = test::random_tensor({1, g.H}, g.dtype, 1.0f, Device::cuda);
  const Tensor x = test::random_tensor({1, g.H}, g.dtype, 1.0f, Device::cuda);
  const Tensor expected = test::run_layer(h, x, l.gpu, ws);
  cuda_check();
  Tensor replayed = Tensor::empty({1, g.H}, g.dtype, Device::cuda);
  cudaGraph_t graph = test::capture_graph(stream.get(), [&] { moe_layer_into(replayed, h, x, l.gpu, ws); }, "T=1");
  ASSERT_NE(graph, nullptr);
  EXPECT_EQ(test::kernel_nodes(graph), 3);
  test::expect_replays_match(graph, stream.get(), replayed, expected, 3, "T=1 routed in gate/up");
#endif
}

#ifdef EXPERTQMM_HAVE_CUDA
namespace {
using DownGroupsGuard = test::SettingGuard<RouteSwitch, decode_down_groups_setting, set_decode_down_groups>;

// Each geometry's layer at each T, the down groups (EXPERTQMM_DECODE_DOWN_GROUPS) against the
// per-token down kernel: per (down row, hidden row) the same mma column, the same group sums of x and
// the same fp32 operations in the same order, and the same slot-order combine, so the outputs are the
// same bytes (a missing, misplaced or stale row or column of the partials would differ near 1).
// Before each measured call `other` is routed through the down groups into the same workspace, so
// partials the measured call did not write would show as other's.
void expect_down_groups_match(const std::vector<test::MoeGeometry>& geometries, const std::vector<int64_t>& tokens) {
  test::DecodeSwitchGuard on(RouteSwitch::on);
  for (const test::MoeGeometry& g : geometries) {
    const test::Layer l = test::make_layer(g);
    for (int64_t T : tokens) {
      if (!cuda::decode_router_fits(T, g.H)) continue;  // sm_80 at Gemma's H: T <= 11
      const std::string what = g.name() + detail::cat(" T=", T);
      const DecodeInputs in(g, T);
      Workspace ws;
      std::vector<float> out[2];
      for (int groups = 0; groups < 2; ++groups) {
        {
          DownGroupsGuard through_groups(RouteSwitch::on);
          (void)test::run_layer(in.other, in.x, l.gpu, ws);
        }
        DownGroupsGuard setting(groups ? RouteSwitch::on : RouteSwitch::off);
        const uint64_t before = test::decode_hits();
        out[groups] = test::to_float(test::run_layer(in.h, in.x, l.gpu, ws));
        cuda_check();
        EXPECT_EQ(test::decode_hits(), before + 1) << what << ": the decode layer did not serve the call";
        EXPECT_EQ(cuda::decode_down_groups(T, g.bits, 0), groups == 1) << what;
      }
      EXPECT_LE(test::rel_error(out[1], out[0]), 1e-3) << what << ": the down groups differ from the per-token down";
      size_t differ = 0;
      for (size_t i = 0; i < out[0].size(); ++i) differ += out[1][i] != out[0][i];
      EXPECT_EQ(differ, 0u) << what << ": outputs not bit-identical to the per-token down's";
    }
  }
}
}  // namespace

// Gemma 4's H and I (16 experts: at T = 16 experts hold more than 8 rows, split plan groups) in bf16
// with separate gate and up and in f16 fused; an odd geometry (H = 320: two blocks of 128 columns and
// one of 64, whose upper four warps idle; I = 96, group 32); group 128 with SwiGLU and a dense router;
// Qwen3's router; mxfp4 and nvfp4 experts (the tile's kFp form; nvfp4 fused, group 16). Captured at
// Gemma's geometry: four kernel nodes (router, gate/up, down groups, combine) with the down grid
// (H / 128, decode_group_rows), replays matching the uncaptured call.
TEST(GpuMoeDecode, DownGroupsMatchThePerTokenDown) {
  EXPERTQMM_REQUIRE_GPU();
  test::MoeGeometry fp4{512, 256, 32, 4, 4, 32, 8, false, Activation::geglu, DType::bf16};
  fp4.mode = QuantMode::mxfp4;
  test::MoeGeometry nvfp4{320, 96, 16, 4, 4, 16, 8, true, Activation::swiglu, DType::bf16};
  nvfp4.mode = QuantMode::nvfp4;
  expect_down_groups_match({{2816, 704, 16, 8, 4, 64, 8, false, Activation::geglu, DType::bf16},
                            {2816, 704, 16, 8, 4, 64, 8, true, Activation::geglu, DType::f16},
                            {320, 96, 16, 4, 4, 32, 8, false, Activation::geglu, DType::bf16},
                            {256, 128, 32, 8, 4, 128, 0, true, Activation::swiglu, DType::bf16},
                            {512, 256, 32, 8, 4, 64, 8, false, Activation::swiglu, DType::bf16, RouterKind::softmax_topk},
                            fp4, nvfp4},
                           {2, 5, 8, 12, 16});
  test::DecodeSwitchGuard on(RouteSwitch::on);
  DownGroupsGuard groups(RouteSwitch::on);
  const test::MoeGeometry g{2816, 704, 16, 8, 4, 64, 8, false, Activation::geglu, DType::bf16};
  const test::Layer l = test::make_layer(g);
  const test::CaptureStream stream;
  Workspace ws;
  for (int64_t T : {8, 16}) {
    if (!cuda::decode_router_fits(T, g.H)) continue;
    const std::string what = detail::cat("down groups T=", T);
    const Tensor h = test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda);
    const Tensor x = test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda);
    const Tensor expected = test::run_layer(h, x, l.gpu, ws);
    cuda_check();
    Tensor replayed = Tensor::empty({T, g.H}, g.dtype, Device::cuda);
    cudaGraph_t graph = test::capture_graph(stream.get(), [&] { moe_layer_into(replayed, h, x, l.gpu, ws); }, what);
    ASSERT_NE(graph, nullptr) << what;
    EXPECT_EQ(test::kernel_nodes(graph), 4) << what;
    const dim3 down(static_cast<unsigned>((g.H + 127) / 128), static_cast<unsigned>(cuda::decode_group_rows(T, g.k, g.E)));
    bool found = false;
    for (const dim3& d : test::kernel_grids(graph)) found |= d.x == down.x && d.y == down.y && d.z == 1;
    EXPECT_TRUE(found) << what << ": no down-groups grid of " << down.x << " x " << down.y;
    test::expect_replays_match(graph, stream.get(), replayed, expected, 3, what);
  }
}

// Who takes the down groups: unset (automatic) from kDecodeDownGroupsMinTokens = 12 tokens, `on` from
// 2, `off` never; only 4-bit down weights, and only where their shared memory fits.
TEST(GpuMoeDecode, DownGroupsFromTwelveTokensByDefault) {
  EXPERTQMM_REQUIRE_GPU();
  for (RouteSwitch s : {RouteSwitch::automatic, RouteSwitch::on, RouteSwitch::off}) {
    DownGroupsGuard setting(s);
    for (int64_t T = 1; T <= 16; ++T) {
      const bool want = s == RouteSwitch::on ? T >= 2 : s == RouteSwitch::automatic && T >= 12;
      EXPECT_EQ(cuda::decode_down_groups(T, 4, 0), want) << "T=" << T << " setting " << static_cast<int>(s);
      EXPECT_FALSE(cuda::decode_down_groups(T, 8, 0)) << "T=" << T << ": 8-bit down has no tensor-core tile";
      EXPECT_FALSE(cuda::decode_down_groups(T, 4, size_t{1} << 30)) << "T=" << T << ": shared memory past the device's";
    }
  }
}

// For the sanitizers: every expert's 16 rows as two plan groups (E = k = 8, T = 16), and an odd
// geometry with shared experts.
TEST(SanitizeMoeDecodeDownGroups, MatchThePerTokenDown) {
  EXPERTQMM_REQUIRE_GPU();
  expect_down_groups_match({{256, 128, 8, 8, 4, 64, 8, false, Activation::swiglu, DType::bf16},
                            {320, 96, 16, 4, 4, 32, 8, false, Activation::geglu, DType::bf16}},
                           {5, 16});
}
#endif

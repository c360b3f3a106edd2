// The expert tile route (gather_qmm route 1) beyond the backend-ops table (gpu_backend_ops_test.cpp
// runs it and both of its kernels on Gemma 4's shapes and on its plan's edges): one-field selector
// misses with their named fallback classes, the on/off switch, the sortedness fail-safe decided on
// the device (inside a CUDA graph capture, which fails on any host synchronization), a bad
// EXPERTQMM_WGMMA_WIDTH, and the diagnostics invariant. Fresh random inputs every run.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "cuda/gather_qmm.h"
#include "cuda/gather_qmm_routes.h"
#include "cuda/gather_qmm_ws_hooks.h"
#include "cuda/tile_plan.cuh"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "expertqmm/ops.h"
#include "support/gather_case.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

// Every test starts from zero counters and the automatic setting, and leaves them so: a retraction
// of a named route's launch (no hit to move) must not take a later test's hit.
struct CountersGuard {
  CountersGuard() {
    set_expert_tiles(RouteSwitch::automatic);
    diagnostics::reset();
  }
  ~CountersGuard() {
    set_expert_tiles(RouteSwitch::automatic);
    try {
      diagnostics::reset();  // reads the device's count: a sticky CUDA error throws
    } catch (const std::exception& e) {
      ADD_FAILURE() << "diagnostics::reset: " << e.what();
    }
  }
};

void expect_invariant(const RouteCounters& c) {
  EXPECT_EQ(c.attempts, c.hits + c.fallback_total()) << diagnostics::format({c});
}

std::vector<int32_t> sorted_ids(int64_t rows, int64_t E) { return test::make_ids(test::sorted(rows), E); }

// p's tile plan built on the device from its ids, as the layer plan builds one (launch_build_tile_plan_at).
Tensor tile_plan_of(const detail::GatherQmmProblem& p) {
  const int E = static_cast<int>(p.w_batch);
  Tensor plan = Tensor::empty({static_cast<int64_t>((cuda::tile_plan_bytes(p.B, E) + 3) / 4)}, DType::i32, Device::cuda);
  cuda::launch_build_tile_plan_at(p.rhs.data_as<const int32_t>(), p.B, E, plan.data(),
                                  static_cast<cudaStream_t>(cuda_stream()));
  return plan;
}

// A warp-specialized test's operand form (the activation: GLU tests only).
struct WsForm {
  DType dtype;
  int group;
  int64_t K;
  Activation act = Activation::geglu;
};

// Elements of got more than about `units` units in T's last place from want.
size_t ulps_apart(const std::vector<float>& got, const std::vector<float>& want, DType dtype, int units) {
  const double ulp = dtype == DType::bf16 ? 1.0 / 128 : 1.0 / 1024;  // relative
  size_t apart = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i)
    apart += !(std::abs(got[i] - want[i]) <= units * ulp * std::abs(want[i]) + 1e-6);
  return apart;
}

}  // namespace

// Each build of the wgmma kernel pinned through set_wgmma_width (the API side of
// EXPERTQMM_WGMMA_WIDTH, whose parsing cpu_settings_test covers): n32, n64 and n128 (with its n96
// width for 65-96 rows), taller tiles in pieces, on tails of every class, against simt.
TEST(SanitizeGpuExpertTiles, EveryWgmmaWidthPinned) {
  EXPERTQMM_REQUIRE_GPU();
  std::vector<int32_t> ids(96, 0);  // 96 rows (n96 in the n128 build), then 97 (n128), then a tail
  ids.insert(ids.end(), 97, 3);
  ids.insert(ids.end(), 13, 7);
  for (DType dtype : {DType::bf16, DType::f16}) {
    const test::GatherCall c = test::rows_call(test::random_codes(8, 200, 192, 4, 64, dtype), dtype, ids, true);
    if (!cuda::supports_expert_tiles_wgmma(c.problem()).ok) return;  // no sm_90a kernels on this device
    const std::vector<float> simt = test::run_route(c, "simt");
    for (int width : {32, 64, 128}) {
      set_wgmma_width(width);
      const std::vector<float> wg = test::run_route(c, "expert_tiles_wgmma");
      set_wgmma_width(0);  // the measured table
      EXPECT_LE(test::rel_error(wg, simt), 1e-2) << dtype_name(dtype) << " width " << width << " " << test::seed_note();
    }
  }
  EXPECT_THROW(set_wgmma_width(48), Error);
}

// The wgmma kernel's 8-bit build is the selector's choice from 32 rows per expert on average
// (kWgmma8BitMinRowsPerExpert), the mma.sync kernel's below: the selected route's output holds the
// pinned kernel's bytes (8 experts, bf16, group 64, 8 * 32 rows, then one row fewer).
TEST(SanitizeGpuExpertTiles, EightBitBuildFromThirtyTwoRowsPerExpert) {
  EXPERTQMM_REQUIRE_GPU();
  if (wgmma_setting() == RouteSwitch::on) GTEST_SKIP() << "EXPERTQMM_WGMMA=1 takes the 8-bit build at any size";
  const QuantizedWeight q8 = test::random_codes(8, 200, 192, 8, 64, DType::bf16);
  for (int64_t rows : {8 * cuda::kWgmma8BitMinRowsPerExpert, 8 * cuda::kWgmma8BitMinRowsPerExpert - 1}) {
    const test::GatherCall c = test::rows_call(q8, DType::bf16, sorted_ids(rows, 8), true);
    if (!cuda::supports_expert_tiles_wgmma(c.problem()).ok) return;  // no sm_90a kernels on this device
    ASSERT_EQ(cuda::gather_qmm_selected_route(c.problem()), "expert_tiles") << rows << " rows";
    const bool wgmma = rows >= 8 * cuda::kWgmma8BitMinRowsPerExpert;
    const std::vector<float> pinned = test::run_route(c, wgmma ? "expert_tiles_wgmma" : "expert_tiles_mma_sync");
    const std::vector<float> selected = test::run_route(c);
    ASSERT_EQ(selected.size(), pinned.size());
    size_t differing = 0;
    for (size_t i = 0; i < selected.size(); ++i) differing += selected[i] != pinned[i];
    EXPECT_EQ(differing, 0u) << rows << " rows, the " << (wgmma ? "wgmma" : "mma.sync") << " kernel expected";
    EXPECT_LE(test::rel_error(selected, test::run_route(c, "simt")), 1e-2) << rows << " rows " << test::seed_note();
  }
}

// The layer's down GEMM in column windows (launch_expert_tiles_columns, moe_layer_into from
// kDownWindowBytes of down output): each window's output is the whole GEMM's columns, bit for bit,
// through the kernel the route picks, in every form a window offsets differently: 4-bit bf16 group
// 64 and f16 group 128 (wgmma on sm_90a), 8-bit at 9 rows per expert (mma.sync; the route's least
// rows), mxfp4 and mxfp8 (uint8 scale codes, viewed as uint16 pairs by make_tile_args), and the
// weight's tile layout in the warp-specialized build and in the two-CTA kernel (each window starts
// at its own 64-row blocks); with a last window narrower than the others and windows that are not
// the first. A mis-sorted plan (the generic algorithm) gives the same columns, and only the window
// told to count it adds a retraction. Misaligned windows are refused.
TEST(SanitizeGpuExpertTiles, ColumnWindowsHoldTheWholeGemmsColumns) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  constexpr int64_t kStep = cuda::kTileColumnsAlign;
  struct Form {
    int bits, group;
    DType dtype;
    QuantMode mode;
    int64_t rows;
    bool tiled = false;  // the weight's tile layout
    bool ws = false;     // the warp-specialized build (else the two-CTA kernel, as by default)
  };
  const Form forms[] = {{4, 64, DType::bf16, QuantMode::affine, 300},   {4, 128, DType::f16, QuantMode::affine, 300},
                        {8, 64, DType::bf16, QuantMode::affine, 72},    {4, 32, DType::bf16, QuantMode::mxfp4, 300},
                        {8, 32, DType::bf16, QuantMode::mxfp8, 300},    {4, 64, DType::bf16, QuantMode::affine, 300, true, true},
                        {4, 128, DType::f16, QuantMode::affine, 300, true, false}};
  for (const Form& f : forms) {
    for (bool mis_sorted : {false, true}) {
      const int64_t E = 8, N = 2 * kStep + 64, K = 256;
      const QuantizedWeight q = test::random_codes(E, N, K, f.bits, f.group, f.dtype, f.mode);
      std::vector<int32_t> ids = sorted_ids(f.rows, E);
      if (mis_sorted) std::swap(ids.front(), ids.back());
      test::GatherCall c = test::rows_call(q, f.dtype, ids, true);
      if (f.tiled) c.q_dev.tiled = tile_weight(c.q_dev);
      const test::WsBuildGuard build(f.ws ? RouteSwitch::on : RouteSwitch::off, 0);
      auto tiled_launches = [&] { return f.ws ? cuda::wgmma_ws_tiled_launches() : cuda::wgmma_tiled_launches(); };
      const uint64_t tiled_before = tiled_launches();
      const std::string what = detail::cat(quant_mode_name(f.mode), " ", f.bits, "-bit g", f.group, " ",
                                           dtype_name(f.dtype), f.tiled ? " tile layout" : "", f.ws ? " warp-specialized" : "",
                                           mis_sorted ? " mis-sorted" : "");
      detail::GatherQmmProblem p = c.problem();
      const std::vector<float> whole = test::run_route(c, "expert_tiles");
      const Tensor plan = tile_plan_of(p);
      p.tile_plan = plan.data();
      auto retracted = [] { return cuda::gather_qmm_device_retractions(); };  // named routes bypass the selector
      const uint64_t retracted_before = retracted();
      for (int64_t begin = 0; begin < N; begin += kStep) {
        const int64_t count = std::min(kStep, N - begin);
        Tensor out = Tensor::empty({p.B, count}, f.dtype, Device::cuda);
        test::poison(out);
        cuda::launch_expert_tiles_columns(p, begin, count, out.data(), begin == 0);
        cuda_check();
        const std::vector<float> window = test::to_float(out);
        size_t differing = 0;
        for (int64_t r = 0; r < p.B; ++r)
          for (int64_t j = 0; j < count; ++j) differing += !(window[r * count + j] == whole[r * N + begin + j]);
        EXPECT_EQ(differing, 0u) << what << ", columns [" << begin << ", " << begin + count << ")";
      }
      EXPECT_EQ(retracted() - retracted_before, mis_sorted ? 1u : 0u) << what;
      if (f.tiled && cuda::wgmma_available())  // the whole GEMM and its three windows
        EXPECT_EQ(tiled_launches() - tiled_before, 4u) << what << ": the tile-layout build did not run";
      Tensor out = Tensor::empty({p.B, kStep}, f.dtype, Device::cuda);
      EXPECT_THROW(cuda::launch_expert_tiles_columns(p, 64, kStep, out.data(), false), Error) << what;  // off a step
      EXPECT_THROW(cuda::launch_expert_tiles_columns(p, 0, 64, out.data(), false), Error) << what;      // ends inside
      EXPECT_THROW(cuda::launch_expert_tiles_columns(p, kStep, N, out.data(), false), Error) << what;   // past N
    }
  }
}

// The warp-specialized build (EXPERTQMM_WGMMA_WS=1, gather_qmm_expert_tiles_ws.cu) against the
// two-CTA kernel (within about one unit in the last place, element by element) and the float64
// reference, through the selector's wgmma route at > 32 rows per expert (its 128-token build):
// gathered token rows; full tiles, 96 and 33 rows (n128), 13 and 32 rows alone (n32), tails of 2
// and 32 rows run with their full tile (n128 + n32; the last after two full tiles) and the 33-row
// one alone, an expert without rows; a partial column block (N = 320); odd and even k-tile counts
// (K = 320 at group 64, 384 at group 128); bf16 and f16; with one CTA per SM and with the grid
// capped at 3 and 1 CTAs (set_wgmma_ws_max_ctas), so that a CTA runs many items and the 7-stage
// ring wraps many times. A mis-sorted plan (the two-CTA kernel's walk, one retraction) gives the
// same answers. The GLU form: the next test and GpuMoe.WarpSpecializedBuildGivesTheLayersAnswer.
TEST(SanitizeGpuExpertTiles, WarpSpecializedBuildMatchesTheTwoCtaBuild) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  for (const WsForm f : {WsForm{DType::bf16, 64, 320}, WsForm{DType::f16, 128, 384}}) {
    const int64_t E = 8, N = 320, tokens = 96;
    std::vector<int32_t> rhs;
    for (auto [expert, rows] : {std::pair<int, int>{0, 128}, {1, 96}, {2, 130}, {3, 160}, {4, 13}, {5, 161}, {6, 258},
                                {7, 32}})
      rhs.insert(rhs.end(), rows, expert);
    std::vector<int32_t> lhs(rhs.size());
    for (size_t r = 0; r < lhs.size(); ++r) lhs[r] = static_cast<int32_t>((r * 37 + 11) % tokens);
    const QuantizedWeight q = test::random_codes(E, N, f.K, 4, f.group, f.dtype);
    for (bool mis_sorted : {false, true}) {
      std::vector<int32_t> ids = rhs;
      if (mis_sorted) std::swap(ids.front(), ids.back());
      test::GatherCall c = test::batched_call(q, f.dtype, tokens, 1, lhs, ids);
      c.sorted = true;  // the promise of the layer's sorted rows (broken on purpose when mis_sorted)
      if (!cuda::wgmma_available()) GTEST_SKIP() << "no sm_90a kernels on this device";
      ASSERT_TRUE(cuda::supports_expert_tiles_wgmma(c.problem()).ok) << c.describe("expert_tiles_wgmma");
      const std::vector<float> two_cta = [&] {
        test::WsBuildGuard off(RouteSwitch::off, 0);
        return test::run_route(c, "expert_tiles_wgmma");
      }();
      for (int max_ctas : {0, 3, 1}) {
        const std::string what = detail::cat(dtype_name(f.dtype), " g", f.group, " K ", f.K, " max CTAs ", max_ctas,
                                             mis_sorted ? " mis-sorted" : "");
        const auto retracted = [] { return cuda::gather_qmm_device_retractions(); };  // named routes bypass the selector
        const uint64_t retracted_before = retracted(), launches_before = cuda::wgmma_ws_launches();
        const std::vector<float> ws = [&] {
          test::WsBuildGuard on(RouteSwitch::on, max_ctas);
          return test::run_route(c, "expert_tiles_wgmma");
        }();
        EXPECT_EQ(cuda::wgmma_ws_launches() - launches_before, 1u) << what << ": the warp-specialized kernel did not run";
        EXPECT_EQ(retracted() - retracted_before, mis_sorted ? 1u : 0u) << what;
        ASSERT_EQ(ws.size(), two_cta.size());
        EXPECT_EQ(ulps_apart(ws, two_cta, f.dtype, 1), 0u)
            << what << ": outputs more than one unit in the last place from the two-CTA kernel's " << test::seed_note();
        EXPECT_LE(test::reference_error(c, ws), 1e-2) << what;
      }
    }
  }
}

// The warp-specialized build's GLU form, as the layer plan launches it (launch_gate_up_glu on one
// shared tile plan), against the two-CTA kernel's GLU form (within two units in the last place)
// and against act(gate) * up of the plain products: sorted rows, f16 at group 128 and bf16 at group 64, N = 288
// (the last 64-column block half full), odd and even k-tile counts, tails merged and alone, the grid
// at one CTA per SM and at one CTA.
TEST(SanitizeGpuExpertTiles, WarpSpecializedGluMatchesTheTwoCtaBuild) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  for (const WsForm f : {WsForm{DType::f16, 128, 384, Activation::geglu}, WsForm{DType::bf16, 64, 320, Activation::swiglu}}) {
    const int64_t E = 6, N = 288, tokens = 80;
    std::vector<int32_t> rhs;
    for (auto [expert, rows] : {std::pair<int, int>{0, 160}, {1, 7}, {2, 129}, {3, 96}, {5, 200}}) rhs.insert(rhs.end(), rows, expert);
    std::vector<int32_t> lhs(rhs.size());
    for (size_t r = 0; r < lhs.size(); ++r) lhs[r] = static_cast<int32_t>((r * 29 + 5) % tokens);
    test::GatherCall gate = test::batched_call(test::random_codes(E, N, f.K, 4, f.group, f.dtype), f.dtype, tokens, 1, lhs, rhs);
    gate.sorted = true;  // the layer's sorted rows
    test::GatherCall up = gate;  // the same x and ids, other weights
    up.q_host = test::random_codes(E, N, f.K, 4, f.group, f.dtype);
    up.q_dev = test::to_device(up.q_host, Device::cuda);
    detail::GatherQmmProblem pg = gate.problem(), pu = up.problem();
    if (!cuda::wgmma_available()) GTEST_SKIP() << "no sm_90a kernels on this device";
    ASSERT_TRUE(cuda::supports_expert_tiles_wgmma(pg).ok) << gate.describe("expert_tiles_wgmma");
    ASSERT_TRUE(cuda::gate_up_glu_fits(pg, pu));
    const Tensor plan = tile_plan_of(pg);  // one plan for both, as the layer plan shares it
    pg.tile_plan = pu.tile_plan = plan.data();
    auto glu = [&](RouteSwitch ws_build, int max_ctas) {
      test::WsBuildGuard build(ws_build, max_ctas);
      Tensor hidden = Tensor::empty({pg.B, N}, f.dtype, Device::cuda);
      test::poison(hidden);
      cuda::launch_gate_up_glu(pg, pu, f.act, hidden.data());
      cuda_check();
      return test::to_float(hidden);
    };
    const std::vector<float> two_cta = glu(RouteSwitch::off, 0);
    // act(gate) * up from the plain products, each rounded to T as the fused epilogue rounds them.
    test::WsBuildGuard plain(RouteSwitch::off, 0);
    const Tensor g = test::from_float(test::run_route(gate, "expert_tiles_wgmma"), {pg.B, N}, f.dtype);
    const Tensor u = test::from_float(test::run_route(up, "expert_tiles_wgmma"), {pg.B, N}, f.dtype);
    const std::vector<float> composed = test::to_float(glu_product(f.act, g, u));
    EXPECT_LE(test::rel_error(two_cta, composed), 5e-3) << activation_name(f.act) << " two-CTA " << test::seed_note();
    for (int max_ctas : {0, 1}) {
      const std::string what = detail::cat(dtype_name(f.dtype), " g", f.group, " K ", f.K, " ", activation_name(f.act),
                                           " max CTAs ", max_ctas);
      const uint64_t launches_before = cuda::wgmma_ws_launches();
      const std::vector<float> ws = glu(RouteSwitch::on, max_ctas);
      EXPECT_EQ(cuda::wgmma_ws_launches() - launches_before, 1u) << what << ": the warp-specialized kernel did not run";
      ASSERT_EQ(ws.size(), two_cta.size());
      // Two units: a one-unit difference in the rounded gate can move act(gate) * up by one more.
      EXPECT_EQ(ulps_apart(ws, two_cta, f.dtype, 2), 0u)
          << what << ": outputs more than two units in the last place from the two-CTA kernel's " << test::seed_note();
    }
  }
}

// The weights' tile layout (docs/tile-layout.md) in the warp-specialized build gives the MLX
// layout's bits, plain and GLU forms, on one CTA per SM and on one CTA (the ring wraps; each stage's
// bulk copies are counted on its barrier again), and so does the two-CTA kernel in its three builds;
// tile_weight of the device weight (the CUDA backend's
// kernels) equals the host's, and its untile_weight gives the MLX tensors back.
// Plain: N = 320, five 64-row blocks, so the last item's second block is missing; GLU: N = 288, the
// last block half rows past N. bf16 at group 64 with K = 320 (odd k tiles), f16 at group 128, K = 384.
TEST(SanitizeGpuExpertTiles, TileLayoutGivesTheMlxLayoutsBits) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  for (const WsForm f : {WsForm{DType::bf16, 64, 320, Activation::geglu}, WsForm{DType::f16, 128, 384, Activation::swiglu}}) {
    const int64_t E = 6, tokens = 80;
    std::vector<int32_t> rhs;
    for (auto [expert, rows] : {std::pair<int, int>{0, 160}, {1, 7}, {2, 129}, {3, 96}, {5, 200}}) rhs.insert(rhs.end(), rows, expert);
    std::vector<int32_t> lhs(rhs.size());
    for (size_t r = 0; r < lhs.size(); ++r) lhs[r] = static_cast<int32_t>((r * 29 + 5) % tokens);
    auto call_of = [&](int64_t N) {
      test::GatherCall c = test::batched_call(test::random_codes(E, N, f.K, 4, f.group, f.dtype), f.dtype, tokens, 1, lhs, rhs);
      c.sorted = true;  // the layer's sorted rows
      c.q_dev.tiled = tile_weight(c.q_dev);
      return c;
    };
    test::GatherCall plain = call_of(320), gate = call_of(288), up = call_of(288);
    up.x_dev = gate.x_dev;  // GLU: one x for both
    const TiledWeight host_tiles = tile_weight(plain.q_host);  // the CUDA kernels run on any GPU
    EXPECT_EQ(plain.q_dev.tiled.codes.to_host_bytes(), host_tiles.codes.to_host_bytes());
    EXPECT_EQ(plain.q_dev.tiled.params.to_host_bytes(), host_tiles.params.to_host_bytes());
    const QuantizedWeight back = untile_weight(plain.q_dev.tiled);  // the device's inverse
    EXPECT_EQ(back.w.device(), Device::cuda);
    EXPECT_EQ(back.w.to_host_bytes(), plain.q_host.w.to_host_bytes());
    EXPECT_EQ(back.scales.to_host_bytes(), plain.q_host.scales.to_host_bytes());
    EXPECT_EQ(back.biases.to_host_bytes(), plain.q_host.biases.to_host_bytes());
    if (!cuda::wgmma_available()) GTEST_SKIP() << "no sm_90a kernels on this device";
    auto untiled = [](test::GatherCall c) {
      c.q_dev.tiled = TiledWeight{};
      return c;
    };
    auto glu = [&](const test::GatherCall& g, const test::GatherCall& u) {
      detail::GatherQmmProblem pg = g.problem(), pu = u.problem();
      const Tensor plan = tile_plan_of(pg);
      pg.tile_plan = pu.tile_plan = plan.data();
      Tensor hidden = Tensor::empty({pg.B, pg.N}, f.dtype, Device::cuda);
      test::poison(hidden);
      cuda::launch_gate_up_glu(pg, pu, f.act, hidden.data());
      cuda_check();
      return test::to_float(hidden);
    };
    auto differing = [](const std::vector<float>& a, const std::vector<float>& b) {
      size_t n = a.size() == b.size() ? 0 : std::max(a.size(), b.size());
      for (size_t i = 0; i < a.size() && i < b.size(); ++i) n += !(a[i] == b[i]);
      return n;
    };
    for (int max_ctas : {0, 1}) {
      const std::string what = detail::cat(dtype_name(f.dtype), " g", f.group, " K ", f.K, " max CTAs ", max_ctas);
      test::WsBuildGuard on(RouteSwitch::on, max_ctas);
      const uint64_t tiled_before = cuda::wgmma_ws_tiled_launches(), launches_before = cuda::wgmma_ws_launches();
      const auto retracted = [] { return cuda::gather_qmm_device_retractions(); };  // named routes bypass the selector
      const uint64_t retracted_before = retracted();  // a retracted plan would leave the rows to the two-CTA kernel
      const std::vector<float> plain_tiled = test::run_route(plain, "expert_tiles_wgmma");
      const std::vector<float> glu_tiled = glu(gate, up);
      EXPECT_EQ(cuda::wgmma_ws_tiled_launches() - tiled_before, 2u) << what << ": the tile-layout build did not run";
      const std::vector<float> plain_mlx = test::run_route(untiled(plain), "expert_tiles_wgmma");
      const std::vector<float> glu_mlx = glu(untiled(gate), untiled(up));
      EXPECT_EQ(cuda::wgmma_ws_launches() - launches_before, 4u) << what;
      EXPECT_EQ(retracted() - retracted_before, 0u) << what;
      EXPECT_EQ(cuda::wgmma_ws_tiled_launches() - tiled_before, 2u) << what << ": the MLX layout ran the tiled build";
      EXPECT_EQ(differing(plain_tiled, plain_mlx), 0u) << what << " plain " << test::seed_note();
      EXPECT_EQ(differing(glu_tiled, glu_mlx), 0u) << what << " " << activation_name(f.act) << " " << test::seed_note();
      EXPECT_LE(test::reference_error(plain, plain_tiled), 1e-2) << what;
      // Another weight's layout (288 rows, not 320) is not this one's: the kernel reads the MLX tensors.
      test::GatherCall foreign = plain;
      foreign.q_dev.tiled = gate.q_dev.tiled;
      const std::vector<float> plain_foreign = test::run_route(foreign, "expert_tiles_wgmma");
      EXPECT_EQ(cuda::wgmma_ws_tiled_launches() - tiled_before, 2u) << what << ": a foreign layout was read";
      EXPECT_EQ(differing(plain_foreign, plain_mlx), 0u) << what;
    }
    // The two-CTA kernel on the same layouts, in each of its builds (n128, and n64 / n32 pinned: their
    // taller tiles run as pieces): the MLX layout's bits, the foreign layout ignored.
    const int width_before = wgmma_width();
    for (int width : {0, 64, 32}) {
      const std::string what = detail::cat(dtype_name(f.dtype), " g", f.group, " K ", f.K, " two-CTA width ", width);
      test::WsBuildGuard off(RouteSwitch::off, 0);
      set_wgmma_width(width);
      const uint64_t tiled_before = cuda::wgmma_tiled_launches();
      const std::vector<float> plain_tiled = test::run_route(plain, "expert_tiles_wgmma");
      const std::vector<float> glu_tiled = glu(gate, up);
      EXPECT_EQ(cuda::wgmma_tiled_launches() - tiled_before, 2u) << what << ": the tile-layout build did not run";
      const std::vector<float> plain_mlx = test::run_route(untiled(plain), "expert_tiles_wgmma");
      const std::vector<float> glu_mlx = glu(untiled(gate), untiled(up));
      test::GatherCall foreign = plain;
      foreign.q_dev.tiled = gate.q_dev.tiled;
      const std::vector<float> plain_foreign = test::run_route(foreign, "expert_tiles_wgmma");
      set_wgmma_width(width_before);
      EXPECT_EQ(cuda::wgmma_tiled_launches() - tiled_before, 2u) << what << ": the MLX layout or a foreign one was read";
      EXPECT_EQ(differing(plain_tiled, plain_mlx), 0u) << what << " plain " << test::seed_note();
      EXPECT_EQ(differing(glu_tiled, glu_mlx), 0u) << what << " " << activation_name(f.act) << " " << test::seed_note();
      EXPECT_EQ(differing(plain_foreign, plain_mlx), 0u) << what;
      EXPECT_LE(test::reference_error(plain, plain_tiled), 1e-2) << what;
    }
  }
}

// Every field changed alone sends the call to the generic routes with the named fallback class,
// and the answer stays right.
TEST(SanitizeGpuExpertTiles, OneFieldSelectorMisses) {
  EXPERTQMM_REQUIRE_GPU();
  const QuantizedWeight q4 = test::random_codes(8, 128, 256, 4, 64);
  const std::vector<int32_t> ids = sorted_ids(128, 8);
  struct Miss {
    std::string name;
    Fallback expected;
    test::GatherCall c;
  };
  std::vector<Miss> misses;
  {
    test::GatherCall c = test::rows_call(q4, DType::bf16, ids, true);
    c.sorted = false;  // no promise: the rows may be in any order
    misses.push_back({"no sorted promise", Fallback::topology, c});
  }
  misses.push_back({"f32 activations", Fallback::dtype, test::rows_call(test::random_codes(8, 128, 256, 4, 64),
                                                                         DType::f32, ids, true)});
  misses.push_back({"3-bit", Fallback::quantization, test::rows_call(test::random_codes(8, 128, 256, 3, 64), DType::bf16, ids, true)});
  misses.push_back({"K % 64", Fallback::alignment, test::rows_call(test::random_codes(8, 128, 96, 4, 32), DType::bf16, ids, true)});
  misses.push_back({"too few rows", Fallback::shape, test::rows_call(q4, DType::bf16, sorted_ids(cuda::kExpertTilesMinRows - 1, 8), true)});
  misses.push_back({"E > 4096", Fallback::shape, test::rows_call(test::random_codes(4097, 8, 64, 4, 64), DType::bf16, sorted_ids(128, 4097), true)});
  for (Miss& m : misses) {
    CountersGuard guard;
    // f32 activations need f32 scales for promotion to keep them f32: the quantized weight is bf16,
    // so the problem promotes to f32 and the route sees f32.
    const detail::GatherQmmProblem p = m.c.problem();
    const cuda::RouteSupport s = cuda::supports_expert_tiles(p);
    ASSERT_FALSE(s.ok) << m.name;
    EXPECT_EQ(s.reason, m.expected) << m.name << ": got " << fallback_name(s.reason);
    Tensor out = Tensor::empty({m.c.B(), 1, m.c.N()}, p.dtype, Device::cuda);
    test::poison(out);
    cuda::gather_qmm_into(p, out.data(), nullptr);
    cuda_check();
    const std::vector<float> got = test::to_float(out);
    EXPECT_LE(test::rel_error(got, test::run_route(m.c, "simt")), p.dtype == DType::f32 ? 1e-4 : 1e-2) << m.name;
    const RouteCounters c = test::gather_counters();
    EXPECT_EQ(c.attempts, 1u) << m.name;
    EXPECT_EQ(c.hits, 0u) << m.name;
    EXPECT_EQ(c.fallbacks[static_cast<int>(m.expected)], 1u) << m.name;
    expect_invariant(c);
  }
}

// The switch: off -> disabled (generic route, same answer); on/automatic -> hit.
TEST(SanitizeGpuExpertTiles, SwitchOffCountsDisabled) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  const test::GatherCall c = test::rows_call(test::random_codes(8, 128, 256, 4, 64), DType::bf16, sorted_ids(256, 8), true);
  const std::vector<float> hit = test::run_route(c);
  set_expert_tiles(RouteSwitch::off);
  EXPECT_EQ(cuda::gather_qmm_selected_route(c.problem()), "rhs_tiles");
  const std::vector<float> off = test::run_route(c);
  EXPECT_LE(test::rel_error(off, hit), 1e-2);
  set_expert_tiles(RouteSwitch::on);
  test::run_route(c);
  const RouteCounters counters = test::gather_counters();
  EXPECT_EQ(counters.attempts, 3u);
  EXPECT_EQ(counters.hits, 2u);
  EXPECT_EQ(counters.requested, 2u);
  EXPECT_EQ(counters.fallbacks[static_cast<int>(Fallback::disabled)], 1u);
  expect_invariant(counters);
}

// Unsorted ids under a sorted promise: the plan is retracted on the device, the same launch runs the
// generic algorithm, the answer is right, and the retraction is counted. The whole call is captured
// in a CUDA graph in global capture mode, so any host synchronization would fail the capture.
TEST(SanitizeGpuExpertTiles, MisSortedInputIsRetractedOnTheDeviceWithoutHostSync) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  const QuantizedWeight q = test::random_codes(16, 136, 256, 4, 64);
  std::vector<int32_t> ids = sorted_ids(200, 16);
  std::swap(ids[10], ids[150]);
  if (ids[10] == ids[150]) ids[10] = (ids[150] + 1) % 16;  // make sure the order is broken
  const test::GatherCall c = test::rows_call(q, DType::bf16, ids, true);
  const detail::GatherQmmProblem p = c.problem();
  ASSERT_EQ(cuda::gather_qmm_selected_route(p), "expert_tiles");

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  set_cuda_stream(stream);
  Workspace ws;
  Tensor out = Tensor::empty({c.B(), 1, c.N()}, DType::bf16, Device::cuda);
  cuda::gather_qmm_into(p, out.data(), &ws);  // warm-up sizes the workspace
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  test::poison(out);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cuda::gather_qmm_into(p, out.data(), &ws);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cuda_check();
  const std::vector<float> got = test::to_float(out);
  set_cuda_stream(nullptr);
  EXPECT_LE(test::reference_error(c, got), 1e-2) << test::seed_note();
  EXPECT_LE(test::rel_error(got, test::run_route(c, "simt")), 1e-2) << test::seed_note();

  const RouteCounters counters = test::gather_counters();
  // The warm-up and the captured call were selected as hits; both plans that ran (warm-up, one
  // replay) were retracted on the device. test::run_route(c, "simt") bypasses the selector.
  EXPECT_EQ(counters.attempts, 2u);
  EXPECT_EQ(counters.fallbacks[static_cast<int>(Fallback::sortedness_retracted)], 2u);
  EXPECT_EQ(counters.hits, 0u);
  expect_invariant(counters);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The same fail-safe for MLX's fp modes (the kernels' kFp forms): mis-sorted ids under a sorted
// promise run the generic algorithm over 16-row tiles on each kernel that takes the mode (mma.sync:
// all three; wgmma: the 4-bit ones on compute capability 9.0), against simt.
TEST(SanitizeGpuExpertTiles, FpModesMisSortedInputRunsTheGenericAlgorithm) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  for (QuantMode mode : {QuantMode::mxfp4, QuantMode::mxfp8, QuantMode::nvfp4}) {
    const QuantizedWeight q =
        test::random_codes(16, 136, 256, quant_mode_bits(mode), quant_mode_group_size(mode), DType::bf16, mode);
    std::vector<int32_t> ids = sorted_ids(200, 16);
    std::swap(ids[10], ids[150]);
    if (ids[10] == ids[150]) ids[10] = (ids[150] + 1) % 16;
    const test::GatherCall c = test::rows_call(q, DType::bf16, ids, true);
    const std::vector<float> simt = test::run_route(c, "simt");
    std::vector<std::string> routes = {"expert_tiles_mma_sync"};
    if (cuda::supports_expert_tiles_wgmma(c.problem()).ok) routes.push_back("expert_tiles_wgmma");
    for (const std::string& r : routes)
      EXPECT_LE(test::rel_error(test::run_route(c, r), simt), 1e-2) << r << " " << quant_mode_name(mode) << test::seed_note();
  }
}

// Calls that never reach the selector count nothing; reset() zeroes; the invariant holds throughout.
TEST(SanitizeGpuExpertTiles, CountersInvariantAndReset) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  const QuantizedWeight q = test::to_device(test::random_codes(8, 64, 128, 4, 64), Device::cuda);
  Tensor x = test::random_tensor({4, 1, 100}, DType::bf16, 1.f, Device::cuda);  // K mismatch: rejected
  EXPECT_THROW(gather_qmm(x, q, Tensor(), test::ids_tensor({0, 1, 2, 3}, {4}, Device::cuda), true, true), Error);
  Tensor empty_x = Tensor::empty({0, 1, 128}, DType::bf16, Device::cuda);  // zero rows: a no-op
  gather_qmm(empty_x, q, Tensor(), Tensor::empty({0}, DType::i32, Device::cuda), true, true);
  RouteCounters c = test::gather_counters();
  EXPECT_EQ(c.attempts, 0u);
  const test::GatherCall rc =
      test::rows_call(test::random_codes(8, 64, 128, 4, 64), DType::bf16, sorted_ids(cuda::kExpertTilesMinRows + 31, 8), true);
  test::run_route(rc);
  test::run_route(rc, "");
  c = test::gather_counters();
  EXPECT_EQ(c.attempts, 2u);
  expect_invariant(c);
  diagnostics::reset();
  c = test::gather_counters();
  EXPECT_EQ(c.attempts, 0u);
  EXPECT_EQ(c.hits, 0u);
}

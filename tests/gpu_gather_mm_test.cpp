// CUDA gather_mm (16-bit experts) against the CPU reference on the same inputs: every route pinned
// through the test hook (tiles, gemv with and without its K split, simt), edge shapes (N and K off
// the tile multiples, one expert, experts with no rows, unsorted ids under the sorted promise),
// bf16 and f16, mlx-lm's [E, N, K] weight (passed swapped) and a plain [E, K, N] one, the
// selector's choices and its counters, and expert ids out of range; the dense linear built on it
// (cuda/dense_linear.h) against the CPU's, each call on the route for its size. Tolerance:
// docs/numerics.md.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/gather_mm_problem.h"
#include "cuda/gather_mm.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "expertqmm/gemma4.h"
#include "expertqmm/ops.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

constexpr double kTolerance = 1e-2;  // docs/numerics.md: gather_mm, CUDA vs the CPU reference

// One gather_mm call over `ids` (one row each, M = 1, x rows gathered in order): x [n, 1, K] and
// mlx-lm's weight w [E, N, K], passed as w.swapaxes(-1, -2) unless `plain` (then w is [E, K, N]).
struct MmCall {
  Tensor x, w, ids;  // host
  bool plain = false, sorted = true;
  Tensor b(const Tensor& w_dev) const { return plain ? w_dev : w_dev.swapaxes(-1, -2); }
  detail::GatherMmProblem problem(const Tensor& xd, const Tensor& wd, const Tensor& idsd) const {
    return detail::make_gather_mm_problem(xd, b(wd), Tensor(), idsd, sorted);
  }
};

MmCall make_call(DType dt, int64_t E, int64_t N, int64_t K, const std::vector<int32_t>& ids, bool plain = false) {
  MmCall c;
  const int64_t n = static_cast<int64_t>(ids.size());
  c.x = test::random_tensor({n, 1, K}, dt);
  c.w = plain ? test::random_tensor({E, K, N}, dt, 0.1f) : test::random_tensor({E, N, K}, dt, 0.1f);
  c.ids = test::ids_tensor(ids, {n});
  c.plain = plain;
  return c;
}

// Sorted ids over E experts with the given row counts (0: an expert with no rows).
std::vector<int32_t> rows_per_expert(const std::vector<int>& counts) {
  std::vector<int32_t> ids;
  for (size_t e = 0; e < counts.size(); ++e) ids.insert(ids.end(), counts[e], static_cast<int32_t>(e));
  return ids;
}

// Runs `route` on the device and compares with the CPU's gather_mm on the same inputs; every output
// is written (the output starts poisoned with NaN).
void expect_route_matches_cpu(const MmCall& c, const std::string& route, const std::string& what) {
  const Tensor cpu = gather_mm(c.x, c.b(c.w), Tensor(), c.ids, c.sorted);
  const Tensor xd = c.x.to(Device::cuda), wd = c.w.to(Device::cuda), idsd = c.ids.to(Device::cuda);
  const detail::GatherMmProblem p = c.problem(xd, wd, idsd);
  Tensor out = Tensor::empty(cpu.shape(), p.dtype, Device::cuda);
  test::poison(out);
  cuda::gather_mm_into_route(route, p, out.data(), nullptr);
  cuda_check();
  EXPECT_LE(test::rel_error(test::to_float(out), test::to_float(cpu)), kTolerance) << route << " " << what;
}

// The gather_mm row of the diagnostics (all zero when nothing was counted).
RouteCounters gather_mm_counters() {
  for (const RouteCounters& r : diagnostics::snapshot())
    if (r.primitive == "gather_mm") return r;
  return RouteCounters{};
}

std::string shape_note(DType dt, int64_t E, int64_t N, int64_t K, size_t n) {
  return detail::cat(dtype_name(dt), " E=", E, " N=", N, " K=", K, " rows=", n);
}

TEST(SanitizeGpuGatherMm, RoutesInSelectorOrderAndTheirChoices) {
  EXPERTQMM_REQUIRE_GPU();
  const std::vector<std::string> names = cuda::gather_mm_route_names();
  ASSERT_EQ(names, (std::vector<std::string>{"tiles", "gemv", "simt"}));
  auto selected = [](const MmCall& c) {
    const Tensor xd = c.x.to(Device::cuda), wd = c.w.to(Device::cuda), idsd = c.ids.to(Device::cuda);
    return cuda::gather_mm_selected_route(c.problem(xd, wd, idsd));
  };
  const std::vector<int32_t> many = rows_per_expert({40, 0, 50}), few = rows_per_expert({3, 0, 5});
  EXPECT_EQ(selected(make_call(DType::bf16, 3, 96, 64, many)), "tiles");
  EXPECT_EQ(selected(make_call(DType::bf16, 3, 96, 64, few)), "gemv");
  EXPECT_EQ(selected(make_call(DType::bf16, 3, 96, 64, many, /*plain=*/true)), "simt");  // [E, K, N]
  EXPECT_EQ(selected(make_call(DType::bf16, 3, 96, 60, many)), "simt");                  // K % 8 != 0
  EXPECT_EQ(selected(make_call(DType::f32, 3, 96, 64, many)), "simt");
  MmCall unsorted = make_call(DType::bf16, 3, 96, 64, many);
  unsorted.sorted = false;
  EXPECT_EQ(selected(unsorted), "simt");  // no promise: the tile route needs one, gemv takes <= 64 rows
  const MmCall c = make_call(DType::bf16, 3, 96, 64, few);
  const Tensor xd = c.x.to(Device::cuda), wd = c.w.to(Device::cuda), idsd = c.ids.to(Device::cuda);
  Tensor out = Tensor::empty({8, 1, 96}, DType::bf16, Device::cuda);
  EXPECT_THROW(cuda::gather_mm_into_route("no_such_route", c.problem(xd, wd, idsd), out.data(), nullptr), Error);
  EXPECT_THROW(cuda::gather_mm_into_route("tiles", c.problem(xd, wd, idsd), out.data(), nullptr), Error);  // 8 rows
}

TEST(GpuGatherMm, TileRouteMatchesTheCpu) {
  EXPERTQMM_REQUIRE_GPU();
  struct Shape3 {
    int64_t N, K;
  };
  // N and K on and off the 128-column / 64-wide k tile multiples; K % 8 == 0 (the route's rule).
  const Shape3 shapes[] = {{128, 64}, {200, 72}, {8, 8}, {257, 136}, {704, 256}};
  // Row counts per expert: plan tiles of every class (16/32/64/128 and a 130-row expert split in
  // two), experts with no rows, and one expert alone.
  const std::vector<std::vector<int>> layouts = {{130, 0, 17, 33, 1, 0, 64}, {200}, {0, 70, 0}};
  for (DType dt : {DType::bf16, DType::f16})
    for (const Shape3& s : shapes)
      for (const auto& counts : layouts) {
        const int64_t E = static_cast<int64_t>(counts.size());
        const std::vector<int32_t> ids = rows_per_expert(counts);
        expect_route_matches_cpu(make_call(dt, E, s.N, s.K, ids), "tiles", shape_note(dt, E, s.N, s.K, ids.size()));
      }
}

TEST(GpuGatherMm, GemvRouteMatchesTheCpuSplitAndUnsplit) {
  EXPERTQMM_REQUIRE_GPU();
  const std::vector<int32_t> decode = {5, 1, 1, 7, 0, 3, 2, 6};  // one token's top-8, any order
  const std::vector<int32_t> one = {2};
  const std::vector<int32_t> full = rows_per_expert({9, 0, 20, 3, 0, 11, 12, 9});  // 64 rows
  for (DType dt : {DType::bf16, DType::f16})
    for (const auto& [N, K] : {std::pair<int64_t, int64_t>{704, 2816}, {2816, 704}, {13, 8}, {100, 200}})
      for (const auto* ids : {&decode, &one, &full})
        for (const char* route : {"gemv", "gemv_split", "gemv_unsplit"})
          expect_route_matches_cpu(make_call(dt, 8, N, K, *ids), route, shape_note(dt, 8, N, K, ids->size()));
}

TEST(GpuGatherMm, SimtRouteMatchesTheCpuOnAnyLayoutAndDtype) {
  EXPERTQMM_REQUIRE_GPU();
  const std::vector<int32_t> ids = {3, 0, 0, 2, 3, 1, 1, 1, 0};
  for (DType dt : {DType::bf16, DType::f16, DType::f32})
    for (bool plain : {false, true})
      expect_route_matches_cpu(make_call(dt, 4, 37, 29, ids, plain), "simt",
                               shape_note(dt, 4, 37, 29, ids.size()) + (plain ? " [E,K,N]" : " [E,N,K]^T"));
  // f32 activations with a bf16 weight: MLX promotes to f32 and reads the weight widened.
  MmCall c = make_call(DType::f32, 4, 37, 32, ids);
  c.w = test::random_tensor({4, 37, 32}, DType::bf16, 0.1f);
  expect_route_matches_cpu(c, "simt", "f32 x bf16 weight");
}

// The public op on device tensors: batch broadcast (lhs and rhs [2, 3], M = 2), no indices, and a
// plain [E, K, N] weight, each against the CPU.
TEST(GpuGatherMm, PublicOpMatchesTheCpu) {
  EXPERTQMM_REQUIRE_GPU();
  const Tensor a = test::random_tensor({4, 2, 64}, DType::bf16);
  const Tensor w = test::random_tensor({5, 48, 64}, DType::bf16, 0.1f);
  const Tensor lhs = test::ids_tensor({0, 3, 3, 1, 2, 0}, {2, 3}), rhs = test::ids_tensor({4, 4, 0, 1, 2, 2}, {2, 3});
  const Tensor cpu = gather_mm(a, w.swapaxes(-1, -2), lhs, rhs);
  const Tensor gpu = gather_mm(a.to(Device::cuda), w.to(Device::cuda).swapaxes(-1, -2), lhs.to(Device::cuda),
                               rhs.to(Device::cuda));
  ASSERT_EQ(gpu.shape(), cpu.shape());
  EXPECT_LE(test::rel_error(test::to_float(gpu), test::to_float(cpu)), kTolerance);
  const Tensor kn = test::random_tensor({5, 64, 48}, DType::f16, 0.1f);
  const Tensor a5 = test::random_tensor({5, 3, 64}, DType::f16);
  EXPECT_LE(test::rel_error(test::to_float(gather_mm(a5.to(Device::cuda), kn.to(Device::cuda), Tensor(), Tensor())),
                            test::to_float(gather_mm(a5, kn, Tensor(), Tensor()))),
            kTolerance);
}

// Unsorted ids under the sorted promise: the device retracts the plan, the same launch computes the
// right answer, and the selector's hit is moved to sortedness_retracted in the counters.
TEST(GpuGatherMm, UnsortedRowsUnderTheSortedPromiseAreStillCorrectAndCounted) {
  EXPERTQMM_REQUIRE_GPU();
  std::vector<int32_t> ids = rows_per_expert({40, 30, 30});
  std::reverse(ids.begin(), ids.end());
  std::swap(ids[5], ids[60]);
  const MmCall c = make_call(DType::bf16, 3, 130, 72, ids);
  expect_route_matches_cpu(c, "tiles", "unsorted");
  diagnostics::reset();
  const Tensor cpu = gather_mm(c.x, c.b(c.w), Tensor(), c.ids, true);
  const Tensor gpu =
      gather_mm(c.x.to(Device::cuda), c.b(c.w.to(Device::cuda)), Tensor(), c.ids.to(Device::cuda), true);
  EXPECT_LE(test::rel_error(test::to_float(gpu), test::to_float(cpu)), kTolerance);
  for (const RouteCounters& r : diagnostics::snapshot()) {
    if (r.primitive != "gather_mm") continue;
    EXPECT_EQ(r.attempts, 1u);
    EXPECT_EQ(r.hits, 0u);
    EXPECT_EQ(r.fallbacks[static_cast<int>(Fallback::sortedness_retracted)], 1u);
    EXPECT_EQ(r.attempts, r.hits + r.fallback_total());
    return;
  }
  ADD_FAILURE() << "no gather_mm row in diagnostics::snapshot()";
}

// The dense linear (the public linear with a 16-bit or f32 weight; the router's projection at Gemma
// 4's N = 128 and K = 2816, and a dense MLP width) against the CPU's, each call counted once under
// gather_mm: bf16 and f16 hit the tile route above 64 rows; at and below, the tile route's miss is
// `shape`, which leaves operands gemv takes (gemv's rule is the tile route's operands and <= 64
// rows). simt takes the rest: f32 (miss `dtype`), bf16 x with an f32 weight (x widened to the f32
// output; `dtype`), and a weight whose K is strided (a transposed [K, N] tensor; `topology`).
TEST(GpuGatherMm, DenseLinearMatchesTheCpuOnTheRouteForItsSize) {
  EXPERTQMM_REQUIRE_GPU();
  const bool tiles_on = expert_tiles_setting() != RouteSwitch::off;
  const int64_t K = 2816;
  struct Case {
    DType x, w;
    int64_t T, N;
    bool k_strided = false;
  };
  std::vector<Case> cases;
  for (DType dt : {DType::bf16, DType::f16})
    for (int64_t T : {1, 8, 64, 65, 300, 2048})
      for (int64_t N : {128, 704})
        if (T < 2048 || N == 128) cases.push_back({dt, dt, T, N});  // (a 2048 x 704 CPU reference takes seconds)
  for (int64_t T : {8, 300}) cases.push_back({DType::f32, DType::f32, T, 128});
  cases.push_back({DType::bf16, DType::f32, 65, 128});
  cases.push_back({DType::bf16, DType::bf16, 300, 128, true});
  for (const Case& c : cases) {
    const std::string what = detail::cat(dtype_name(c.x), " x, ", dtype_name(c.w), c.k_strided ? " K-strided" : "",
                                         " weight, T=", c.T, " N=", c.N, " K=", K);
    Linear w, wd;
    if (c.k_strided) {
      const Tensor kn = test::random_tensor({K, c.N}, c.w, 0.05f);
      w.dense = kn.swapaxes(0, 1);
      wd.dense = kn.to(Device::cuda).swapaxes(0, 1);
    } else {
      w.dense = test::random_tensor({c.N, K}, c.w, 0.05f);
      wd.dense = w.dense.to(Device::cuda);
    }
    const Tensor x = test::random_tensor({c.T, K}, c.x);
    const Tensor expected = linear(x, w);
    diagnostics::reset();
    const Tensor got = linear(x.to(Device::cuda), wd);
    cuda_check();
    ASSERT_EQ(got.shape(), expected.shape()) << what;
    ASSERT_EQ(got.dtype(), expected.dtype()) << what;
    EXPECT_LE(test::rel_error(test::to_float(got), test::to_float(expected)), kTolerance) << what;
    const RouteCounters mm = gather_mm_counters();
    EXPECT_EQ(mm.attempts, 1u) << what;
    const bool tensor_core_operands = c.x != DType::f32 && c.w == c.x && !c.k_strided;
    EXPECT_EQ(mm.hits, tiles_on && tensor_core_operands && c.T > cuda::kGemvMaxRows ? 1u : 0u) << what;
    if (!tiles_on) continue;
    const Fallback miss = c.k_strided ? Fallback::topology : !tensor_core_operands ? Fallback::dtype : Fallback::shape;
    if (!tensor_core_operands || c.T <= cuda::kGemvMaxRows)
      EXPECT_EQ(mm.fallbacks[static_cast<int>(miss)], 1u) << what;
  }
}

// The dense linear at sanitizer sizes, N and K off the tile multiples: gemv (5 rows), and the tile
// route over row groups whose last group is short (100 and 300 rows of 16-row groups), bf16 and f32.
TEST(SanitizeGpuGatherMm, DenseLinearOffTheTileMultiples) {
  EXPERTQMM_REQUIRE_GPU();
  for (DType dt : {DType::bf16, DType::f32})
    for (int64_t T : {5, 100, 300}) {
      Linear w, wd;
      w.dense = test::random_tensor({40, 72}, dt, 0.1f);
      wd.dense = w.dense.to(Device::cuda);
      const Tensor x = test::random_tensor({T, 72}, dt);
      const Tensor got = linear(x.to(Device::cuda), wd);
      cuda_check();
      EXPECT_LE(test::rel_error(test::to_float(got), test::to_float(linear(x, w))), kTolerance)
          << dtype_name(dt) << " T=" << T;
    }
}

TEST(SanitizeGpuGatherMm, OutOfRangeIdsAreReported) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t E = 4;
  cuda_check();  // start from a clean fault record
  for (const char* route : {"tiles", "gemv", "simt"}) {
    for (int32_t bad : {static_cast<int32_t>(E), -1}) {
      std::vector<int32_t> ids = std::string(route) == "tiles" ? rows_per_expert({30, 30, 20, 20}) : rows_per_expert({2, 2, 2, 2});
      ids[7] = bad;
      MmCall c = make_call(DType::bf16, E, 40, 64, ids);
      const Tensor xd = c.x.to(Device::cuda), wd = c.w.to(Device::cuda), idsd = c.ids.to(Device::cuda);
      const detail::GatherMmProblem p = c.problem(xd, wd, idsd);
      Tensor out = Tensor::empty({p.B, 1, p.N}, p.dtype, Device::cuda);
      cuda::gather_mm_into_route(route, p, out.data(), nullptr);
      try {
        cuda_check();
        ADD_FAILURE() << "expert id " << bad << " was not reported by " << route;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("expert id"), std::string::npos) << e.what();
      }
    }
  }
  cuda_check();  // nothing left behind
}

}  // namespace
}  // namespace expertqmm

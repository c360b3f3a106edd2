// The row grouping (src/cuda/group_rows.cu: the one-CTA kernel and its three-launch grid form)
// against first principles: a stable sort of the flat ids on the host gives sorted_ids, inv_order
// and token_of_row, and the CPU plan builder the plan; each form must give exactly those (ids in range), or the in-range rows in that order, the
// others last in flat order and a retracted plan (ids out of range). Then the layer: moe_layer_into
// and switch_glu give the same bytes with the grouping on and off (CUB's sort and the plan builder).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/tile_plan.h"
#include "expertqmm/backend.h"
#include "expertqmm/error.h"
#include "expertqmm/settings.h"
#include "support/moe_case.h"
#include "support/test_util.h"

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/device_memory.h"
#include "support/device_buffer.h"
#include "cuda/check.cuh"
#include "cuda/group_rows.h"
#include "cuda/layer_plan_hooks.h"
#include "cuda/tile_plan.cuh"
#include "support/graph_capture.h"
#endif

using namespace expertqmm;
using detail::ExpertTile;
using detail::TilePlanHeader;

namespace {

// What the grouping must give for flat ids over E experts, k slots per token.
struct Grouping {
  std::vector<int32_t> sorted_ids, inv_order, token_of_row;
  detail::TilePlan plan;  // retracted when an id is out of range
  TilePlanHeader header;  // what the kernel writes: the plan's, retracted for kPlanOutOfRange only
};

Grouping expected_grouping(const std::vector<int32_t>& ids, int E, int k) {
  const int64_t n = static_cast<int64_t>(ids.size());
  auto bucket = [&](int32_t id) { return id >= 0 && id < E ? id : E; };
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return bucket(ids[a]) < bucket(ids[b]); });
  Grouping g;
  g.sorted_ids.resize(n);
  g.inv_order.resize(n);
  g.token_of_row.resize(n);
  bool out_of_range = false;
  for (int64_t i = 0; i < n; ++i) {
    g.sorted_ids[i] = ids[order[i]];
    g.inv_order[order[i]] = static_cast<int32_t>(i);
    g.token_of_row[i] = order[i] / k;
    out_of_range |= bucket(ids[order[i]]) == E;
  }
  g.plan = detail::build_tile_plan(g.sorted_ids.data(), n, E);
  EXPECT_EQ(g.plan.out_of_range, out_of_range);
  // The kernel retracts for ids out of range alone (they sit last, so the CPU builder also sees
  // them out of order).
  g.header = g.plan.header();
  if (out_of_range) g.header.retract_reasons = detail::kPlanOutOfRange;
  return g;
}

#ifdef EXPERTQMM_HAVE_CUDA

// Device buffers of one grouping, poisoned (0xFF) before each launch so that a missed write shows.
struct GroupBuffers {
  int64_t n;
  int E;
  size_t plan_bytes;
  size_t grid_bytes;
  test::DeviceBuffer ids, sorted_ids, inv_order, token_of_row, plan, grid_scratch;
  GroupBuffers(int64_t n_, int E_)
      : n(n_), E(E_), plan_bytes(cuda::tile_plan_bytes(n_, E_)), grid_bytes(cuda::group_rows_grid_scratch_bytes(n_, E_)),
        ids(n_ * 4), sorted_ids(n_ * 4), inv_order(n_ * 4), token_of_row(n_ * 4), plan(plan_bytes),
        grid_scratch(grid_bytes) {}
  void prepare(const std::vector<int32_t>& host_ids) {
    cudaStream_t s = test::library_stream();
    detail::copy_host_to_device(ids.ptr, host_ids.data(), n * 4);
    for (const test::DeviceBuffer* b : {&sorted_ids, &inv_order, &token_of_row})
      EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(b->ptr, 0xFF, n * 4, s));
    EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(plan.ptr, 0xFF, plan_bytes, s));
    EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(grid_scratch.ptr, 0xFF, grid_bytes, s));
  }
  // grid: the three-launch grid form (its scratch poisoned too), else the one-CTA kernel.
  void launch(int k, bool with_plan, cudaStream_t s, bool grid = false) {
    cuda::launch_group_rows(ids.i32(), n, k, E, sorted_ids.i32(), inv_order.i32(), token_of_row.i32(),
                            with_plan ? plan.ptr : nullptr, s, grid ? grid_scratch.i32() : nullptr);
  }
  std::vector<int32_t> read(const test::DeviceBuffer& b) const {
    std::vector<int32_t> v(n);
    detail::copy_device_to_host(v.data(), b.ptr, n * 4);
    return v;
  }
};

// The outputs of one form (the one-CTA kernel or the grid form) for ids equal the host's, the plan's
// header and tiles included (or, without a plan, the plan buffer untouched).
void expect_form(const std::vector<int32_t>& ids, int E, int k, const Grouping& want, bool with_plan, bool grid) {
  SCOPED_TRACE(grid ? "grid form" : "one CTA");
  const int64_t n = static_cast<int64_t>(ids.size());
  GroupBuffers b(n, E);
  b.prepare(ids);
  b.launch(k, with_plan, test::library_stream(), grid);
  cuda_check();
  ASSERT_EQ(b.read(b.sorted_ids), want.sorted_ids);
  ASSERT_EQ(b.read(b.inv_order), want.inv_order);
  ASSERT_EQ(b.read(b.token_of_row), want.token_of_row);

  std::vector<unsigned char> plan(b.plan_bytes);
  detail::copy_device_to_host(plan.data(), b.plan.ptr, b.plan_bytes);
  const cuda::TilePlanView v = cuda::tile_plan_view(plan.data(), n, E);
  if (!with_plan) {
    ASSERT_TRUE(std::all_of(plan.begin(), plan.end(), [](unsigned char c) { return c == 0xFF; }))
        << "no plan was asked for, but the plan buffer was written";
    return;
  }
  const TilePlanHeader& h = want.header;
  ASSERT_EQ(v.header->tile_count, h.tile_count);
  ASSERT_EQ(v.header->sorted, h.sorted);
  ASSERT_EQ(v.header->retract_reasons, h.retract_reasons);
  for (size_t i = 0; i < want.plan.tiles.size(); ++i) {
    const ExpertTile& g = v.tiles[i];
    const ExpertTile& c = want.plan.tiles[i];
    ASSERT_TRUE(g.expert == c.expert && g.row_begin == c.row_begin && g.rows == c.rows && g.bm == c.bm)
        << "tile " << i << ": gpu {" << g.expert << ", " << g.row_begin << ", " << g.rows << ", " << g.bm << "} cpu {"
        << c.expert << ", " << c.row_begin << ", " << c.rows << ", " << c.bm << "}";
  }
  for (int64_t i = static_cast<int64_t>(want.plan.tiles.size()); i < v.tile_slots; ++i)
    ASSERT_EQ(v.tiles[i].expert, -1) << "stray write at tile " << i;
}

// Both forms' outputs for ids equal the host's.
void expect_grouping(const std::vector<int32_t>& ids, int E, int k, const std::string& what, bool with_plan = true) {
  SCOPED_TRACE(what);
  const Grouping want = expected_grouping(ids, E, k);
  for (bool grid : {false, true}) expect_form(ids, E, k, want, with_plan, grid);
}
#else
void expect_grouping(const std::vector<int32_t>&, int, int, const std::string&, bool = true) {}
#endif

// n flat ids: uniform, Zipf-skewed or all one expert.
std::vector<int32_t> random_ids(int64_t n, int E, int shape, std::mt19937_64& g) {
  std::vector<double> weight(E);
  for (int e = 0; e < E; ++e) weight[e] = shape == 1 ? 1.0 / (1.0 + e) : 1.0;
  std::discrete_distribution<int32_t> pick(weight.begin(), weight.end());
  std::vector<int32_t> ids(n);
  const int32_t one = static_cast<int32_t>(g() % E);
  for (auto& id : ids) id = shape == 2 ? one : pick(g);
  return ids;
}

}  // namespace

TEST(GpuGroupRows, MatchesTheStableSortAndThePlanBuilder) {
  EXPERTQMM_REQUIRE_GPU();
  std::mt19937_64 g(test::test_seed());
  // Row counts around the warp chunks (32 rows a pass, 1024 a CTA pass, 16 passes a batch) and the
  // layer's sizes (T*k for T = 8 .. 8192, k = 8).
  for (int64_t n : std::vector<int64_t>{1, 31, 33, 64, 1000, 1025, 4096, 16384, 16411, 65536, int64_t{1} << 18})
    for (int E : {1, 8, 128, 256})
      for (int shape : {0, 1, 2}) {
        if (n >= 65536 && (E != 128 || shape == 2)) continue;  // the large sizes once
        const int k = n % 8 == 0 ? 8 : 1;
        expect_grouping(random_ids(n, E, shape, g), E, k,
                        detail::cat("n=", n, " E=", E, shape == 0 ? " uniform" : shape == 1 ? " zipf" : " one expert",
                                    " k=", k, " ", test::seed_note()));
      }
  std::vector<int32_t> ascending(4096), descending(4096);
  for (int i = 0; i < 4096; ++i) ascending[i] = descending[4095 - i] = i % 256;
  std::sort(ascending.begin(), ascending.end());
  std::sort(descending.begin(), descending.end(), std::greater<>());
  expect_grouping(ascending, 256, 8, "already grouped");
  expect_grouping(descending, 256, 8, "grouped in reverse");
  expect_grouping(random_ids(2048, 128, 0, g), 128, 8, "no plan", /*with_plan=*/false);
}

// Ids outside [0, E) (user ids of switch_glu) go last in flat order and retract the plan; nothing is
// read or written out of bounds (compute-sanitizer runs the Sanitize* tests).
TEST(SanitizeGpuGroupRows, OutOfRangeIdsGoLastAndRetractThePlan) {
  EXPERTQMM_REQUIRE_GPU();
  std::mt19937_64 g(test::test_seed() + 1);
  for (int64_t n : {64, 5000}) {
    std::vector<int32_t> ids = random_ids(n, 128, 0, g);
    ids[3] = 128 + 8;  // low bits alias a valid id
    ids[n - 1] = -3;
    ids[n / 2] = INT32_MIN;  // a uint32 id >= 2^31 read as int32
    expect_grouping(ids, 128, 8, detail::cat("n=", n, " three ids out of range"));
  }
}

TEST(GpuGroupRows, LimitsAreCheckedOnTheHost) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  EXPECT_TRUE(cuda::group_rows_fits(1, 1));
  EXPECT_TRUE(cuda::group_rows_fits(cuda::kGroupRowsMaxRows, cuda::kGroupRowsMaxExperts));
  EXPECT_FALSE(cuda::group_rows_fits(0, 8));
  EXPECT_FALSE(cuda::group_rows_fits(cuda::kGroupRowsMaxRows + 1, 8));
  EXPECT_FALSE(cuda::group_rows_fits(64, cuda::kGroupRowsMaxExperts + 1));
  test::DeviceBuffer buf(64 * 4);
  test::expect_error([&] { cuda::launch_group_rows(buf.i32(), 64, 8, 257, buf.i32(), buf.i32(), buf.i32(), nullptr, test::library_stream()); },
                     "group_rows", "E=257");
  test::expect_error([&] { cuda::launch_group_rows(nullptr, 64, 8, 8, buf.i32(), buf.i32(), buf.i32(), nullptr, test::library_stream()); },
                     "group_rows", "null pointer");
#endif
}

// The grouping is one kernel with no host synchronization: it captures into a graph whose replay
// gives the same outputs.
TEST(GpuGroupRows, CapturesIntoACudaGraph) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  std::mt19937_64 g(test::test_seed() + 2);
  const std::vector<int32_t> ids = random_ids(16384, 128, 1, g);
  const Grouping want = expected_grouping(ids, 128, 8);
  for (bool grid : {false, true}) {
    SCOPED_TRACE(grid ? "grid form" : "one CTA");
    GroupBuffers b(16384, 128);
    b.prepare(ids);
    const test::CaptureStream stream;
    cudaGraph_t graph = test::capture_graph(stream.get(), [&] { b.launch(8, true, stream.get(), grid); }, "group_rows");
    ASSERT_NE(graph, nullptr);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
    EXPECT_EQ(b.read(b.sorted_ids), want.sorted_ids);
    EXPECT_EQ(b.read(b.inv_order), want.inv_order);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
#endif
}

// The layer with the grouping on and off: the same bytes (the rows reach the same GEMM tiles in
// the same order), for moe_layer_into at sorted sizes (its router's ids) and switch_glu (ids that
// repeat an expert within a token); past 8192 rows "on" is the grid form.
TEST(GpuGroupRows, LayerGivesTheSameBytesWithTheGroupingOnAndOff) {
  EXPERTQMM_REQUIRE_GPU();
  test::MoeGeometry geo;  // GeGLU, separate gate and up
  geo.E = 128;
  geo.k = 8;
  const test::Layer l = test::make_layer(geo);
  const int64_t D = l.cpu.experts.down.w.size(1);
  for (int64_t T : {32, 300, 1100}) {  // 1100: 8800 rows, the grid form with the grouping forced on
    const std::string what = detail::cat("T=", T, " ", test::seed_note());
    const Tensor h = test::random_tensor({T, D}, DType::bf16, 1.0f, Device::cuda);
    const Tensor x = test::random_tensor({T, D}, DType::bf16, 1.0f, Device::cuda);
    auto layer_bytes = [&](RouteSwitch grouping) {
      const test::SettingGuard<RouteSwitch, group_rows_setting, set_group_rows> guard(grouping);
      Workspace ws;
      Tensor out = Tensor::empty({T, D}, DType::bf16, Device::cuda);
      moe_layer_into(out, h, x, l.gpu, ws);
      cuda_check();
      return test::to_float(out.to(Device::cpu));
    };
    EXPECT_EQ(layer_bytes(RouteSwitch::on), layer_bytes(RouteSwitch::off)) << "moe_layer_into " << what;

    std::vector<int32_t> ids(T * geo.k);
    for (int64_t i = 0; i < T * geo.k; ++i) ids[i] = static_cast<int32_t>((i * 37 + i / geo.k) % geo.E);
    const Tensor id_tensor = test::ids_tensor(ids, {T, geo.k}, Device::cuda);
    auto switch_bytes = [&](RouteSwitch grouping) {
      const test::SettingGuard<RouteSwitch, group_rows_setting, set_group_rows> guard(grouping);
      const Tensor y = switch_glu(x, id_tensor, l.gpu.experts);
      cuda_check();
      return test::to_float(y.to(Device::cpu));
    };
    EXPECT_EQ(switch_bytes(RouteSwitch::on), switch_bytes(RouteSwitch::off)) << "switch_glu " << what;
  }
}

// Which calls the plan groups with the kernel: unset or 1, every sorted size it fits (the one CTA up
// to kGroupRowsOneCtaMaxRows rows, the grid form past it: both measured faster than CUB's path); 0,
// none (CUB's sort and the plan builder).
TEST(GpuGroupRows, PlanTakesTheKernelWhereItMeasuredFaster) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  test::MoeGeometry geo;
  geo.E = 128;
  geo.k = 8;
  const test::Layer l = test::make_layer(geo);
  const int64_t D = l.cpu.experts.down.w.size(1);
  auto planned = [&](int64_t T, RouteSwitch grouping) {
    const test::SettingGuard<RouteSwitch, group_rows_setting, set_group_rows> guard(grouping);
    const Tensor h = Tensor::empty({T, D}, DType::bf16, Device::cuda);
    Tensor out = Tensor::empty({T, D}, DType::bf16, Device::cuda);
    return cuda::planned_group_rows(out, h, h, l.gpu);
  };
  const int64_t at_limit = cuda::kGroupRowsOneCtaMaxRows / geo.k;  // T = 1024
  EXPECT_TRUE(planned(32, RouteSwitch::automatic));
  EXPECT_TRUE(planned(at_limit, RouteSwitch::automatic));
  EXPECT_TRUE(planned(at_limit + 1, RouteSwitch::automatic));
  EXPECT_TRUE(planned(2048, RouteSwitch::automatic));
  EXPECT_TRUE(planned(2048, RouteSwitch::on));
  EXPECT_FALSE(planned(32, RouteSwitch::off));
  EXPECT_FALSE(planned(2048, RouteSwitch::off));
#endif
}

// The device tile plan builder against the CPU reference: exact equality of tiles and header on
// random and edge cases (n up to 16384, E up to 4096), retraction on the device for unsorted or
// out-of-range ids, no stray writes past tile_count, and launch inside CUDA graph capture (which
// fails on any host synchronization).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "core/tile_plan.h"
#include "expertqmm/error.h"
#include "support/test_util.h"

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/device_memory.h"
#include "support/device_buffer.h"
#include "cuda/check.cuh"
#include "cuda/tile_plan.cuh"
#endif

using namespace expertqmm;
using detail::ExpertTile;
using detail::TilePlanHeader;

namespace {

struct GpuPlan {
  TilePlanHeader header{};
  std::vector<ExpertTile> tiles;        // the first header.tile_count entries
  std::vector<ExpertTile> after_count;  // entries [tile_count, max_tiles]: must still hold the poison
  unsigned long long retractions = 0;   // the device retraction counter after the launch
};

#ifdef EXPERTQMM_HAVE_CUDA

// Device buffers for one plan: ids, max_tiles + 1 tiles (one guard entry), header, counter.
struct PlanBuffers {
  int64_t n;
  int E;
  int64_t capacity;
  test::DeviceBuffer ids, tiles, header, counter;
  PlanBuffers(int64_t n_, int E_)
      : n(n_), E(E_), capacity(detail::max_tiles(n_, E_) + 1), ids(n_ * sizeof(int32_t)),
        tiles(capacity * sizeof(ExpertTile)), header(sizeof(TilePlanHeader)), counter(sizeof(unsigned long long)) {}

  // Uploads ids, fills tiles and header with 0xFF (expert -1) and zeroes the counter.
  void prepare(const std::vector<int32_t>& host_ids) {
    cudaStream_t s = test::library_stream();
    if (n > 0) detail::copy_host_to_device(ids.ptr, host_ids.data(), n * sizeof(int32_t));
    EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(tiles.ptr, 0xFF, capacity * sizeof(ExpertTile), s));
    EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(header.ptr, 0xFF, sizeof(TilePlanHeader), s));
    EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(counter.ptr, 0, sizeof(unsigned long long), s));
  }

  void launch(cudaStream_t s) {
    cuda::launch_build_tile_plan(n > 0 ? static_cast<const int32_t*>(ids.ptr) : nullptr, n, E,
                                 static_cast<ExpertTile*>(tiles.ptr), static_cast<TilePlanHeader*>(header.ptr), s,
                                 static_cast<unsigned long long*>(counter.ptr));
  }

  GpuPlan read() {
    GpuPlan out;
    std::vector<ExpertTile> all(capacity);
    detail::copy_device_to_host(all.data(), tiles.ptr, capacity * sizeof(ExpertTile));
    detail::copy_device_to_host(&out.header, header.ptr, sizeof(TilePlanHeader));
    detail::copy_device_to_host(&out.retractions, counter.ptr, sizeof(unsigned long long));
    const int64_t count = std::clamp<int64_t>(out.header.tile_count, 0, capacity);
    out.tiles.assign(all.begin(), all.begin() + count);
    out.after_count.assign(all.begin() + count, all.end());
    return out;
  }
};

GpuPlan build_on_gpu(const std::vector<int32_t>& ids, int E) {
  PlanBuffers b(static_cast<int64_t>(ids.size()), E);
  b.prepare(ids);
  b.launch(test::library_stream());
  return b.read();
}
#else
GpuPlan build_on_gpu(const std::vector<int32_t>&, int) {
  throw Error("gpu_tile_plan_test", "this build has no CUDA backend");
}
#endif

bool same_tile(const ExpertTile& a, const ExpertTile& b) {
  return a.expert == b.expert && a.row_begin == b.row_begin && a.rows == b.rows && a.bm == b.bm;
}

bool is_poison(const ExpertTile& t) { return t.expert == -1 && t.row_begin == -1 && t.rows == -1 && t.bm == -1; }

// The GPU plan of `ids` equals the CPU plan: header, every tile, and nothing written past the plan.
void expect_gpu_matches_cpu(const std::vector<int32_t>& ids, int E, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t n = static_cast<int64_t>(ids.size());
  const detail::TilePlan cpu = detail::build_tile_plan(ids.data(), n, E);
  const GpuPlan gpu = build_on_gpu(ids, E);
  const TilePlanHeader want = cpu.header();
  ASSERT_EQ(gpu.header.tile_count, want.tile_count);
  ASSERT_EQ(gpu.header.sorted, want.sorted);
  ASSERT_EQ(gpu.header.retract_reasons, want.retract_reasons);
  ASSERT_EQ(gpu.retractions, cpu.retracted() ? 1u : 0u);
  ASSERT_EQ(gpu.tiles.size(), cpu.tiles.size());
  for (size_t i = 0; i < cpu.tiles.size(); ++i) {
    const ExpertTile& g = gpu.tiles[i];
    const ExpertTile& c = cpu.tiles[i];
    ASSERT_TRUE(same_tile(g, c)) << "tile " << i << ": gpu {" << g.expert << ", " << g.row_begin << ", " << g.rows
                                 << ", " << g.bm << "} cpu {" << c.expert << ", " << c.row_begin << ", " << c.rows
                                 << ", " << c.bm << "}";
  }
  for (size_t i = 0; i < gpu.after_count.size(); ++i)
    ASSERT_TRUE(is_poison(gpu.after_count[i])) << "stray write at tile " << gpu.tiles.size() + i;
  if (!cpu.retracted()) {
    ASSERT_EQ(detail::tile_plan_violation(gpu.tiles.data(), gpu.tiles.size(), ids.data(), n, E), "");
  }
}

std::vector<int32_t> ids_from_counts(const std::vector<int64_t>& counts) {
  std::vector<int32_t> ids;
  for (size_t e = 0; e < counts.size(); ++e) ids.insert(ids.end(), counts[e], static_cast<int32_t>(e));
  return ids;
}

// n routed rows: each a uniform or Zipf-skewed expert, then sorted (what gather_sort produces).
std::vector<int32_t> routed_ids(int64_t n, int E, bool zipf, std::mt19937_64& g) {
  std::vector<double> weight(E);
  for (int e = 0; e < E; ++e) weight[e] = zipf ? 1.0 / (1.0 + e) : 1.0;
  std::discrete_distribution<int32_t> pick(weight.begin(), weight.end());
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = pick(g);
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace

TEST(GpuTilePlan, EdgeCasesMatchCpu) {
  EXPERTQMM_REQUIRE_GPU();
  expect_gpu_matches_cpu({}, 128, "n=0");
  expect_gpu_matches_cpu({0}, 1, "E=1 n=1");
  expect_gpu_matches_cpu(std::vector<int32_t>(16384, 0), 1, "E=1 n=16384");
  expect_gpu_matches_cpu(std::vector<int32_t>(16384, 77), 128, "one expert owns every row");
  expect_gpu_matches_cpu(std::vector<int32_t>(16384 - 5, 1023), 1024, "last of 1024 owns every row");
  expect_gpu_matches_cpu(ids_from_counts({0, 33, 16, 17, 0, 64, 1, 129, 96, 112}), 10, "hand-written");
  expect_gpu_matches_cpu(std::vector<int32_t>(16384 + 40, 5), 8, "one expert, 40-row bm 64 tail");
  {
    std::vector<int64_t> one_each(1024, 1);
    expect_gpu_matches_cpu(ids_from_counts(one_each), 1024, "E=1024, one row each");
    std::vector<int64_t> one_each_4096(4096, 1);
    expect_gpu_matches_cpu(ids_from_counts(one_each_4096), 4096, "E=4096, one row each");
  }
  {
    std::vector<int64_t> counts(4096, 0);
    counts[0] = 17;
    counts[127] = 16;
    counts[128] = 32;
    counts[129] = 48;
    counts[130] = 65;
    counts[255] = 97;
    counts[256] = 128;
    counts[4095] = 33;
    expect_gpu_matches_cpu(ids_from_counts(counts), 4096, "sparse over round edges, E=4096");
  }
  const std::vector<int64_t> edges = {0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 80, 96, 97, 127, 128, 129};
  for (int64_t a : edges)
    for (int64_t b : edges)
      expect_gpu_matches_cpu(ids_from_counts({b, 0, a, b, a}), 5, "counts " + std::to_string(a) + "/" + std::to_string(b));
}

TEST(GpuTilePlan, RandomRoutingMatchesCpu) {
  EXPERTQMM_REQUIRE_GPU();
  std::mt19937_64 g(test::test_seed());
  SCOPED_TRACE(test::seed_note());
  const std::vector<int> expert_counts = {1, 2, 8, 127, 128, 129, 256, 1000, 1024, 4096};
  for (int iter = 0; iter < 120; ++iter) {
    const int E = expert_counts[iter % expert_counts.size()];
    const int64_t n = std::uniform_int_distribution<int64_t>(0, 16384)(g);
    const bool zipf = iter % 2 == 1;
    expect_gpu_matches_cpu(routed_ids(n, E, zipf, g), E,
                           "iter " + std::to_string(iter) + " E=" + std::to_string(E) + " n=" + std::to_string(n) +
                               (zipf ? " zipf" : " uniform"));
  }
  // The Gemma 4 shapes: k = 8 of 128 experts, tokens 1 .. 2048.
  for (int64_t tokens : {1, 8, 64, 512, 1024, 2048})
    expect_gpu_matches_cpu(routed_ids(8 * tokens, 128, false, g), 128, "gemma4 tokens=" + std::to_string(tokens));
}

TEST(GpuTilePlan, UnsortedIdsAreRetractedOnTheDevice) {
  EXPERTQMM_REQUIRE_GPU();
  std::mt19937_64 g(test::test_seed());
  SCOPED_TRACE(test::seed_note());
  for (int iter = 0; iter < 40; ++iter) {
    const int E = iter % 2 ? 128 : 1024;
    const int64_t n = std::uniform_int_distribution<int64_t>(2, 16384)(g);
    std::vector<int32_t> ids = routed_ids(n, E, iter % 3 == 0, g);
    // One inversion, at the start, the end, or anywhere; forced so the pair really decreases.
    int64_t at = iter % 4 == 0 ? 0 : iter % 4 == 1 ? n - 2 : std::uniform_int_distribution<int64_t>(0, n - 2)(g);
    ids[at] = ids[at + 1] + 1;
    if (ids[at] >= E) {
      ids[at] = E - 1;
      ids[at + 1] = E - 2;
    }
    expect_gpu_matches_cpu(ids, E, "inversion at " + std::to_string(at) + " n=" + std::to_string(n));
    const GpuPlan gpu = build_on_gpu(ids, E);
    EXPECT_EQ(gpu.header.sorted, 0);
    EXPECT_EQ(gpu.header.tile_count, 0);
    EXPECT_NE(gpu.header.retract_reasons & detail::kPlanUnsorted, 0);
    EXPECT_EQ(gpu.retractions, 1u);
  }
}

TEST(GpuTilePlan, OutOfRangeIdsAreRetractedOnTheDevice) {
  EXPERTQMM_REQUIRE_GPU();
  std::mt19937_64 g(test::test_seed());
  SCOPED_TRACE(test::seed_note());
  std::vector<int32_t> ids = routed_ids(4096, 128, false, g);
  ids.back() = 128;
  expect_gpu_matches_cpu(ids, 128, "id == E at the end");
  ids.back() = 127;
  ids.front() = -1;
  expect_gpu_matches_cpu(ids, 128, "id -1 at the start");
  ids.front() = 200;
  expect_gpu_matches_cpu(ids, 128, "out of range and unsorted");
  const GpuPlan both = build_on_gpu(ids, 128);
  EXPECT_EQ(both.header.retract_reasons, detail::kPlanUnsorted | detail::kPlanOutOfRange);
}

TEST(GpuTilePlan, LaunchRejectsBadArguments) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  PlanBuffers b(64, 8);
  auto* ids = static_cast<const int32_t*>(b.ids.ptr);
  auto* tiles = static_cast<ExpertTile*>(b.tiles.ptr);
  auto* header = static_cast<TilePlanHeader*>(b.header.ptr);
  cudaStream_t s = test::library_stream();
  EXPECT_THROW(cuda::launch_build_tile_plan(ids, 64, 0, tiles, header, s), Error);
  EXPECT_THROW(cuda::launch_build_tile_plan(ids, 64, 4097, tiles, header, s), Error);
  EXPECT_THROW(cuda::launch_build_tile_plan(ids, -1, 8, tiles, header, s), Error);
  EXPECT_THROW(cuda::launch_build_tile_plan(ids, int64_t{1} << 31, 8, tiles, header, s), Error);
  EXPECT_THROW(cuda::launch_build_tile_plan(nullptr, 64, 8, tiles, header, s), Error);
  EXPECT_THROW(cuda::launch_build_tile_plan(ids, 64, 8, nullptr, header, s), Error);
  EXPECT_THROW(cuda::launch_build_tile_plan(ids, 64, 8, tiles, nullptr, s), Error);
  cuda_check();
#else
  FAIL() << "a CUDA device without a CUDA build";
#endif
}

TEST(GpuTilePlan, BuildsInsideGraphCaptureWithoutHostSync) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  std::mt19937_64 g(test::test_seed());
  SCOPED_TRACE(test::seed_note());
  const int64_t n = 8 * 512;
  const int E = 128;
  PlanBuffers b(n, E);
  std::vector<int32_t> sorted = routed_ids(n, E, true, g);
  b.prepare(sorted);
  EXPERTQMM_CUDA_CHECK(cudaDeviceSynchronize());

  // Global capture mode makes any synchronizing call in the launch path fail the capture.
  cudaStream_t stream = nullptr;
  EXPERTQMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EXPERTQMM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  b.launch(stream);
  EXPERTQMM_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  EXPERTQMM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  // Replay on sorted ids, then on the same buffer made unsorted: the verdict is decided per replay.
  EXPERTQMM_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(stream));
  GpuPlan first = b.read();
  std::vector<int32_t> unsorted = sorted;
  std::reverse(unsorted.begin(), unsorted.end());
  unsorted.front() = unsorted.back() + 1;  // guarantee a decrease even if every row had one expert
  b.prepare(unsorted);
  EXPERTQMM_CUDA_CHECK(cudaDeviceSynchronize());
  EXPERTQMM_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(stream));
  GpuPlan second = b.read();
  EXPERTQMM_CUDA_CHECK(cudaGraphExecDestroy(exec));
  EXPERTQMM_CUDA_CHECK(cudaGraphDestroy(graph));
  EXPERTQMM_CUDA_CHECK(cudaStreamDestroy(stream));

  const detail::TilePlan cpu = detail::build_tile_plan(sorted.data(), n, E);
  ASSERT_EQ(first.header.sorted, 1);
  ASSERT_EQ(first.tiles.size(), cpu.tiles.size());
  for (size_t i = 0; i < cpu.tiles.size(); ++i) ASSERT_TRUE(same_tile(first.tiles[i], cpu.tiles[i])) << "tile " << i;
  EXPECT_EQ(first.retractions, 0u);
  EXPECT_EQ(second.header.sorted, 0);
  EXPECT_EQ(second.header.tile_count, 0);
  EXPECT_EQ(second.retractions, 1u);
  cuda_check();
#else
  FAIL() << "a CUDA device without a CUDA build";
#endif
}

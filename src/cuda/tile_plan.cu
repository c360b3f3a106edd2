// Device builder of the expert tile plan: one block, no host synchronization.
#include "cuda/check.cuh"
#include "cuda/device/tile_plan_emit.cuh"
#include "cuda/tile_plan.cuh"

namespace expertqmm::cuda {

namespace {
using detail::ExpertTile;
using detail::TilePlanHeader;
using device::kPlanThreads;

// Pointers and layout:
//   ids    (n,) int32, the expert of each sorted row; read-only
//   tiles  (max_tiles(n, E),) ExpertTile {expert, row_begin, rows <= 128, bm}; [0, tile_count) written
//   header (1,) TilePlanHeader {tile_count, sorted, retract_reasons}, written last by thread 0
//
// Work split: ONE block of 1024 threads does everything, so the verdict and the plan need no
// inter-block sync and no host round trip. Phase 1: thread t visits the row boundaries i = t,
// t+1024, ... (between rows i-1 and i): it checks ids[i-1] > ids[i] and ids outside [0, E); two
// block votes (__syncthreads_or) give the verdict, and a retracted plan writes only the header.
// Then, for i = 0 .. n, it writes first_row[e] = i for every expert e in (ids[i-1], ids[i]]
// (ids[-1] = -1, ids[n] = E): the first row of each expert (its lower bound in the sorted ids)
// with no search, each entry written once. Phase 2 is device::emit_tile_plan (tile_plan_emit.cuh).
// (A binary search per expert over the ids, as before, was a chain of log2(n) dependent loads:
// 17.5 us at n = 16384 with 128 threads; bench/NOTES.md step 7b.)
__global__ void __launch_bounds__(kPlanThreads, 1)
    build_tile_plan_kernel(const int32_t* __restrict__ ids, int64_t n, int E, ExpertTile* __restrict__ tiles,
                           TilePlanHeader* __restrict__ header, unsigned long long* retraction_counter) {
  __shared__ int32_t first_row[detail::kTilePlanMaxExperts + 1];  // (E + 1,): first sorted row of each expert, then n
  __shared__ device::TilePlanEmitSmem emit;
  const int tid = threadIdx.x;

  // Phase 1: verdict, then first rows (only for sorted, in-range ids: then the ranges (ids[i-1],
  // ids[i]] partition [0, E] and the writes total E + 1; unsorted ids could make them n * E).
  int unsorted = 0, out_of_range = 0;
  for (int64_t i = tid; i < n; i += kPlanThreads) {
    const int32_t id = ids[i];
    out_of_range |= id < 0 || id >= E;
    if (i > 0) unsorted |= ids[i - 1] > id;
  }
  unsorted = __syncthreads_or(unsorted);
  out_of_range = __syncthreads_or(out_of_range);
  if (unsorted || out_of_range) {
    device::retract_tile_plan(
        header, (unsorted ? detail::kPlanUnsorted : 0) | (out_of_range ? detail::kPlanOutOfRange : 0),
        retraction_counter);
    return;
  }
  for (int64_t i = tid; i <= n; i += kPlanThreads) {
    const int32_t id = i < n ? ids[i] : E;
    const int32_t prev = i > 0 ? ids[i - 1] : -1;
    for (int32_t e = prev + 1; e <= id; ++e) first_row[e] = static_cast<int32_t>(i);
  }
  __syncthreads();

  // Phase 2: count, scan and emit, 1024 experts per round.
  device::emit_tile_plan(first_row, E, tiles, header, emit);
}
}  // namespace

void launch_build_tile_plan(const int32_t* ids, int64_t n, int E, ExpertTile* tiles, TilePlanHeader* header,
                            cudaStream_t s, unsigned long long* retraction_counter) {
  constexpr const char* op = "build_tile_plan";
  detail::check_tile_plan_args(op, ids, n, E);
  EXPERTQMM_CHECK(header != nullptr, op, "header is null");
  EXPERTQMM_CHECK(tiles != nullptr || n == 0, op, "tiles is null with n=", n, " (needs max_tiles(n, E) = ",
                  detail::max_tiles(n, E), " entries)");
  build_tile_plan_kernel<<<1, kPlanThreads, 0, s>>>(ids, n, E, tiles, header, retraction_counter);
  EXPERTQMM_CUDA_CHECK_LAUNCH(build_tile_plan_kernel);
}

}  // namespace expertqmm::cuda

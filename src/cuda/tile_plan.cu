// Device builder of the expert tile plan: one block, no host synchronization.
#include "cuda/check.cuh"
#include "cuda/tile_plan.cuh"

namespace expertqmm::cuda {

namespace {
using detail::ExpertTile;
using detail::TilePlanHeader;

constexpr int kPlanThreads = 128;
static_assert((kPlanThreads & (kPlanThreads - 1)) == 0, "the emit search assumes a power-of-two block");

// First index in ids[0, n) whose id is >= value; ids are non-decreasing (checked before the call).
__device__ __forceinline__ int32_t lower_bound_rows(const int32_t* __restrict__ ids, int64_t n, int64_t value) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (ids[mid] < value)
      lo = mid + 1;
    else
      hi = mid;
  }
  return static_cast<int32_t>(lo);
}

// Tiles of an expert with `rows` rows: ceil(rows / 64), written so rows near 2^31 cannot overflow.
__device__ __forceinline__ int32_t tiles_of(int32_t rows) {
  return rows / detail::kTileRowsFull + (rows % detail::kTileRowsFull != 0);
}

// Pointers and layout:
//   ids    (n,) int32, the expert of each sorted row; read-only, checked before any search
//   tiles  (max_tiles(n, E),) ExpertTile {expert, row_begin, rows <= 64, bm}; [0, tile_count) written
//   header (1,) TilePlanHeader {tile_count, sorted, retract_reasons}, written last by thread 0
//
// Work split: ONE block of 128 threads does everything, so the verdict and the plan need no
// inter-block sync and no host round trip. Phase 1: thread t checks rows t, t+128, ... for
// ids[i] > ids[i+1] and ids outside [0, E); two block votes (__syncthreads_or) give the verdict, and
// a retracted plan writes only the header. Phase 2 walks the experts in rounds of 128: in a round
// thread t owns expert round_base + t, binary-searches its first row (lower_bound; its end is the
// next expert's lower_bound, i.e. its upper_bound, searched by thread t+1 or by thread 0 for the
// round's last expert), and counts ceil(rows/64) tiles (floor(rows/64) full ones and one tail). A Hillis-Steele inclusive scan over the 128
// counts in shared memory (7 steps, ping-pong buffers) gives each expert its first tile slot in the
// round; rounds are appended at a running base, so tiles come out ordered by expert, then row.
// The threads then emit the round's tiles in a strided loop over tile slots (not over experts, so
// one expert holding every row does not serialize on one thread): slot s finds its expert by a
// binary search over the 128 scanned first slots and derives row_begin, rows and bm from it (bm:
// the class of the tile's row count, tile_bm_for_rows, the same rule as the CPU builder).
__global__ void __launch_bounds__(kPlanThreads, 1)
    build_tile_plan_kernel(const int32_t* __restrict__ ids, int64_t n, int E, ExpertTile* __restrict__ tiles,
                           TilePlanHeader* __restrict__ header, unsigned long long* retraction_counter) {
  __shared__ int32_t row_bound[kPlanThreads + 1];  // first row of experts round_base .. round_base + 128
  __shared__ int32_t scan[2][kPlanThreads];        // Hillis-Steele ping-pong buffers (tile counts)
  __shared__ int32_t first_slot[kPlanThreads];     // round-local first tile slot of each expert
  const int tid = threadIdx.x;

  // Phase 1: verdict.
  int unsorted = 0, out_of_range = 0;
  for (int64_t i = tid; i < n; i += kPlanThreads) {
    const int32_t id = ids[i];
    out_of_range |= id < 0 || id >= E;
    if (i + 1 < n) unsorted |= id > ids[i + 1];
  }
  unsorted = __syncthreads_or(unsorted);
  out_of_range = __syncthreads_or(out_of_range);
  if (unsorted || out_of_range) {
    if (tid == 0) {
      header->tile_count = 0;
      header->sorted = 0;
      header->retract_reasons = (unsorted ? detail::kPlanUnsorted : 0) | (out_of_range ? detail::kPlanOutOfRange : 0);
      if (retraction_counter != nullptr) atomicAdd(retraction_counter, 1ull);
    }
    return;
  }

  // Phase 2: count, scan and emit, 128 experts per round.
  int32_t tile_base = 0;  // tiles emitted by earlier rounds (same value in every thread)
  for (int round_base = 0; round_base < E; round_base += kPlanThreads) {
    const int expert = round_base + tid;
    row_bound[tid] = expert < E ? lower_bound_rows(ids, n, expert) : static_cast<int32_t>(n);
    if (tid == 0) {
      const int next = round_base + kPlanThreads;
      row_bound[kPlanThreads] = next < E ? lower_bound_rows(ids, n, next) : static_cast<int32_t>(n);
    }
    __syncthreads();
    const int32_t my_tiles = tiles_of(row_bound[tid + 1] - row_bound[tid]);

    int buf = 0;
    scan[buf][tid] = my_tiles;
    __syncthreads();
    for (int offset = 1; offset < kPlanThreads; offset <<= 1) {
      int32_t v = scan[buf][tid];
      if (tid >= offset) v += scan[buf][tid - offset];
      scan[buf ^ 1][tid] = v;
      buf ^= 1;
      __syncthreads();
    }
    first_slot[tid] = scan[buf][tid] - my_tiles;
    const int32_t round_tiles = scan[buf][kPlanThreads - 1];
    __syncthreads();

    for (int32_t slot = tid; slot < round_tiles; slot += kPlanThreads) {
      // Last local expert j with first_slot[j] <= slot; empty experts share their successor's first
      // slot, so the last such j is the one that owns tiles.
      int lo = 0;
      for (int step = kPlanThreads / 2; step > 0; step >>= 1)
        if (first_slot[lo + step] <= slot) lo += step;
      const int32_t tile_in_expert = slot - first_slot[lo];
      const int32_t row_begin = row_bound[lo] + tile_in_expert * detail::kTileRowsFull;
      const int32_t rows = min(detail::kTileRowsFull, row_bound[lo + 1] - row_begin);
      ExpertTile& out = tiles[tile_base + slot];
      out.expert = round_base + lo;
      out.row_begin = row_begin;
      out.rows = rows;
      out.bm = detail::tile_bm_for_rows(rows);
    }
    tile_base += round_tiles;
    __syncthreads();  // row_bound, scan and first_slot are rewritten by the next round
  }
  if (tid == 0) {
    header->tile_count = tile_base;
    header->sorted = 1;
    header->retract_reasons = 0;
  }
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

// Device builder of the expert tile plan: one block, no host synchronization.
#include "cuda/check.cuh"
#include "cuda/tile_plan.cuh"

namespace expertqmm::cuda {

namespace {
using detail::ExpertTile;
using detail::TilePlanHeader;

constexpr int kPlanThreads = 1024;
static_assert((kPlanThreads & (kPlanThreads - 1)) == 0, "the emit search assumes a power-of-two block");

// Tiles of an expert with `rows` rows: ceil(rows / kTileRowsFull), written so rows near 2^31 cannot overflow.
__device__ __forceinline__ int32_t tiles_of(int32_t rows) {
  return rows / detail::kTileRowsFull + (rows % detail::kTileRowsFull != 0);
}

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
// with no search, each entry written once. Phase 2 walks the experts in rounds of 1024:
// thread t owns expert round_base + t and counts ceil(rows/128) tiles (floor(rows/128) full ones and
// one tail); a Hillis-Steele inclusive scan over the counts in shared memory (10 steps, ping-pong
// buffers) gives each expert its first tile slot in the round; rounds are appended at a running
// base, so tiles come out ordered by expert, then row. The threads then emit the round's tiles in
// a strided loop over tile slots (not over experts, so one expert holding every row does not
// serialize on one thread): slot s finds its expert by a binary search over the scanned first
// slots and derives row_begin, rows and bm from it (bm: the class of the tile's row count,
// tile_bm_for_rows, the same rule as the CPU builder).
// (A binary search per expert over the ids, as before, was a chain of log2(n) dependent loads:
// 17.5 us at n = 16384 with 128 threads; bench/NOTES.md step 7b.)
__global__ void __launch_bounds__(kPlanThreads, 1)
    build_tile_plan_kernel(const int32_t* __restrict__ ids, int64_t n, int E, ExpertTile* __restrict__ tiles,
                           TilePlanHeader* __restrict__ header, unsigned long long* retraction_counter) {
  __shared__ int32_t first_row[detail::kTilePlanMaxExperts + 1];  // (E + 1,): first sorted row of each expert, then n
  __shared__ int32_t scan[2][kPlanThreads];                        // Hillis-Steele ping-pong buffers (tile counts)
  __shared__ int32_t first_slot[kPlanThreads];                     // round-local first tile slot of each expert
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
    if (tid == 0) {
      header->tile_count = 0;
      header->sorted = 0;
      header->retract_reasons = (unsorted ? detail::kPlanUnsorted : 0) | (out_of_range ? detail::kPlanOutOfRange : 0);
      if (retraction_counter != nullptr) atomicAdd(retraction_counter, 1ull);
    }
    return;
  }
  for (int64_t i = tid; i <= n; i += kPlanThreads) {
    const int32_t id = i < n ? ids[i] : E;
    const int32_t prev = i > 0 ? ids[i - 1] : -1;
    for (int32_t e = prev + 1; e <= id; ++e) first_row[e] = static_cast<int32_t>(i);
  }
  __syncthreads();

  // Phase 2: count, scan and emit, 1024 experts per round.
  int32_t tile_base = 0;  // tiles emitted by earlier rounds (same value in every thread)
  for (int round_base = 0; round_base < E; round_base += kPlanThreads) {
    // Rows of expert e: first_row[e + 1] - first_row[e]; experts past E own none.
    const int32_t* row_bound = first_row + round_base;  // (min(kPlanThreads, E - round_base) + 1,)
    const int expert = round_base + tid;
    const int32_t my_tiles = expert < E ? tiles_of(row_bound[tid + 1] - row_bound[tid]) : 0;

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
    __syncthreads();  // scan and first_slot are rewritten by the next round
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

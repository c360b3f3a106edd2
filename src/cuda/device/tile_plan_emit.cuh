// The expert tile plan's emission (format: src/core/tile_plan.h) from the experts' first rows, as a
// device function of one 1024-thread CTA: the plan builder (tile_plan.cu) calls it after it has
// found the first rows in sorted ids, the row grouping (group_rows.cu) after it has counted them.
#pragma once
#include <cstdint>

#include "core/tile_plan.h"

namespace expertqmm::cuda::device {

constexpr int kPlanThreads = 1024;
static_assert((kPlanThreads & (kPlanThreads - 1)) == 0, "the emit search assumes a power-of-two block");

// The shared memory the emission uses besides first_row.
struct TilePlanEmitSmem {
  int32_t scan[2][kPlanThreads];     // Hillis-Steele ping-pong buffers (tile counts)
  int32_t first_slot[kPlanThreads];  // round-local first tile slot of each expert
};

// Tiles of an expert with `rows` rows: ceil(rows / kTileRowsFull), written so rows near 2^31 cannot overflow.
__device__ __forceinline__ int32_t tiles_of(int32_t rows) {
  return rows / detail::kTileRowsFull + (rows % detail::kTileRowsFull != 0);
}

// Inclusive sum of every thread's v over threads 0 .. threadIdx.x (a Hillis-Steele scan: 10 steps,
// ping-pong buffers in sm.scan, one barrier each); cta_total gets the sum over the CTA. Every thread
// of the CTA calls it; sm.scan may be rewritten only after a barrier that follows the call.
__device__ __forceinline__ int32_t cta_inclusive_scan(int32_t v, TilePlanEmitSmem& sm, int32_t& cta_total) {
  const int tid = threadIdx.x;
  int buf = 0;
  sm.scan[buf][tid] = v;
  __syncthreads();
  for (int offset = 1; offset < kPlanThreads; offset <<= 1) {
    int32_t sum = sm.scan[buf][tid];
    if (tid >= offset) sum += sm.scan[buf][tid - offset];
    sm.scan[buf ^ 1][tid] = sum;
    buf ^= 1;
    __syncthreads();
  }
  cta_total = sm.scan[buf][kPlanThreads - 1];
  return sm.scan[buf][tid];
}

// Writes the tiles of a valid plan and then its header (thread 0).
//   first_row (E + 1,) shared: the first sorted row of each expert, then n (non-decreasing)
//   tiles     (max_tiles(n, E),) ExpertTile; [0, tile_count) written
// Work split: the experts in rounds of 1024: thread t owns expert round_base + t and counts
// ceil(rows/128) tiles (floor(rows/128) full ones and one tail); a Hillis-Steele inclusive scan over
// the counts (10 steps, ping-pong buffers) gives each expert its first tile slot in the round;
// rounds are appended at a running base, so tiles come out ordered by expert, then row. The threads
// then emit the round's tiles in a strided loop over tile slots (not over experts, so one expert
// holding every row does not serialize on one thread): slot s finds its expert by a binary search
// over the scanned first slots and derives row_begin, rows and bm (tile_bm_for_rows, the CPU
// builder's rule). Every thread of the CTA calls it (barriers inside); first_row must be complete
// (a barrier after its last write) before the call.
__device__ __forceinline__ void emit_tile_plan(const int32_t* first_row, int E, detail::ExpertTile* __restrict__ tiles,
                                               detail::TilePlanHeader* __restrict__ header, TilePlanEmitSmem& sm) {
  const int tid = threadIdx.x;
  int32_t tile_base = 0;  // tiles emitted by earlier rounds (same value in every thread)
  for (int round_base = 0; round_base < E; round_base += kPlanThreads) {
    // Rows of expert e: first_row[e + 1] - first_row[e]; experts past E own none.
    const int32_t* row_bound = first_row + round_base;  // (min(kPlanThreads, E - round_base) + 1,)
    const int expert = round_base + tid;
    const int32_t my_tiles = expert < E ? tiles_of(row_bound[tid + 1] - row_bound[tid]) : 0;

    int32_t round_tiles;
    sm.first_slot[tid] = cta_inclusive_scan(my_tiles, sm, round_tiles) - my_tiles;
    __syncthreads();

    for (int32_t slot = tid; slot < round_tiles; slot += kPlanThreads) {
      // Last local expert j with first_slot[j] <= slot; empty experts share their successor's first
      // slot, so the last such j is the one that owns tiles.
      int lo = 0;
      for (int step = kPlanThreads / 2; step > 0; step >>= 1)
        if (sm.first_slot[lo + step] <= slot) lo += step;
      const int32_t tile_in_expert = slot - sm.first_slot[lo];
      const int32_t row_begin = row_bound[lo] + tile_in_expert * detail::kTileRowsFull;
      const int32_t rows = min(detail::kTileRowsFull, row_bound[lo + 1] - row_begin);
      detail::ExpertTile& out = tiles[tile_base + slot];
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

// A retracted plan's header (thread 0 writes it; no tiles), counted once when the counter is given.
__device__ __forceinline__ void retract_tile_plan(detail::TilePlanHeader* header, int32_t reasons,
                                                  unsigned long long* retraction_counter) {
  if (threadIdx.x != 0) return;
  header->tile_count = 0;
  header->sorted = 0;
  header->retract_reasons = reasons;
  if (retraction_counter != nullptr) atomicAdd(retraction_counter, 1ull);
}

}  // namespace expertqmm::cuda::device

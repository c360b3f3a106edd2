// Device builder of the expert tile plan (format: src/core/tile_plan.h; algorithm: docs/design.md,
// "Tile plan"). Used by the expert_tiles route of gather_qmm.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/tile_plan.h"

namespace expertqmm::cuda {

// Builds the plan of the sorted ids (device int32 [n]) over E experts on stream s, with no host
// synchronization: one kernel of one 1024-thread block writes tiles[0 .. header->tile_count) and
// *header. `tiles` must hold detail::max_tiles(n, E) entries. If the ids are not non-decreasing or
// not all in [0, E), the plan is retracted on the device (header: tile_count 0, sorted 0, reasons
// set; no tile written) and, when retraction_counter is not null, *retraction_counter is
// incremented once. Throws Error("build_tile_plan", ...) for n or E outside the limits of
// detail::check_tile_plan_args or null pointers; graph capture safe.
void launch_build_tile_plan(const int32_t* ids, int64_t n, int E, detail::ExpertTile* tiles,
                            detail::TilePlanHeader* header, cudaStream_t s,
                            unsigned long long* retraction_counter = nullptr);

// A plan in one device buffer, as the expert tile route stores it: the header, then the tiles
// kTilePlanHeaderBytes in (16-byte aligned), room for max_tiles(n, E) of them.
constexpr size_t kTilePlanHeaderBytes = 16;
static_assert(sizeof(detail::TilePlanHeader) <= kTilePlanHeaderBytes, "the header fits before the tiles");
inline size_t tile_plan_bytes(int64_t n, int E) {
  return kTilePlanHeaderBytes + static_cast<size_t>(detail::max_tiles(n, E)) * sizeof(detail::ExpertTile);
}
struct TilePlanView {
  const detail::TilePlanHeader* header;
  const detail::ExpertTile* tiles;
  int64_t tile_slots;  // max_tiles(n, E)
};
inline TilePlanView tile_plan_view(const void* plan, int64_t n, int E) {
  const auto* base = static_cast<const unsigned char*>(plan);
  return {reinterpret_cast<const detail::TilePlanHeader*>(base),
          reinterpret_cast<const detail::ExpertTile*>(base + kTilePlanHeaderBytes), detail::max_tiles(n, E)};
}
// launch_build_tile_plan into a buffer of tile_plan_bytes(n, E) laid out as above.
inline void launch_build_tile_plan_at(const int32_t* ids, int64_t n, int E, void* plan, cudaStream_t s) {
  auto* base = static_cast<unsigned char*>(plan);
  launch_build_tile_plan(ids, n, E, reinterpret_cast<detail::ExpertTile*>(base + kTilePlanHeaderBytes),
                         reinterpret_cast<detail::TilePlanHeader*>(base), s, nullptr);
}

}  // namespace expertqmm::cuda

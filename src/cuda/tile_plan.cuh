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

}  // namespace expertqmm::cuda

// Host-only handles on the wgmma expert builds (gather_qmm_expert_tiles_ws.cu, the warp-specialized
// one, and gather_qmm_expert_tiles_wgmma.cu, the two-CTA kernel) for tests: their own headers pull in
// device code, which a host compiler cannot read.
#pragma once
#include <cstdint>

namespace expertqmm::cuda {

// The most CTAs the persistent kernel launches (0: one per SM). Tests cap it so that one CTA runs
// many work items: the stage ring wraps and the items hand the staging over. Process-wide.
void set_wgmma_ws_max_ctas(int ctas);
// Launches of the warp-specialized kernel so far in this process (a test's proof that it ran).
uint64_t wgmma_ws_launches();
// Of those, the launches that read the weights' tile layout (docs/tile-layout.md).
uint64_t wgmma_ws_tiled_launches();
// Launches of the two-CTA kernel that read the tile layout (the retracted-plan walk launched after a
// warp-specialized launch not counted).
uint64_t wgmma_tiled_launches();

}  // namespace expertqmm::cuda

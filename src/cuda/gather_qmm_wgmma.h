// The Hopper (sm_90a, wgmma) kernels of the expert tile route (gather_qmm_expert_tiles_wgmma.cu):
// the plain GEMM and the gate/up GEMM with the GLU product in its epilogue. Internal.
#pragma once
#include <cstdint>

#include "core/gather_qmm_problem.h"
#include "core/tile_plan.h"
#include "cuda/gather_qmm_routes.h"  // wgmma_available
#include "cuda/device/tile_gemm.cuh"
#include "expertqmm/ops.h"

namespace expertqmm::cuda {

enum class WgmmaForm : uint8_t { plain, geglu, swiglu };
constexpr bool is_glu(WgmmaForm f) { return f == WgmmaForm::geglu || f == WgmmaForm::swiglu; }

// The problem as the kernel reads it. plain: tile describes the one GEMM. geglu / swiglu: tile
// holds the gate weights and the output (hidden, [rows, N], N = the expert width), *_up the up
// weights of the same shape and layout.
struct WgmmaTileArgs {
  device::TileArgs tile;
  device::QuantView up;  // glu forms: the up weights (geometry as tile.q)
  unsigned long long* retractions = nullptr;  // += calls when the plan turns out retracted
  int calls = 1;                              // gather_qmm calls this launch serves (glu: 2)
  // The two-CTA kernel does nothing with a valid plan (the warp-specialized kernel ran it) and
  // walks a retracted one as always.
  bool retracted_only = false;
};

// Whether a wgmma build can run p: wgmma_available(), bf16/f16 4-bit affine with group size 64 or
// 128, bf16 8-bit affine (group 64 or 128), or bf16 mxfp4 / nvfp4 (the plain form only), M == 1, K %
// 64 == 0, N % 8 == 0 and supports_tile_operands(p). The output must also be 16-byte aligned (the
// epilogue's stores): the caller checks its pointer.
bool wgmma_builds_take(const detail::GatherQmmProblem& p);
// Whether the selector and the layer plan choose the wgmma kernel for p: wgmma_builds_take, 8-bit
// codes from kWgmma8BitMinRowsPerExpert rows per expert (gather_qmm_routes.h) or at any size with
// EXPERTQMM_WGMMA=1 (the test hook's route runs them at any size too).
bool wgmma_tiles_fit(const detail::GatherQmmProblem& p);

// Runs the plan (built by launch_build_tile_plan on the same stream) in the given form; fp: an
// fp4 mode's codes (plain form, p.tile from make_tile_args).
void launch_expert_tiles_wgmma(const WgmmaTileArgs& p, WgmmaForm form, DType dtype, const detail::ExpertTile* tiles,
                               const detail::TilePlanHeader* header, int64_t tile_slots, bool fp = false);

// The warp-specialized build (gather_qmm_expert_tiles_ws.cu; EXPERTQMM_WGMMA_WS=1): whether it takes
// the launch that launch_expert_tiles_wgmma would give the build of `max_tokens` (both forms, 4-bit
// affine bf16 / f16, the 128-token build), and its launch, which leaves a retracted plan alone.
bool wgmma_ws_takes(DType dtype, int bits, bool fp, int max_tokens);
void launch_expert_tiles_ws(const WgmmaTileArgs& p, WgmmaForm form, DType dtype, const detail::ExpertTile* tiles,
                            const detail::TilePlanHeader* header);

// The fused launch (gate/up with the GLU product): gather_qmm_routes.h.

}  // namespace expertqmm::cuda

// Internal device entry of gather_qmm, used by the public op and by the device MoE path.
#pragma once
#include <string>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "expertqmm/moe.h"

namespace expertqmm::cuda {

// Runs the route selector on `p` and writes out [B, M, N] in p.dtype on the current stream.
// No host synchronization; scratch comes from `ws` (nullptr: the op allocates its own).
void gather_qmm_into(const detail::GatherQmmProblem& p, void* out, Workspace* ws);

// Test hooks. The selector's route names in order; the route it picks for p; and a run of one
// named route instead of the selector: a selector route, or "rhs_tiles_bm16" / "rhs_tiles_bm32"
// (rhs_tiles with its tile height pinned). Throws Error when the route does not support p.
std::vector<std::string> gather_qmm_route_names();
std::string gather_qmm_selected_route(const detail::GatherQmmProblem& p);
void gather_qmm_into_route(const std::string& route, const detail::GatherQmmProblem& p, void* out,
                           Workspace* ws);

}  // namespace expertqmm::cuda

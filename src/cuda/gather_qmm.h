// Internal device entry of gather_qmm, used by the public op and by the device MoE path.
#pragma once
#include "core/gather_qmm_problem.h"
#include "expertqmm/moe.h"

namespace expertqmm::cuda {

// Runs the route selector on `p` and writes out [B, M, N] in p.dtype on the current stream.
// No host synchronization; scratch comes from `ws` (nullptr: the op allocates its own).
void gather_qmm_into(const detail::GatherQmmProblem& p, void* out, Workspace* ws);

}  // namespace expertqmm::cuda

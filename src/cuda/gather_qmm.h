// Internal device entry of gather_qmm, used by the public op and by the device MoE path.
#pragma once
#include <string>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "cuda/gather_qmm_routes.h"
#include "expertqmm/moe.h"

namespace expertqmm::cuda {

// Runs the route selector on `p` and writes out [B, M, N] in p.dtype on the current stream.
// No host synchronization; scratch comes from `ws` (nullptr: the op allocates its own).
void gather_qmm_into(const detail::GatherQmmProblem& p, void* out, Workspace* ws);

// The same selection in two steps, for the layer plan (layer_plan.cu): the route the selector picks
// for p, counted once (the expert tile route's hit, or the class of its miss), whether or not the
// plan then fuses the GEMM into a neighbour; and a run of p on that route with no second choice.
const GatherQmmRoute& select_gather_qmm_route(const detail::GatherQmmProblem& p);
bool is_expert_tiles(const GatherQmmRoute& route);
void run_gather_qmm_route(const GatherQmmRoute& route, const detail::GatherQmmProblem& p, void* out, Workspace* ws);

// The problem of out [T, N] = x [T, K] @ dequant(q)^T with one weight matrix: x (T, K) in `dtype`
// on the device is one batch of M = T rows (B = 1, identity indices), N = q's rows. scales/biases
// replace q's (e.g. copies cast to `dtype`) when defined. Builds views only: no copy, no sync.
detail::GatherQmmProblem single_matrix_problem(const void* x, int64_t T, int64_t K, DType dtype,
                                               const QuantizedWeight& q, const Tensor& scales = Tensor(),
                                               const Tensor& biases = Tensor());
// The same product as T rows of expert 0 of a one-expert batch (x [T, 1, K], B = T, rhs = zero_ids,
// sorted): the expert tile route's form of a dense linear. zero_ids: T zeroed int32 on the device;
// plan: a prebuilt tile plan of those ids, or null for the route to build one.
detail::GatherQmmProblem one_expert_rows_problem(const detail::GatherQmmProblem& single, int32_t* zero_ids,
                                                 const void* plan = nullptr);

// Bytes of fp32 slices the rhs_tiles route's split-K takes for a problem of `rows` (B * M) rows, N
// columns and K (0 when it would not split); see GatherQmmProblem::split_k_scratch.
size_t gather_qmm_split_k_bytes(int64_t rows, int64_t N, int64_t K);

// Test hooks. The selector's route names in order; the route it picks for p; and a run of one
// named route instead of the selector: a selector route, or "rhs_tiles_bm16" / "rhs_tiles_bm32"
// (rhs_tiles with its tile height pinned). Throws Error when the route does not support p.
std::vector<std::string> gather_qmm_route_names();
std::string gather_qmm_selected_route(const detail::GatherQmmProblem& p);
void gather_qmm_into_route(const std::string& route, const detail::GatherQmmProblem& p, void* out,
                           Workspace* ws);
// The device's count of retracted gather_qmm tile plans since diagnostics::reset(), those of named
// routes and column windows included (diagnostics::snapshot() moves only the selector's hits).
uint64_t gather_qmm_device_retractions();

}  // namespace expertqmm::cuda

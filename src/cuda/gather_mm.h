// gather_mm on CUDA (MLX's unquantized gathered matmul: 16-bit experts), internal side. Like
// gather_qmm (gather_qmm.h), an ordered table of routes, each a supports_* predicate returning the
// first Fallback class that rules a problem out and a call_*:
//   tiles (gather_mm_tiles.cu)  sorted rows over the expert tile plan, mma.sync on bf16/f16 weights
//                               read as they are ([E, N, K] row-major, mlx-lm's layout)
//   gemv  (gather_mm_gemv.cu)   decode sizes (at most kGemvMaxRows rows), same weight layout
//   simt  (gather_mm_simt.cu)   every valid problem: any float dtypes, any weight strides
// Every call that reaches the selector records the tile route's hit or miss (Primitive::gather_mm).
#pragma once
#include <string>
#include <vector>

#include "core/gather_mm_problem.h"
#include "cuda/gather_qmm_routes.h"

namespace expertqmm::cuda {

using GatherMmRoute = Route<detail::GatherMmProblem>;  // route_table.h

// --- checks shared by the tensor-core and GEMV routes -------------------------------------------
// bf16/f16 with the weight in the output dtype (Fallback::dtype); the weight k-contiguous, each
// [N, K] row and matrix 16-byte aligned, x rows 16-byte aligned (alignment / topology).
RouteSupport supports_mm_operands(const detail::GatherMmProblem& p);

// --- tiles: sorted rows over the expert tile plan (gather_mm_tiles.cu) ---------------------------
constexpr int64_t kGemvMaxRows = 64;  // rows (B * M) the GEMV route takes; the tile route starts above
constexpr int kMmTileCols = 128;      // columns of one tile-route CTA (its grid is ceil(N / 128) wide)
RouteSupport supports_mm_tiles(const detail::GatherMmProblem& p);
void call_mm_tiles(const detail::GatherMmProblem& p, void* out, Workspace* ws);

// --- gemv: decode sizes (gather_mm_gemv.cu) ------------------------------------------------------
RouteSupport supports_mm_gemv(const detail::GatherMmProblem& p);
void call_mm_gemv(const detail::GatherMmProblem& p, void* out, Workspace* ws);
// The GEMV with the K split across the CTA's warps forced on or off (tests).
void call_mm_gemv_split(const detail::GatherMmProblem& p, void* out, Workspace* ws);
void call_mm_gemv_unsplit(const detail::GatherMmProblem& p, void* out, Workspace* ws);

// --- simt: every valid problem (gather_mm_simt.cu) -----------------------------------------------
RouteSupport supports_mm_simt(const detail::GatherMmProblem& p);
void call_mm_simt(const detail::GatherMmProblem& p, void* out, Workspace* ws);

// Runs the selector on p and writes out [B, M, N] in p.dtype on the current stream (no host sync).
void gather_mm_into(const detail::GatherMmProblem& p, void* out, Workspace* ws);
// The two steps for the layer plan: the route the selector picks (counted once), and a run on it.
const GatherMmRoute& select_gather_mm_route(const detail::GatherMmProblem& p);
bool is_mm_tiles(const GatherMmRoute& route);
void run_gather_mm_route(const GatherMmRoute& route, const detail::GatherMmProblem& p, void* out, Workspace* ws);

// Test hooks: the selector's route names in order, the route it picks (not counted), and a run of
// one named route ("tiles", "gemv", "gemv_split", "gemv_unsplit", "simt"); throws Error when the
// route does not support p.
std::vector<std::string> gather_mm_route_names();
std::string gather_mm_selected_route(const detail::GatherMmProblem& p);
void gather_mm_into_route(const std::string& route, const detail::GatherMmProblem& p, void* out, Workspace* ws);

}  // namespace expertqmm::cuda

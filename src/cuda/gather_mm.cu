// gather_mm on CUDA: the route selector, the internal entry gather_mm_into and the op.
#include <string>
#include <vector>

#include "core/route_counters.h"
#include "cuda/cuda_backend.h"
#include "cuda/gather_mm.h"
#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

namespace {

constexpr const char* kOp = "gather_mm";

// Tried in order. tiles is first and is gated by the same on/off setting as gather_qmm's expert tile
// route (EXPERTQMM_EXPERT_TILES); its misses are counted and fall through. simt takes every valid
// problem.
const GatherMmRoute kRoutes[] = {
    {"tiles", supports_mm_tiles, call_mm_tiles},
    {"gemv", supports_mm_gemv, call_mm_gemv},
    {"simt", supports_mm_simt, call_mm_simt},
};
const GatherMmRoute kTestRoutes[] = {
    {"gemv_split", supports_mm_gemv, call_mm_gemv_split},
    {"gemv_unsplit", supports_mm_gemv, call_mm_gemv_unsplit},
};

// The problem arrives validated by make_gather_mm_problem (or built by the layer plan); this checks
// what every CUDA route relies on. Returns false when there is nothing to compute.
bool check_problem(const detail::GatherMmProblem& p, const void* out) {
  EXPERTQMM_CHECK(p.device == Device::cuda, kOp, "the CUDA backend got a problem on ", device_name(p.device));
  EXPERTQMM_CHECK(p.B >= 0 && p.M >= 0 && p.N >= 0 && p.K >= 0, kOp, "negative size in ", p.describe());
  if (p.B == 0 || p.M == 0 || p.N == 0) return false;
  EXPERTQMM_CHECK(out != nullptr, kOp, "output pointer is null for ", p.describe());
  EXPERTQMM_CHECK(p.x.device() == Device::cuda && p.w.device() == Device::cuda, kOp, "operands must be on cuda: ",
                  p.describe());
  EXPERTQMM_CHECK(is_floating(p.dtype) && p.x.dtype() == p.dtype && is_floating(p.w.dtype()), kOp,
                  "x must be in the output dtype and w a float tensor: ", p.describe());
  if (!p.lhs_is_identity) check_index_tensor(kOp, p.lhs, "lhs", p.B);
  if (!p.rhs_is_identity) check_index_tensor(kOp, p.rhs, "rhs", p.B);
  return true;
}

// Picks the route; with `record`, counts the tile route's hit or the class of its miss.
const GatherMmRoute& pick_route(const detail::GatherMmProblem& p, bool record) {
  return select_route(kOp, detail::Primitive::gather_mm, kRoutes, p, record);
}

}  // namespace

RouteSupport supports_mm_operands(const detail::GatherMmProblem& p) {
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return route_miss(Fallback::dtype);
  if (p.w.dtype() != p.dtype || p.x.dtype() != p.dtype) return route_miss(Fallback::dtype);
  if (p.w_stride_k != 1 && p.K > 1) return route_miss(Fallback::topology);  // not mlx-lm's [E, N, K] layout
  if (p.K % 8 != 0 || p.w_stride_n % 8 != 0 || p.w_batch_stride % 8 != 0 || p.x_batch_stride % 8 != 0)
    return route_miss(Fallback::alignment);  // 16-byte chunks of k
  if (!is_aligned(p.w.data(), 16) || !is_aligned(p.x.data(), 16)) return route_miss(Fallback::alignment);
  if (!fits_int32(p.N) || !fits_int32(p.K) || !fits_int32(p.M) || !fits_int32(p.w_batch))
    return route_miss(Fallback::shape);
  return route_ok();
}

void gather_mm_into(const detail::GatherMmProblem& p, void* out, Workspace* ws) {
  if (!check_problem(p, out)) return;
  pick_route(p, /*record=*/true).call(p, out, ws);
}

const GatherMmRoute& select_gather_mm_route(const detail::GatherMmProblem& p) { return pick_route(p, true); }

bool is_mm_tiles(const GatherMmRoute& route) { return &route == &kRoutes[0]; }

void run_gather_mm_route(const GatherMmRoute& route, const detail::GatherMmProblem& p, void* out, Workspace* ws) {
  if (!check_problem(p, out)) return;
  route.call(p, out, ws);
}

Tensor gather_mm(const detail::GatherMmProblem& p) {
  Tensor out = gathered_output(p);
  gather_mm_into(p, out.data(), nullptr);
  return out;
}

std::vector<std::string> gather_mm_route_names() { return route_names(kRoutes); }

std::string gather_mm_selected_route(const detail::GatherMmProblem& p) { return pick_route(p, false).name; }

void gather_mm_into_route(const std::string& route, const detail::GatherMmProblem& p, void* out, Workspace* ws) {
  const GatherMmRoute& r = route_named(kOp, route, kRoutes, kTestRoutes, p);
  if (!check_problem(p, out)) return;
  r.call(p, out, ws);
}

}  // namespace expertqmm::cuda

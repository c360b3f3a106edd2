// What the CUDA selectors share (gather_qmm.cu, gather_mm.cu): a route is a supports_* predicate,
// which returns the first reason it cannot take a problem (one Fallback class per miss), and a
// call_* that runs it on the current stream; a selector is an ordered table of them plus the routes
// reachable only from tests.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "core/route_counters.h"
#include "expertqmm/moe.h"
#include "expertqmm/settings.h"

namespace expertqmm::cuda {

// A route's verdict on a problem: supported, or the first Fallback class that rules it out.
struct RouteSupport {
  bool ok = true;
  Fallback reason = Fallback::disabled;  // meaningful only when !ok
};
inline RouteSupport route_ok() { return {}; }
inline RouteSupport route_miss(Fallback reason) { return {false, reason}; }

template <class Problem>
struct Route {
  const char* name;
  RouteSupport (*supports)(const Problem& p);
  void (*call)(const Problem& p, void* out, Workspace* ws);
};

// The selector over a table whose first route is a tile route (gated by the expert tile setting,
// EXPERTQMM_EXPERT_TILES): that route when it is requested and takes p, else the first of the others
// that does. With `record`, the tile route's hit or the class of its miss is counted under
// `primitive` (one attempt).
template <class Problem, size_t N>
const Route<Problem>& select_route(const char* op, detail::Primitive primitive, const Route<Problem> (&routes)[N],
                                   const Problem& p, bool record) {
  const bool requested = expert_tiles_setting() != RouteSwitch::off;
  const RouteSupport tiles = routes[0].supports(p);
  const bool hit = requested && tiles.ok;
  if (record)
    detail::record_selection(primitive, requested, tiles.ok, hit, !requested ? Fallback::disabled : tiles.reason);
  if (hit) return routes[0];
  for (size_t i = 1; i < N; ++i)
    if (routes[i].supports(p).ok) return routes[i];
  throw Error(op, "no CUDA route for " + p.describe());
}

// An index operand of a problem: contiguous int32 [B] on the device.
inline void check_index_tensor(const char* op, const Tensor& t, const char* name, int64_t B) {
  EXPERTQMM_CHECK(t.defined(), op, name, " indices are missing but not marked identity");
  EXPERTQMM_CHECK(t.dtype() == DType::i32 && t.numel() == B && t.is_contiguous() && t.device() == Device::cuda, op,
                  name, " indices must be contiguous int32 [", B, "] on cuda, got ", t.describe());
}

// The names of a table, in order.
template <class Problem, size_t N>
std::vector<std::string> route_names(const Route<Problem> (&routes)[N]) {
  std::vector<std::string> names;
  for (const Route<Problem>& r : routes) names.emplace_back(r.name);
  return names;
}

// The route called `name` in either table, checked to support p (test hooks: an Error naming op,
// the route and the problem otherwise).
template <class Problem, size_t N, size_t M>
const Route<Problem>& route_named(const char* op, const std::string& name, const Route<Problem> (&routes)[N],
                                  const Route<Problem> (&test_routes)[M], const Problem& p) {
  const Route<Problem>* found = nullptr;
  for (const Route<Problem>& r : routes)
    if (name == r.name) found = &r;
  for (const Route<Problem>& r : test_routes)
    if (name == r.name) found = &r;
  EXPERTQMM_CHECK(found != nullptr, op, "unknown CUDA route '", name, "'");
  const RouteSupport s = found->supports(p);
  EXPERTQMM_CHECK(s.ok, op, "route ", name, " does not support ", p.describe(), " (", fallback_name(s.reason), ")");
  return *found;
}

// The output of a gathered matmul problem: batch + [M, N] in its dtype, on the device.
template <class Problem>
Tensor gathered_output(const Problem& p) {
  Shape shape = p.batch;
  shape.push_back(p.M);
  shape.push_back(p.N);
  return Tensor::empty(shape, p.dtype, Device::cuda);
}

}  // namespace expertqmm::cuda

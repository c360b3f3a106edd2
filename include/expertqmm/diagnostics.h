// Route selector counters, per primitive. Relaxed atomics on the host; retractions decided on the
// device are folded in by snapshot(), which therefore synchronizes the CUDA stream.
//   attempts  = calls that reached the selector
//   requested = attempts where the primitive's fast path was requested (not disabled)
//   available = attempts where its supports_* predicate held
//   hits      = attempts served by it
// The primitives and their fast paths: gather_qmm and gather_mm (the expert tile route),
// moe_decode_layer (the three-kernel decode layer), dense_mlp_glu (the Gemma 4 block's dense MLP with
// gate, up and the GLU product in one launch).
// Invariant: attempts == hits + sum(fallbacks), every fallback class mutually exclusive.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "expertqmm/settings.h"

namespace expertqmm {

enum class Fallback : uint8_t {
  disabled,              // the route is switched off (env or API)
  dtype,                 // activation dtype not supported by the route
  quantization,          // bits / group size not supported
  topology,              // indices not of the sorted-rows form (lhs given, M != 1, batch shape)
  shape,                 // M, N, K outside the route's limits
  alignment,             // K or N not a multiple of the tile, misaligned pointers
  sortedness_retracted,  // sorted_indices promised but the device found the ids unsorted
  count_
};
constexpr int kFallbackCount = static_cast<int>(Fallback::count_);
const char* fallback_name(Fallback f);

struct RouteCounters {
  std::string primitive;  // "gather_qmm"
  uint64_t attempts = 0, requested = 0, available = 0, hits = 0;
  uint64_t fallbacks[kFallbackCount] = {};
  uint64_t fallback_total() const;
};

namespace diagnostics {
std::vector<RouteCounters> snapshot();
void reset();
std::string format(const std::vector<RouteCounters>& counters);  // a table for humans
}  // namespace diagnostics

// The route switches (set_expert_tiles, set_decode_layer, ...) live in settings.h.

}  // namespace expertqmm

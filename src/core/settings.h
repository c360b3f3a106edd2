// Internal side of include/expertqmm/settings.h: the environment parser (pure, so tests can feed it
// any environment) and the only reader of the process environment in the project.
#pragma once
#include <functional>
#include <optional>
#include <string>

#include "expertqmm/settings.h"

namespace expertqmm::detail {

// What the EXPERTQMM_* variables say (before API overrides).
struct EnvSettings {
  RouteSwitch expert_tiles = RouteSwitch::automatic;
  RouteSwitch decode_layer = RouteSwitch::automatic;
  RouteSwitch decode_route_in_gate_up = RouteSwitch::automatic;  // automatic = on unless the router is chained
  RouteSwitch decode_down_groups = RouteSwitch::automatic;       // automatic = from 12 tokens (measured)
  RouteSwitch chained_launch = RouteSwitch::automatic;
  RouteSwitch deterministic = RouteSwitch::automatic;  // automatic = off
  RouteSwitch wgmma = RouteSwitch::automatic;          // automatic = on where available
  int wgmma_width = 0;                                 // 0: the measured table
  RouteSwitch wgmma_ws = RouteSwitch::automatic;       // automatic = off (step 47, not yet measured)
  RouteSwitch group_rows = RouteSwitch::automatic;     // automatic = wherever it fits (as on; measured)
  RouteSwitch dense_cublas = RouteSwitch::automatic;   // automatic = from kDenseCublasMinTokens (measured)
  int down_window_mib = 0;                             // 0: the layer plan's own cap (kDownWindowBytes)
};

// Looks a variable up: the value, or nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;

// Parses every EXPERTQMM_* setting variable through `lookup`; the first bad value throws Error
// naming the variable, the value and what it takes.
EnvSettings parse_env_settings(const EnvLookup& lookup);

// The process environment's value of `name` (nullopt when unset). The one place that reads it:
// the library's settings above, and the tools' and tests' own variables (EXPERTQMM_COMMIT, ...).
std::optional<std::string> environment_variable(const char* name);

// Reads and validates the process environment once (the first call; later calls return at once,
// or throw the same Error again when a value was bad). Every op front calls it, so that a bad
// variable is reported on every build even when no code path reads it.
void check_settings();

}  // namespace expertqmm::detail

// Settings, diagnostics and backend facts (settings.h, diagnostics.h, backend.h) for expertqmm._core.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "bind.h"
#include "expertqmm/backend.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "expertqmm/settings.h"

namespace expertqmm::python {

namespace nb = nanobind;
using nb::arg;

namespace {

RouteSwitch parse_switch(const std::string& s, const char* op) {
  if (s == "auto") return RouteSwitch::automatic;
  if (s == "on") return RouteSwitch::on;
  if (s == "off") return RouteSwitch::off;
  throw Error(op, "must be 'auto', 'on' or 'off', got '" + s + "'");
}

std::string switch_name(RouteSwitch s) {
  return s == RouteSwitch::automatic ? "auto" : s == RouteSwitch::on ? "on" : "off";
}

nb::list snapshot_dicts() {
  nb::list out;
  for (const RouteCounters& c : diagnostics::snapshot()) {
    nb::dict d, fallbacks;
    d["primitive"] = c.primitive;
    d["attempts"] = c.attempts;
    d["requested"] = c.requested;
    d["available"] = c.available;
    d["hits"] = c.hits;
    for (int i = 0; i < kFallbackCount; ++i) fallbacks[fallback_name(Fallback(i))] = c.fallbacks[i];
    d["fallbacks"] = fallbacks;
    out.append(d);
  }
  return out;
}

nb::list settings_dicts() {
  nb::list out;
  for (const SettingInfo& s : settings_table()) {
    nb::dict d;
    d["variable"] = s.variable;
    d["values"] = s.values;
    d["current"] = s.current;
    d["what"] = s.what;
    out.append(d);
  }
  return out;
}

}  // namespace

void bind_settings(nb::module_& m) {
  m.def("set_expert_tiles", [](const std::string& s) { set_expert_tiles(parse_switch(s, "set_expert_tiles")); },
        arg("value"), "The expert tile routes of gather_qmm / gather_mm: 'auto', 'on' or 'off' (EXPERTQMM_EXPERT_TILES).");
  m.def("expert_tiles", [] { return switch_name(expert_tiles_setting()); }, "The expert tile setting in force.");
  m.def("set_decode_layer", [](const std::string& s) { set_decode_layer(parse_switch(s, "set_decode_layer")); },
        arg("value"), "The three-kernel decode MoE layer: 'auto', 'on' or 'off' (EXPERTQMM_DECODE_LAYER).");
  m.def("decode_layer", [] { return switch_name(decode_layer_setting()); }, "The decode layer setting in force.");
  m.def("set_wgmma", [](const std::string& s) { set_wgmma(parse_switch(s, "set_wgmma")); }, arg("value"),
        "The sm_90a wgmma kernels: 'auto', 'on' or 'off' (EXPERTQMM_WGMMA).");
  m.def("wgmma", [] { return switch_name(wgmma_setting()); }, "The wgmma setting in force.");
  m.def("set_wgmma_width", &set_wgmma_width, arg("width"),
        "Pin the wgmma expert-tile GEMM's token width (32, 64, 128; 0: the measured table).");
  m.def("wgmma_width", &wgmma_width, "The pinned wgmma width (0: none).");
  m.def("set_deterministic", &set_deterministic, arg("on"),
        "Only kernels with the same output bits on every run (EXPERTQMM_DETERMINISTIC); every path is today, so no effect yet.");
  m.def("deterministic", &deterministic, "Whether deterministic mode is on.");
  m.def("set_product_mode", [](const std::string& s) {
    EXPERTQMM_CHECK(s == "fused" || s == "separate", "set_product_mode", "must be 'fused' or 'separate', got '", s, "'");
    set_product_mode(s == "fused" ? ProductMode::fused : ProductMode::separate);
  }, arg("mode"), "The GLU product on CUDA: 'fused' (one kernel) or 'separate' (two, for comparison).");
  m.def("product_mode", [] { return std::string(product_mode() == ProductMode::fused ? "fused" : "separate"); },
        "The product mode in force.");
  m.def("set_setting", [](const std::string& variable, std::optional<std::string> value) { set_setting(variable, value); },
        arg("variable"), arg("value").none() = nb::none(),
        "Override any EXPERTQMM_* setting by its variable, with the text its environment variable takes "
        "(e.g. set_setting('EXPERTQMM_DOWN_WINDOW_MIB', '48')); None gives it back to the environment. "
        "A bad value or an unknown name raises expertqmm.Error and changes nothing.");
  m.def("settings_table", &settings_dicts,
        "Every EXPERTQMM_* setting: a list of dicts with variable, values, current and what.");
  m.def("diagnostics_snapshot", &snapshot_dicts,
        "The route counters per primitive (list of dicts; synchronizes the CUDA stream to fold in device verdicts).");
  m.def("diagnostics_reset", &diagnostics::reset, "Zero every route counter.");
  m.def("diagnostics_format", [] { return diagnostics::format(diagnostics::snapshot()); },
        "The route counters as a table for humans.");
  m.def("cuda_built", &cuda_built, "Whether this build has the CUDA backend.");
  m.def("cuda_available", &cuda_available, "Built with CUDA, and a device is usable now.");
  m.def("cuda_device_name", [] { return std::string(cuda_device_name()); }, "Device 0's name ('' when none).");
  m.def("cuda_check", &cuda_check, "Synchronize the stream and raise for faults the kernels recorded.");
}

}  // namespace expertqmm::python

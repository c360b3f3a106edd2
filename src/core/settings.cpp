// The settings of include/expertqmm/settings.h: one table of EXPERTQMM_* variables, parsed once;
// API overrides on top. The only file that reads the process environment.
#include "core/settings.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "expertqmm/error.h"

namespace expertqmm {

namespace detail {

namespace {

const char* switch_text(RouteSwitch s) {
  return s == RouteSwitch::off ? "0" : s == RouteSwitch::on ? "1" : "auto";
}

// A 0/1 variable: unset -> automatic, "0" -> off, "1" -> on, anything else (empty too) an Error.
RouteSwitch parse_switch(const char* variable, const std::optional<std::string>& value) {
  if (!value) return RouteSwitch::automatic;
  if (*value == "0") return RouteSwitch::off;
  if (*value == "1") return RouteSwitch::on;
  throw Error("settings", cat(variable, "='", *value, "' is not valid: use 0 (off), 1 (on) or leave it unset"));
}

int parse_wgmma_width(const char* variable, const std::optional<std::string>& value) {
  if (!value) return 0;
  if (*value == "32" || *value == "64" || *value == "128") return std::stoi(*value);
  throw Error("settings", cat(variable, "='", *value, "' is not valid: use 32, 64 or 128, or leave it unset"));
}

constexpr int kMaxDownWindowMib = 4096;
int parse_down_window_mib(const char* variable, const std::optional<std::string>& value) {
  if (!value) return 0;
  const bool digits = !value->empty() && value->size() <= 4 &&
                      value->find_first_not_of("0123456789") == std::string::npos;
  const int v = digits ? std::stoi(*value) : 0;
  if (v < 1 || v > kMaxDownWindowMib)
    throw Error("settings", cat(variable, "='", *value, "' is not valid: use a whole number of MiB from 1 to ",
                                kMaxDownWindowMib, ", or leave it unset"));
  return v;
}

// API overrides: -1 = none (the environment decides), else the value.
constexpr int kNone = -1;
std::atomic<int> g_expert_tiles{kNone}, g_decode_layer{kNone}, g_decode_route_in_gate_up{kNone}, g_chained_launch{kNone}, g_deterministic{kNone}, g_wgmma{kNone},
    g_wgmma_width{kNone}, g_decode_down_groups{kNone}, g_wgmma_ws{kNone}, g_group_rows{kNone}, g_dense_cublas{kNone},
    g_down_window_mib{kNone};
std::atomic<ProductMode> g_product_mode{ProductMode::fused};
thread_local int t_chained_launch = kNone;  // ChainedLaunchScope's value on this thread

// The variables, as data: name, accepted values, what it does, and how it lands in EnvSettings.
struct Variable {
  const char* name;
  const char* values;
  const char* what;
  void (*parse)(const char* name, const std::optional<std::string>& value, EnvSettings& into);
  std::string (*current)();
  std::atomic<int>* override_slot;     // its API override (kNone: none)
  int (*override_of)(const EnvSettings&);  // the override a parsed value stands for
};
int switch_override(RouteSwitch s) { return static_cast<int>(s); }

const Variable kVariables[] = {
    {"EXPERTQMM_EXPERT_TILES", "0|1", "the expert tile route of gather_qmm off or on (unset: automatic)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.expert_tiles = parse_switch(n, v); },
     [] { return std::string(switch_text(expert_tiles_setting())); },
     &g_expert_tiles, [](const EnvSettings& e) { return switch_override(e.expert_tiles); }},
    {"EXPERTQMM_DECODE_LAYER", "0|1", "the three-kernel decode MoE layer off or on (unset: on)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.decode_layer = parse_switch(n, v); },
     [] { return std::string(switch_text(decode_layer_setting())); },
     &g_decode_layer, [](const EnvSettings& e) { return switch_override(e.decode_layer); }},
    {"EXPERTQMM_DECODE_ROUTE_IN_GATE_UP", "0|1",
     "1: at one token the decode layer's gate/up CTAs rank the router's logits, no routing CTA; 0: the router's last CTA (unset: 1 in the MoE layer alone, 0 in the Gemma 4 block)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.decode_route_in_gate_up = parse_switch(n, v); },
     [] { return std::string(switch_text(decode_route_in_gate_up_setting())); },
     &g_decode_route_in_gate_up, [](const EnvSettings& e) { return switch_override(e.decode_route_in_gate_up); }},
    {"EXPERTQMM_CHAINED_LAUNCH", "0|1", "programmatic dependent launches at the Gemma 4 block's decode boundaries (unset: on)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.chained_launch = parse_switch(n, v); },
     [] { return std::string(switch_text(chained_launch_setting())); },
     &g_chained_launch, [](const EnvSettings& e) { return switch_override(e.chained_launch); }},
    {"EXPERTQMM_DETERMINISTIC", "0|1", "1: only kernels with the same output bits every run (every path is today: no effect; unset: 0)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.deterministic = parse_switch(n, v); },
     [] { return std::string(deterministic() ? "1" : "0"); },
     &g_deterministic, [](const EnvSettings& e) { return e.deterministic == RouteSwitch::on ? 1 : 0; }},
    {"EXPERTQMM_WGMMA", "0|1", "0: the sm_90a wgmma kernels off, mma.sync instead; 1: also where the measured rules do not choose them (8-bit codes below 32 rows per expert) (unset: the measured rules)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.wgmma = parse_switch(n, v); },
     [] { return std::string(switch_text(wgmma_setting())); },
     &g_wgmma, [](const EnvSettings& e) { return switch_override(e.wgmma); }},
    {"EXPERTQMM_WGMMA_WIDTH", "32|64|128", "pins one token width of the wgmma GEMM (unset: the measured table)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.wgmma_width = parse_wgmma_width(n, v); },
     [] { return wgmma_width() ? std::to_string(wgmma_width()) : std::string("auto"); },
     &g_wgmma_width, [](const EnvSettings& e) { return e.wgmma_width; }},
    {"EXPERTQMM_WGMMA_WS", "0|1",
     "1: the 4-bit wgmma expert GEMM's 128-token build as the warp-specialized persistent kernel (unset: 0, until measured)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.wgmma_ws = parse_switch(n, v); },
     [] { return std::string(switch_text(wgmma_ws_setting())); },
     &g_wgmma_ws, [](const EnvSettings& e) { return switch_override(e.wgmma_ws); }},
    {"EXPERTQMM_DECODE_DOWN_GROUPS", "0|1",
     "the decode layer's 4-bit down product per (expert group, 128 columns), then a slot-order combine kernel: 1 from 2 tokens, 0 never (unset: from 12 tokens, measured)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.decode_down_groups = parse_switch(n, v); },
     [] { return std::string(switch_text(decode_down_groups_setting())); },
     &g_decode_down_groups, [](const EnvSettings& e) { return switch_override(e.decode_down_groups); }},
    {"EXPERTQMM_GROUP_ROWS", "0|1",
     "the layer's rows grouped by expert, with the tile plan, by group_rows.cu (one CTA up to 8192 rows, its three-launch grid form past that): unset or 1 wherever it fits (256 experts, 2^18 rows), 0 never: CUB's stable sort, the inverse and the plan builder",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.group_rows = parse_switch(n, v); },
     [] { return std::string(switch_text(group_rows_setting())); },
     &g_group_rows, [](const EnvSettings& e) { return switch_override(e.group_rows); }},
    {"EXPERTQMM_DENSE_CUBLAS", "0|1",
     "the Gemma 4 block's quantized dense MLP dequantized to 16 bits and run on cuBLAS: 1 at every size the decode kernels leave (2 tokens up), 0 never (unset: from 512 tokens, measured)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.dense_cublas = parse_switch(n, v); },
     [] { return std::string(switch_text(dense_cublas_setting())); },
     &g_dense_cublas, [](const EnvSettings& e) { return switch_override(e.dense_cublas); }},
    {"EXPERTQMM_DOWN_WINDOW_MIB", "1..4096",
     "the most MiB of the prefill MoE layer's down output held at once: past it, down and the combine run per window of columns (unset: 24)",
     [](const char* n, const std::optional<std::string>& v, EnvSettings& s) { s.down_window_mib = parse_down_window_mib(n, v); },
     [] { return down_window_mib() ? std::to_string(down_window_mib()) : std::string("auto"); },
     &g_down_window_mib, [](const EnvSettings& e) { return e.down_window_mib; }},
};

// The environment, parsed on first use. A bad value is kept as its message and thrown on every read.
struct ProcessEnv {
  EnvSettings settings;
  std::optional<Error> error;
};
const ProcessEnv& process_env() {
  static const ProcessEnv env = [] {
    ProcessEnv e;
    try {
      e.settings = parse_env_settings(environment_variable);
    } catch (const Error& err) {
      e.error = err;
    }
    return e;
  }();
  if (env.error) throw *env.error;
  return env;
}
const EnvSettings& env() { return process_env().settings; }

bool valid_switch(RouteSwitch s) { return s == RouteSwitch::automatic || s == RouteSwitch::off || s == RouteSwitch::on; }
void set_switch(std::atomic<int>& slot, RouteSwitch s, const char* setter) {
  EXPERTQMM_CHECK(valid_switch(s), setter, "value ", static_cast<int>(s), " is not a RouteSwitch");
  slot.store(static_cast<int>(s));
}
RouteSwitch read_switch(const std::atomic<int>& slot, RouteSwitch from_env) {
  const int v = slot.load();
  return v == kNone ? from_env : static_cast<RouteSwitch>(v);
}

}  // namespace

EnvSettings parse_env_settings(const EnvLookup& lookup) {
  EnvSettings s;
  for (const Variable& v : kVariables) v.parse(v.name, lookup(v.name), s);
  return s;
}

std::optional<std::string> environment_variable(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

void check_settings() { (void)process_env(); }

}  // namespace detail

using namespace detail;

void set_expert_tiles(RouteSwitch s) { set_switch(g_expert_tiles, s, "set_expert_tiles"); }
RouteSwitch expert_tiles_setting() { return read_switch(g_expert_tiles, env().expert_tiles); }

void set_decode_layer(RouteSwitch s) { set_switch(g_decode_layer, s, "set_decode_layer"); }
RouteSwitch decode_layer_setting() { return read_switch(g_decode_layer, env().decode_layer); }
void set_decode_route_in_gate_up(RouteSwitch s) { set_switch(g_decode_route_in_gate_up, s, "set_decode_route_in_gate_up"); }
RouteSwitch decode_route_in_gate_up_setting() {
  return read_switch(g_decode_route_in_gate_up, env().decode_route_in_gate_up);
}
void set_decode_down_groups(RouteSwitch s) { set_switch(g_decode_down_groups, s, "set_decode_down_groups"); }
RouteSwitch decode_down_groups_setting() { return read_switch(g_decode_down_groups, env().decode_down_groups); }
void set_chained_launch(RouteSwitch s) { set_switch(g_chained_launch, s, "set_chained_launch"); }
RouteSwitch chained_launch_setting() {
  if (t_chained_launch != kNone) return static_cast<RouteSwitch>(t_chained_launch);
  return read_switch(g_chained_launch, env().chained_launch);
}
bool chained_launches() { return chained_launch_setting() != RouteSwitch::off; }
ChainedLaunchScope::ChainedLaunchScope(RouteSwitch s) : previous_(t_chained_launch) {
  EXPERTQMM_CHECK(valid_switch(s), "ChainedLaunchScope", "value ", static_cast<int>(s), " is not a RouteSwitch");
  t_chained_launch = static_cast<int>(s);
}
ChainedLaunchScope::~ChainedLaunchScope() { t_chained_launch = previous_; }

void set_deterministic(bool on) { g_deterministic.store(on ? 1 : 0); }
bool deterministic() {
  const int v = g_deterministic.load();
  return v == kNone ? env().deterministic == RouteSwitch::on : v == 1;
}

void set_product_mode(ProductMode mode) {
  EXPERTQMM_CHECK(mode == ProductMode::fused || mode == ProductMode::separate, "set_product_mode", "value ",
                  static_cast<int>(mode), " is not a ProductMode");
  g_product_mode.store(mode);
}
ProductMode product_mode() { return g_product_mode.load(); }

void set_wgmma(RouteSwitch s) { set_switch(g_wgmma, s, "set_wgmma"); }
RouteSwitch wgmma_setting() { return read_switch(g_wgmma, env().wgmma); }

void set_wgmma_ws(RouteSwitch s) { set_switch(g_wgmma_ws, s, "set_wgmma_ws"); }
RouteSwitch wgmma_ws_setting() { return read_switch(g_wgmma_ws, env().wgmma_ws); }

void set_group_rows(RouteSwitch s) { set_switch(g_group_rows, s, "set_group_rows"); }
RouteSwitch group_rows_setting() { return read_switch(g_group_rows, env().group_rows); }

void set_dense_cublas(RouteSwitch s) { set_switch(g_dense_cublas, s, "set_dense_cublas"); }
RouteSwitch dense_cublas_setting() { return read_switch(g_dense_cublas, env().dense_cublas); }

void set_wgmma_width(int width) {
  EXPERTQMM_CHECK(width == 0 || width == 32 || width == 64 || width == 128, "set_wgmma_width", "width ", width,
                  " is not 0 (the measured table), 32, 64 or 128");
  g_wgmma_width.store(width);
}
int wgmma_width() {
  const int v = g_wgmma_width.load();
  return v == kNone ? env().wgmma_width : v;
}

void set_down_window_mib(int mib) {
  EXPERTQMM_CHECK(mib >= 0 && mib <= kMaxDownWindowMib, "set_down_window_mib", "value ", mib,
                  " is not 0 (the layer's own cap) or a number of MiB from 1 to ", kMaxDownWindowMib);
  g_down_window_mib.store(mib);
}
int down_window_mib() {
  const int v = g_down_window_mib.load();
  return v == kNone ? env().down_window_mib : v;
}

void set_setting(const std::string& variable, const std::optional<std::string>& value) {
  for (const Variable& v : kVariables) {
    if (variable != v.name) continue;
    if (!value) {
      v.override_slot->store(kNone);
      return;
    }
    EnvSettings parsed;
    v.parse(v.name, value, parsed);  // a bad value throws as the environment's would
    v.override_slot->store(v.override_of(parsed));
    return;
  }
  std::string known;
  for (const Variable& v : kVariables) known += cat(known.empty() ? "" : ", ", v.name);
  throw Error("settings", cat("'", variable, "' is not a setting; the settings are ", known));
}

std::vector<SettingInfo> settings_table() {
  std::vector<SettingInfo> rows;
  for (const Variable& v : kVariables) rows.push_back({v.name, v.values, v.current(), v.what});
  return rows;
}

}  // namespace expertqmm

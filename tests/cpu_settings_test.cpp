// The settings module (include/expertqmm/settings.h, src/core/settings.cpp): every EXPERTQMM_*
// variable parsed from a given environment, a bad value of each an Error naming it, API overrides,
// and the table `expertqmm info` prints. Runs on every build: a CPU build validates the variables too.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <thread>

#include "core/settings.h"
#include "expertqmm/error.h"

namespace expertqmm {
namespace {

using detail::EnvSettings;

// An environment with only the given variables set.
detail::EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

EnvSettings parse(std::map<std::string, std::string> vars) { return detail::parse_env_settings(env_of(std::move(vars))); }

// Parsing `name=bad` throws an Error that names the variable and quotes the value.
void expect_rejected(const std::string& name, const std::string& bad) {
  try {
    (void)parse({{name, bad}});
    ADD_FAILURE() << name << " accepted '" << bad << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
    EXPECT_NE(msg.find("'" + bad + "'"), std::string::npos) << msg;
  }
}

const char* const kSwitchBad[] = {"", "2", "on", "off", "true", " 1", "1 ", "01", "-1"};

TEST(Settings, UnsetEnvironmentGivesTheDefaults) {
  const EnvSettings s = parse({});
  EXPECT_EQ(s.expert_tiles, RouteSwitch::automatic);
  EXPECT_EQ(s.decode_layer, RouteSwitch::automatic);
  EXPECT_EQ(s.chained_launch, RouteSwitch::automatic);
  EXPECT_EQ(s.deterministic, RouteSwitch::automatic);
  EXPECT_EQ(s.wgmma, RouteSwitch::automatic);
  EXPECT_EQ(s.wgmma_width, 0);
  EXPECT_EQ(s.down_window_mib, 0);
}

TEST(Settings, ExpertTilesVariable) {
  EXPECT_EQ(parse({{"EXPERTQMM_EXPERT_TILES", "0"}}).expert_tiles, RouteSwitch::off);
  EXPECT_EQ(parse({{"EXPERTQMM_EXPERT_TILES", "1"}}).expert_tiles, RouteSwitch::on);
  for (const char* bad : kSwitchBad) expect_rejected("EXPERTQMM_EXPERT_TILES", bad);
}

TEST(Settings, DecodeLayerVariable) {
  EXPECT_EQ(parse({{"EXPERTQMM_DECODE_LAYER", "0"}}).decode_layer, RouteSwitch::off);
  EXPECT_EQ(parse({{"EXPERTQMM_DECODE_LAYER", "1"}}).decode_layer, RouteSwitch::on);
  for (const char* bad : kSwitchBad) expect_rejected("EXPERTQMM_DECODE_LAYER", bad);
}

TEST(Settings, WgmmaWsVariable) {
  EXPECT_EQ(parse({}).wgmma_ws, RouteSwitch::automatic);
  EXPECT_EQ(parse({{"EXPERTQMM_WGMMA_WS", "0"}}).wgmma_ws, RouteSwitch::off);
  EXPECT_EQ(parse({{"EXPERTQMM_WGMMA_WS", "1"}}).wgmma_ws, RouteSwitch::on);
  for (const char* bad : kSwitchBad) expect_rejected("EXPERTQMM_WGMMA_WS", bad);
}

TEST(Settings, GroupRowsVariable) {
  EXPECT_EQ(parse({}).group_rows, RouteSwitch::automatic);
  EXPECT_EQ(parse({{"EXPERTQMM_GROUP_ROWS", "0"}}).group_rows, RouteSwitch::off);
  EXPECT_EQ(parse({{"EXPERTQMM_GROUP_ROWS", "1"}}).group_rows, RouteSwitch::on);
  for (const char* bad : kSwitchBad) expect_rejected("EXPERTQMM_GROUP_ROWS", bad);
}

TEST(Settings, DenseCublasVariable) {
  EXPECT_EQ(parse({}).dense_cublas, RouteSwitch::automatic);
  EXPECT_EQ(parse({{"EXPERTQMM_DENSE_CUBLAS", "0"}}).dense_cublas, RouteSwitch::off);
  EXPECT_EQ(parse({{"EXPERTQMM_DENSE_CUBLAS", "1"}}).dense_cublas, RouteSwitch::on);
  for (const char* bad : kSwitchBad) expect_rejected("EXPERTQMM_DENSE_CUBLAS", bad);
}

TEST(Settings, DownWindowMibVariable) {
  for (int mib : {1, 12, 24, 4096})
    EXPECT_EQ(parse({{"EXPERTQMM_DOWN_WINDOW_MIB", std::to_string(mib)}}).down_window_mib, mib);
  for (const char* bad : {"", "0", "4097", "-1", "12 ", " 12", "1e3", "12MiB", "99999", "0x10"})
    expect_rejected("EXPERTQMM_DOWN_WINDOW_MIB", bad);
}

// The API form: 0 gives the cap back to the layer, a value out of range is refused and changes nothing;
// set_setting reaches the same slot and the table shows it.
TEST(Settings, DownWindowMibApi) {
  set_down_window_mib(12);
  EXPECT_EQ(down_window_mib(), 12);
  EXPECT_THROW(set_down_window_mib(-1), Error);
  EXPECT_THROW(set_down_window_mib(4097), Error);
  EXPECT_EQ(down_window_mib(), 12);
  set_setting("EXPERTQMM_DOWN_WINDOW_MIB", "48");
  EXPECT_EQ(down_window_mib(), 48);
  bool shown = false;
  for (const SettingInfo& row : settings_table())
    if (row.variable == "EXPERTQMM_DOWN_WINDOW_MIB") shown = row.current == "48";
  EXPECT_TRUE(shown);
  set_down_window_mib(0);
  EXPECT_EQ(down_window_mib(), 0);
  set_setting("EXPERTQMM_DOWN_WINDOW_MIB", std::nullopt);
  EXPECT_EQ(down_window_mib(), 0);  // the test's environment leaves it unset
}

TEST(Settings, DecodeRouteInGateUpVariable) {
  EXPECT_EQ(parse({}).decode_route_in_gate_up, RouteSwitch::automatic);
  EXPECT_EQ(parse({}).decode_down_groups, RouteSwitch::automatic);
  EXPECT_EQ(parse({{"EXPERTQMM_DECODE_DOWN_GROUPS", "0"}}).decode_down_groups, RouteSwitch::off);
  EXPECT_EQ(parse({{"EXPERTQMM_DECODE_DOWN_GROUPS", "1"}}).decode_down_groups, RouteSwitch::on);
  for (const char* bad : kSwitchBad) expect_rejected("EXPERTQMM_DECODE_DOWN_GROUPS", bad);
  EXPECT_EQ(parse({{"EXPERTQMM_DECODE_ROUTE_IN_GATE_UP", "0"}}).decode_route_in_gate_up, RouteSwitch::off);
  EXPECT_EQ(parse({{"EXPERTQMM_DECODE_ROUTE_IN_GATE_UP", "1"}}).decode_route_in_gate_up, RouteSwitch::on);
  for (const char* bad : kSwitchBad) expect_rejected("EXPERTQMM_DECODE_ROUTE_IN_GATE_UP", bad);
}

TEST(Settings, ChainedLaunchVariable) {
  EXPECT_EQ(parse({{"EXPERTQMM_CHAINED_LAUNCH", "0"}}).chained_launch, RouteSwitch::off);
  EXPECT_EQ(parse({{"EXPERTQMM_CHAINED_LAUNCH", "1"}}).chained_launch, RouteSwitch::on);
  for (const char* bad : kSwitchBad) expect_rejected("EXPERTQMM_CHAINED_LAUNCH", bad);
}

TEST(Settings, DeterministicVariable) {
  EXPECT_EQ(parse({{"EXPERTQMM_DETERMINISTIC", "0"}}).deterministic, RouteSwitch::off);
  EXPECT_EQ(parse({{"EXPERTQMM_DETERMINISTIC", "1"}}).deterministic, RouteSwitch::on);
  for (const char* bad : kSwitchBad) expect_rejected("EXPERTQMM_DETERMINISTIC", bad);
}

TEST(Settings, WgmmaVariable) {
  EXPECT_EQ(parse({{"EXPERTQMM_WGMMA", "0"}}).wgmma, RouteSwitch::off);
  EXPECT_EQ(parse({{"EXPERTQMM_WGMMA", "1"}}).wgmma, RouteSwitch::on);
  for (const char* bad : kSwitchBad) expect_rejected("EXPERTQMM_WGMMA", bad);
}

TEST(Settings, WgmmaWidthVariable) {
  for (int w : {32, 64, 128}) EXPECT_EQ(parse({{"EXPERTQMM_WGMMA_WIDTH", std::to_string(w)}}).wgmma_width, w);
  for (const char* bad : {"", "0", "48", "96", "n64", "64 ", "256", "-32"}) expect_rejected("EXPERTQMM_WGMMA_WIDTH", bad);
}

// ChainedLaunchScope: this thread's value while it lives (over the API's), nested scopes restore in
// order, another thread keeps the API's value, and a bad value is refused.
TEST(Settings, ChainedLaunchScopeIsPerThreadAndRestores) {
  const RouteSwitch before = chained_launch_setting();
  set_chained_launch(RouteSwitch::on);
  {
    ChainedLaunchScope off(RouteSwitch::off);
    EXPECT_EQ(chained_launch_setting(), RouteSwitch::off);
    RouteSwitch other = RouteSwitch::automatic;
    std::thread([&] { other = chained_launch_setting(); }).join();
    EXPECT_EQ(other, RouteSwitch::on);
    {
      ChainedLaunchScope on(RouteSwitch::on);
      EXPECT_EQ(chained_launch_setting(), RouteSwitch::on);
    }
    EXPECT_EQ(chained_launch_setting(), RouteSwitch::off);
  }
  EXPECT_EQ(chained_launch_setting(), RouteSwitch::on);
  EXPECT_THROW(ChainedLaunchScope bad(static_cast<RouteSwitch>(3)), Error);
  EXPECT_EQ(chained_launch_setting(), RouteSwitch::on);
  set_chained_launch(before);
}

// Every variable of the table is parsed (a bad value of each is caught), and nothing else is.
TEST(Settings, TableListsEveryVariableAndEachIsValidated) {
  const std::vector<SettingInfo> table = settings_table();
  ASSERT_EQ(table.size(), 12u);
  for (const SettingInfo& row : table) {
    EXPECT_EQ(row.variable.rfind("EXPERTQMM_", 0), 0u) << row.variable;
    EXPECT_FALSE(row.values.empty() || row.current.empty() || row.what.empty()) << row.variable;
    expect_rejected(row.variable, "bogus");
  }
  // A variable outside the table is not read: an unknown EXPERTQMM_ name is no error.
  EXPECT_NO_THROW(parse({{"EXPERTQMM_NOT_A_SETTING", "bogus"}}));
}

// set_setting: a variable's text as the environment would give it, as an API override; nullopt gives
// the decision back to the environment; a bad value or an unknown name is an Error naming it, and
// changes nothing.
TEST(Settings, SetSettingOverridesByVariableName) {
  const RouteSwitch tiles = expert_tiles_setting(), chained = chained_launch_setting();
  const int width = wgmma_width();
  const bool det = deterministic();
  set_setting("EXPERTQMM_EXPERT_TILES", "0");
  EXPECT_EQ(expert_tiles_setting(), RouteSwitch::off);
  set_setting("EXPERTQMM_EXPERT_TILES", "1");
  EXPECT_EQ(expert_tiles_setting(), RouteSwitch::on);
  set_setting("EXPERTQMM_CHAINED_LAUNCH", "0");
  EXPECT_FALSE(chained_launches());
  set_setting("EXPERTQMM_WGMMA_WIDTH", "64");
  EXPECT_EQ(wgmma_width(), 64);
  set_setting("EXPERTQMM_DETERMINISTIC", "1");
  EXPECT_TRUE(deterministic());
  const std::vector<SettingInfo> table = settings_table();
  for (const SettingInfo& row : table)
    if (row.variable == "EXPERTQMM_WGMMA_WIDTH") EXPECT_EQ(row.current, "64");
  try {
    set_setting("EXPERTQMM_EXPERT_TILES", "2");
    ADD_FAILURE() << "accepted EXPERTQMM_EXPERT_TILES=2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("EXPERTQMM_EXPERT_TILES='2'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(expert_tiles_setting(), RouteSwitch::on) << "a bad value must leave the setting as it was";
  try {
    set_setting("EXPERTQMM_NOT_A_SETTING", "1");
    ADD_FAILURE() << "accepted an unknown variable";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("EXPERTQMM_NOT_A_SETTING"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("EXPERTQMM_WGMMA_WIDTH"), std::string::npos) << e.what();
  }
  // Dropping the overrides gives each setting back to the environment (the test's: unset).
  for (const char* v : {"EXPERTQMM_EXPERT_TILES", "EXPERTQMM_CHAINED_LAUNCH", "EXPERTQMM_WGMMA_WIDTH",
                        "EXPERTQMM_DETERMINISTIC"})
    set_setting(v, std::nullopt);
  EXPECT_EQ(expert_tiles_setting(), RouteSwitch::automatic);
  EXPECT_EQ(chained_launch_setting(), RouteSwitch::automatic);
  EXPECT_EQ(wgmma_width(), 0);
  EXPECT_FALSE(deterministic());
  set_expert_tiles(tiles);
  set_chained_launch(chained);
  set_wgmma_width(width);
  set_deterministic(det);
}

// The first bad variable stops the parse, whichever others are fine.
TEST(Settings, OneBadVariableAmongGoodOnesIsReported) {
  try {
    (void)parse({{"EXPERTQMM_EXPERT_TILES", "1"}, {"EXPERTQMM_WGMMA_WIDTH", "7"}, {"EXPERTQMM_DETERMINISTIC", "0"}});
    ADD_FAILURE() << "accepted EXPERTQMM_WGMMA_WIDTH=7";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("EXPERTQMM_WGMMA_WIDTH='7'"), std::string::npos) << e.what();
  }
}

TEST(Settings, ApiOverridesAndRejectsBadValues) {
  const int width_before = wgmma_width();
  set_wgmma_width(64);
  EXPECT_EQ(wgmma_width(), 64);
  EXPECT_THROW(set_wgmma_width(48), Error);
  EXPECT_EQ(wgmma_width(), 64);
  set_wgmma_width(width_before);

  // Each route switch: the set value is in force, a bad one is refused, the old one comes back.
  struct SwitchApi {
    RouteSwitch (*get)();
    void (*set)(RouteSwitch);
    RouteSwitch value;
  };
  const SwitchApi switches[] = {{wgmma_setting, set_wgmma, RouteSwitch::off},
                                {decode_layer_setting, set_decode_layer, RouteSwitch::off},
                                {chained_launch_setting, set_chained_launch, RouteSwitch::on},
                                {decode_down_groups_setting, set_decode_down_groups, RouteSwitch::on}};
  for (const SwitchApi& api : switches) {
    const RouteSwitch before = api.get();
    api.set(api.value);
    EXPECT_EQ(api.get(), api.value);
    EXPECT_THROW(api.set(static_cast<RouteSwitch>(3)), Error);
    api.set(before);
  }

  EXPECT_THROW(set_product_mode(static_cast<ProductMode>(5)), Error);

  // The table shows the value in force.
  set_wgmma_width(128);
  bool found = false;
  for (const SettingInfo& row : settings_table())
    if (row.variable == "EXPERTQMM_WGMMA_WIDTH") found = row.current == "128";
  EXPECT_TRUE(found);
  set_wgmma_width(width_before);
}

// The process environment of the test run is valid (ctest sets none of these), so the checks pass.
TEST(Settings, ProcessEnvironmentIsValidated) {
  EXPECT_NO_THROW(detail::check_settings());
  EXPECT_FALSE(detail::environment_variable("EXPERTQMM_SURELY_UNSET_VARIABLE_FOR_TEST").has_value());
}

}  // namespace
}  // namespace expertqmm

// Route counters: the attempts == hits + sum(fallbacks) invariant under recorded selections and
// folded device retractions, reset(), the API switch, format().
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/route_counters.h"
#include "expertqmm/backend.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "support/test_util.h"

using namespace expertqmm;
using detail::Primitive;

namespace {

// A stand-in for the CUDA side's device counter of retracted plans.
std::atomic<uint64_t> g_fake_device_retractions{0};
std::atomic<int> g_fake_reader_resets{0};
uint64_t fake_reader(bool reset) {
  if (reset) {
    g_fake_reader_resets.fetch_add(1);
    return g_fake_device_retractions.exchange(0);
  }
  return g_fake_device_retractions.load();
}

// Registers the fake reader for one test and unregisters it after, with counters cleared.
struct FakeReaderScope {
  FakeReaderScope() {
    g_fake_device_retractions = 0;
    g_fake_reader_resets = 0;
    detail::set_device_retraction_reader(&fake_reader);
    diagnostics::reset();
  }
  ~FakeReaderScope() {
    detail::set_device_retraction_reader(nullptr);
    diagnostics::reset();
  }
};

RouteCounters gather_qmm_counters() {
  for (const RouteCounters& c : diagnostics::snapshot())
    if (c.primitive == "gather_qmm") return c;
  ADD_FAILURE() << "no gather_qmm row in snapshot()";
  return {};
}

uint64_t fallback(const RouteCounters& c, Fallback f) { return c.fallbacks[static_cast<int>(f)]; }

void expect_invariant(const RouteCounters& c) {
  EXPECT_EQ(c.attempts, c.hits + c.fallback_total()) << diagnostics::format({c});
}

}  // namespace

TEST(Diagnostics, RecordSelectionCountsEachField) {
  diagnostics::reset();
  detail::record_selection(Primitive::gather_qmm, true, true, true, Fallback::disabled);  // why ignored on a hit
  detail::record_selection(Primitive::gather_qmm, true, true, true, Fallback::shape);
  detail::record_selection(Primitive::gather_qmm, false, true, false, Fallback::disabled);
  detail::record_selection(Primitive::gather_qmm, false, false, false, Fallback::disabled);
  detail::record_selection(Primitive::gather_qmm, true, false, false, Fallback::dtype);
  detail::record_selection(Primitive::gather_qmm, true, false, false, Fallback::alignment);
  detail::record_selection(Primitive::gather_qmm, true, true, false, Fallback::sortedness_retracted);
  const RouteCounters c = gather_qmm_counters();
  EXPECT_EQ(c.attempts, 7u);
  EXPECT_EQ(c.requested, 5u);
  EXPECT_EQ(c.available, 4u);
  EXPECT_EQ(c.hits, 2u);
  EXPECT_EQ(fallback(c, Fallback::disabled), 2u);
  EXPECT_EQ(fallback(c, Fallback::dtype), 1u);
  EXPECT_EQ(fallback(c, Fallback::alignment), 1u);
  EXPECT_EQ(fallback(c, Fallback::sortedness_retracted), 1u);
  EXPECT_EQ(fallback(c, Fallback::shape), 0u);
  EXPECT_EQ(c.fallback_total(), 5u);
  expect_invariant(c);
  diagnostics::reset();
}

TEST(Diagnostics, InvalidSelectionsThrowAndCountNothing) {
  diagnostics::reset();
  EXPECT_THROW(detail::record_selection(Primitive::gather_qmm, false, true, true, Fallback::disabled), Error);
  EXPECT_THROW(detail::record_selection(Primitive::gather_qmm, true, false, true, Fallback::disabled), Error);
  EXPECT_THROW(detail::record_selection(Primitive::gather_qmm, true, true, false, Fallback::disabled), Error);
  EXPECT_THROW(detail::record_selection(Primitive::gather_qmm, false, true, false, Fallback::shape), Error);
  EXPECT_THROW(detail::record_selection(Primitive::gather_qmm, true, true, false, Fallback::count_), Error);
  EXPECT_THROW(detail::record_selection(Primitive::count_, true, true, true, Fallback::disabled), Error);
  const RouteCounters c = gather_qmm_counters();
  EXPECT_EQ(c.attempts, 0u);
  EXPECT_EQ(c.requested, 0u);
  EXPECT_EQ(c.available, 0u);
}

TEST(Diagnostics, InvariantUnderRandomSelectionsAndDeviceRetractions) {
  FakeReaderScope scope;
  std::mt19937_64 g(test::test_seed());
  SCOPED_TRACE(test::seed_note());
  uint64_t hits = 0, misses[kFallbackCount] = {}, retractions = 0;
  for (int i = 0; i < 5000; ++i) {
    const bool requested = g() % 5 != 0;
    const bool available = requested ? g() % 4 != 0 : g() % 2 == 0;
    const bool hit = requested && available && g() % 3 != 0;
    Fallback why = Fallback::disabled;
    if (!hit && requested) why = static_cast<Fallback>(1 + g() % (kFallbackCount - 1));
    detail::record_selection(Primitive::gather_qmm, requested, available, hit, why);
    if (hit) {
      ++hits;
      // Some hits are retracted on the device afterwards.
      if (g() % 7 == 0) {
        ++retractions;
        g_fake_device_retractions.fetch_add(1);
      }
    } else {
      ++misses[static_cast<int>(why)];
    }
    if (i % 500 == 0) expect_invariant(gather_qmm_counters());
  }
  const RouteCounters c = gather_qmm_counters();
  expect_invariant(c);
  EXPECT_EQ(c.attempts, 5000u);
  EXPECT_EQ(c.hits, hits - retractions);
  EXPECT_EQ(fallback(c, Fallback::sortedness_retracted),
            misses[static_cast<int>(Fallback::sortedness_retracted)] + retractions);
  for (int f = 0; f < kFallbackCount; ++f)
    if (f != static_cast<int>(Fallback::sortedness_retracted)) {
      EXPECT_EQ(c.fallbacks[f], misses[f]) << f;
    }
  // snapshot() only reads the device counter; a second snapshot gives the same numbers.
  const RouteCounters again = gather_qmm_counters();
  EXPECT_EQ(again.hits, c.hits);
  EXPECT_EQ(fallback(again, Fallback::sortedness_retracted), fallback(c, Fallback::sortedness_retracted));
}

TEST(Diagnostics, RetractionsBeyondHitsAreClamped) {
  FakeReaderScope scope;
  detail::record_selection(Primitive::gather_qmm, true, true, true, Fallback::disabled);
  detail::record_selection(Primitive::gather_qmm, true, false, false, Fallback::shape);
  g_fake_device_retractions = 5;  // e.g. retractions of work queued before a reset()
  const RouteCounters c = gather_qmm_counters();
  EXPECT_EQ(c.hits, 0u);
  EXPECT_EQ(fallback(c, Fallback::sortedness_retracted), 1u);
  EXPECT_EQ(c.attempts, 2u);
  expect_invariant(c);
}

TEST(Diagnostics, ResetClearsHostAndDeviceCounters) {
  FakeReaderScope scope;
  for (int i = 0; i < 3; ++i) detail::record_selection(Primitive::gather_qmm, true, true, true, Fallback::disabled);
  g_fake_device_retractions = 2;
  const int resets_before = g_fake_reader_resets.load();
  diagnostics::reset();
  EXPECT_EQ(g_fake_reader_resets.load(), resets_before + 1);
  EXPECT_EQ(g_fake_device_retractions.load(), 0u);
  const RouteCounters c = gather_qmm_counters();
  EXPECT_EQ(c.attempts, 0u);
  EXPECT_EQ(c.requested, 0u);
  EXPECT_EQ(c.available, 0u);
  EXPECT_EQ(c.hits, 0u);
  EXPECT_EQ(c.fallback_total(), 0u);
}

TEST(Diagnostics, UnregisteredReaderFoldsNothing) {
  diagnostics::reset();
  detail::set_device_retraction_reader(nullptr);
  g_fake_device_retractions = 4;
  detail::record_selection(Primitive::gather_qmm, true, true, true, Fallback::disabled);
  const RouteCounters c = gather_qmm_counters();
  EXPECT_EQ(c.hits, 1u);
  EXPECT_EQ(fallback(c, Fallback::sortedness_retracted), 0u);
  diagnostics::reset();
}

TEST(Diagnostics, ApiSwitchOverridesTheSetting) {
  const RouteSwitch before = expert_tiles_setting();  // the env value (unset in a plain test run)
  set_expert_tiles(RouteSwitch::on);
  EXPECT_EQ(expert_tiles_setting(), RouteSwitch::on);
  set_expert_tiles(RouteSwitch::off);
  EXPECT_EQ(expert_tiles_setting(), RouteSwitch::off);
  set_expert_tiles(RouteSwitch::automatic);
  EXPECT_EQ(expert_tiles_setting(), RouteSwitch::automatic);
  EXPECT_THROW(set_expert_tiles(static_cast<RouteSwitch>(7)), Error);
  EXPECT_EQ(expert_tiles_setting(), RouteSwitch::automatic);
  set_expert_tiles(before);
}

TEST(Diagnostics, FallbackNames) {
  EXPECT_STREQ(fallback_name(Fallback::disabled), "disabled");
  EXPECT_STREQ(fallback_name(Fallback::dtype), "dtype");
  EXPECT_STREQ(fallback_name(Fallback::quantization), "quantization");
  EXPECT_STREQ(fallback_name(Fallback::topology), "topology");
  EXPECT_STREQ(fallback_name(Fallback::shape), "shape");
  EXPECT_STREQ(fallback_name(Fallback::alignment), "alignment");
  EXPECT_STREQ(fallback_name(Fallback::sortedness_retracted), "sortedness_retracted");
  EXPECT_THROW(fallback_name(Fallback::count_), Error);
  EXPECT_STREQ(detail::primitive_name(Primitive::gather_qmm), "gather_qmm");
}

TEST(Diagnostics, FormatIsATableOfEveryCounter) {
  RouteCounters c;
  c.primitive = "gather_qmm";
  c.requested = 11;
  c.available = 9;
  c.hits = 7;
  c.fallbacks[static_cast<int>(Fallback::disabled)] = 1;
  c.fallbacks[static_cast<int>(Fallback::alignment)] = 2;
  c.fallbacks[static_cast<int>(Fallback::sortedness_retracted)] = 12345;
  c.attempts = c.hits + c.fallback_total();
  const std::string table = diagnostics::format({c});

  std::istringstream lines(table);
  std::string header, row, extra;
  ASSERT_TRUE(std::getline(lines, header));
  ASSERT_TRUE(std::getline(lines, row));
  EXPECT_FALSE(std::getline(lines, extra)) << table;

  auto tokens = [](const std::string& s) {
    std::istringstream in(s);
    std::vector<std::string> out;
    for (std::string t; in >> t;) out.push_back(t);
    return out;
  };
  std::vector<std::string> want_header = {"primitive", "attempts", "requested", "available", "hits", "|"};
  for (int f = 0; f < kFallbackCount; ++f) want_header.push_back(fallback_name(static_cast<Fallback>(f)));
  EXPECT_EQ(tokens(header), want_header) << table;
  const std::vector<std::string> want_row = {"gather_qmm", "12355", "11", "9", "7", "|", "1", "0", "0", "0", "0", "2",
                                             "12345"};
  EXPECT_EQ(tokens(row), want_row) << table;
  // Columns line up: every value ends where its header ends.
  EXPECT_EQ(header.size(), row.size()) << table;

  // A live snapshot formats one row per primitive.
  const std::string live = diagnostics::format(diagnostics::snapshot());
  EXPECT_NE(live.find("gather_qmm"), std::string::npos) << live;
}

// The process-wide switches of include/expertqmm/backend.h: what the API sets is what the CUDA
// paths read next (the environment only gives the starting value).
TEST(Diagnostics, DeterministicAndProductModeSwitchesRoundTrip) {
  const bool saved_deterministic = deterministic();
  const ProductMode saved_mode = product_mode();
  set_deterministic(true);
  EXPECT_TRUE(deterministic());
  set_deterministic(false);
  EXPECT_FALSE(deterministic());
  set_product_mode(ProductMode::separate);
  EXPECT_EQ(product_mode(), ProductMode::separate);
  set_product_mode(ProductMode::fused);
  EXPECT_EQ(product_mode(), ProductMode::fused);
  set_deterministic(saved_deterministic);
  set_product_mode(saved_mode);
}

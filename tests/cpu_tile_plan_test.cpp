// The CPU tile plan builder and the plan checker: exhaustive small cases, random (E, counts) fuzz,
// edge cases, retraction, limits, and checker mutations (so a wrong plan cannot pass unnoticed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "core/tile_plan.h"
#include "expertqmm/error.h"
#include "support/test_util.h"

using namespace expertqmm;
using detail::ExpertTile;
using detail::TilePlan;

namespace {

bool operator==(const ExpertTile& a, const ExpertTile& b) {
  return a.expert == b.expert && a.row_begin == b.row_begin && a.rows == b.rows && a.bm == b.bm;
}

std::vector<int32_t> ids_from_counts(const std::vector<int64_t>& counts) {
  std::vector<int32_t> ids;
  for (size_t e = 0; e < counts.size(); ++e) ids.insert(ids.end(), counts[e], static_cast<int32_t>(e));
  return ids;
}

// Checks a built plan against the ids with counts computed here, independently of the builder and of
// tile_plan_violation: per-row coverage, per-expert tile counts, the class of every tile (full tiles
// of 128 rows are bm 128; a tail of r = c % 128 rows is bm 16 for r <= 16, 32 for r <= 32, 64 for
// r <= 64, else 128).
void expect_valid_plan(const TilePlan& plan, const std::vector<int32_t>& ids, int E, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t n = static_cast<int64_t>(ids.size());
  ASSERT_FALSE(plan.retracted());
  ASSERT_EQ(detail::tile_plan_violation(plan.tiles.data(), plan.tiles.size(), ids.data(), n, E), "");
  std::vector<int64_t> count(E, 0);
  for (int32_t id : ids) ++count[id];
  std::vector<int64_t> tiles_of(E, 0), bm16_of(E, 0), bm32_of(E, 0), bm64_of(E, 0), bm128_of(E, 0), rows_of(E, 0);
  std::vector<int> covered(n, 0);
  for (const ExpertTile& t : plan.tiles) {
    ASSERT_GE(t.expert, 0);
    ASSERT_LT(t.expert, E);
    ASSERT_GE(t.rows, 1);
    ASSERT_LE(t.rows, 128);
    ASSERT_TRUE(t.bm == 16 || t.bm == 32 || t.bm == 64 || t.bm == 128) << "bm " << t.bm;
    ASSERT_LE(t.rows, t.bm);
    if (t.bm > 16) {
      ASSERT_GT(t.rows, t.bm / 2) << "a tile of " << t.rows << " rows belongs to a smaller class than bm " << t.bm;
    }
    ++tiles_of[t.expert];
    bm16_of[t.expert] += t.bm == 16;
    bm32_of[t.expert] += t.bm == 32;
    bm64_of[t.expert] += t.bm == 64;
    bm128_of[t.expert] += t.bm == 128;
    rows_of[t.expert] += t.rows;
    for (int64_t r = t.row_begin; r < t.row_begin + t.rows; ++r) {
      ASSERT_EQ(ids[r], t.expert) << "row " << r;
      ++covered[r];
    }
  }
  for (int64_t r = 0; r < n; ++r) ASSERT_EQ(covered[r], 1) << "row " << r;
  for (int e = 0; e < E; ++e) {
    ASSERT_EQ(rows_of[e], count[e]) << "expert " << e;
    ASSERT_EQ(tiles_of[e], count[e] / 128 + (count[e] % 128 != 0)) << "expert " << e;
    const int64_t tail = count[e] % 128;
    ASSERT_EQ(bm16_of[e], (tail > 0 && tail <= 16) ? 1 : 0) << "expert " << e;
    ASSERT_EQ(bm32_of[e], (tail > 16 && tail <= 32) ? 1 : 0) << "expert " << e;
    ASSERT_EQ(bm64_of[e], (tail > 32 && tail <= 64) ? 1 : 0) << "expert " << e;
    ASSERT_EQ(bm128_of[e], count[e] / 128 + (tail > 64 ? 1 : 0)) << "expert " << e;
  }
  for (size_t i = 1; i < plan.tiles.size(); ++i) {
    const ExpertTile& a = plan.tiles[i - 1];
    const ExpertTile& b = plan.tiles[i];
    ASSERT_TRUE(a.expert < b.expert || (a.expert == b.expert && a.row_begin < b.row_begin)) << "tile " << i;
  }
  ASSERT_LE(static_cast<int64_t>(plan.tiles.size()), detail::max_tiles(n, E));
  const detail::TilePlanHeader h = plan.header();
  EXPECT_EQ(h.tile_count, static_cast<int32_t>(plan.tiles.size()));
  EXPECT_EQ(h.sorted, 1);
  EXPECT_EQ(h.retract_reasons, 0);
}

std::string str(const std::vector<int32_t>& v) {
  std::string s;
  for (int32_t x : v) s += std::to_string(x) + " ";
  return s;
}

}  // namespace

TEST(TilePlan, TileClassRule) {
  for (int32_t rows = 1; rows <= 128; ++rows)
    EXPECT_EQ(detail::tile_bm_for_rows(rows), rows <= 16 ? 16 : rows <= 32 ? 32 : rows <= 64 ? 64 : 128)
        << "rows " << rows;
  EXPECT_EQ(detail::tile_bm_for_rows(0), 0);
  EXPECT_EQ(detail::tile_bm_for_rows(129), 0);
  EXPECT_EQ(detail::tile_bm_for_rows(-1), 0);
  EXPECT_EQ(detail::kTileRowsFull, 128);
}

TEST(TilePlan, HandWrittenPlan) {
  const std::vector<int32_t> ids = ids_from_counts({0, 33, 16, 17, 0, 64, 1, 129, 96, 112});
  const TilePlan plan = detail::build_tile_plan(ids.data(), ids.size(), 10);
  const std::vector<ExpertTile> expected = {
      {1, 0, 33, 64},     {2, 33, 16, 16},  {3, 49, 17, 32},    {5, 66, 64, 64},   {6, 130, 1, 16},
      {7, 131, 128, 128}, {7, 259, 1, 16},  {8, 260, 96, 128},  {9, 356, 112, 128}};
  ASSERT_EQ(ids.size(), 468u);
  ASSERT_EQ(plan.tiles.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_TRUE(plan.tiles[i] == expected[i]) << "tile " << i;
  expect_valid_plan(plan, ids, 10, "hand-written");
}

TEST(TilePlan, EveryIdSequenceOfSmallSizes) {
  // Ids drawn from [-1, E] (both ends out of range), every sequence of length 0..6.
  int64_t plans = 0;
  for (int E = 1; E <= 3; ++E) {
    const int symbols = E + 2;
    for (int n = 0; n <= 6; ++n) {
      int64_t total = 1;
      for (int i = 0; i < n; ++i) total *= symbols;
      std::vector<int32_t> ids(n);
      for (int64_t code = 0; code < total; ++code) {
        int64_t c = code;
        for (int i = 0; i < n; ++i, c /= symbols) ids[i] = static_cast<int32_t>(c % symbols) - 1;
        bool unsorted = false, out_of_range = false;
        for (int i = 0; i < n; ++i) {
          out_of_range |= ids[i] < 0 || ids[i] >= E;
          if (i + 1 < n) unsorted |= ids[i] > ids[i + 1];
        }
        const TilePlan plan = detail::build_tile_plan(ids.data(), n, E);
        ASSERT_EQ(plan.unsorted, unsorted) << str(ids);
        ASSERT_EQ(plan.out_of_range, out_of_range) << str(ids);
        if (unsorted || out_of_range) {
          ASSERT_TRUE(plan.tiles.empty()) << str(ids);
          ASSERT_EQ(plan.header().sorted, 0);
          ASSERT_EQ(plan.header().tile_count, 0);
          ASSERT_EQ(plan.header().retract_reasons,
                    (unsorted ? detail::kPlanUnsorted : 0) | (out_of_range ? detail::kPlanOutOfRange : 0));
        } else {
          expect_valid_plan(plan, ids, E, str(ids));
        }
        ++plans;
      }
    }
  }
  EXPECT_GT(plans, 20000);
}

TEST(TilePlan, EveryCountPairUpTo200) {
  for (int64_t a = 0; a <= 200; ++a)
    for (int64_t b = 0; b <= 200; ++b) {
      const std::vector<int32_t> ids = ids_from_counts({a, b});
      expect_valid_plan(detail::build_tile_plan(ids.data(), ids.size(), 2), ids, 2,
                        "counts " + std::to_string(a) + "," + std::to_string(b));
    }
}

TEST(TilePlan, CountsAroundTileBoundaries) {
  const std::vector<int64_t> edges = {0,  1,  15, 16, 17, 31, 32,  33,  47,  48,  49,  63,
                                      64, 65, 80, 81, 96, 97, 127, 128, 129, 144, 160, 161};
  for (int64_t a : edges)
    for (int64_t b : edges)
      for (int64_t c : edges) {
        const std::vector<int32_t> ids = ids_from_counts({a, 0, b, c});
        expect_valid_plan(detail::build_tile_plan(ids.data(), ids.size(), 4), ids, 4,
                          "counts " + std::to_string(a) + ",0," + std::to_string(b) + "," + std::to_string(c));
      }
}

TEST(TilePlan, RandomExpertCountsFuzz) {
  std::mt19937_64 g(test::test_seed());
  SCOPED_TRACE(test::seed_note());
  for (int iter = 0; iter < 400; ++iter) {
    const int E = std::uniform_int_distribution<int>(1, iter % 4 == 0 ? 4096 : 160)(g);
    std::vector<int64_t> counts(E, 0);
    const int shape = iter % 3;
    for (int e = 0; e < E; ++e) {
      if (shape == 0) counts[e] = std::uniform_int_distribution<int64_t>(0, 200)(g);       // uniform
      else if (shape == 1) counts[e] = (g() % 4 == 0) ? std::uniform_int_distribution<int64_t>(0, 300)(g) : 0;  // sparse
      else counts[e] = static_cast<int64_t>(2000.0 / (1.0 + e)) * (g() % 2);                // Zipf-like
    }
    const std::vector<int32_t> ids = ids_from_counts(counts);
    expect_valid_plan(detail::build_tile_plan(ids.data(), ids.size(), E), ids, E,
                      "iter " + std::to_string(iter) + " E=" + std::to_string(E) + " n=" + std::to_string(ids.size()));
  }
}

TEST(TilePlan, EmptyInputAndEmptyExperts) {
  const TilePlan empty = detail::build_tile_plan(nullptr, 0, 128);
  EXPECT_TRUE(empty.tiles.empty());
  EXPECT_FALSE(empty.retracted());
  EXPECT_EQ(empty.header().sorted, 1);
  EXPECT_EQ(empty.header().tile_count, 0);

  // Only the last of 128 experts has rows.
  std::vector<int64_t> counts(128, 0);
  counts[127] = 5;
  const std::vector<int32_t> ids = ids_from_counts(counts);
  const TilePlan plan = detail::build_tile_plan(ids.data(), ids.size(), 128);
  ASSERT_EQ(plan.tiles.size(), 1u);
  EXPECT_TRUE(plan.tiles[0] == (ExpertTile{127, 0, 5, 16}));
}

TEST(TilePlan, OneExpertOwnsEveryRow) {
  std::vector<int32_t> ids(16384 + 20, 77);
  const TilePlan plan = detail::build_tile_plan(ids.data(), ids.size(), 128);
  ASSERT_EQ(plan.tiles.size(), 129u);
  EXPECT_TRUE(plan.tiles.back() == (ExpertTile{77, 16384, 20, 32}));
  expect_valid_plan(plan, ids, 128, "one expert");
  ids.resize(16384 + 40, 77);
  const TilePlan wide_tail = detail::build_tile_plan(ids.data(), ids.size(), 128);
  ASSERT_EQ(wide_tail.tiles.size(), 129u);
  EXPECT_TRUE(wide_tail.tiles.back() == (ExpertTile{77, 16384, 40, 64}));
  expect_valid_plan(wide_tail, ids, 128, "one expert, 40-row tail");
}

TEST(TilePlan, SingleExpert) {
  for (int64_t n : {1, 16, 17, 32, 33, 48, 49, 63, 64, 65, 96, 97, 128, 129, 1000}) {
    const std::vector<int32_t> ids(n, 0);
    const TilePlan plan = detail::build_tile_plan(ids.data(), n, 1);
    EXPECT_EQ(static_cast<int64_t>(plan.tiles.size()), (n + 127) / 128);
    expect_valid_plan(plan, ids, 1, "E=1 n=" + std::to_string(n));
  }
}

TEST(TilePlan, UnsortedInputIsRetracted) {
  const std::vector<int32_t> ids = {0, 0, 1, 2, 2, 1, 3};
  const TilePlan plan = detail::build_tile_plan(ids.data(), ids.size(), 4);
  EXPECT_TRUE(plan.unsorted);
  EXPECT_FALSE(plan.out_of_range);
  EXPECT_TRUE(plan.tiles.empty());
  EXPECT_EQ(plan.header().sorted, 0);
  EXPECT_EQ(plan.header().retract_reasons, detail::kPlanUnsorted);
  // A single inversion at the very end is found too.
  std::vector<int32_t> late(5000, 3);
  late.back() = 2;
  EXPECT_TRUE(detail::build_tile_plan(late.data(), late.size(), 4).unsorted);
}

TEST(TilePlan, OutOfRangeIdsAreRetracted) {
  for (int32_t bad : {-1, 4, 1000, INT32_MIN, INT32_MAX}) {
    std::vector<int32_t> ids = {0, 1, 2, 3};
    if (bad < 0) ids.front() = bad; else ids.back() = bad;  // keep them sorted
    const TilePlan plan = detail::build_tile_plan(ids.data(), ids.size(), 4);
    EXPECT_TRUE(plan.out_of_range) << bad;
    EXPECT_FALSE(plan.unsorted) << bad;
    EXPECT_TRUE(plan.tiles.empty());
    EXPECT_EQ(plan.header().retract_reasons, detail::kPlanOutOfRange);
  }
  const std::vector<int32_t> both = {3, 9, 1};
  const TilePlan plan = detail::build_tile_plan(both.data(), both.size(), 4);
  EXPECT_EQ(plan.header().retract_reasons, detail::kPlanUnsorted | detail::kPlanOutOfRange);
}

TEST(TilePlan, LimitsThrow) {
  const std::vector<int32_t> ids = {0, 1};
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no Error; expected one mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { detail::build_tile_plan(ids.data(), -1, 4); }, "n=-1");
  expect_error([&] { detail::build_tile_plan(ids.data(), int64_t{1} << 31, 4); }, "n=2147483648");
  expect_error([&] { detail::build_tile_plan(ids.data(), 2, 0); }, "E=0");
  expect_error([&] { detail::build_tile_plan(ids.data(), 2, 4097); }, "E=4097");
  expect_error([&] { detail::build_tile_plan(nullptr, 2, 4); }, "ids is null");
  expect_error([&] { detail::build_tile_plan(ids.data(), 2, -3); }, "build_tile_plan");
  expect_error([&] { detail::max_tiles(-5, 4); }, "n=-5");
  expect_error([&] { detail::max_tiles(10, 5000); }, "E=5000");
  EXPECT_NO_THROW(detail::build_tile_plan(ids.data(), 2, 4096));
  EXPECT_EQ(detail::max_tiles(INT32_MAX, 4096), INT32_MAX / 128 + 4096);
  EXPECT_EQ(detail::max_tiles(16384, 128), 128 + 128);
  EXPECT_EQ(detail::max_tiles(3, 128), 3);
  EXPECT_EQ(detail::max_tiles(0, 1), 0);
}

TEST(TilePlan, MaxTilesIsReached) {
  // Two experts of one row each: 2 tiles == floor(2/128) + min(2, 2).
  const std::vector<int32_t> ids = {0, 1};
  EXPECT_EQ(static_cast<int64_t>(detail::build_tile_plan(ids.data(), 2, 2).tiles.size()), detail::max_tiles(2, 2));
  // With full tiles too: three experts of 129 rows, 6 tiles == floor(387/128) + min(387, 3).
  const std::vector<int32_t> full = ids_from_counts({129, 129, 129});
  EXPECT_EQ(static_cast<int64_t>(detail::build_tile_plan(full.data(), full.size(), 3).tiles.size()),
            detail::max_tiles(full.size(), 3));
  EXPECT_EQ(detail::max_tiles(full.size(), 3), 6);
}

TEST(TilePlan, CheckerRejectsCorruptedPlans) {
  // Tiles: {0,0,128,128} {0,128,100,128} {2,228,17,32} {3,245,16,16} {4,261,64,64} {5,325,40,64}.
  const std::vector<int32_t> ids = ids_from_counts({228, 0, 17, 16, 64, 40});
  const int E = 6;
  const std::vector<ExpertTile> good = detail::build_tile_plan(ids.data(), ids.size(), E).tiles;
  ASSERT_EQ(good.size(), 6u);
  ASSERT_TRUE(good[1] == (ExpertTile{0, 128, 100, 128}));
  ASSERT_TRUE(good[5] == (ExpertTile{5, 325, 40, 64}));
  ASSERT_EQ(detail::tile_plan_violation(good.data(), good.size(), ids.data(), ids.size(), E), "");
  const std::vector<std::pair<std::string, std::function<void(std::vector<ExpertTile>&)>>> mutations = {
      {"drop first", [](auto& t) { t.erase(t.begin()); }},
      {"drop last", [](auto& t) { t.pop_back(); }},
      {"duplicate", [](auto& t) { const ExpertTile copy = t[1]; t.insert(t.begin() + 1, copy); }},
      {"bm 16 tail as 32", [](auto& t) { t[3].bm = 32; }},
      {"bm 32 tail as 16", [](auto& t) { t[2].bm = 16; }},
      {"bm 32 tail as 64", [](auto& t) { t[2].bm = 64; }},
      {"bm 64 tail as 32", [](auto& t) { t[5].bm = 32; }},
      {"bm of a full tile", [](auto& t) { t[0].bm = 32; }},
      {"rows over 128", [](auto& t) {
         t[0].rows = 228;
         t.erase(t.begin() + 1);
       }},
      {"rows too many", [](auto& t) { t[1].rows += 1; }},
      {"rows zero", [](auto& t) { t[1].rows = 0; }},
      {"row_begin shifted", [](auto& t) { t[2].row_begin += 1; }},
      {"wrong expert", [](auto& t) { t[2].expert = 3; }},
      {"expert out of range", [](auto& t) { t.back().expert = E; }},
      {"swapped", [](auto& t) { std::swap(t[1], t[2]); }},
      {"full tile split 32+32", [](auto& t) {
         t[0] = ExpertTile{0, 0, 32, 32};
         t.insert(t.begin() + 1, ExpertTile{0, 32, 32, 32});
       }},
      {"tail split 32+8", [](auto& t) {
         t[5] = ExpertTile{5, 325, 32, 32};
         t.push_back(ExpertTile{5, 357, 8, 16});
       }},
      {"the old 64-row plan", [](auto& t) {
         t[0] = ExpertTile{0, 0, 64, 64};
         t.insert(t.begin() + 1, ExpertTile{0, 64, 64, 64});
       }},
      {"the old 32-row plan", [](auto& t) {
         t[0] = ExpertTile{0, 0, 32, 32};
         t[1] = ExpertTile{0, 32, 32, 32};
         t.insert(t.begin() + 2, {ExpertTile{0, 64, 32, 32}, ExpertTile{0, 96, 4, 16}});
       }},
  };
  for (const auto& [name, mutate] : mutations) {
    std::vector<ExpertTile> bad = good;
    mutate(bad);
    EXPECT_NE(detail::tile_plan_violation(bad.data(), bad.size(), ids.data(), ids.size(), E), "") << name;
  }
  EXPECT_NE(detail::tile_plan_violation(good.data(), detail::max_tiles(ids.size(), E) + 1, ids.data(), ids.size(), E),
            "");
  // A plan cannot be valid for unsorted ids, whatever its tiles.
  const std::vector<int32_t> unsorted = {1, 0};
  const std::vector<ExpertTile> as_runs = {{1, 0, 1, 16}, {0, 1, 1, 16}};
  EXPECT_NE(detail::tile_plan_violation(as_runs.data(), 2, unsorted.data(), 2, 2), "");
}

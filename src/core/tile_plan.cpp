#include "core/tile_plan.h"

#include <algorithm>

#include "expertqmm/error.h"

namespace expertqmm::detail {

namespace {
void check_limits(const char* op, int64_t n, int E) {
  EXPERTQMM_CHECK(n >= 0 && n <= kTilePlanMaxRows, op, "row count n=", n, " outside [0, ", kTilePlanMaxRows,
                  "]");
  EXPERTQMM_CHECK(E >= 1 && E <= kTilePlanMaxExperts, op, "expert count E=", E, " outside [1, ",
                  kTilePlanMaxExperts, "]");
}

int32_t tile_rows(int64_t remaining) {
  return static_cast<int32_t>(std::min<int64_t>(remaining, kTileRowsFull));
}
}  // namespace

int64_t max_tiles(int64_t n, int E) {
  check_limits("tile_plan", n, E);
  return n / kTileRowsFull + std::min<int64_t>(n, E);
}

void check_tile_plan_args(const char* op, const int32_t* ids, int64_t n, int E) {
  check_limits(op, n, E);
  EXPERTQMM_CHECK(ids != nullptr || n == 0, op, "ids is null with n=", n);
}

TilePlanHeader TilePlan::header() const {
  TilePlanHeader h{};
  h.tile_count = static_cast<int32_t>(tiles.size());
  h.sorted = retracted() ? 0 : 1;
  h.retract_reasons = (unsorted ? kPlanUnsorted : 0) | (out_of_range ? kPlanOutOfRange : 0);
  return h;
}

TilePlan build_tile_plan(const int32_t* ids, int64_t n, int E) {
  check_tile_plan_args("build_tile_plan", ids, n, E);
  TilePlan plan;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= E) plan.out_of_range = true;
    if (i + 1 < n && ids[i] > ids[i + 1]) plan.unsorted = true;
  }
  if (plan.retracted()) return plan;

  // Each run of equal ids is one expert's rows: full 64-row tiles, then one tile for the rest, in
  // the class of its row count.
  plan.tiles.reserve(static_cast<size_t>(max_tiles(n, E)));
  for (int64_t run_begin = 0; run_begin < n;) {
    const int32_t expert = ids[run_begin];
    int64_t run_end = run_begin + 1;
    while (run_end < n && ids[run_end] == expert) ++run_end;
    for (int64_t row = run_begin; row < run_end; row += kTileRowsFull) {
      const int32_t rows = tile_rows(run_end - row);
      plan.tiles.push_back(ExpertTile{expert, static_cast<int32_t>(row), rows, tile_bm_for_rows(rows)});
    }
    run_begin = run_end;
  }
  return plan;
}

std::string tile_plan_violation(const ExpertTile* tiles, int64_t tile_count, const int32_t* ids, int64_t n,
                                int E) {
  using detail::cat;
  check_tile_plan_args("tile_plan_violation", ids, n, E);
  if (tile_count < 0 || tile_count > max_tiles(n, E))
    return cat("tile_count ", tile_count, " outside [0, max_tiles(", n, ", ", E, ") = ", max_tiles(n, E), "]");
  if (tile_count > 0 && tiles == nullptr) return cat("tiles is null with tile_count ", tile_count);

  int64_t next_row = 0;  // tiles must cover [0, n) in order, so each starts where the last ended
  for (int64_t t = 0; t < tile_count; ++t) {
    const ExpertTile& tile = tiles[t];
    const std::string at = cat("tile ", t, " {expert ", tile.expert, ", row_begin ", tile.row_begin, ", rows ",
                               tile.rows, ", bm ", tile.bm, "}: ");
    if (tile.expert < 0 || tile.expert >= E) return at + cat("expert outside [0, ", E, ")");
    if (tile.rows < 1 || tile.rows > kTileRowsFull) return at + cat("rows outside [1, ", kTileRowsFull, "]");
    if (tile.bm != tile_bm_for_rows(tile.rows)) return at + cat("bm should be ", tile_bm_for_rows(tile.rows));
    if (tile.row_begin != next_row) return at + cat("expected row_begin ", next_row, " (gap or overlap)");
    if (tile.row_begin + static_cast<int64_t>(tile.rows) > n) return at + cat("runs past n=", n);
    for (int64_t r = tile.row_begin; r < tile.row_begin + tile.rows; ++r)
      if (ids[r] != tile.expert) return at + cat("row ", r, " has id ", ids[r]);
    // A short tile must end its expert's rows: otherwise the expert got more tiles than ceil(c/kTileRowsFull).
    const int64_t end = tile.row_begin + tile.rows;
    if (tile.rows < kTileRowsFull && end < n && ids[end] == tile.expert)
      return at + cat("short tile but row ", end, " is the same expert");
    if (t > 0 && tiles[t - 1].expert > tile.expert) return at + "experts out of order";
    next_row = end;
  }
  if (next_row != n) return cat("tiles cover rows [0, ", next_row, ") of n=", n);
  return "";
}

}  // namespace expertqmm::detail

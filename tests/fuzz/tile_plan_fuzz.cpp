// libFuzzer entry: builds a tile plan from fuzzer bytes and aborts on any broken invariant.
// Input: byte 0 picks the mode, bytes 1-2 give E = 1 + (u16 % 4096), the rest are the ids:
//   even mode: (expert step, row count) byte pairs -> sorted, in-range ids; the plan must be valid
//   odd mode:  little-endian int16 pairs mapped to ids in [-1, E] -> mostly unsorted or out of range;
//              the plan must be retracted exactly when an independent scan says so
// Build: clang++ -std=c++17 -fsanitize=fuzzer,address,undefined -Iinclude -Isrc \
//        tests/fuzz/tile_plan_fuzz.cpp src/core/tile_plan.cpp
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/tile_plan.h"
#include "expertqmm/error.h"

namespace {

[[noreturn]] void fail(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "tile_plan_fuzz: %s %s\n", what, detail.c_str());
  std::abort();
}

void check_plan(const std::vector<int32_t>& ids, int E) {
  using namespace expertqmm::detail;
  const int64_t n = static_cast<int64_t>(ids.size());
  bool unsorted = false, out_of_range = false;
  for (int64_t i = 0; i < n; ++i) {
    out_of_range |= ids[i] < 0 || ids[i] >= E;
    if (i + 1 < n) unsorted |= ids[i] > ids[i + 1];
  }
  const TilePlan plan = build_tile_plan(ids.data(), n, E);
  if (plan.unsorted != unsorted) fail("unsorted flag wrong");
  if (plan.out_of_range != out_of_range) fail("out_of_range flag wrong");
  const TilePlanHeader h = plan.header();
  if (plan.retracted()) {
    if (!plan.tiles.empty() || h.tile_count != 0 || h.sorted != 0 || h.retract_reasons == 0)
      fail("retracted plan has tiles or a wrong header");
    return;
  }
  if (h.sorted != 1 || h.retract_reasons != 0 || h.tile_count != static_cast<int32_t>(plan.tiles.size()))
    fail("valid plan has a wrong header");
  const std::string violation = tile_plan_violation(plan.tiles.data(), plan.tiles.size(), ids.data(), n, E);
  if (!violation.empty()) fail("invalid plan:", violation);
  // Independent of the checker: an expert with c rows has c / 128 full tiles of bm 128, then for
  // the tail r = c % 128 one tile of bm 16 (r <= 16), 32 (r <= 32), 64 (r <= 64) or 128, and every
  // tile has <= bm rows.
  std::vector<int64_t> rows(E, 0), tiles(E, 0), bm16(E, 0), bm32(E, 0), bm64(E, 0), bm128(E, 0);
  for (int32_t id : ids) ++rows[id];
  for (const ExpertTile& t : plan.tiles) {
    if (t.rows < 1 || t.rows > 128 || t.rows > t.bm) fail("tile rows outside [1, min(128, bm)]");
    ++tiles[t.expert];
    bm16[t.expert] += t.bm == 16;
    bm32[t.expert] += t.bm == 32;
    bm64[t.expert] += t.bm == 64;
    bm128[t.expert] += t.bm == 128;
  }
  for (int e = 0; e < E; ++e) {
    const int64_t tail = rows[e] % 128;
    if (tiles[e] != (rows[e] + 127) / 128) fail("wrong tile count for expert", std::to_string(e));
    if (bm16[e] != (tail > 0 && tail <= 16) || bm32[e] != (tail > 16 && tail <= 32) ||
        bm64[e] != (tail > 32 && tail <= 64) || bm128[e] != rows[e] / 128 + (tail > 64))
      fail("wrong tile classes for expert", std::to_string(e));
  }
  if (static_cast<int64_t>(plan.tiles.size()) > max_tiles(n, E)) fail("more tiles than max_tiles");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const uint8_t mode = data[0];
  const int E = 1 + (data[1] | (data[2] << 8)) % expertqmm::detail::kTilePlanMaxExperts;
  data += 3;
  size -= 3;
  std::vector<int32_t> ids;
  if (mode % 2 == 0) {
    // Row counts are scaled by (mode / 2 % 4 + 1) so long runs (many full tiles) show up too.
    const int scale = mode / 2 % 4 + 1;
    int64_t expert = 0;
    for (size_t i = 0; i + 1 < size; i += 2) {
      expert += data[i] % 8;
      if (expert >= E) break;
      ids.insert(ids.end(), static_cast<size_t>(data[i + 1]) * scale, static_cast<int32_t>(expert));
    }
  } else {
    for (size_t i = 0; i + 1 < size; i += 2) {
      const int v = data[i] | (data[i + 1] << 8);
      ids.push_back(v % (E + 2) - 1);
    }
  }
  try {
    check_plan(ids, E);
  } catch (const expertqmm::Error& e) {
    fail("unexpected Error:", e.what());
  }
  return 0;
}

// The expert tile plan: sorted per-row expert ids cut into row tiles that each belong to exactly one
// expert. Built on the device by src/cuda/tile_plan.cu for the expert_tiles route; the CPU builder
// here is the reference the GPU plan is tested against. Format and algorithm: docs/design.md
// ("Tile plan").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace expertqmm::detail {

constexpr int kTileRowsFull = 32;      // BM of a full tile
constexpr int kTileRowsShort = 16;     // BM of a tail tile holding at most 16 rows
constexpr int kTilePlanMaxExperts = 4096;
constexpr int64_t kTilePlanMaxRows = INT32_MAX;

// One tile: rows [row_begin, row_begin + rows) of the sorted rows, all routed to `expert`.
// rows is in [1, 32]; bm (the GEMM's row-tile class) is 16 when rows <= 16, else 32.
struct ExpertTile {
  int32_t expert;
  int32_t row_begin;
  int32_t rows;
  int32_t bm;
};
static_assert(sizeof(ExpertTile) == 16, "ExpertTile is a 16-byte POD shared with device code");

// Why a plan was retracted (bit flags in TilePlanHeader::retract_reasons).
enum TilePlanRetraction : int32_t {
  kPlanUnsorted = 1,    // some ids[i] > ids[i + 1]
  kPlanOutOfRange = 2,  // some id outside [0, E)
};

struct TilePlanHeader {
  int32_t tile_count;       // tiles written; 0 when retracted
  int32_t sorted;           // 1: plan valid; 0: retracted (ids unsorted or out of range)
  int32_t retract_reasons;  // TilePlanRetraction bits; 0 when valid
};

// Upper bound on the tile count of any valid plan of n rows over E experts (sizes tile buffers):
// each expert with c rows has ceil(c/32) tiles, so the sum is <= floor(n/32) + min(n, E).
// Throws Error("tile_plan", ...) when n or E is outside the limits.
int64_t max_tiles(int64_t n, int E);

// Validates the builder arguments (shared by the CPU and GPU builders); `op` names the caller.
void check_tile_plan_args(const char* op, const int32_t* ids, int64_t n, int E);

struct TilePlan {
  std::vector<ExpertTile> tiles;  // ordered by expert, then row; empty when retracted
  bool unsorted = false;          // some ids[i] > ids[i + 1]
  bool out_of_range = false;      // some id outside [0, E)
  bool retracted() const { return unsorted || out_of_range; }
  TilePlanHeader header() const;  // what the GPU builder writes for the same ids
};

// The reference builder. ids: int32 [n], one expert id per sorted row. A plan whose ids are not
// non-decreasing or not all in [0, E) is retracted (no tiles). Throws Error("build_tile_plan", ...)
// for n < 0, n > 2^31 - 1, E outside [1, 4096], or ids == nullptr with n > 0.
TilePlan build_tile_plan(const int32_t* ids, int64_t n, int E);

// Checks a non-retracted plan against ids from first principles (not through the builder): every row
// covered once and in order, each tile one expert matching ids, rows in [1, 32], bm == 16 exactly
// when rows <= 16, only an expert's last tile short, at most max_tiles(n, E) tiles. Returns "" when
// the plan is valid, else a description of the first violation.
std::string tile_plan_violation(const ExpertTile* tiles, int64_t tile_count, const int32_t* ids, int64_t n,
                                int E);

}  // namespace expertqmm::detail

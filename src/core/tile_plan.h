// The expert tile plan: sorted per-row expert ids cut into row tiles that each belong to exactly one
// expert. Built on the device by src/cuda/tile_plan.cu for the expert_tiles route; the CPU builder
// here is the reference the GPU plan is tested against. Format and algorithm: docs/design.md
// ("Tile plan").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace expertqmm::detail {

// Tile classes, ascending: a tile of `rows` rows runs through the GEMM of the first class whose
// max_rows >= rows, with that class's row-tile height bm. An expert with c rows gets floor(c / 128)
// full tiles of the last class, then at most one tail tile of c % 128 rows in its class. More
// classes mean less padding on tails but one more GEMM instantiation; the four are the heights of
// the tile GEMMs (16: MLX's height; 32 and 64 spread each dequantized weight fragment over 2 and 4
// mmas; 128: one wgmma width on Hopper, two 64-row pieces for tile_gemm).
struct TileClass {
  int32_t bm;        // the GEMM's row-tile height
  int32_t max_rows;  // largest tile of this class (== bm: a tile never pads past its own class)
};
constexpr int kTileClassCount = 4;
// The table as a constexpr function rather than an array: device code may call constexpr
// functions (--expt-relaxed-constexpr) but may not read a host array at run time (it traps).
constexpr TileClass tile_class(int c) {
  return c == 0 ? TileClass{16, 16} : c == 1 ? TileClass{32, 32} : c == 2 ? TileClass{64, 64} : TileClass{128, 128};
}
constexpr int kTileRowsFull = tile_class(kTileClassCount - 1).max_rows;  // rows of a full tile (128)
constexpr bool tile_classes_well_formed() {
  for (int c = 0; c < kTileClassCount; ++c) {
    if (tile_class(c).max_rows < 1 || tile_class(c).max_rows > tile_class(c).bm) return false;
    if (tile_class(c).bm % 16 != 0) return false;  // tile_gemm heights are whole m16 tiles
    if (c > 0 && tile_class(c).max_rows <= tile_class(c - 1).max_rows) return false;
  }
  return true;
}
static_assert(tile_classes_well_formed(), "classes ascend by max_rows, and each tile fits its bm");
constexpr int kTilePlanMaxExperts = 4096;
constexpr int64_t kTilePlanMaxRows = INT32_MAX;

// bm of a tile of `rows` rows, 1 <= rows <= kTileRowsFull (0 outside). Usable in device code
// (--expt-relaxed-constexpr): the loop unrolls over the constant table.
constexpr int32_t tile_bm_for_rows(int32_t rows) {
  if (rows < 1) return 0;
  for (int c = 0; c < kTileClassCount; ++c)
    if (rows <= tile_class(c).max_rows) return tile_class(c).bm;
  return 0;
}
static_assert(tile_bm_for_rows(1) == 16 && tile_bm_for_rows(16) == 16 && tile_bm_for_rows(17) == 32 &&
                  tile_bm_for_rows(32) == 32 && tile_bm_for_rows(33) == 64 && tile_bm_for_rows(64) == 64 &&
                  tile_bm_for_rows(65) == 128 && tile_bm_for_rows(128) == 128 && tile_bm_for_rows(129) == 0,
              "the class rule of docs/design.md (Tile plan)");

// One tile: rows [row_begin, row_begin + rows) of the sorted rows, all routed to `expert`.
// rows is in [1, 128]; bm (the GEMM's row-tile class) is tile_bm_for_rows(rows): 16, 32, 64 or 128.
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
// floor(n/F) + min(n, E), F = kTileRowsFull. Proof: an expert with c > 0 rows has floor(c/F) full
// tiles plus at most one tail, and none when c == 0. Summing over experts, sum floor(c_e/F) <=
// floor(sum c_e / F) = floor(n/F) (a sum of floors never exceeds the floor of the sum), and the tails number at most
// the count of experts with rows, which is <= E and <= n. Reached when every expert with rows has
// a tail (e.g. n <= E rows over distinct experts: n tiles).
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
// covered once and in order, each tile one expert matching ids, rows in [1, kTileRowsFull], bm ==
// tile_bm_for_rows(rows), only an expert's last tile short of kTileRowsFull rows, at most max_tiles(n, E) tiles. Returns "" when
// the plan is valid, else a description of the first violation.
std::string tile_plan_violation(const ExpertTile* tiles, int64_t tile_count, const int32_t* ids, int64_t n,
                                int E);

}  // namespace expertqmm::detail

// expert_tiles: the sorted tile route of gather_qmm (DESIGN.md route 1). A device-built plan cuts
// the sorted rows into tiles that each belong to exactly one expert (src/core/tile_plan.h), and the
// GEMM runs one CTA per (plan tile, N block) with the tile's row count read from the plan: each
// expert's weight slice is read once per tile, with no pass per run as in rhs_tiles.
//
// The sortedness promise is checked, never trusted, and without a host synchronization: the plan
// builder (one 1024-thread block) votes on the ids and, when they are not non-decreasing (or out of
// range), retracts the plan (tile_count 0, sorted 0). The GEMM kernel then reads the verdict: a
// valid plan runs its tiles; a retracted one makes the same CTAs run the generic rhs_tiles
// algorithm (16-row tiles, one pass per run of equal ids), which is correct for any order, and
// CTA (0, 0) counts the retraction on the device (once per gather_qmm call, so a plan shared by
// the GEMMs of a layer counts once per GEMM). Both outcomes are decided on the device, so the call
// can be captured in a CUDA graph. On compute capability 9.0 with sm_90a code the plan's GEMM is
// the wgmma kernel (gather_qmm_expert_tiles_wgmma.cu); this file's mma.sync kernel serves sm_80+.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "core/route_counters.h"
#include "core/tile_layout.h"
#include "core/tile_plan.h"
#include "cuda/device/tile_gemm.cuh"
#include "cuda/gather_qmm_routes.h"
#include "cuda/gather_qmm_wgmma.h"
#include "cuda/runtime.cuh"
#include "cuda/tile_plan.cuh"

namespace expertqmm::cuda {

namespace {

using device::TileArgs;
using device::TileConfig;
using device::TileLayout;
using detail::ExpertTile;
using detail::TilePlanHeader;

// The three plan tile classes (detail::tile_class) run in ONE kernel. ptxas -v (CUDA 13.0,
// sm_90, bf16/f16 x 4/8-bit) left free: 166-168 registers, so 3 CTAs (12 warps) per SM as the 16/32
// kernel had before BM 64; no spills with 8-bit, 8 bytes with 4-bit: one stack word stored at
// kernel entry and reloaded once per tile_gemm call, outside the k loops (SASS: no local memory
// access inside any loop). Instructions per mma in the bf16 4-bit k loop: 22.3 / 12.3 / 7.7 at
// BM 16 / 32 / 64, against 22.1 / 11.8 / 7.4 for the same tiles in their own rhs_tiles kernels
// (122 / 168 / 223 registers). More registers do not buy that 3% back here
// (__launch_bounds__(128, 2): 197-207 registers, 7.6 per mma) and cost a CTA per SM; an explicit
// cap of 3 CTAs spills more (12-28 bytes) than ptxas's own choice. Launching per class would run
// three grids one after another, most CTAs of each finding a tile of another class. So one launch.
using ExpertTiles64 = TileConfig<64, 128, 4, 4>;  // full plan tiles and tails of 33..63 rows
using ExpertTiles32 = TileConfig<32, 128, 4, 4>;  // tails of 17..32 rows
using ExpertTiles16 = TileConfig<16, 128, 4, 4>;  // tails of <= 16 rows and the retracted path
static_assert(ExpertTiles64::THREADS == ExpertTiles32::THREADS && ExpertTiles32::THREADS == ExpertTiles16::THREADS,
              "one launch runs every tile height");
static_assert(ExpertTiles64::BN == ExpertTiles32::BN && ExpertTiles32::BN == ExpertTiles16::BN,
              "every tile height covers the same column block of the grid");
static_assert(kTileColumnsAlign % ExpertTiles64::BN == 0, "a column window starts at a column block");

template <int kBits>
constexpr int expert_tiles_smem() {
  return std::max({TileLayout<ExpertTiles64, kBits>::kSmemBytes, TileLayout<ExpertTiles32, kBits>::kSmemBytes,
                   TileLayout<ExpertTiles16, kBits>::kSmemBytes});
}

// Grid (ceil(N / BN), min(tile slots, 65535)), 128 threads. With a valid plan, CTA (x, y) runs plan
// tiles y, y + gridDim.y, ... < tile_count against column block x through the tile_gemm of the
// tile's class: bm 64 (full 64-row tiles and 33..63-row tails; each dequantized B fragment feeds 4
// m16 mmas), bm 32 (17..32-row tails) or bm 16 (<= 16-row tails). The row count is the tile's, so
// rows past it are zero-filled and never stored. Dynamic shared memory is the largest of the three
// layouts (bm 64's: its x stages are 4x bm 16's); each call reuses it from offset 0. CTAs past the plan's tile count exit at once. With a retracted
// plan the same CTAs stride over the 16-row tiles of all rows and split each into runs of equal ids
// (the rhs_tiles algorithm), so any order of ids still gives the right answer.
//   tiles   (max_tiles,) ExpertTile {expert, row_begin, rows <= 64, bm}, the first header->tile_count valid
//   header  the builder's verdict (written by the previous kernel on the stream)
// kFp: MLX's fp modes (E2M1 / E4M3 codes, bf16; device::tile_gemm's kFp), one kernel per code width
// for every mode of that width (nvfp4's E4M3 scales and group 16 are read at run time).
template <class T, int kBits, bool kFp>
__global__ void __launch_bounds__(ExpertTiles64::THREADS)
    expert_tiles_kernel(TileArgs a, const ExpertTile* __restrict__ tiles, const TilePlanHeader* __restrict__ header,
                        unsigned long long* retractions) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int sorted = header->sorted;
  if (!sorted && retractions && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) atomicAdd(retractions, 1ull);
  if (sorted) {
    const int tile_count = header->tile_count;
    for (int t = blockIdx.y; t < tile_count; t += gridDim.y) {
      const ExpertTile tile = tiles[t];
      if (tile.bm >= ExpertTiles64::BM) {
        // A 128-row tile (the wgmma kernel's full width) runs as two 64-row halves.
        for (int half = 0; half < tile.rows; half += ExpertTiles64::BM) {
          const int rows = min(ExpertTiles64::BM, tile.rows - half);
          device::tile_gemm<ExpertTiles64, T, kBits, false, kFp>(a, tile.expert, tile.row_begin + half, rows, 0, rows, blockIdx.x,
                                                     smem);
        }
      }
      else if (tile.bm == ExpertTiles32::BM)
        device::tile_gemm<ExpertTiles32, T, kBits, false, kFp>(a, tile.expert, tile.row_begin, tile.rows, 0, tile.rows,
                                                   blockIdx.x, smem);
      else
        device::tile_gemm<ExpertTiles16, T, kBits, false, kFp>(a, tile.expert, tile.row_begin, tile.rows, 0, tile.rows,
                                                   blockIdx.x, smem);
    }
    return;
  }
  // Retracted: the generic route over 16-row tiles (M == 1 here, so the expert of row r is rhs[r]).
  __shared__ int tile_expert[ExpertTiles16::BM];
  const int64_t row_tiles = (a.rows + ExpertTiles16::BM - 1) / ExpertTiles16::BM;
  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y)
    device::tile_gemm_runs<ExpertTiles16, T, kBits, false, kFp>(a, tile, blockIdx.x, smem, tile_expert);
}

template <class T, int kBits, bool kFp>
void launch_expert_tiles(const TileArgs& args, const ExpertTile* tiles, const TilePlanHeader* header,
                         int64_t tile_slots, unsigned long long* retractions) {
  constexpr int kSmem = expert_tiles_smem<kBits>();
  static const bool smem_configured = [] {
    if (kSmem > 48 * 1024)
      EXPERTQMM_CUDA_CHECK(cudaFuncSetAttribute(expert_tiles_kernel<T, kBits, kFp>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    return true;
  }();
  (void)smem_configured;
  // Enough CTAs in y for every plan tile, and for the 16-row tiles of the retracted path.
  const int64_t slots = std::max<int64_t>(tile_slots, (args.rows + 15) / 16);
  const dim3 grid(ceil_div(args.N, ExpertTiles64::BN), static_cast<unsigned>(std::min<int64_t>(slots, 65535)));
  expert_tiles_kernel<T, kBits, kFp>
      <<<grid, ExpertTiles64::THREADS, kSmem, current_stream()>>>(args, tiles, header, retractions);
  EXPERTQMM_CUDA_CHECK_LAUNCH("expert_tiles_kernel");
}

struct ExpertTilesVariant {
  DType dtype;
  int bits;
  bool fp;  // an fp mode's codes (mxfp4 / nvfp4: 4-bit, mxfp8: 8-bit)
  void (*launch)(const TileArgs&, const ExpertTile*, const TilePlanHeader*, int64_t, unsigned long long*);
};
const ExpertTilesVariant kExpertTilesVariants[] = {
    {DType::bf16, 4, false, launch_expert_tiles<__nv_bfloat16, 4, false>},
    {DType::bf16, 8, false, launch_expert_tiles<__nv_bfloat16, 8, false>},
    {DType::f16, 4, false, launch_expert_tiles<__half, 4, false>},
    {DType::f16, 8, false, launch_expert_tiles<__half, 8, false>},
    {DType::bf16, 4, true, launch_expert_tiles<__nv_bfloat16, 4, true>},
    {DType::bf16, 8, true, launch_expert_tiles<__nv_bfloat16, 8, true>},
};

}  // namespace

RouteSupport supports_expert_tiles(const detail::GatherQmmProblem& p) {
  if (!p.sorted_indices) return route_miss(Fallback::topology);  // no promise of sorted rows
  if (p.M != 1 || p.rhs_is_identity) return route_miss(Fallback::topology);
  const RouteSupport operands = supports_tile_operands(p);
  if (!operands.ok) return operands;
  if (p.w_batch > detail::kTilePlanMaxExperts || p.B > detail::kTilePlanMaxRows) return route_miss(Fallback::shape);
  if (p.B < kExpertTilesMinRows) return route_miss(Fallback::shape);  // decode sizes: qmv
  return route_ok();
}

namespace {

enum class TileKernel { automatic, mma_sync, wgmma };

// The plan's storage (tile_plan.cuh): in the caller's workspace or a temporary that the
// stream-ordered caching allocator keeps alive until the kernels have run.
size_t plan_bytes(const detail::GatherQmmProblem& p) { return tile_plan_bytes(p.B, static_cast<int>(p.w_batch)); }
TilePlanView plan_view(const detail::GatherQmmProblem& p, const void* plan) {
  return tile_plan_view(plan, p.B, static_cast<int>(p.w_batch));
}
const void* build_plan_into(const detail::GatherQmmProblem& p, void* base) {
  launch_build_tile_plan_at(p.rhs.data_as<const int32_t>(), p.B, static_cast<int>(p.w_batch), base, current_stream());
  return base;
}

// Rows [begin, begin + count) of every expert's weight (count < 0: all N): the GEMM's N becomes
// count and out is (B, count). TileArgs reach the window's first row through q's pointers and the
// next expert through expert_rows, so neither kernel changes.
struct RowWindow {
  int64_t begin = 0, count = -1;
};
TileArgs window_tile_args(const detail::GatherQmmProblem& p, void* out, RowWindow window) {
  TileArgs a = make_tile_args(p, out);
  if (window.count < 0) return a;
  a.q.w += window.begin * a.q.words_per_row;
  a.q.scales += window.begin * a.q.groups_per_row;  // fp modes: make_tile_args' uint16 view of the codes
  if (a.q.biases) a.q.biases += window.begin * a.q.groups_per_row;
  if (a.q.fp_scales) a.q.fp_scales += window.begin * (p.K / p.group_size);
  if (a.q.tiled_codes) {  // begin is a multiple of kTileColumnsAlign: whole 64-row blocks
    const int64_t blocks = window.begin / detail::kTileRows;
    a.q.tiled_codes += blocks * (p.K / detail::kTileK) * detail::kTileWords;
    a.q.tiled_params += blocks * a.q.groups_per_row * detail::kTileRows;
  }
  a.N = static_cast<int>(window.count);
  a.paired_store = window.count % 2 == 0 && is_aligned(out, 4);
  return a;
}

// Runs `kernel` on p's plan (p.tile_plan, or one built here): the wgmma kernel where
// wgmma_tiles_fit, else the mma.sync one. Retractions are counted by the GEMM kernels, once per
// call (count_retraction: once per call of which this launch is the first).
void run_expert_tiles(const detail::GatherQmmProblem& p, void* out, Workspace* ws, TileKernel kernel,
                      RowWindow window = {}, bool count_retraction = true) {
  if (kernel == TileKernel::automatic)
    kernel = wgmma_tiles_fit(p) && is_aligned(out, 16) ? TileKernel::wgmma : TileKernel::mma_sync;
  unsigned long long* retractions = count_retraction ? retraction_counter(detail::Primitive::gather_qmm) : nullptr;
  const ExpertTilesVariant* variant = nullptr;
  for (const ExpertTilesVariant& v : kExpertTilesVariants)
    if (v.dtype == p.dtype && v.bits == p.bits && v.fp == (p.mode != QuantMode::affine)) variant = &v;
  EXPERTQMM_CHECK(variant != nullptr, "gather_qmm", "expert_tiles has no kernel for ", p.describe());
  Tensor temp;
  const void* plan = p.tile_plan;
  if (plan == nullptr) {
    void* base = nullptr;
    if (ws) {
      base = ws->get(detail::kSlotTilePlan, plan_bytes(p));
    } else {
      temp = Tensor::empty({static_cast<int64_t>((plan_bytes(p) + 3) / 4)}, DType::i32, Device::cuda);
      base = temp.data();
    }
    plan = build_plan_into(p, base);
  }
  const TilePlanView v = plan_view(p, plan);
  if (kernel == TileKernel::wgmma) {
    WgmmaTileArgs args;
    args.tile = window_tile_args(p, out, window);
    args.retractions = retractions;
    args.calls = 1;
    launch_expert_tiles_wgmma(args, WgmmaForm::plain, p.dtype, v.tiles, v.header, v.tile_slots,
                              p.mode != QuantMode::affine);
  } else {
    variant->launch(window_tile_args(p, out, window), v.tiles, v.header, v.tile_slots, retractions);
  }
}

}  // namespace

void call_expert_tiles(const detail::GatherQmmProblem& p, void* out, Workspace* ws) {
  run_expert_tiles(p, out, ws, TileKernel::automatic);
}

RouteSupport supports_expert_tiles_wgmma(const detail::GatherQmmProblem& p) {
  const RouteSupport tiles = supports_expert_tiles(p);
  if (!tiles.ok) return tiles;
  return wgmma_builds_take(p) ? route_ok() : route_miss(Fallback::quantization);
}
void call_expert_tiles_mma_sync(const detail::GatherQmmProblem& p, void* out, Workspace* ws) {
  run_expert_tiles(p, out, ws, TileKernel::mma_sync);
}
void call_expert_tiles_wgmma(const detail::GatherQmmProblem& p, void* out, Workspace* ws) {
  EXPERTQMM_CHECK(wgmma_builds_take(p) && is_aligned(out, 16), "gather_qmm", "expert_tiles_wgmma does not fit ", p.describe());
  run_expert_tiles(p, out, ws, TileKernel::wgmma);
}

bool gate_up_glu_fits(const detail::GatherQmmProblem& gate, const detail::GatherQmmProblem& up) {
  // The fused forms are built for affine codes only (the fp modes' wgmma kernel is the plain form).
  const bool same = gate.N == up.N && gate.K == up.K && gate.w_batch == up.w_batch && gate.bits == up.bits &&
                    gate.group_size == up.group_size && gate.dtype == up.dtype && gate.B == up.B &&
                    gate.mode == QuantMode::affine && up.mode == QuantMode::affine;
  return same && wgmma_tiles_fit(gate) && wgmma_tiles_fit(up);
}

void launch_gate_up_glu(const detail::GatherQmmProblem& gate, const detail::GatherQmmProblem& up, Activation act,
                        void* hidden) {
  // Invariants of the layer plan, not choices: it fused only GEMMs that fit, over one shared plan.
  EXPERTQMM_CHECK(gate.tile_plan != nullptr && gate.tile_plan == up.tile_plan && is_aligned(hidden, 16),
                  "gather_qmm", "the fused gate/up GEMM needs one shared tile plan and a 16-byte aligned output");
  WgmmaTileArgs args;
  args.tile = make_tile_args(gate, hidden);
  args.up = quant_view(up);
  args.retractions = retraction_counter(detail::Primitive::gather_qmm);
  args.calls = 2;
  const TilePlanView v = plan_view(gate, gate.tile_plan);
  launch_expert_tiles_wgmma(args, act == Activation::geglu ? WgmmaForm::geglu : WgmmaForm::swiglu, gate.dtype, v.tiles,
                            v.header, v.tile_slots);
}

void launch_expert_tiles_columns(const detail::GatherQmmProblem& p, int64_t begin, int64_t count, void* out,
                                 bool count_retraction) {
  EXPERTQMM_CHECK(p.tile_plan != nullptr && begin >= 0 && count > 0 && begin + count <= p.N &&
                      begin % kTileColumnsAlign == 0 && (count % kTileColumnsAlign == 0 || begin + count == p.N) &&
                      is_aligned(out, 16),
                  "gather_qmm", "a column window [", begin, ", ", begin + count, ") of ", p.describe(),
                  " needs the layer's tile plan, ", kTileColumnsAlign, "-column steps and a 16-byte aligned output");
  run_expert_tiles(p, out, nullptr, TileKernel::automatic, RowWindow{begin, count}, count_retraction);
}

}  // namespace expertqmm::cuda

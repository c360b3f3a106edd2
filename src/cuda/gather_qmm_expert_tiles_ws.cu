// expert_tiles on Hopper, warp-specialized (sm_90a; EXPERTQMM_WGMMA_WS=1; bench/NOTES.md step 47):
// the wide (128-token) build of the 4-bit affine wgmma expert GEMM with copies and math on separate
// warpgroups. The two-CTA kernel (gather_qmm_expert_tiles_wgmma.cu) issues its own cp.async, then
// waits for them, a CTA-wide barrier and its wgmmas once per 64-wide k tile; here no barrier spans
// the CTA in the k loop and each consumer's dequantization of tile kt + 1 overlaps its wgmmas of kt.
//
// Forms as the two-CTA kernel's: plain and GLU (gate rows and up rows in one item, the product in the
// epilogue).
//
// out^T = W x^T per work item, as in the two-CTA kernel: 128 weight rows (wgmma's M, 64 per consumer
// warpgroup) x the tile's tokens (N: 128, or 32 for tiles of at most 32 rows, or 128 + 32 for a full
// tile with its expert's tail of at most 32 rows: two wgmma groups on the same A fragments, so the
// tail costs no second pass over the weights) x K in 64-wide k tiles.
//
// Work split. Grid: at most one CTA per SM (persistent), 384 threads:
//   warpgroup 0, the producer (40 registers after setmaxnreg): per item, the tile's x row pointers
//     into shared memory, then per k tile, into ring stage u % kStages: the rows' 128-byte x pieces
//     (chunk c of row r at c ^ (r % 8): wgmma's 128-byte swizzled B), the 128 weight rows' 32 bytes
//     of codes (thread p: row p, both 16-byte chunks) and the word holding each row's group scale
//     and bias; then cp.async.mbarrier.arrive.noinc on the stage's `full` barrier (128 arrivals).
//     Before it refills a stage it waits on the stage's `empty` barrier. With the tile layout
//     (docs/tile-layout.md; kTiled) the weights and parameters come instead as four bulk copies per
//     stage (two 2 KB code blocks, two 256-byte parameter blocks), one by lane 0 of each producer
//     warp, counted as transactions on `full`; the threads then copy only x.
//     Consumers with the tile layout: one 16-byte load of codes and one 8-byte load of parameters
//     per lane and k tile, each A register one shift and one mask from its codes.
//   warpgroups 1-2, the consumers (232 registers): weight rows 0-63 and 64-127 (glu: the gate rows
//     and the up rows of 64 output columns). Per k tile: wait `full`, dequantize lane (g, t)'s A
//     fragments (rows g and g + 8 of its warp's 16; k 2t..2t+1 and 2t+8..2t+9 of each k16 step) into
//     one of two register buffers, issue the 4 wgmmas as one group, wait until only that group is in
//     flight, and arrive on the previous tile's `empty` (256 arrivals). Epilogue: the accumulators
//     as T into the staging (its own shared memory, so the producer fills the next item's stages
//     meanwhile), a consumer barrier, 16-byte stores (glu: the GLU product of the gate and up halves).
// Items: plan tile i / col_blocks against column block i % col_blocks (a tail merged into the full
// tile before it is no item of its own; the CTAs of a tile's column blocks run together and share
// its x rows in the L2); the CTA strides over items by gridDim.x, and a k-tile counter across items
// keeps every stage's phase. A retracted plan (header->sorted == 0) is
// left to the two-CTA kernel's rhs_tiles walk (launch_expert_tiles_wgmma launches it after this one).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "core/tile_layout.h"
#include "core/tile_plan.h"
#include "cuda/device/cp_async.cuh"
#include "cuda/device/dequant.cuh"
#include "cuda/device/elem.cuh"
#include "cuda/device/glu.cuh"
#include "cuda/device/mbarrier.cuh"
#include "cuda/device/tile_fragments.cuh"
#include "cuda/device/wgmma.cuh"
#include "cuda/gather_qmm_wgmma.h"
#include "cuda/gather_qmm_ws_hooks.h"
#include "cuda/runtime.cuh"
#include "expertqmm/settings.h"

namespace expertqmm::cuda {

namespace {

using detail::ExpertTile;
using detail::TilePlanHeader;
using device::TileArgs;

// [[maybe_unused]]: the sm_80 pass compiles the kernel's body out.
[[maybe_unused]] constexpr int kProducerThreads = 128, kConsumerThreads = 256, kThreads = 384;
// 128 x 40 + 256 x 232 <= 64K registers (ptxas -v: no spill; the consumers at 224 spilled in the plain
// form, and at 216 ptxas serialized the wgmmas, C7512).
[[maybe_unused]] constexpr int kProducerRegs = 40, kConsumerRegs = 232;
constexpr int kCtaRows = 128;     // weight rows per item, 64 per consumer warpgroup
constexpr int kBK = 64;           // k per stage
constexpr int kTokens = 128;      // the wide wgmma's N: a full plan tile
constexpr int kNarrowTokens = 32; // tiles of at most 32 rows run n32; an expert's tail of at most
                                  // 32 rows after a full tile runs in that tile's item, n128 + n32
constexpr int kStageRows = kTokens + kNarrowTokens;  // x rows a stage holds (a full tile and a tail)
constexpr int kStages = 7;
static_assert(kStageRows <= kConsumerThreads, "one consumer thread per row of an item (row_ok)");
static_assert(detail::kTileRowsFull == kTokens, "a plan tile is at most one wgmma's rows (a loop over pieces made ptxas serialize the wgmmas, C7514)");

// Shared memory (bytes from a 1024-byte aligned base):
//   stages   kStages x { xs (160, 64) T, 128-byte rows, chunk c of row r at c ^ (r % 8) (a tail's
//                        rows 128-159 start 16 KB in, 1024-byte aligned like the first);
//                        ws (128, 8) uint32 codes, chunk c of row r at c ^ ((r / 4) % 2);
//                        ss, bs (128,) uint32: the aligned word holding the row's group scale / bias }
//   staging  (160, 136) T: a token's 128 outputs padded by 8 (the 4 token rows a warp writes at
//            once fall in different banks)
//   full[kStages], empty[kStages] mbarriers; rows (160,) const T*: the x row, null: no row (producer's);
//   row_ok (160,) uint8: the row's x index is in range (the consumers', for their stores)
struct Layout {
  static constexpr int kXBytes = kStageRows * kBK * 2;
  static constexpr int kTailXOffset = kTokens * kBK * 2;
  static constexpr int kWBytes = kCtaRows * kBK / 2;
  // The tile layout's pieces (docs/tile-layout.md): two 64-row code blocks fill the kWBytes, their
  // two parameter blocks the first half of the scale/bias words.
  static constexpr int kTileCodeBytes = detail::kTileWords * 4, kTileParamBytes = detail::kTileRows * 4;
  static_assert(2 * kTileCodeBytes == kWBytes && 2 * kTileParamBytes <= 2 * kCtaRows * 4, "a stage holds two blocks");
  static constexpr int kStageBytes = kXBytes + kWBytes + 2 * kCtaRows * 4;
  static constexpr int kOutStride = kCtaRows + 8;
  static constexpr int kStagingOffset = kStages * kStageBytes;
  static constexpr int kBarOffset = kStagingOffset + kStageRows * kOutStride * 2;
  static constexpr int kRowsOffset = kBarOffset + 2 * kStages * 8;
  static constexpr int kRowOkOffset = kRowsOffset + kStageRows * 8;
  static constexpr int kBytes = kRowOkOffset + kStageRows;
  static constexpr int kAllocBytes = kBytes + 1024;
  static_assert(kStageBytes % 1024 == 0 && kTailXOffset % 1024 == 0, "x tiles stay 1024-byte aligned for the swizzle");
  static_assert(kAllocBytes <= 227 * 1024, "one CTA per SM");
  static_assert(kRowsOffset % sizeof(void*) == 0, "the row pointers are aligned");
};

// The rows of work item tile t: a tile, or a full tile and the expert's tail of at most 32 rows
// after it (ordered by expert, then row: the plan's order), which then is no item of its own.
struct ItemRows {
  int expert = 0;
  int64_t row0 = 0;
  int rows = 0, tail_rows = 0;  // rows includes the tail's
  bool absorbed = false;        // a tail that the full tile before it runs
};
__device__ __forceinline__ bool is_tail_of(const ExpertTile& full, const ExpertTile& tail) {
  return full.rows == kTokens && tail.expert == full.expert && tail.rows <= kNarrowTokens &&
         tail.row_begin == full.row_begin + full.rows;
}
[[maybe_unused]] __device__ __forceinline__ ItemRows item_rows(const ExpertTile* tiles, int tile_count, int t) {
  const ExpertTile tile = tiles[t];
  ItemRows r;
  if (t > 0 && is_tail_of(tiles[t - 1], tile)) {
    r.absorbed = true;
    return r;
  }
  r.expert = tile.expert;
  r.row0 = tile.row_begin;
  r.tail_rows = t + 1 < tile_count && is_tail_of(tile, tiles[t + 1]) ? tiles[t + 1].rows : 0;
  r.rows = tile.rows + r.tail_rows;
  return r;
}

// The k loop of one item on one consumer warpgroup with wgmma width kN into acc and, kTailN = 32,
// the tail's rows 128-159 into acc_tail with the same A fragments (one dequantization for both).
template <class T, bool kTiled, int kN, int kTailN>
__device__ __forceinline__ void consume_item(float (&acc)[kN / 2], float (&acc_tail)[kTailN ? kTailN / 2 : 1],
                                              unsigned char* smem, uint64_t* full,
                                              uint64_t* empty, int ring0, int k_tiles, int group_shift,
                                              int m_lo, int parity_lo, int parity_hi, uint32_t selector) {
  using Dequant = device::PackedDequant<T>;
  const int m_hi = m_lo + 8;
  const uint64_t desc0 = device::wgmma_desc_k128(smem);
  uint32_t afrag[2][4][4];
  auto k_tile = [&](int kt, uint32_t(&af)[4][4]) {
    const int ring = ring0 + kt;
    const int s = ring % kStages;
    device::mbarrier_wait(&full[s], (ring / kStages) & 1);
    const unsigned char* wst = smem + s * Layout::kStageBytes + Layout::kXBytes;
    if constexpr (kTiled) {
      device::tile_layout_fragments<T>(wst, wst + Layout::kWBytes, m_lo, static_cast<int>(threadIdx.x & 31), af);
    } else {
      const uint32_t* ws = reinterpret_cast<const uint32_t*>(wst);
      const uint32_t* ss = ws + kCtaRows * 8;
      const uint32_t* bs = ss + kCtaRows;
      const int tile_parity = ((kt * kBK) >> group_shift) & 1;
      const bool high_lo = (parity_lo ^ tile_parity) != 0, high_hi = (parity_hi ^ tile_parity) != 0;
      const uint32_t s_lo = device::broadcast_half(ss[m_lo], high_lo), b_lo = device::broadcast_half(bs[m_lo], high_lo);
      const uint32_t s_hi = device::broadcast_half(ss[m_hi], high_hi), b_hi = device::broadcast_half(bs[m_hi], high_hi);
      auto chunk_of = [&](int m, int c) {
        return *reinterpret_cast<const uint4*>(ws + m * 8 + ((c ^ ((m >> 2) & 1)) << 2));
      };
      const uint4 lo0 = chunk_of(m_lo, 0), lo1 = chunk_of(m_lo, 1), hi0 = chunk_of(m_hi, 0), hi1 = chunk_of(m_hi, 1);
      const uint32_t lo[8] = {lo0.x, lo0.y, lo0.z, lo0.w, lo1.x, lo1.y, lo1.z, lo1.w};
      const uint32_t hi[8] = {hi0.x, hi0.y, hi0.z, hi0.w, hi1.x, hi1.y, hi1.z, hi1.w};
#pragma unroll
      for (int k16 = 0; k16 < 4; ++k16) {
        af[k16][0] = Dequant::nibbles(lo[2 * k16], selector, s_lo, b_lo);
        af[k16][1] = Dequant::nibbles(hi[2 * k16], selector, s_hi, b_hi);
        af[k16][2] = Dequant::nibbles(lo[2 * k16 + 1], selector, s_lo, b_lo);
        af[k16][3] = Dequant::nibbles(hi[2 * k16 + 1], selector, s_hi, b_hi);
      }
    }
    device::fence_proxy_async_shared();  // x came through cp.async (generic proxy); wgmma reads it (async)
    device::wgmma_fence();
    const uint64_t desc = desc0 + ((s * Layout::kStageBytes) >> 4);  // the address field counts 16 bytes
#pragma unroll
    for (int k16 = 0; k16 < 4; ++k16) device::WgmmaRS<T, kN>::run(acc, af[k16], desc + 2 * k16);
    if constexpr (kTailN > 0) {
#pragma unroll
      for (int k16 = 0; k16 < 4; ++k16)
        device::WgmmaRS<T, kTailN>::run(acc_tail, af[k16], desc + (Layout::kTailXOffset >> 4) + 2 * k16);
    }
    device::wgmma_commit();
    device::wgmma_wait<1>();  // tile kt - 1's group retired: its stage and A buffer are free
    if (kt > 0) device::mbarrier_arrive(&empty[(ring - 1) % kStages]);
  };
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) acc[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) device::fence_operand(acc[i]);
  if constexpr (kTailN > 0) {
#pragma unroll
    for (int i = 0; i < kTailN / 2; ++i) acc_tail[i] = 0.f;
#pragma unroll
    for (int i = 0; i < kTailN / 2; ++i) device::fence_operand(acc_tail[i]);
  }
  // Pairs of k tiles, so that each A buffer is a fixed set of registers; an odd count's first tile
  // alone before them (a conditional second tile inside the loop makes ptxas serialize every
  // wgmma: C7513).
  int kt0 = 0;
  if (k_tiles & 1) {
    k_tile(0, afrag[1]);
    kt0 = 1;
  }
  for (int kt = kt0; kt < k_tiles; kt += 2) {
    k_tile(kt, afrag[0]);
    k_tile(kt + 1, afrag[1]);
  }
  device::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) device::fence_operand(acc[i]);
  if constexpr (kTailN > 0) {
#pragma unroll
    for (int i = 0; i < kTailN / 2; ++i) device::fence_operand(acc_tail[i]);
  }
  device::mbarrier_arrive(&empty[(ring0 + k_tiles - 1) % kStages]);  // the item's last stage
}

// Accumulators (kN wide) as T into the staging from token tok0: staging[token][m], m the smem weight row.
template <class T, int kN>
__device__ __forceinline__ void stage_outputs(const float (&acc)[kN / 2], T* staging, int tok0, int m_lo, int t) {
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    const int tok = tok0 + 8 * j + 2 * t;
    staging[tok * Layout::kOutStride + m_lo] = device::Elem<T>::from_float(acc[4 * j + 0]);
    staging[(tok + 1) * Layout::kOutStride + m_lo] = device::Elem<T>::from_float(acc[4 * j + 1]);
    staging[tok * Layout::kOutStride + m_lo + 8] = device::Elem<T>::from_float(acc[4 * j + 2]);
    staging[(tok + 1) * Layout::kOutStride + m_lo + 8] = device::Elem<T>::from_float(acc[4 * j + 3]);
  }
}

template <class T, WgmmaForm kForm, bool kTiled>
__global__ void __launch_bounds__(kThreads, 1)
    expert_tiles_ws_kernel(WgmmaTileArgs p, const ExpertTile* __restrict__ tiles,
                           const TilePlanHeader* __restrict__ header) {
#if EXPERTQMM_WGMMA_ENABLED
  constexpr bool kGlu = is_glu(kForm);
  constexpr Activation kAct = kForm == WgmmaForm::swiglu ? Activation::swiglu : Activation::geglu;
  const TileArgs& a = p.tile;
  if (!header->sorted) return;  // uniform: the two-CTA kernel walks a retracted plan
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = device::shared_address(smem_raw);
  unsigned char* smem = smem_raw + ((1024u - (raw & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Layout::kBarOffset);
  uint64_t* empty = full + kStages;
  const void** row_src = reinterpret_cast<const void**>(smem + Layout::kRowsOffset);
  uint8_t* row_ok = smem + Layout::kRowOkOffset;
  T* staging = reinterpret_cast<T*>(smem + Layout::kStagingOffset);

  const int cols_per_item = kGlu ? 64 : kCtaRows;
  const int col_blocks = (a.N + cols_per_item - 1) / cols_per_item;
  const int tile_count = header->tile_count;
  const int items = tile_count * col_blocks;
  const int k_tiles = a.K / kBK;
  const int tid = threadIdx.x;
  // Smem weight row r (0..127) of column block cb: weight set r / 64 and row 64 cb + r % 64 (glu),
  // or row 128 cb + r.
  auto weight_row = [&](int cb, int r) { return kGlu ? cb * 64 + (r & 63) : cb * kCtaRows + r; };
  auto expert_ok = [&](int e) { return e >= 0 && e < a.E; };

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      device::mbarrier_init(&full[s], kProducerThreads);
      device::mbarrier_init(&empty[s], kConsumerThreads);
    }
    device::mbarrier_init_fence();
  }
  __syncthreads();

  if (tid < kProducerThreads) {
    device::setmaxnreg_dec<kProducerRegs>();
    const T* x = static_cast<const T*>(a.x);
    const int pr = tid;                    // weight row pr, its scale and bias words
    const int xr = tid >> 3, xc = tid & 7;  // x rows xr + 16 i, chunk xc
    const uint32_t* w_base = kGlu && pr >= 64 ? p.up.w : a.q.w;
    const uint16_t* s_base = kGlu && pr >= 64 ? p.up.scales : a.q.scales;
    const uint16_t* b_base = kGlu && pr >= 64 ? p.up.biases : a.q.biases;
    // Tile layout: lane 0 of producer warp w copies piece w of every stage: the codes of 64-row
    // block w % 2 (w < 2) or its parameters (w >= 2); block 0 holds smem rows 0-63, block 1 rows
    // 64-127 (glu: the gate's and the up's block cb; plain: blocks 2 cb and 2 cb + 1).
    const int piece = pr >> 5, piece_half = piece & 1;
    const bool piece_lane = (pr & 31) == 0;
    const device::QuantView& piece_q = kGlu && piece_half ? p.up : a.q;
    const int64_t row_blocks = (a.expert_rows + detail::kTileRows - 1) / detail::kTileRows;
    int ring = 0;  // k tiles issued: stage ring % kStages, use ring / kStages
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const ItemRows tile = item_rows(tiles, tile_count, item / col_blocks);
      if (tile.absorbed || !expert_ok(tile.expert)) continue;  // the consumers skip it too
      const int64_t piece_block = kGlu ? item % col_blocks : 2 * (item % col_blocks) + piece_half;
      // A missing block: rows past N (a.N: a column window's width; row_blocks strides experts).
      const bool piece_copies = kTiled && piece_lane && piece_block * detail::kTileRows < a.N;
      const int64_t piece_first = tile.expert * row_blocks + piece_block;
      const uint32_t* piece_src = !kTiled     ? nullptr
                                  : piece < 2 ? piece_q.tiled_codes + piece_first * k_tiles * detail::kTileWords
                                              : piece_q.tiled_params + piece_first * a.q.groups_per_row * detail::kTileRows;
      const int n = weight_row(item % col_blocks, pr);
      const bool w_valid = n < a.N;
      const int64_t w_row = static_cast<int64_t>(tile.expert) * a.expert_rows + (w_valid ? n : 0);
      const uint32_t* w_src = w_base + w_row * a.q.words_per_row;
      const uint16_t* s_src = s_base + w_row * a.q.groups_per_row;
      const uint16_t* b_src = b_base + w_row * a.q.groups_per_row;
      {
        const int rows = tile.rows;  // <= kStageRows
        const int64_t row0 = tile.row0;
        device::named_barrier_sync<2, kProducerThreads>();  // the previous item's rows were read
        for (int r = pr; r < rows; r += kProducerThreads) {
          const int64_t xb = a.lhs ? static_cast<int64_t>(a.lhs[row0 + r]) : row0 + r;  // M == 1
          const bool in_range = xb >= 0 && xb < a.x_batch;
          if (!in_range)
            record_fault(a.faults, kFaultRowOutOfRange, static_cast<uint32_t>(xb), static_cast<uint32_t>(a.x_batch));
          row_src[r] = in_range ? x + xb * a.x_batch_stride : nullptr;
        }
        device::named_barrier_sync<2, kProducerThreads>();
        // This thread's x rows r = xr + 16 i all have r % 8 == xr % 8: one swizzled chunk position.
        const int x_chunk = ((xc ^ (xr & 7)) << 4);
        for (int kt = 0; kt < k_tiles; ++kt, ++ring) {
          const int s = ring % kStages;
          if (ring >= kStages) device::mbarrier_wait(&empty[s], ((ring / kStages) - 1) & 1);
          unsigned char* stage = smem + s * Layout::kStageBytes;
          // Rows past the tile are not copied: their outputs are never stored. Per chunk: the row's
          // pointer from shared memory, one add, the copy (the producer's issue slots per stage are
          // the SM's: each scheduler also issues two consumer warps' dequantization).
          const int col = kt * kBK + xc * 8;
          unsigned char* dst = stage + xr * 128 + x_chunk;
          for (int r = xr; r < rows; r += 16, dst += 16 * 128) {
            const T* src = static_cast<const T*>(row_src[r]);
            device::cp_async_16(dst, src ? src + col : x, src != nullptr);
          }
          unsigned char* ws = stage + Layout::kXBytes;
          const int group = (kt * kBK) >> a.q.group_shift;
          if constexpr (kTiled) {
            if (piece_copies) {
              const bool codes = piece < 2;
              const uint32_t bytes = codes ? Layout::kTileCodeBytes : Layout::kTileParamBytes;
              unsigned char* dst = codes ? ws + piece_half * Layout::kTileCodeBytes
                                         : ws + Layout::kWBytes + piece_half * Layout::kTileParamBytes;
              const uint32_t* src = piece_src + (codes ? kt * detail::kTileWords : group * detail::kTileRows);
              device::mbarrier_expect_tx(&full[s], bytes);
              device::bulk_copy_to_shared(dst, src, bytes, &full[s]);
            }
          } else {
#pragma unroll
            for (int c = 0; c < 2; ++c)
              device::cp_async_16(ws + pr * 32 + ((c ^ ((pr >> 2) & 1)) << 4), w_src + kt * 8 + 4 * c, w_valid);
            // The group's element sits in the aligned word at el & ~1: el odd -> both halves; el even ->
            // its 2 bytes only (the next element may lie past the end of the tensor).
            const uint16_t* se = s_src + group;
            const uint16_t* be = b_src + group;
            const int odd = static_cast<int>((reinterpret_cast<uintptr_t>(se) >> 1) & 1);
            const int bytes = w_valid ? (odd ? 4 : 2) : 0;
            device::cp_async_4(ws + Layout::kWBytes + pr * 4, se - odd, bytes);
            device::cp_async_4(ws + Layout::kWBytes + kCtaRows * 4 + pr * 4, be - odd, bytes);
          }
          device::cp_async_mbarrier_arrive(&full[s]);
        }
      }
    }
    return;
  }

  device::setmaxnreg_inc<kConsumerRegs>();
  const int ct = tid - kProducerThreads;
  const int warp = ct >> 5, lane = ct & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m_lo = (warp >> 2) * 64 + (warp & 3) * 16 + g;  // smem weight rows m_lo and m_lo + 8
  const uint32_t selector = device::PackedDequant<T>::nibble_selector(t);
  T* out = static_cast<T*>(a.out);
  int ring0 = 0;  // the ring position of the current item's first k tile
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const ItemRows tile = item_rows(tiles, tile_count, item / col_blocks);
    if (tile.absorbed) continue;
    if (!expert_ok(tile.expert)) {
      if (ct == 0 && item % col_blocks == 0)
        record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(tile.expert), static_cast<uint32_t>(a.E));
      continue;
    }
    const int cb = item % col_blocks;
    // Half of a staged scale/bias word holding the row's group: its first element's parity (the
    // tensors are 4-byte aligned) flipped by the group index's parity.
    auto row_parity = [&](int r) {
      const int n = weight_row(cb, r);
      const int64_t first = (static_cast<int64_t>(tile.expert) * a.expert_rows + n) * a.q.groups_per_row;
      return n < a.N ? static_cast<int>(first & 1) : 0;
    };
    const int parity_lo = row_parity(m_lo), parity_hi = row_parity(m_lo + 8);
    {
      const int rows = tile.rows;  // <= kStageRows
      const int64_t row0 = tile.row0;
      device::named_barrier_sync<1, kConsumerThreads>();  // the previous item's stores read the staging and row_ok
      if (tile.tail_rows > 0) {
        float acc[kTokens / 2], acc_tail[kNarrowTokens / 2];
        consume_item<T, kTiled, kTokens, kNarrowTokens>(acc, acc_tail, smem, full, empty, ring0, k_tiles,
                                                        a.q.group_shift, m_lo, parity_lo, parity_hi, selector);
        stage_outputs<T, kTokens>(acc, staging, 0, m_lo, t);
        stage_outputs<T, kNarrowTokens>(acc_tail, staging, kTokens, m_lo, t);
      } else if (rows <= kNarrowTokens) {
        float acc[kNarrowTokens / 2], none[1];
        consume_item<T, kTiled, kNarrowTokens, 0>(acc, none, smem, full, empty, ring0, k_tiles, a.q.group_shift,
                                                  m_lo, parity_lo, parity_hi, selector);
        stage_outputs<T, kNarrowTokens>(acc, staging, 0, m_lo, t);
      } else {
        float acc[kTokens / 2], none[1];
        consume_item<T, kTiled, kTokens, 0>(acc, none, smem, full, empty, ring0, k_tiles, a.q.group_shift, m_lo,
                                            parity_lo, parity_hi, selector);
        stage_outputs<T, kTokens>(acc, staging, 0, m_lo, t);
      }
      // A row whose x index is out of range (recorded by the producer) keeps its output, as in the
      // two-CTA kernel; the producer's row pointers may already be the next item's, so read lhs here,
      // once.
      if (ct < rows) {
        const int64_t xb = a.lhs ? static_cast<int64_t>(a.lhs[row0 + ct]) : row0 + ct;
        row_ok[ct] = xb >= 0 && xb < a.x_batch;
      }
      device::named_barrier_sync<1, kConsumerThreads>();
      // 16-byte stores of 8 outputs: plain 16 chunks per token (128 columns), glu 8 (64 columns).
      constexpr int kChunks = kGlu ? 8 : 16;
      const int col0 = cb * cols_per_item;
      for (int i = ct; i < rows * kChunks; i += kConsumerThreads) {
        const int tok = i / kChunks, chunk = i % kChunks;
        const int col = col0 + chunk * 8;
        if (col >= a.N || !row_ok[tok]) continue;
        const T* src = staging + tok * Layout::kOutStride + chunk * 8;
        uint4 v = *reinterpret_cast<const uint4*>(src);
        if constexpr (kGlu) v = device::glu8<kAct, T>(v, *reinterpret_cast<const uint4*>(src + 64));
        *reinterpret_cast<uint4*>(out + (row0 + tok) * a.N + col) = v;
      }
      ring0 += k_tiles;
    }
  }
#else
  (void)p;
  (void)tiles;
  (void)header;
  __trap();
#endif
}

std::atomic<int> g_max_ctas{0};
std::atomic<uint64_t> g_launches{0};
std::atomic<uint64_t> g_tiled_launches{0};

template <class T, WgmmaForm kForm, bool kTiled>
void launch_ws_build(const WgmmaTileArgs& p, const ExpertTile* tiles, const TilePlanHeader* header) {
  static const bool smem_configured = [] {
    EXPERTQMM_CUDA_CHECK(cudaFuncSetAttribute(expert_tiles_ws_kernel<T, kForm, kTiled>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, Layout::kAllocBytes));
    return true;
  }();
  (void)smem_configured;
  const int cap = g_max_ctas.load();
  const int grid = cap > 0 ? std::min(cap, device_sm_count()) : device_sm_count();
  expert_tiles_ws_kernel<T, kForm, kTiled><<<grid, kThreads, Layout::kAllocBytes, current_stream()>>>(p, tiles, header);
  EXPERTQMM_CUDA_CHECK_LAUNCH("expert_tiles_ws_kernel");
  g_launches.fetch_add(1);
  if (kTiled) g_tiled_launches.fetch_add(1);
}

// The tile-layout build when every weight the form reads has one (glu: the gate's and the up's).
template <class T, WgmmaForm kForm>
void launch_ws(const WgmmaTileArgs& p, const ExpertTile* tiles, const TilePlanHeader* header) {
  const bool tiled = p.tile.q.tiled_codes != nullptr && (!is_glu(kForm) || p.up.tiled_codes != nullptr);
  if (tiled) launch_ws_build<T, kForm, true>(p, tiles, header);
  else launch_ws_build<T, kForm, false>(p, tiles, header);
}

}  // namespace

void set_wgmma_ws_max_ctas(int ctas) { g_max_ctas.store(ctas > 0 ? ctas : 0); }
uint64_t wgmma_ws_launches() { return g_launches.load(); }
uint64_t wgmma_ws_tiled_launches() { return g_tiled_launches.load(); }

bool wgmma_ws_takes(DType dtype, int bits, bool fp, int max_tokens) {
  return wgmma_ws_setting() == RouteSwitch::on && bits == 4 && !fp &&
         max_tokens == kTokens && (dtype == DType::bf16 || dtype == DType::f16);
}

void launch_expert_tiles_ws(const WgmmaTileArgs& p, WgmmaForm form, DType dtype, const ExpertTile* tiles,
                            const TilePlanHeader* header) {
  const bool bf16 = dtype == DType::bf16;
  switch (form) {
    case WgmmaForm::plain:
      return bf16 ? launch_ws<__nv_bfloat16, WgmmaForm::plain>(p, tiles, header)
                  : launch_ws<__half, WgmmaForm::plain>(p, tiles, header);
    case WgmmaForm::geglu:
      return bf16 ? launch_ws<__nv_bfloat16, WgmmaForm::geglu>(p, tiles, header)
                  : launch_ws<__half, WgmmaForm::geglu>(p, tiles, header);
    case WgmmaForm::swiglu:
      return bf16 ? launch_ws<__nv_bfloat16, WgmmaForm::swiglu>(p, tiles, header)
                  : launch_ws<__half, WgmmaForm::swiglu>(p, tiles, header);
  }
  throw Error("gather_qmm", detail::cat("expert_tiles_ws has no kernel for dtype=", dtype_name(dtype),
                                        " form=", static_cast<int>(form)));
}

}  // namespace expertqmm::cuda

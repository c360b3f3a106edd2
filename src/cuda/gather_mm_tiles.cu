// tiles: the sorted tile route of gather_mm (16-bit experts). The rows are cut by the expert tile
// plan (src/core/tile_plan.h; built on the device by tile_plan.cu, or shared by the MoE layer's
// GEMMs) into tiles that each belong to one expert, and one CTA per (plan tile, 128 columns) runs
// a bf16/f16 mma.sync m16n8k16 GEMM over the full K with the weights read as they are: no
// dequantization, so both operands go through the same cp.async pipeline and ldmatrix.
//
// Operands (element offsets in int64):
//   x    x_batch matrices of (M, K) T (M == 1 here), x_batch_stride apart; problem row r reads x row
//        lhs[r] (lhs null: r)
//   w    (E, N, K) T with K contiguous: mlx-lm's [E, N, K] weight, seen by gather_mm as its
//        swapaxes(-1, -2) [E, K, N]; matrix e at e * w_batch_stride, row n at n * w_row_stride
//   out  (rows, N) T
//
// Work split. Grid (ceil(N / 128), min(plan tile slots, 65535)); CTA (x, y) runs plan tiles
// y, y + gridDim.y, ... against columns [128x, 128x + 128). A tile of bm 16/32/64 rows runs as one
// mm_tile of that height, a 128-row class tile as two 64-row halves. Inside mm_tile the 4 warps
// share all BM rows and split the 128 columns: warp w owns columns [32w, 32w + 32) = four n8 tiles,
// and BM/16 m16 tiles, so it holds BM/16 x 4 accumulator fragments (64 floats at BM 64). Per k16
// step a lane loads the A fragment of each m16 tile with one ldmatrix.x4 and the B fragments of its
// four n8 tiles with two ldmatrix.x4 (the weight rows are n, so the non-transposed 8x8 matrices of
// an [n][k] tile are exactly mma's column-major B fragment), then issues BM/16 x 4 mmas. A
// 3-stage cp.async pipeline keeps two 64-wide k tiles in flight; each thread's copies per k tile
// are fixed (the x chunks tid + 128i, the weight chunks of rows tid/8 + 16i, chunk tid % 8).
//
// Shared memory per stage (16-byte chunks, chunk c of row r stored at c ^ (r % 8): the 8 rows one
// ldmatrix reads fall in 8 different bank groups):
//   xs (BM, 64) T      the tile's x rows, zero for rows past the tile and for k >= K
//   ws (128, 64) T     weight rows n0 .. n0+127 of the expert, zero past N and K
// Before the stages: (BM,) int64 x offset per row, -1 for rows to skip (past the end, bad lhs).
//
// A retracted plan (unsorted or out-of-range ids) makes the same CTAs run 16-row tiles of all rows,
// one pass per run of equal ids (device::for_each_expert_run), so any order stays correct; CTA (0, 0)
// counts the retraction for the diagnostics (Primitive::gather_mm), once per call.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "core/route_counters.h"
#include "core/tile_plan.h"
#include "cuda/device/cp_async.cuh"
#include "cuda/device/elem.cuh"
#include "cuda/device/mma.cuh"
#include "cuda/device/tile_gemm.cuh"
#include "cuda/gather_mm.h"
#include "cuda/runtime.cuh"
#include "cuda/tile_plan.cuh"

namespace expertqmm::cuda {

namespace {

using detail::ExpertTile;
using detail::TilePlanHeader;
using device::Elem;

struct MmTileArgs {
  const void* x;
  const void* w;
  const int32_t* lhs;  // (B,) or nullptr (identity)
  const int32_t* rhs;  // (B,) (the retracted path reads it)
  void* out;
  uint32_t* faults;
  int64_t rows;  // B * M
  int64_t x_batch, x_batch_stride;
  int64_t w_batch_stride, w_row_stride;
  int M, N, K, E;
  bool paired_store;  // N even and out 4-byte aligned: two outputs per 32-bit store
};

constexpr int kBN = kMmTileCols, kBK = 64, kWarps = 4, kThreads = 32 * kWarps, kStages = 3;
constexpr int kWarpN = kBN / kWarps;  // 32 columns per warp
constexpr int kN8 = kWarpN / 8;       // 4 n8 tiles per warp
constexpr int kChunks = kBK / 8;      // 16-byte chunks per row per k tile

template <int kBM>
struct MmTileLayout {
  static constexpr int kRowInfoBytes = (kBM * 8 + 127) / 128 * 128;
  static constexpr int kXBytes = kBM * kBK * 2;
  static constexpr int kWBytes = kBN * kBK * 2;
  static constexpr int kStageBytes = kXBytes + kWBytes;
};
// Every tile height reuses the dynamic shared memory from offset 0: the 64-row layout is the largest
// (72.5 KB; 3 CTAs fit an H100/H200 SM, 2 an A100 SM).
constexpr int kSmemBytes = MmTileLayout<64>::kRowInfoBytes + kStages * MmTileLayout<64>::kStageBytes;

__device__ __forceinline__ int swizzled(int row, int chunk) { return row * kBK + ((chunk ^ (row & 7)) << 3); }

// Rows [row0, row0 + load_rows) (load_rows <= BM) times expert `expert`'s weight for columns
// [n_block * 128, +128) over the full K; stores the local rows [store_begin, store_end). Called by
// all kThreads threads with the same arguments; ends with a barrier, so calls may follow each other.
template <int kBM, class T>
__device__ __forceinline__ void mm_tile(const MmTileArgs& a, int expert, int64_t row0, int load_rows, int store_begin,
                                        int store_end, int n_block, unsigned char* smem) {
  using L = MmTileLayout<kBM>;
  constexpr int kM16 = kBM / 16;
  const int tid = threadIdx.x;
  if (expert < 0 || expert >= a.E) {
    if (tid == 0) record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(expert), static_cast<uint32_t>(a.E));
    return;  // uniform across the CTA
  }
  int64_t* row_offset = reinterpret_cast<int64_t*>(smem);
  if (tid < kBM) {
    int64_t offset = -1;
    if (tid < load_rows) {
      const int64_t r = row0 + tid;
      const int64_t b = r / a.M, m = r - b * a.M;
      const int64_t xb = a.lhs ? static_cast<int64_t>(a.lhs[b]) : b;
      if (xb >= 0 && xb < a.x_batch) offset = xb * a.x_batch_stride + m * a.K;
      else record_fault(a.faults, kFaultRowOutOfRange, static_cast<uint32_t>(xb), static_cast<uint32_t>(a.x_batch));
    }
    row_offset[tid] = offset;
  }
  __syncthreads();

  const T* x = static_cast<const T*>(a.x);
  const int n0 = n_block * kBN;
  const int chunk = tid % kChunks;  // every copy of this thread moves this 16-byte chunk of a row
  // x copies: chunks tid + 128i of the (BM, 8) chunk grid, i.e. rows tid/8 + 16i.
  constexpr int kXCopies = (kBM * kChunks + kThreads - 1) / kThreads;
  const T* x_src[kXCopies];
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int row = (tid + i * kThreads) / kChunks;
    const int64_t offset = row < kBM ? row_offset[row] : -1;
    x_src[i] = offset >= 0 ? x + offset + chunk * 8 : nullptr;
  }
  // Weight copies: rows tid/8 + 16i of the 128-row block, one base pointer stepping 16 rows.
  constexpr int kWCopies = kBN * kChunks / kThreads;
  constexpr int kWRowStep = kThreads / kChunks;
  const int w_row0 = tid / kChunks;
  const T* w_expert = static_cast<const T*>(a.w) + static_cast<int64_t>(expert) * a.w_batch_stride;
  const T* w_src = w_expert + static_cast<int64_t>(n0 + w_row0) * a.w_row_stride + chunk * 8;

  auto stage_base = [&](int stage) { return smem + L::kRowInfoBytes + stage * L::kStageBytes; };
  auto load_stage = [&](int stage, int kt) {
    T* xs = reinterpret_cast<T*>(stage_base(stage));
    T* ws = reinterpret_cast<T*>(stage_base(stage) + L::kXBytes);
    const int k = kt * kBK + chunk * 8;
    const bool k_in = k < a.K;  // K % 8 == 0: a chunk is wholly inside K or wholly past it
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      const int row = (tid + i * kThreads) / kChunks;
      if ((kBM * kChunks) % kThreads != 0 && row >= kBM) break;
      const bool valid = k_in && x_src[i] != nullptr;
      device::cp_async_16(xs + swizzled(row, chunk), valid ? x_src[i] + kt * kBK : x, valid);
    }
#pragma unroll
    for (int i = 0; i < kWCopies; ++i) {
      const int row = w_row0 + i * kWRowStep;
      const bool valid = k_in && n0 + row < a.N;
      device::cp_async_16(ws + swizzled(row, chunk), valid ? w_src + i * kWRowStep * a.w_row_stride + kt * kBK : a.w,
                          valid);
    }
  };

  const int warp = tid >> 5, lane = tid & 31;
  const int warp_col = warp * kWarpN;
  float acc[kM16][kN8][4];
#pragma unroll
  for (int mt = 0; mt < kM16; ++mt)
#pragma unroll
    for (int j = 0; j < kN8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.f;

  const int k_tiles = (a.K + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    device::cp_async_commit();  // empty groups keep the count uniform
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    device::cp_async_wait<kStages - 2>();
    __syncthreads();  // tile kt visible; the stage of kt-1 is free
    if (kt + kStages - 1 < k_tiles) load_stage((kt + kStages - 1) % kStages, kt + kStages - 1);
    device::cp_async_commit();
    const T* xs = reinterpret_cast<const T*>(stage_base(kt % kStages));
    const T* ws = reinterpret_cast<const T*>(stage_base(kt % kStages) + L::kXBytes);
#pragma unroll
    for (int s = 0; s < kBK / 16; ++s) {
      // B fragments: ldmatrix p covers n8 tiles 2p and 2p+1; lane L addresses weight row
      // warp_col + 8(2p + L/16) + L%8 at k chunk 2s + (L/8)%2, so registers 0-1 are b0/b1 of
      // tile 2p and 2-3 those of tile 2p+1.
      uint32_t bfrag[kN8][2];
#pragma unroll
      for (int p = 0; p < kN8 / 2; ++p) {
        uint32_t r[4];
        const int row = warp_col + 8 * (2 * p + (lane >> 4)) + (lane & 7);
        device::ldmatrix_x4(r, ws + swizzled(row, 2 * s + ((lane >> 3) & 1)));
        bfrag[2 * p][0] = r[0];
        bfrag[2 * p][1] = r[1];
        bfrag[2 * p + 1][0] = r[2];
        bfrag[2 * p + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < kM16; ++mt) {
        // A fragment: lanes 0-15 address rows 0-15 of k chunk 2s, lanes 16-31 of chunk 2s+1.
        uint32_t afrag[4];
        const int row = mt * 16 + (lane & 15);
        device::ldmatrix_x4(afrag, xs + swizzled(row, 2 * s + (lane >> 4)));
#pragma unroll
        for (int j = 0; j < kN8; ++j) device::Mma<T>::run(acc[mt][j], afrag, bfrag[j][0], bfrag[j][1]);
      }
    }
  }
  device::cp_async_wait<0>();

  // Epilogue: c0,c1 are local row mt*16 + g, c2,c3 row mt*16 + g + 8, columns 2t and 2t+1.
  T* out = static_cast<T*>(a.out);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kM16; ++mt)
#pragma unroll
    for (int j = 0; j < kN8; ++j) {
      const int col = n0 + warp_col + 8 * j + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int local = mt * 16 + g + 8 * h;
        if (local < store_begin || local >= store_end || row_offset[local] < 0 || col >= a.N) continue;
        T* o = out + (row0 + local) * a.N + col;
        if (a.paired_store) {
          *reinterpret_cast<uint32_t*>(o) = Elem<T>::pack2(acc[mt][j][2 * h], acc[mt][j][2 * h + 1]);
        } else {
          o[0] = Elem<T>::from_float(acc[mt][j][2 * h]);
          if (col + 1 < a.N) o[1] = Elem<T>::from_float(acc[mt][j][2 * h + 1]);
        }
      }
    }
  __syncthreads();  // row_offset and the stages are rewritten by the next call
}

// The route's one kernel: every plan tile class, or the retracted path (see the file comment).
template <class T>
__global__ void __launch_bounds__(kThreads)
    mm_tiles_kernel(MmTileArgs a, const ExpertTile* __restrict__ tiles, const TilePlanHeader* __restrict__ header,
                    unsigned long long* retractions) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int sorted = header->sorted;
  if (!sorted && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) atomicAdd(retractions, 1ull);
  if (sorted) {
    const int tile_count = header->tile_count;
    for (int i = blockIdx.y; i < tile_count; i += gridDim.y) {
      const ExpertTile tile = tiles[i];
      if (tile.bm >= 64) {
        for (int half = 0; half < tile.rows; half += 64) {
          const int rows = min(64, tile.rows - half);
          mm_tile<64, T>(a, tile.expert, tile.row_begin + half, rows, 0, rows, blockIdx.x, smem);
        }
      } else if (tile.bm == 32) {
        mm_tile<32, T>(a, tile.expert, tile.row_begin, tile.rows, 0, tile.rows, blockIdx.x, smem);
      } else {
        mm_tile<16, T>(a, tile.expert, tile.row_begin, tile.rows, 0, tile.rows, blockIdx.x, smem);
      }
    }
    return;
  }
  __shared__ int tile_expert[16];
  const int64_t row_tiles = (a.rows + 15) / 16;
  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y)
    device::for_each_expert_run<16>(a, tile, tile_expert, [&](int expert, int64_t row0, int load_rows, int begin, int end) {
      mm_tile<16, T>(a, expert, row0, load_rows, begin, end, blockIdx.x, smem);
    });
}


template <class T>
void launch_mm_tiles(const MmTileArgs& args, const TilePlanView& plan) {
  static const bool smem_configured = [] {
    EXPERTQMM_CUDA_CHECK(
        cudaFuncSetAttribute(mm_tiles_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  (void)smem_configured;
  // Enough CTAs in y for every plan tile and for the 16-row tiles of the retracted path.
  const int64_t slots = std::max<int64_t>(plan.tile_slots, (args.rows + 15) / 16);
  const dim3 grid(ceil_div(args.N, kBN), static_cast<unsigned>(std::min<int64_t>(slots, 65535)));
  mm_tiles_kernel<T><<<grid, kThreads, kSmemBytes, current_stream()>>>(args, plan.tiles, plan.header,
                                                                        retraction_counter(detail::Primitive::gather_mm));
  EXPERTQMM_CUDA_CHECK_LAUNCH("mm_tiles_kernel");
}

}  // namespace

RouteSupport supports_mm_tiles(const detail::GatherMmProblem& p) {
  if (!p.sorted_indices) return route_miss(Fallback::topology);
  if (p.M != 1 || p.rhs_is_identity) return route_miss(Fallback::topology);
  const RouteSupport operands = supports_mm_operands(p);
  if (!operands.ok) return operands;
  if (p.w_batch > detail::kTilePlanMaxExperts || p.B > detail::kTilePlanMaxRows) return route_miss(Fallback::shape);
  if (p.B <= kGemvMaxRows) return route_miss(Fallback::shape);  // decode sizes: gemv
  return route_ok();
}

void call_mm_tiles(const detail::GatherMmProblem& p, void* out, Workspace* ws) {
  const RouteSupport s = supports_mm_tiles(p);
  EXPERTQMM_CHECK(s.ok, "gather_mm", "tiles does not support ", p.describe(), " (", fallback_name(s.reason), ")");
  const int E = static_cast<int>(p.w_batch);
  Tensor temp;
  const void* plan = p.tile_plan;
  if (plan == nullptr) {
    const size_t bytes = tile_plan_bytes(p.B, E);
    void* base = nullptr;
    if (ws) {
      base = ws->get(detail::kSlotTilePlan, bytes);
    } else {
      temp = Tensor::empty({static_cast<int64_t>((bytes + 3) / 4)}, DType::i32, Device::cuda);
      base = temp.data();
    }
    launch_build_tile_plan_at(p.rhs.data_as<const int32_t>(), p.B, E, base, current_stream());
    plan = base;
  }
  MmTileArgs a{};
  a.x = p.x.data();
  a.w = p.w.data();
  a.lhs = p.lhs_is_identity ? nullptr : p.lhs.data_as<const int32_t>();
  a.rhs = p.rhs.data_as<const int32_t>();
  a.out = out;
  a.faults = device_faults();
  a.rows = p.B * p.M;
  a.x_batch = p.x_batch;
  a.x_batch_stride = p.x_batch_stride;
  a.w_batch_stride = p.w_batch_stride;
  a.w_row_stride = p.w_stride_n;
  a.M = static_cast<int>(p.M);
  a.N = static_cast<int>(p.N);
  a.K = static_cast<int>(p.K);
  a.E = E;
  a.paired_store = p.N % 2 == 0 && is_aligned(out, 4);
  const TilePlanView view = tile_plan_view(plan, p.B, E);
  if (p.dtype == DType::bf16) launch_mm_tiles<__nv_bfloat16>(a, view);
  else launch_mm_tiles<__half>(a, view);
}

}  // namespace expertqmm::cuda

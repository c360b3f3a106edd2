// rhs_tiles: the generic tensor-core route of gather_qmm (MLX gather_qmm_rhs), for any row count
// and any order of expert ids.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/device/tile_gemm.cuh"
#include "cuda/gather_qmm_routes.h"
#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

namespace {

using device::TileArgs;
using device::TileConfig;
using device::TileLayout;

// Kernel: grid (ceil(N / BN), min(row_tiles, 65535)), Cfg::THREADS threads. CTA (x, y) owns the
// column block x and the row tiles y, y + gridDim.y, ... (BM consecutive problem rows each). It
// reads the tile's BM expert ids (rhs[r / M]) into shared memory, splits them into maximal runs of
// equal ids and, for each run, runs tile_gemm over all BM rows with that expert's weights, storing
// only the run's rows. Sorted ids give one run per tile; any order stays correct, only slower.
// kSplitK: grid z = split_k.slices, CTA (x, y, z) does the same over the z-th slice of the k
// tiles and writes fp32 sums to split_k.partial (slices, rows, N); split_k_sum_kernel finishes.
// kFp: MLX's fp modes (bf16; device::tile_gemm's kFp).
template <class Cfg, class T, int kBits, bool kSplitK, bool kFp>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS_PER_SM)
    rhs_tiles_kernel(TileArgs a, int64_t row_tiles, device::SplitK split_k) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int tile_expert[Cfg::BM];  // (BM,) expert id of each local row
  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y)
    device::tile_gemm_runs<Cfg, T, kBits, kSplitK, kFp>(a, tile, blockIdx.x, smem, tile_expert, split_k);
}

// out[i] = T(partial[0][i] + partial[1][i] + ...), the slices added in order (the same bits every
// run). partial (splits, count) fp32, out (count,) T. Work split: 4 consecutive values per thread,
// grid-stride; count % 4 == 0 and 16-byte aligned slices (checked by the caller).
template <class T>
__global__ void split_k_sum_kernel(const float* __restrict__ partial, int splits, int64_t count, T* __restrict__ out) {
  const int64_t count4 = count / 4;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float4 sum = reinterpret_cast<const float4*>(partial)[i];
    for (int z = 1; z < splits; ++z) {
      const float4 v = reinterpret_cast<const float4*>(partial + z * count)[i];
      sum.x = __fadd_rn(sum.x, v.x);
      sum.y = __fadd_rn(sum.y, v.y);
      sum.z = __fadd_rn(sum.z, v.z);
      sum.w = __fadd_rn(sum.w, v.w);
    }
    T* o = out + 4 * i;
    o[0] = device::Elem<T>::from_float(sum.x);
    o[1] = device::Elem<T>::from_float(sum.y);
    o[2] = device::Elem<T>::from_float(sum.z);
    o[3] = device::Elem<T>::from_float(sum.w);
  }
}

template <class Cfg, class T, int kBits, bool kSplitK, bool kFp>
void launch_rhs_tiles_kernel(const TileArgs& args, device::SplitK split_k) {
  constexpr int kSmem = TileLayout<Cfg, kBits>::kSmemBytes;
  static const bool smem_configured = [] {
    if (kSmem > 48 * 1024)
      EXPERTQMM_CUDA_CHECK(cudaFuncSetAttribute(rhs_tiles_kernel<Cfg, T, kBits, kSplitK, kFp>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    return true;
  }();
  (void)smem_configured;
  const int64_t row_tiles = (args.rows + Cfg::BM - 1) / Cfg::BM;
  const dim3 grid(ceil_div(args.N, Cfg::BN), static_cast<unsigned>(std::min<int64_t>(row_tiles, 65535)),
                  static_cast<unsigned>(split_k.slices));
  rhs_tiles_kernel<Cfg, T, kBits, kSplitK, kFp><<<grid, Cfg::THREADS, kSmem, current_stream()>>>(args, row_tiles, split_k);
  EXPERTQMM_CUDA_CHECK_LAUNCH("rhs_tiles_kernel");
}

template <class Cfg, class T, int kBits, bool kFp = false>
void launch_rhs_tiles(const TileArgs& args) {
  launch_rhs_tiles_kernel<Cfg, T, kBits, false, kFp>(args, device::SplitK{nullptr, 1});
}

// split_k.slices >= 2 fp32 slices of (rows, N) at split_k.partial; args.out receives the rounded sums.
template <class Cfg, class T, int kBits, bool kFp = false>
void launch_rhs_tiles_split_k(const TileArgs& args, device::SplitK split_k) {
  launch_rhs_tiles_kernel<Cfg, T, kBits, true, kFp>(args, split_k);
  const int64_t count = args.rows * args.N;
  const int64_t blocks = std::min<int64_t>((count / 4 + 255) / 256, 4096);
  split_k_sum_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, current_stream()>>>(split_k.partial, split_k.slices,
                                                                                     count, static_cast<T*>(args.out));
  EXPERTQMM_CUDA_CHECK_LAUNCH("split_k_sum_kernel");
}

// Register caps (the 5th parameter, CTAs per SM for __launch_bounds__) chosen from ptxas -v: BM=16
// fits 128 registers (4 CTAs, 16 warps per SM) and BM=32 168 (3 CTAs) without spills.
using RhsTiles16 = TileConfig<16, 128, 4, 4, 4>;
using RhsTiles32 = TileConfig<32, 128, 4, 4, 3>;
// BM=64: each dequantized B fragment feeds 4 mmas. ptxas wants 215-228 registers (64 fp32
// accumulators per lane plus addressing); capped at 168 it spills 4-40 bytes, at 128 about 240,
// so it runs uncapped at 2 CTAs (8 warps) per SM. That is enough: every warp has 16 independent
// mmas per k16 step to cover the tensor-core latency. BN=128 with 4 warps rather than BN=256 with
// 8: the same 8 warps per SM and per-warp registers either way, but two CTAs do not all stop at
// the same barrier, and 128-wide column blocks give twice the CTAs (N=704 has the same 8% tail
// either way). Shared memory: 4 stages of 13 KB.
using RhsTiles64 = TileConfig<64, 128, 4, 4>;

// The rhs_tiles kernels. The first entry matching (dtype, bits, fp) with min_m <= M is used: when
// every batch element has at least 64 (32) rows, one expert each, BM=64 (32) tiles dequantize each
// weight once for four (two) m16 mma tiles; otherwise BM=16 (MLX's tile height) wastes fewer rows
// on short runs. MLX's fp modes (bf16) have the BM=16 kernels only (and their split-K form: the
// router's projection), to keep the instance count down: rows-heavy fp problems with sorted ids
// take the expert tile route.
struct RhsTilesVariant {
  int bm;
  int64_t min_m;
  DType dtype;
  int bits;
  bool fp;  // an fp mode's codes (mxfp4 / nvfp4: 4-bit, mxfp8: 8-bit)
  void (*launch)(const TileArgs&);
  // The split-K form (see kSplitK), for a grid too small for the GPU: BM=16 (every form) and BM=64 bf16
  // (the router's projection at prefill: one weight dequantized per 64 rows instead of 16).
  void (*launch_split_k)(const TileArgs&, device::SplitK);
};
const RhsTilesVariant kRhsTilesVariants[] = {
    {64, 64, DType::bf16, 4, false, launch_rhs_tiles<RhsTiles64, __nv_bfloat16, 4>, launch_rhs_tiles_split_k<RhsTiles64, __nv_bfloat16, 4>},
    {64, 64, DType::bf16, 8, false, launch_rhs_tiles<RhsTiles64, __nv_bfloat16, 8>, launch_rhs_tiles_split_k<RhsTiles64, __nv_bfloat16, 8>},
    {64, 64, DType::f16, 4, false, launch_rhs_tiles<RhsTiles64, __half, 4>, nullptr},
    {64, 64, DType::f16, 8, false, launch_rhs_tiles<RhsTiles64, __half, 8>, nullptr},
    {32, 32, DType::bf16, 4, false, launch_rhs_tiles<RhsTiles32, __nv_bfloat16, 4>, nullptr},
    {32, 32, DType::bf16, 8, false, launch_rhs_tiles<RhsTiles32, __nv_bfloat16, 8>, nullptr},
    {32, 32, DType::f16, 4, false, launch_rhs_tiles<RhsTiles32, __half, 4>, nullptr},
    {32, 32, DType::f16, 8, false, launch_rhs_tiles<RhsTiles32, __half, 8>, nullptr},
    {16, 1, DType::bf16, 4, false, launch_rhs_tiles<RhsTiles16, __nv_bfloat16, 4>, launch_rhs_tiles_split_k<RhsTiles16, __nv_bfloat16, 4>},
    {16, 1, DType::bf16, 8, false, launch_rhs_tiles<RhsTiles16, __nv_bfloat16, 8>, launch_rhs_tiles_split_k<RhsTiles16, __nv_bfloat16, 8>},
    {16, 1, DType::f16, 4, false, launch_rhs_tiles<RhsTiles16, __half, 4>, launch_rhs_tiles_split_k<RhsTiles16, __half, 4>},
    {16, 1, DType::f16, 8, false, launch_rhs_tiles<RhsTiles16, __half, 8>, launch_rhs_tiles_split_k<RhsTiles16, __half, 8>},
    {16, 1, DType::bf16, 4, true, launch_rhs_tiles<RhsTiles16, __nv_bfloat16, 4, true>,
     launch_rhs_tiles_split_k<RhsTiles16, __nv_bfloat16, 4, true>},
    {16, 1, DType::bf16, 8, true, launch_rhs_tiles<RhsTiles16, __nv_bfloat16, 8, true>,
     launch_rhs_tiles_split_k<RhsTiles16, __nv_bfloat16, 8, true>},
};

// Split-K when a tile height's grid is too small for the GPU (a few-column problem with many rows,
// such as the router's projection: N = 128, K = 2816, T rows: T / 16 BM=16 CTAs, each a chain of 44
// k tiles at ~0.6 us per tile, 27 us at T = 512 and 2048; bench/NOTES.md step 7c), as data: slices
// to reach the kernel's CTAs per SM (kSplitCtasPerSm16: the BM=16 kernel's residency;
// kSplitCtasPerSm64: BM=64 runs uncapped at 2), each at least kSplitMinKTiles k tiles, at most
// kSplitMaxSlices, and the fp32 slices at most kSplitMaxBytes16 / 64 of workspace (8 MB lets BM=64
// reach 8 slices at 2048 rows of N = 128, as measured; BM=16 keeps its 4). BM=64 splits where
// every batch element has 64 rows (x [1, T, K]: the router at prefill, T >= 64), so that each
// weight tile is dequantized once per 64 rows rather than 16 (bench/NOTES.md step 55).
constexpr int64_t kSplitCtasPerSm16 = RhsTiles16::MIN_CTAS_PER_SM;
constexpr int64_t kSplitCtasPerSm64 = 2;
constexpr int64_t kSplitMinKTiles = 4;
constexpr int64_t kSplitMaxSlices = 16;
constexpr int64_t kSplitMaxBytes16 = int64_t{4} << 20;
constexpr int64_t kSplitMaxBytes64 = int64_t{8} << 20;
// BM=64 splits only problems of this many 128-column blocks (the router's N = 128; wider ones keep
// the measured rule: BM=32 where BM=64's grid is small) and at least this many 64-row tiles: on an
// H100 the Gemma layer measured +1.8 / +1.8 / 0.0 / -1.1% at 1 / 2 / 8 / 32 tiles (64 / 128 / 512 /
// 2048 tokens; bench/NOTES.md "Step 55 measured"), so it starts where it measured faster.
constexpr int64_t kSplitTallMaxColBlocks = 1;
constexpr int64_t kSplitTallMinRowTiles = 32;

int64_t split_slices(int64_t rows, int64_t N, int64_t K, int64_t bm, int64_t ctas_per_sm, int64_t max_bytes) {
  const int64_t ctas = std::max<int64_t>(1, (rows + bm - 1) / bm * ((N + RhsTiles16::BN - 1) / RhsTiles16::BN));
  const int64_t want = (ctas_per_sm * device_sm_count() + ctas - 1) / ctas;
  const int64_t by_bytes = max_bytes / std::max<int64_t>(1, rows * N * 4);
  const int64_t slices = std::min({want, K / RhsTiles16::BK / kSplitMinKTiles, kSplitMaxSlices, by_bytes});
  const bool aligned = N % 4 == 0;  // split_k_sum_kernel's float4 slices
  return aligned && slices >= 2 ? slices : 1;
}

}  // namespace

int64_t rhs_tiles_split_slices(int64_t rows, int64_t N, int64_t K, int bm) {
  if (bm == 64) {  // only where BM=64's own grid leaves SMs idle, and only few-column problems
    const int64_t col_blocks = (N + RhsTiles64::BN - 1) / RhsTiles64::BN;
    const int64_t row_tiles = (rows + 63) / 64;
    if (col_blocks > kSplitTallMaxColBlocks || row_tiles < kSplitTallMinRowTiles ||
        row_tiles * col_blocks >= device_sm_count())
      return 1;
  }
  return bm == 64 ? split_slices(rows, N, K, bm, kSplitCtasPerSm64, kSplitMaxBytes64)
                  : split_slices(rows, N, K, bm, kSplitCtasPerSm16, kSplitMaxBytes16);
}

size_t gather_qmm_split_k_bytes(int64_t rows, int64_t N, int64_t K) {
  // Either tile height may split (run_rhs_tiles picks by the problem's dtype, bits and M): room for
  // the larger.
  const int64_t slices = std::max(rhs_tiles_split_slices(rows, N, K, 16), rhs_tiles_split_slices(rows, N, K, 64));
  return slices > 1 ? static_cast<size_t>(slices * rows * N) * sizeof(float) : 0;
}

namespace {

// bm == 0: the table's choice for p.M, except that a taller tile whose grid would leave SMs idle
// splits K where rhs_tiles_split_slices lets it (BM=64 at N <= 128: the router's projection, T / 64
// CTAs over the whole K) and otherwise gives way to a shorter one, and BM=16 splits K when even its
// grid is small (fp32 slices in p.split_k_scratch, else ws slot detail::kSlotSplitK, else a
// temporary); else the variant with that tile height, unsplit.
void run_rhs_tiles(const detail::GatherQmmProblem& p, void* out, int bm, Workspace* ws) {
  const RouteSupport s = supports_rhs_tiles(p);
  EXPERTQMM_CHECK(s.ok, "gather_qmm", "rhs_tiles does not support ", p.describe(), " (",
                  fallback_name(s.reason), ")");
  const int64_t col_blocks = (p.N + 127) / 128;
  for (const RhsTilesVariant& v : kRhsTilesVariants) {
    if (v.dtype != p.dtype || v.bits != p.bits || v.fp != (p.mode != QuantMode::affine)) continue;
    if (bm == 0 ? p.M < v.min_m : v.bm != bm) continue;
    const int64_t ctas = (p.B * p.M + v.bm - 1) / v.bm * col_blocks;
    const int64_t slices = bm == 0 && v.launch_split_k ? rhs_tiles_split_slices(p.B * p.M, p.N, p.K, v.bm) : 1;
    // A tall tile whose grid leaves SMs idle splits K where it can, else gives way to a shorter one.
    if (bm == 0 && v.bm > 16 && ctas < device_sm_count() && slices < 2) continue;
    const TileArgs args = make_tile_args(p, out);
    if (slices > 1) {
      const size_t bytes = static_cast<size_t>(slices * p.B * p.M * p.N) * sizeof(float);
      Tensor temp;
      float* partial = static_cast<float*>(p.split_k_scratch);
      if (partial) {
        // the caller's scratch (sized by gather_qmm_split_k_bytes)
      } else if (ws) {
        partial = static_cast<float*>(ws->get(detail::kSlotSplitK, bytes));
      } else {
        temp = Tensor::empty({static_cast<int64_t>(bytes / sizeof(float))}, DType::f32, Device::cuda);
        partial = temp.data_as<float>();
      }
      v.launch_split_k(args, device::SplitK{partial, static_cast<int>(slices)});
      return;
    }
    v.launch(args);
    return;
  }
  throw Error("gather_qmm", detail::cat("rhs_tiles has no kernel for dtype=", dtype_name(p.dtype),
                                        " bits=", p.bits, " mode=", quant_mode_name(p.mode), " bm=", bm));
}

}  // namespace

RouteSupport supports_tile_operands(const detail::GatherQmmProblem& p) {
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return route_miss(Fallback::dtype);
  // fp modes (each with its one bits and group size): tile_gemm's kFp decodes E2M1 / E4M3 to bf16
  // only (MLX's fp checkpoints are bf16; f16 would also under/overflow decoded scales far sooner).
  if (p.mode != QuantMode::affine && p.dtype != DType::bf16) return route_miss(Fallback::dtype);
  if (p.bits != 4 && p.bits != 8) return route_miss(Fallback::quantization);
  if (p.mode == QuantMode::affine && p.group_size != 32 && p.group_size != 64 && p.group_size != 128)
    return route_miss(Fallback::quantization);
  if (!p.transpose) return route_miss(Fallback::quantization);  // codes run along N, not K
  if (p.K <= 0 || p.N <= 0) return route_miss(Fallback::shape);
  if (!fits_int32(p.N) || !fits_int32(p.K) || !fits_int32(p.M) || !fits_int32(p.B) || !fits_int32(p.w_batch))
    return route_miss(Fallback::shape);
  if (p.K % 64 != 0) return route_miss(Fallback::alignment);
  // 16-byte cp.async of x rows and weight chunks, 4-byte cp.async of scale/bias words.
  if (!is_aligned(p.x.data(), 16) || p.x_batch_stride % 8 != 0) return route_miss(Fallback::alignment);
  if (!is_aligned(p.w.data(), 16)) return route_miss(Fallback::alignment);
  if (!is_aligned(p.scales.data(), 4) || !is_aligned(p.biases.data(), 4)) return route_miss(Fallback::alignment);
  return route_ok();
}

TileArgs make_tile_args(const detail::GatherQmmProblem& p, void* out) {
  TileArgs a{};
  a.x = p.x.data();
  a.q = quant_view(p);
  if (p.mode != QuantMode::affine) {
    // tile_gemm's kFp staging: the uint8 scale codes as uint16 pairs of consecutive groups (K % 64
    // == 0 gives every row an even group count), so a pair covers twice the group size.
    a.q.scales = reinterpret_cast<const uint16_t*>(a.q.fp_scales);
    a.q.groups_per_row /= 2;
    a.q.group_shift += 1;
  }
  a.lhs = p.lhs_is_identity ? nullptr : static_cast<const int32_t*>(p.lhs.data());
  a.rhs = p.rhs_is_identity ? nullptr : static_cast<const int32_t*>(p.rhs.data());
  a.out = out;
  a.faults = device_faults();
  a.rows = p.B * p.M;
  a.x_batch = p.x_batch;
  a.x_batch_stride = p.x_batch_stride;
  a.M = static_cast<int>(p.M);
  a.N = static_cast<int>(p.N);
  a.K = static_cast<int>(p.K);
  a.E = static_cast<int>(p.w_batch);
  a.expert_rows = static_cast<int>(p.N);
  a.paired_store = p.N % 2 == 0 && is_aligned(out, 4);
  return a;
}

RouteSupport supports_rhs_tiles(const detail::GatherQmmProblem& p) { return supports_tile_operands(p); }
RouteSupport supports_rhs_tiles_tall(const detail::GatherQmmProblem& p) {
  if (p.mode != QuantMode::affine) return route_miss(Fallback::quantization);  // BM=16 kernels only
  return supports_tile_operands(p);
}

void call_rhs_tiles(const detail::GatherQmmProblem& p, void* out, Workspace* ws) { run_rhs_tiles(p, out, 0, ws); }
void call_rhs_tiles_bm16(const detail::GatherQmmProblem& p, void* out, Workspace* ws) { run_rhs_tiles(p, out, 16, ws); }
void call_rhs_tiles_bm32(const detail::GatherQmmProblem& p, void* out, Workspace* ws) { run_rhs_tiles(p, out, 32, ws); }
void call_rhs_tiles_bm64(const detail::GatherQmmProblem& p, void* out, Workspace* ws) { run_rhs_tiles(p, out, 64, ws); }

}  // namespace expertqmm::cuda

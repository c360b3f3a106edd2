// One tensor-core tile of gather_qmm: rows [row0, row0 + BM) of the problem times the dequantized
// weights of ONE expert for BN output columns, over the full K, storing a chosen slice of the rows.
// Shared by the generic route (rhs_tiles: one pass per run of equal expert ids inside a 16-row tile)
// and the sorted tile route (expert_tiles: one pass per plan tile, BM = 16, 32 or 64).
//
// Operands (all row-major, element offsets in int64):
//   x      activations, x_batch matrices of (M, K) T, x_batch_stride elements apart; problem row r
//          (b = r / M, m = r % M) reads x + lhs[b] * x_batch_stride + m * K (lhs == nullptr: b)
//   w      (E, N, K*bits/32) uint32, LSB-first codes (4-bit: 8 nibbles per word, value i at bits 4i)
//   scales, biases  (E, N, K/group_size) raw T bits (bf16 or f16)
//   out    (rows, N) T
//
// Work split inside the CTA (THREADS = 32 * WARPS): every warp covers all BM rows (BM/16 m16 tiles)
// and WARP_N = BN/WARPS consecutive columns (WARP_N/8 n8 tiles). Per k tile (BK = 64) a lane reads
// the scale and bias of each of its columns once (as packed T pairs). Per k16 step it loads the A
// fragment of each m16 tile with ldmatrix, then for each of its n8 tiles takes the packed words of
// its column g = lane/4 (4-bit: one 16-byte shared load per two steps; 8-bit: two 4-byte loads),
// dequantizes the 4 values it owns in the B fragment (k = 2t, 2t+1, 2t+8, 2t+9, t = lane%4) to T
// with packed math (PackedDequant) and issues one mma per m16 tile, so a larger BM spreads the
// dequantization over more mmas. A multi-stage cp.async pipeline keeps STAGES-1 k tiles in
// flight; each thread's copies per k tile are a fixed set (see the copy setup).
//
// Shared memory, per stage (all offsets 16-byte aligned):
//   xs  (BM, 64) T: 8 chunks of 16 bytes per row, chunk c stored at c ^ (row % 8) so that the 8
//       rows one ldmatrix reads hit 8 different bank groups
//   ws  (BN, 64*bits/32) uint32: 2 (4-bit) or 4 (8-bit) chunks per row, chunk c stored at
//       c ^ ((row * chunks / 8) % chunks) so that the 8 columns a warp reads at once spread over
//       all 32 banks
//   ss, bs  (BN,) uint32: the aligned word of scales/biases that holds this k tile's group(s)
//       (one 4-byte cp.async per row; the group sits in the low or high half, see scale_half)
//       kFp (MLX's fp modes, bf16): ss only; make_tile_args views the uint8 scale codes as uint16
//       pairs of groups, so the same staging brings a k tile's 2 (mxfp4 / mxfp8, group 32) or 4
//       (nvfp4, group 16) codes, and each k16 step decodes its group's scale (FpDequantBf16).
// Before the stages: (BM,) int64 x offset per row, -1 for rows to skip (past the end, bad lhs).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/device/cp_async.cuh"
#include "cuda/device/dequant.cuh"
#include "cuda/device/quant_view.cuh"
#include "cuda/device/mma.cuh"
#include "cuda/runtime.cuh"
#include "expertqmm/quant.h"

namespace expertqmm::cuda::device {

// A tile shape. BK is fixed at 64: the x swizzle, the scale staging and the fragment unpacking are
// written for eight 16-byte x chunks per row and at most two groups (group_size 32) per k tile.
// kMinCtasPerSm is a hint for the calling kernel's __launch_bounds__ (register cap 64K / (CTAs *
// THREADS)); 1 leaves ptxas free.
template <int kBM, int kBN, int kWarps, int kStages, int kMinCtasPerSm = 1>
struct TileConfig {
  static constexpr int MIN_CTAS_PER_SM = kMinCtasPerSm;
  static constexpr int BM = kBM;
  static constexpr int BN = kBN;
  static constexpr int BK = 64;
  static constexpr int WARPS = kWarps;
  static constexpr int STAGES = kStages;
  static constexpr int THREADS = 32 * kWarps;
  static constexpr int WARP_N = kBN / kWarps;  // columns per warp
  static constexpr int N8_TILES = WARP_N / 8;
  static constexpr int M16_TILES = kBM / 16;
  static_assert(kBM % 16 == 0 && kBM <= THREADS, "BM: a multiple of 16, one row per thread for row setup");
  static_assert(kBN % (8 * kWarps) == 0, "BN must give each warp whole n8 tiles");
  static_assert(kStages >= 2, "the pipeline needs at least two stages");
};

// Everything tile_gemm needs of the problem; built on the host by make_tile_args.
struct TileArgs {
  const void* x;
  QuantView q;         // (E, N, K*bits/32) codes, (E, N, K/group) scales and biases
  const int32_t* lhs;  // (B,) or nullptr for identity
  const int32_t* rhs;  // (B,) or nullptr for identity (read by the calling kernel, not tile_gemm)
  void* out;
  uint32_t* faults;
  int64_t rows;            // B * M
  int64_t x_batch;         // number of x matrices (lhs range)
  int64_t x_batch_stride;  // elements
  int M, N, K, E;
  // Weight rows from one expert to the next in q: N, or more when the GEMM reads a window of rows
  // (q's pointers at its first row; launch_expert_tiles_columns). An int like N (every route's
  // supports_* keeps row geometry in int32): as N did, it costs the kernels one parameter register.
  int expert_rows;
  bool paired_store;   // N even and out 4-byte aligned: store two outputs per 32-bit write
};

// Split-K (tile_gemm<..., kSplitK = true> only): the CTA with blockIdx.z == z of `slices` computes
// k tiles [z * k_tiles / slices, (z + 1) * k_tiles / slices) and writes its fp32 sums to
// partial (slices, rows, N); a second kernel adds the slices in order and rounds. Kept out of
// TileArgs so that the unsplit kernels' parameters (and code) stay as they were.
struct SplitK {
  float* partial;
  int slices;
};

// Shared-memory layout of one tile_gemm for a config and bit width (bytes).
template <class Cfg, int kBits>
struct TileLayout {
  static constexpr int kWordsPerRow = Cfg::BK * kBits / 32;  // packed words per weight row per k tile
  static constexpr int kChunksPerRow = kWordsPerRow / 4;     // 16-byte chunks
  static constexpr int kRowInfoBytes = (Cfg::BM * 8 + 127) / 128 * 128;
  static constexpr int kXBytes = Cfg::BM * Cfg::BK * 2;
  static constexpr int kWBytes = Cfg::BN * kWordsPerRow * 4;
  static constexpr int kParamBytes = Cfg::BN * 4;
  static constexpr int kStageBytes = kXBytes + kWBytes + 2 * kParamBytes;
  static constexpr int kSmemBytes = kRowInfoBytes + Cfg::STAGES * kStageBytes;
  static_assert(kBits == 4 || kBits == 8, "tile_gemm unpacks 4- and 8-bit codes");
  static_assert(kStageBytes % 16 == 0, "stages must stay 16-byte aligned");

  static __device__ __forceinline__ int w_chunk(int row, int chunk) {
    return chunk ^ (((row * kChunksPerRow) >> 3) & (kChunksPerRow - 1));
  }
};

// Computes rows [row0, row0 + load_rows) (load_rows <= BM; rows past it are zero) against expert
// `expert` for columns [n_block * BN, +BN) over the full K, and stores the local rows
// [store_begin, store_end). Must be called by all Cfg::THREADS threads with the same arguments;
// `smem` holds TileLayout<Cfg, kBits>::kSmemBytes. An out-of-range expert or lhs id is recorded
// in the fault word and its rows are skipped. Ends with a barrier, so calls may follow each other.
// kSplitK: only the k tiles of slice blockIdx.z, stored unrounded to split_k.partial (see SplitK).
// kFp: codes of an fp mode (E2M1 for 4-bit, E4M3 for 8-bit; T = bf16), scales as make_tile_args
// lays them out for it, no biases.
template <class Cfg, class T, int kBits, bool kSplitK = false, bool kFp = false>
__device__ __forceinline__ void tile_gemm(const TileArgs& a, int expert, int64_t row0, int load_rows,
                                          int store_begin, int store_end, int n_block, unsigned char* smem,
                                          SplitK split_k = {nullptr, 1}) {
  using L = TileLayout<Cfg, kBits>;
  const int tid = threadIdx.x;
  if (expert < 0 || expert >= a.E) {
    if (tid == 0) record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(expert),
                               static_cast<uint32_t>(a.E));
    return;  // uniform across the CTA: every thread sees the same expert
  }

  int64_t* row_offset = reinterpret_cast<int64_t*>(smem);
  if (tid < Cfg::BM) {
    int64_t offset = -1;
    if (tid < load_rows) {
      const int64_t r = row0 + tid;
      const int64_t b = r / a.M;
      const int64_t m = r - b * a.M;
      const int64_t xb = a.lhs ? static_cast<int64_t>(a.lhs[b]) : b;
      if (xb >= 0 && xb < a.x_batch) offset = xb * a.x_batch_stride + m * a.K;
      else record_fault(a.faults, kFaultRowOutOfRange, static_cast<uint32_t>(xb), static_cast<uint32_t>(a.x_batch));
    }
    row_offset[tid] = offset;
  }
  __syncthreads();

  const T* x = static_cast<const T*>(a.x);
  const int n0 = n_block * Cfg::BN;
  const uint32_t* w_expert = a.q.w + static_cast<int64_t>(expert) * a.expert_rows * a.q.words_per_row;
  const int64_t param_expert = static_cast<int64_t>(expert) * a.expert_rows * a.q.groups_per_row;
  const bool two_groups_per_tile = a.q.group_shift == 5;  // group_size 32 inside a 64-wide k tile
  int kt_begin = 0, k_tiles = a.K / Cfg::BK;  // this CTA's k tiles: [kt_begin, kt_begin + k_tiles)
  if constexpr (kSplitK) {
    const int all = k_tiles, z = static_cast<int>(blockIdx.z);
    kt_begin = z * all / split_k.slices;
    k_tiles = (z + 1) * all / split_k.slices - kt_begin;
  }

  auto stage_base = [&](int stage) { return smem + L::kRowInfoBytes + stage * L::kStageBytes; };

  // Each thread's share of a k tile's copies is fixed: copy i of a kind is slot tid + i * THREADS.
  // Sources at k tile 0 and destinations are worked out once here, so a k tile only adds its own
  // offset (no division, no 64-bit index math, no loop in the pipeline). Invalid copies keep a
  // source inside the first row of their tensor, which stays a valid address for every k tile.
  constexpr int kXChunks = Cfg::BM * 8;                  // 16-byte x chunks per k tile
  constexpr int kWChunks = Cfg::BN * L::kChunksPerRow;  // 16-byte weight chunks per k tile
  constexpr int kParamWords = (kFp ? 1 : 2) * Cfg::BN;  // scale words, then bias words (affine)
  constexpr int kXCopies = (kXChunks + Cfg::THREADS - 1) / Cfg::THREADS;
  constexpr int kWCopies = (kWChunks + Cfg::THREADS - 1) / Cfg::THREADS;
  constexpr int kParamCopies = (kParamWords + Cfg::THREADS - 1) / Cfg::THREADS;
  const T* x_src[kXCopies];
  bool x_valid[kXCopies];
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int c = tid + i * Cfg::THREADS;
    const int64_t offset = c < kXChunks ? row_offset[c >> 3] : -1;
    x_valid[i] = offset >= 0;
    x_src[i] = x_valid[i] ? x + offset + (c & 7) * 8 : x;
  }
  // Weight copies of one thread share the chunk and lie kWRowStep rows apart: one base pointer.
  static_assert(Cfg::THREADS % L::kChunksPerRow == 0, "each thread copies the same chunk of its rows");
  constexpr int kWRowStep = Cfg::THREADS / L::kChunksPerRow;
  const int w_row0 = tid / L::kChunksPerRow;
  const uint32_t* w_src = w_expert + static_cast<int64_t>(n0 + w_row0) * a.q.words_per_row + (tid % L::kChunksPerRow) * 4;
  const int64_t w_copy_stride = static_cast<int64_t>(kWRowStep) * a.q.words_per_row;
  const uint16_t* param_src[kParamCopies];  // the row's first group element
  bool param_valid[kParamCopies];
#pragma unroll
  for (int i = 0; i < kParamCopies; ++i) {
    const int c = tid + i * Cfg::THREADS;
    const int n = n0 + c % Cfg::BN;
    const uint16_t* param = c < Cfg::BN ? a.q.scales : a.q.biases;
    param_valid[i] = c < kParamWords && n < a.N;
    param_src[i] = param_valid[i] ? param + param_expert + static_cast<int64_t>(n) * a.q.groups_per_row : param;
  }

  auto load_stage = [&](int stage, int kt) {
    unsigned char* base = stage_base(stage);
    T* xs = reinterpret_cast<T*>(base);
    uint32_t* ws = reinterpret_cast<uint32_t*>(base + L::kXBytes);
    uint32_t* params = ws + Cfg::BN * L::kWordsPerRow;  // ss (BN,) then bs (BN,)
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      const int c = tid + i * Cfg::THREADS;
      if (kXChunks % Cfg::THREADS != 0 && c >= kXChunks) break;
      const int row = c >> 3, chunk = c & 7;
      cp_async_16(xs + row * Cfg::BK + ((chunk ^ (row & 7)) << 3), x_src[i] + kt * Cfg::BK, x_valid[i]);
    }
#pragma unroll
    for (int i = 0; i < kWCopies; ++i) {
      const int c = tid + i * Cfg::THREADS;
      if (kWChunks % Cfg::THREADS != 0 && c >= kWChunks) break;
      const int row = w_row0 + i * kWRowStep, chunk = tid % L::kChunksPerRow;
      const bool valid = n0 + row < a.N;
      cp_async_16(ws + row * L::kWordsPerRow + (L::w_chunk(row, chunk) << 2),
                  valid ? w_src + i * w_copy_stride + kt * L::kWordsPerRow : a.q.w, valid);
    }
    // Group element el of a row lives in the 4-byte word at el & ~1 (scales and biases are 4-byte
    // aligned). Read exactly the bytes of the needed groups: el odd -> both halves (el-1, el); el
    // even -> el, plus el+1 when the tile spans two groups; the unread half is zero-filled.
    const int group = (kt * Cfg::BK) >> a.q.group_shift;
#pragma unroll
    for (int i = 0; i < kParamCopies; ++i) {
      const int c = tid + i * Cfg::THREADS;
      if (kParamWords % Cfg::THREADS != 0 && c >= kParamWords) break;
      const uint16_t* el = param_src[i] + group;
      const int odd = static_cast<int>((reinterpret_cast<uintptr_t>(el) >> 1) & 1);
      if (param_valid[i]) cp_async_4(params + c, el - odd, (odd || two_groups_per_tile) ? 4 : 2);
      else cp_async_4(params + c, param_src[i], 0);
    }
  };

  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int warp_col = warp * Cfg::WARP_N;
  using Dequant = PackedDequant<T>;
  static_assert(!kFp || std::is_same<T, __nv_bfloat16>::value, "the fp modes' tiles decode to bf16");
  using FpDequant = FpDequantBf16;
  const uint32_t code_selector = kFp ? (kBits == 4 ? FpDequant::nibble_selector(t) : FpDequant::byte_selector(t))
                                     : (kBits == 4 ? Dequant::nibble_selector(t) : Dequant::byte_selector(t));
  const bool e4m3_scales = a.q.fp_mode == static_cast<int>(QuantMode::nvfp4);  // else E8M0 (kFp only)

  // Parity of each owned column's first group element: with an odd group count per row the
  // group of a k tile may sit in the high half of its staged word.
  int col_parity[Cfg::N8_TILES];
#pragma unroll
  for (int j = 0; j < Cfg::N8_TILES; ++j) {
    const int n = n0 + warp_col + 8 * j + g;
    col_parity[j] = n < a.N ? static_cast<int>((param_expert + static_cast<int64_t>(n) * a.q.groups_per_row) & 1) : 0;
  }

  float acc[Cfg::M16_TILES][Cfg::N8_TILES][4];
#pragma unroll
  for (int mt = 0; mt < Cfg::M16_TILES; ++mt)
#pragma unroll
    for (int j = 0; j < Cfg::N8_TILES; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.f;

#pragma unroll
  for (int s = 0; s < Cfg::STAGES - 1; ++s) {
    if (s < k_tiles) load_stage(s, kt_begin + s);
    cp_async_commit();  // empty groups keep the group count uniform
  }

  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<Cfg::STAGES - 2>();
    __syncthreads();  // tile kt visible to all; stage (kt-1) % STAGES free for reuse
    const int next = kt + Cfg::STAGES - 1;
    if (next < k_tiles) load_stage(next % Cfg::STAGES, kt_begin + next);
    cp_async_commit();

    const unsigned char* base = stage_base(kt % Cfg::STAGES);
    const T* xs = reinterpret_cast<const T*>(base);
    const uint32_t* ws = reinterpret_cast<const uint32_t*>(base + L::kXBytes);
    const uint32_t* ss = ws + Cfg::BN * L::kWordsPerRow;
    const uint32_t* bs = ss + Cfg::BN;

    // Scale and bias of each owned column as a packed pair (the value in both halves), read once
    // per k tile: the tile's single group sits in the staged word's half given by its parity.
    // With group_size 32 the word holds two groups: the low one serves k16 steps 0-1, and the
    // high one is read at step 2.
    const int tile_parity = (((kt_begin + kt) * Cfg::BK) >> a.q.group_shift) & 1;
    uint32_t col_scale[Cfg::N8_TILES], col_bias[Cfg::N8_TILES];
    auto read_params = [&](bool second_group) {
#pragma unroll
      for (int j = 0; j < Cfg::N8_TILES; ++j) {
        const int row = warp_col + 8 * j + g;
        const bool high = two_groups_per_tile ? second_group : (col_parity[j] ^ tile_parity) != 0;
        col_scale[j] = broadcast_half(ss[row], high);
        col_bias[j] = broadcast_half(bs[row], high);
      }
    };
    // kFp: each owned column's scale codes of this k tile, byte s for k16 step s: nvfp4's four
    // groups of 16 as staged; the mx modes' two groups of 32 (a 16-bit half) each doubled.
    uint32_t col_codes[kFp ? Cfg::N8_TILES : 1];
    if constexpr (kFp) {
#pragma unroll
      for (int j = 0; j < Cfg::N8_TILES; ++j) {
        const int row = warp_col + 8 * j + g;
        const bool high = (col_parity[j] ^ tile_parity) != 0;
        col_codes[j] = two_groups_per_tile ? ss[row] : __byte_perm(ss[row], 0u, high ? 0x3322u : 0x1100u);
      }
    } else {
      read_params(false);
    }

    constexpr bool kWideWordLoads = Cfg::M16_TILES <= 2;
    uint4 w4[kWideWordLoads ? Cfg::N8_TILES : 1];  // 4-bit: each column's 16-byte chunk (two k16 steps)
#pragma unroll
    for (int s = 0; s < 4; ++s) {  // k16 steps: k = 16s .. 16s+15 of the tile
      if constexpr (kFp) {
#pragma unroll
        for (int j = 0; j < Cfg::N8_TILES; ++j)
          col_scale[j] = FpDequant::scale_pair((col_codes[j] >> (8 * s)) & 0xFFu, e4m3_scales);
      } else if (s == 2 && two_groups_per_tile) {
        read_params(true);
      }
      // B fragments of every owned n8 tile for this step (2 registers each), then one m16 tile at
      // a time: its A fragment feeds N8_TILES mmas, each B fragment M16_TILES mmas.
      uint32_t bfrag[Cfg::N8_TILES][2];
#pragma unroll
      for (int j = 0; j < Cfg::N8_TILES; ++j) {
        const int row = warp_col + 8 * j + g;  // weight row (output column) inside the tile
        const uint32_t* wrow = ws + row * L::kWordsPerRow;
        if constexpr (kBits == 4) {
          // Word w holds k = 8w..8w+7; step s needs words 2s (b0) and 2s+1 (b1), the second
          // half of chunk s/2 for odd s. With BM <= 32 one 16-byte load serves two steps; BM=64
          // has no registers to spare for it and loads 8 bytes per step (1 load per 8 mmas).
          uint32_t word0, word1;
          if constexpr (kWideWordLoads) {
            if ((s & 1) == 0) w4[j] = *reinterpret_cast<const uint4*>(wrow + (L::w_chunk(row, s >> 1) << 2));
            word0 = (s & 1) ? w4[j].z : w4[j].x;
            word1 = (s & 1) ? w4[j].w : w4[j].y;
          } else {
            const uint2 words = *reinterpret_cast<const uint2*>(wrow + (L::w_chunk(row, s >> 1) << 2) + 2 * (s & 1));
            word0 = words.x;
            word1 = words.y;
          }
          if constexpr (kFp) {
            bfrag[j][0] = FpDequant::e2m1(word0, code_selector, col_scale[j]);
            bfrag[j][1] = FpDequant::e2m1(word1, code_selector, col_scale[j]);
          } else {
            bfrag[j][0] = Dequant::nibbles(word0, code_selector, col_scale[j], col_bias[j]);
            bfrag[j][1] = Dequant::nibbles(word1, code_selector, col_scale[j], col_bias[j]);
          }
        } else {
          // Word w holds k = 4w..4w+3; step s reads chunk s (words 4s..4s+3): k 16s+2t, +1 are
          // halfword t%2 of word 4s + t/2, and k 16s+8+2t, +1 the same halfword of word 4s+2+t/2.
          const uint32_t* chunk = wrow + (L::w_chunk(row, s) << 2) + (t >> 1);
          if constexpr (kFp) {
            bfrag[j][0] = FpDequant::e4m3(chunk[0], code_selector, col_scale[j]);
            bfrag[j][1] = FpDequant::e4m3(chunk[2], code_selector, col_scale[j]);
          } else {
            bfrag[j][0] = Dequant::bytes(chunk[0], code_selector, col_scale[j], col_bias[j]);
            bfrag[j][1] = Dequant::bytes(chunk[2], code_selector, col_scale[j], col_bias[j]);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < Cfg::M16_TILES; ++mt) {
        // A fragment: lanes 0-15 address rows 0-15 of the low 8-wide k chunk, lanes 16-31 the
        // same rows of the high chunk.
        uint32_t afrag[4];
        const int row = mt * 16 + (lane & 15);
        const int chunk = 2 * s + (lane >> 4);
        ldmatrix_x4(afrag, xs + row * Cfg::BK + ((chunk ^ (row & 7)) << 3));
#pragma unroll
        for (int j = 0; j < Cfg::N8_TILES; ++j) Mma<T>::run(acc[mt][j], afrag, bfrag[j][0], bfrag[j][1]);
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: c0,c1 belong to local row mt*16 + g, c2,c3 to row mt*16 + g + 8, columns 2t, 2t+1.
  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int mt = 0; mt < Cfg::M16_TILES; ++mt)
#pragma unroll
    for (int j = 0; j < Cfg::N8_TILES; ++j) {
      const int col = n0 + warp_col + 8 * j + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int local = mt * 16 + g + 8 * h;
        if (local < store_begin || local >= store_end || row_offset[local] < 0 || col >= a.N) continue;
        const float v0 = acc[mt][j][2 * h], v1 = acc[mt][j][2 * h + 1];
        if constexpr (kSplitK) {
          float* o = split_k.partial + (static_cast<int64_t>(blockIdx.z) * a.rows + row0 + local) * a.N + col;
          o[0] = v0;
          if (col + 1 < a.N) o[1] = v1;
          continue;
        }
        T* o = out + (row0 + local) * a.N + col;
        if (a.paired_store) {
          *reinterpret_cast<uint32_t*>(o) = Elem<T>::pack2(v0, v1);  // N even: col + 1 < N
        } else {
          o[0] = Elem<T>::from_float(v0);
          if (col + 1 < a.N) o[1] = Elem<T>::from_float(v1);
        }
      }
    }
  __syncthreads();  // row_offset and the stages are rewritten by the next call
}

// The generic route's unit of work (also the expert tile routes' fallback when a plan is
// retracted): the kBM-row tile `tile` of problem rows whose expert ids may differ, split into
// maximal runs of equal ids (expert of row r = rhs[r / M], or r / M without rhs); calls
// fn(expert, row0, load_rows, run_begin, run_end) once per run, where the callee computes all
// load_rows rows of the tile and stores only the run's local rows [run_begin, run_end). Sorted ids
// give one run per tile; any order stays correct, only slower. tile_expert: (kBM,) int in shared
// memory. Called by all threads of the CTA. Args: any argument struct with rows, M and rhs as in
// TileArgs (gather_mm's tile route uses it too).
template <int kBM, class Args, class Fn>
__device__ __forceinline__ void for_each_expert_run(const Args& a, int64_t tile, int* tile_expert, Fn&& fn) {
  const int64_t row0 = tile * kBM;
  const int load_rows = static_cast<int>(min(static_cast<int64_t>(kBM), a.rows - row0));
  if (static_cast<int>(threadIdx.x) < load_rows) {
    const int64_t b = (row0 + threadIdx.x) / a.M;
    tile_expert[threadIdx.x] = a.rhs ? a.rhs[b] : static_cast<int>(b);
  }
  __syncthreads();
  int begin = 0;
  while (begin < load_rows) {
    const int expert = tile_expert[begin];
    int end = begin + 1;
    while (end < load_rows && tile_expert[end] == expert) ++end;
    fn(expert, row0, load_rows, begin, end);
    begin = end;
  }
  __syncthreads();  // tile_expert is rewritten for the next tile
}

// for_each_expert_run with tile_gemm as the callee.
template <class Cfg, class T, int kBits, bool kSplitK = false, bool kFp = false>
__device__ __forceinline__ void tile_gemm_runs(const TileArgs& a, int64_t tile, int n_block, unsigned char* smem,
                                               int* tile_expert, SplitK split_k = {nullptr, 1}) {
  for_each_expert_run<Cfg::BM>(a, tile, tile_expert, [&](int expert, int64_t row0, int load_rows, int begin, int end) {
    tile_gemm<Cfg, T, kBits, kSplitK, kFp>(a, expert, row0, load_rows, begin, end, n_block, smem, split_k);
  });
}

}  // namespace expertqmm::cuda::device

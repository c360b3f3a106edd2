// expert_tiles on Hopper: the plan tiles of the sorted tile route computed with warpgroup MMA
// (wgmma, sm_90a), weights as the M operand. The mma.sync kernel (gather_qmm_expert_tiles.cu)
// spends ~7.4 issue slots per m16n8k16 on dequantization, ldmatrix and mma issue and runs at ~200
// TFLOP/s; here one wgmma instruction covers a 64 x tokens x 16 block, its B operand (the gathered
// activations) is read by the tensor cores straight from shared memory, and the dequantized
// weights go from registers into the A operand, so the only per-element work left on the issue
// ports is the dequantization itself.
//
// out^T = W x^T per tile: the CTA's 128 weight rows are wgmma's M (two warpgroups of 64), the
// tile's tokens (16, 32, 64 or 128: the plan tile's class) are N, K runs in 64-wide k tiles.
//
// Two forms (one kernel template, WgmmaForm):
//   plain    out[row, n] = sum_k x[lhs[row], k] * W[expert, n, k], CTA rows n0 .. n0 + 127
//   glu      hidden[row, c] = act(T(gate)) * T(up) (one rounding), warpgroup 0 the gate rows
//          c0 .. c0 + 63 and warpgroup 1 the up rows c0 .. c0 + 63 of two weight tensors: the GLU
//          product in the epilogue, so the [rows, 2I] gate/up output never exists (DESIGN.md
//          fusion ladder, step 2) and x is read once for both.
//
// Requirements (wgmma_tiles_fit, plus the caller's 16-byte aligned out for the 16-byte epilogue
// stores): 4-bit affine codes, group size 64 or 128 (one group per k tile), or 8-bit affine codes
// under bf16 (one n128 build: a 64-wide k tile is 64 bytes per weight row), or mxfp4 / nvfp4 under
// bf16 in the plain form (kFp: E2M1 decoded as tile_gemm's kFp, the k tile's 2 or 4 scale codes
// staged as one word, make_tile_args' view), K % 64 == 0, N % 8 == 0, and everything
// supports_tile_operands checks. mxfp8's E4M3 codes run on the mma.sync kernel.
//
// Each 4-bit affine build comes twice: on MLX's layout and on the experts' tile layout (kTiled, where
// the weight carries one: fewer copies and shared loads per k tile; bench/NOTES.md step 51).
//
// Three builds per form: n128 (the plan's full 128-row tiles in one wgmma width, n96 for those of
// at most 96 rows), n64 and n32 (taller tiles as pieces of 64 or 32 rows; fewer accumulators, less
// shared memory, n32 at 3 CTAs per SM), chosen by mean rows per expert (kWidths); 8-bit codes n128 only.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <string>

#include "core/route_counters.h"
#include "core/tile_layout.h"
#include "core/tile_plan.h"
#include "cuda/device/glu.cuh"
#include "cuda/device/tile_fragments.cuh"
#include "cuda/device/tile_gemm.cuh"
#include "cuda/device/wgmma.cuh"
#include "cuda/gather_qmm_routes.h"
#include "cuda/gather_qmm_wgmma.h"
#include "cuda/gather_qmm_ws_hooks.h"
#include "cuda/runtime.cuh"
#include "expertqmm/settings.h"

namespace expertqmm::cuda {

namespace {

using detail::ExpertTile;
using detail::TilePlanHeader;
using device::TileArgs;

constexpr int kThreads = 256;    // two warpgroups
constexpr int kCtaRows = 128;    // weight rows per CTA, 64 per warpgroup
constexpr int kBK = 64;          // k per pipeline stage (one quantization group at group size 64)
std::atomic<uint64_t> g_tiled_launches{0};  // wgmma_tiled_launches()
static_assert(kTileColumnsAlign % kCtaRows == 0, "a column window (launch_expert_tiles_columns) starts at a CTA's rows");

// Pipeline depth and residency per build (widest wgmma n32, n64 or n128), as data: stages, the
// prefetch distance (at most kStages - 1: the barrier at the top of k tile kt frees the slot tile
// kt - 1 was read from) and CTAs per SM (the register cap of __launch_bounds__; shared memory must
// fit as well). Measured (bench/NOTES.md): n64 8 stages with distance 7 slower than 5 / 3 (step
// 4d); 6 / 4 a little faster (step 6a); two 64-k tiles per stage slower (step 6a); n128 5 / 4 ~1%
// faster than 5 / 3 (step 6e); n32 at 3 CTAs per SM (24 warps) 4% faster than n64 at T=64, the
// same at 4 CTAs (step 6b). 8-bit codes (n128 only): a stage holds twice the weight bytes (25 KB),
// so 4 stages keep 2 CTAs per SM (5 would need 2 x 127 KB).
template <int kMaxTokens, int kBits>
struct PipelineDepth;
template <>
struct PipelineDepth<32, 4> {
  static constexpr int kStages = 6, kPrefetch = 4, kCtasPerSm = 3;
};
template <>
struct PipelineDepth<64, 4> {
  static constexpr int kStages = 6, kPrefetch = 4, kCtasPerSm = 2;
};
template <>
struct PipelineDepth<128, 4> {
  static constexpr int kStages = 5, kPrefetch = 4, kCtasPerSm = 2;
};
template <>
struct PipelineDepth<128, 8> {
  static constexpr int kStages = 4, kPrefetch = 3, kCtasPerSm = 2;
};

// Shared memory (bytes from a 1024-byte aligned base):
//   stages  kStages x { xs (kMaxTokens, 64) T, 128-byte swizzled (wgmma B: chunk c of row r at c ^ (r % 8));
//                       ws (128, 64 * kBits / 32) uint32 in 16-byte chunks: 4-bit 2 per row, chunk c
//                       of row r at c ^ ((r / 4) % 2) (conflict-free 16-byte reads of 8 rows); 8-bit
//                       4 per row at c ^ ((r / 2) % 4) (conflict-free 4-byte reads of 2 words in 8
//                       rows);  ss, bs (128,) uint32: the word holding the row's group scale / bias
//                       (see the parity below) }
//   rows    (kMaxTokens,) int64 x offset of each tile row, -1 for rows to skip
// The epilogue reuses the stages as (kMaxTokens, 136) T: a row of 128 outputs padded by 8 so that the
// four token rows a warp writes at once fall in different banks.
// n128: 5 x 21 KB stages, n64: 6 x 13 KB (2 CTAs per SM each), n32: 6 x 9 KB (3 CTAs per SM);
// 8-bit n128: 4 x 25 KB (2 CTAs per SM).
template <int kMaxTokens, int kCodeBits = 4>
struct Layout {
  using Depth = PipelineDepth<kMaxTokens, kCodeBits>;
  static constexpr int kBits = kCodeBits;
  static constexpr int kWordsPerRow = kBK * kBits / 32;  // packed words per weight row per k tile: 8 or 16
  static constexpr int kWChunks = kWordsPerRow / 4;      // 16-byte chunks per weight row: 2 or 4
  static constexpr int kStages = Depth::kStages;
  static constexpr int kPrefetch = Depth::kPrefetch;
  static constexpr int kXBytes = kMaxTokens * kBK * 2;
  static constexpr int kWBytes = kCtaRows * kWordsPerRow * 4;
  static constexpr int kParamBytes = kCtaRows * 4;
  static constexpr int kStageBytes = kXBytes + kWBytes + 2 * kParamBytes;
  static constexpr int kRowsOffset = kStages * kStageBytes;
  static constexpr int kOutStride = kCtaRows + 8;  // elements
  static constexpr int kBytes = kRowsOffset + kMaxTokens * 8;
  static constexpr int kAllocBytes = kBytes + 1024;  // room to align the dynamic base
  static constexpr int kCtasPerSm = Depth::kCtasPerSm;
  static_assert(kMaxTokens == 32 || kMaxTokens == 64 || kMaxTokens == 128, "the widest wgmma of a kernel: n32, n64 or n128");
  static_assert(kStageBytes % 1024 == 0, "every stage's x tile stays 1024-byte aligned for the swizzle");
  static_assert(kMaxTokens * kOutStride * 2 <= kRowsOffset, "the epilogue staging fits in the stages");
  static_assert(kCtasPerSm * (kAllocBytes + 1024) <= 228 * 1024, "kCtasPerSm CTAs fit an SM's shared memory");
  static_assert(kPrefetch >= 1 && kPrefetch < kStages, "a free slot for every prefetched stage");
  static_assert(kBits == 4 || kBits == 8, "4- or 8-bit codes");
  static_assert(kWChunks % 2 == 0 && kCtaRows * 2 == kThreads, "two threads per weight row, kWChunks / 2 chunks each");
  static __device__ __forceinline__ unsigned w_chunk(unsigned row, unsigned chunk) {
    return kBits == 4 ? chunk ^ ((row >> 2) & 1) : chunk ^ ((row >> 1) & 3);
  }
};

// Computes one tile: rows [row0, row0 + load_rows) (<= kTokens) against `expert` for the CTA's
// column block, storing local rows [store_begin, store_end). All 256 threads call it with the same
// arguments; it ends with a barrier.
//
// Work split: every thread issues an equal share of each stage's cp.async copies (x: kTokens rows x
// 8 chunks; weights: 128 rows x 2 chunks (4-bit) or 4 (8-bit), thread i row i / 2 and its chunks
// (i % 2) * kWChunks / 2 ..; scale and bias words: one per thread). kTiled (4-bit affine on the
// tile layout, docs/tile-layout.md): the weights are the CTA's two 64-row blocks, one 16-byte copy of
// codes per thread and 16 bytes of parameters for threads 0-31, into the same stage bytes.
// Warp w of warpgroup q owns smem weight rows 64q + 16(w % 4) .. +15; lane (g, t) dequantizes rows
// 64q + 16(w % 4) + g and + 8 (the A fragment rows), 16 values per row per k tile (4-bit: from two
// 16-byte shared loads per row; 8-bit: two 4-byte loads per row and k16 step, halfword t % 2 of
// words 4s + t / 2 and 4s + 2 + t / 2): 4 wgmma A fragments, one per k16 step; then the warpgroup
// issues its 4 wgmmas (64 x kTokens x 16) as one group and waits for it before the next k tile.
template <class T, int kTokens, WgmmaForm kForm, class L, bool kFp, bool kTiled>
__device__ __forceinline__ void wgmma_tile(const WgmmaTileArgs& p, int expert, int64_t row0, int load_rows,
                                           int store_begin, int store_end, int col_block, unsigned char* smem) {
  constexpr bool kGlu = is_glu(kForm);
  constexpr Activation kAct = kForm == WgmmaForm::swiglu ? Activation::swiglu : Activation::geglu;
  const TileArgs& a = p.tile;
  const int tid = threadIdx.x;
  if (expert < 0 || expert >= a.E) {
    if (tid == 0)
      record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(expert), static_cast<uint32_t>(a.E));
    return;  // uniform: every thread sees the same expert
  }

  int64_t* row_offset = reinterpret_cast<int64_t*>(smem + L::kRowsOffset);
  if (tid < kTokens) {
    int64_t offset = -1;
    if (tid < load_rows) {
      const int64_t r = row0 + tid;
      const int64_t xb = a.lhs ? static_cast<int64_t>(a.lhs[r]) : r;  // M == 1: row r is batch r
      if (xb >= 0 && xb < a.x_batch) offset = xb * a.x_batch_stride;
      else record_fault(a.faults, kFaultRowOutOfRange, static_cast<uint32_t>(xb), static_cast<uint32_t>(a.x_batch));
    }
    row_offset[tid] = offset;
  }
  __syncthreads();

  // Copy sources at k tile 0; k tile kt adds kt * 64 elements (x), kt * 8 words (w) or its group.
  // Invalid copies read nothing (source size 0): their pointers stay inside the tensors but are
  // never dereferenced, so the per-tile copy code has no selects.
  const T* x = static_cast<const T*>(a.x);
  constexpr int kXChunks = kTokens * 8;
  constexpr int kXCopies = (kXChunks + kThreads - 1) / kThreads;
  const T* x_src[kXCopies];
  uint32_t x_valid = 0;  // bit i: copy i reads a row (not past the tile's rows, not a row to skip)
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int c = tid + i * kThreads;
    const int64_t offset = c < kXChunks ? row_offset[c >> 3] : -1;
    if (offset >= 0) x_valid |= 1u << i;
    x_src[i] = offset >= 0 ? x + offset + (c & 7) * 8 : x;
  }
  // Smem weight row r (0..127): weight set r / 64 and row n0 + r % 64 (glu), or row n0 + r.
  auto weight_row = [&](int r) { return kGlu ? col_block * 64 + (r & 63) : col_block * kCtaRows + r; };
  auto weight_set = [&](int r) { return kGlu && r >= 64 ? 1 : 0; };
  const int64_t w_expert = static_cast<int64_t>(expert) * a.expert_rows * a.q.words_per_row;
  const int64_t param_expert = static_cast<int64_t>(expert) * a.expert_rows * a.q.groups_per_row;
  constexpr int kWordsPerRow = L::kWordsPerRow;
  constexpr int kWCopies = L::kWChunks / 2;  // weight chunks per thread per stage: 1 or 2
  const unsigned w_row = tid >> 1, w_chunk0 = (tid & 1) * kWCopies;
  const int w_n = weight_row(w_row);
  const bool w_valid = w_n < a.N;
  const uint32_t* w_base = weight_set(w_row) ? p.up.w : a.q.w;
  const uint32_t* w_src = w_valid ? w_base + w_expert + static_cast<int64_t>(w_n) * a.q.words_per_row + w_chunk0 * 4 : a.q.w;
  auto w_dst = [&](int j) {
    return L::kXBytes + (w_row * kWordsPerRow + (L::w_chunk(w_row, w_chunk0 + j) << 2)) * 4;
  };
  const int param_row = tid & (kCtaRows - 1);
  const int param_n = weight_row(param_row);
  const bool is_bias = tid >= kCtaRows;
  const bool param_valid = param_n < a.N && !(kFp && is_bias);  // kFp: scale codes only
  const uint16_t* param_base = weight_set(param_row) ? (is_bias ? p.up.biases : p.up.scales)
                                                     : (is_bias ? a.q.biases : a.q.scales);
  const uint16_t* param_src =
      param_valid ? param_base + param_expert + static_cast<int64_t>(param_n) * a.q.groups_per_row : a.q.scales;
  const unsigned param_dst = L::kXBytes + L::kWBytes + tid * 4;  // ss (128,) then bs (128,)
  // kTiled (docs/tile-layout.md): the CTA's two 64-row blocks instead (plain: blocks 2 cb and 2 cb + 1;
  // glu: the gate's and the up's block cb; a block past N (a window's width) is not read). Thread tid
  // copies 16 bytes of block tid / 128's codes; threads 0-31 16 bytes of block tid / 16's parameters.
  const int code_block = tid >> 7, param_block = (tid >> 4) & 1;
  auto tile_block = [&](int b) { return kGlu ? col_block : 2 * col_block + b; };
  const int64_t row_blocks = (a.expert_rows + detail::kTileRows - 1) / detail::kTileRows;
  const bool code_valid = kTiled && tile_block(code_block) * detail::kTileRows < a.N;
  const bool tile_param_valid = kTiled && tid < 32 && tile_block(param_block) * detail::kTileRows < a.N;
  const uint32_t* code_src = a.q.w;  // never read where not valid
  const uint32_t* tile_param_src = a.q.w;
  if constexpr (kTiled) {
    const device::QuantView& cq = kGlu && code_block ? p.up : a.q;
    const device::QuantView& pq = kGlu && param_block ? p.up : a.q;
    if (code_valid)
      code_src = cq.tiled_codes + (expert * row_blocks + tile_block(code_block)) * (a.K / kBK) * detail::kTileWords +
                 (tid & 127) * 4;
    if (tile_param_valid)
      tile_param_src = pq.tiled_params + (expert * row_blocks + tile_block(param_block)) * a.q.groups_per_row *
                                             detail::kTileRows + (tid & 15) * 4;
  }

  auto load_stage = [&](unsigned char* stage, int kt) {
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      const unsigned c = tid + i * kThreads;
      if (kXChunks % kThreads != 0 && c >= kXChunks) break;
      const unsigned row = c >> 3, chunk = c & 7;
      device::cp_async_16(stage + row * 128 + ((chunk ^ (row & 7)) << 4), x_src[i] + kt * kBK, (x_valid >> i) & 1);
    }
    if constexpr (kTiled) {
      device::cp_async_16(stage + L::kXBytes + code_block * detail::kTileWords * 4 + (tid & 127) * 16,
                          code_src + (code_valid ? kt * detail::kTileWords : 0), code_valid);
      const int group = (kt * kBK) >> a.q.group_shift;
      if (tid < 32)
        device::cp_async_16(stage + L::kXBytes + L::kWBytes + param_block * detail::kTileRows * 4 + (tid & 15) * 16,
                            tile_param_src + (tile_param_valid ? group * detail::kTileRows : 0), tile_param_valid);
    } else {
#pragma unroll
      for (int j = 0; j < kWCopies; ++j)
        device::cp_async_16(stage + w_dst(j), w_src + kt * kWordsPerRow + (w_valid ? 4 * j : 0), w_valid);
      // The group element el sits in the aligned word at el & ~1: el odd -> read both halves; el even
      // -> its 2 bytes only (the next element may lie past the end of the tensor).
      // kFp, nvfp4: the k tile's 4 codes are the whole (aligned) word.
      const uint16_t* el = param_src + ((kt * kBK) >> a.q.group_shift);
      const int odd = static_cast<int>((reinterpret_cast<uintptr_t>(el) >> 1) & 1);
      const bool whole_word = odd || (kFp && a.q.group_shift == 5);
      if (param_valid) device::cp_async_4(stage + param_dst, el - odd, whole_word ? 4 : 2);
      else device::cp_async_4(stage + param_dst, param_src, 0);
    }
  };

  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m_lo = (warp >> 2) * 64 + (warp & 3) * 16 + g;  // smem weight rows of this lane
  const int m_hi = m_lo + 8;
  using Dequant = device::PackedDequant<T>;
  // FpDequantBf16's nibble selector is the bf16 one too.
  const uint32_t selector = L::kBits == 4 ? Dequant::nibble_selector(t) : Dequant::byte_selector(t);
  static_assert(!kFp || std::is_same<T, __nv_bfloat16>::value, "the fp modes decode to bf16");
  static_assert(!kFp || L::kBits == 4, "the fp modes' wgmma kernel is for E2M1 codes");
  const bool e4m3_scales = a.q.fp_mode == static_cast<int>(QuantMode::nvfp4);  // kFp: 4 codes per word
  // Half of the staged scale/bias word holding the group: the row's first element's parity
  // (4-byte aligned tensors) flipped by the group index's parity.
  auto row_parity = [&](int r) {
    const int n = weight_row(r);
    return n < a.N ? static_cast<int>((param_expert + static_cast<int64_t>(n) * a.q.groups_per_row) & 1) : 0;
  };
  const int parity_lo = row_parity(m_lo), parity_hi = row_parity(m_hi);

  constexpr int kAcc = kTokens / 2;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;

  // Pipeline: k tiles kt+1 .. kt+kPrefetch are in flight in cp.async while tile kt is computed.
  // The four wgmmas of a tile are one commit group, waited for at the end of the tile. Keeping a
  // group in flight across tiles (wait_group 1 with two A buffers, or one group per k16 step
  // with wait_group 3) made ptxas serialize every wgmma (C7514; SASS: a wait after each HGMMA).
  // Slots are kt % kStages of the loop counter, so the compiler keeps them and the wgmma
  // descriptors in uniform registers.
  constexpr int kPrefetch = L::kPrefetch;
  const int k_tiles = a.K / kBK;
  auto stage_at = [&](int kt) { return smem + (kt % L::kStages) * L::kStageBytes; };
  const uint64_t smem_desc = device::wgmma_desc_k128(smem);
#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {
    if (s < k_tiles) load_stage(stage_at(s), s);
    device::cp_async_commit();
  }

  for (int kt = 0; kt < k_tiles; ++kt) {
    device::cp_async_wait<kPrefetch - 1>();
    __syncthreads();  // tile kt visible; every warpgroup has retired its wgmmas on tile kt - 1
    if (kt + kPrefetch < k_tiles) load_stage(stage_at(kt + kPrefetch), kt + kPrefetch);
    device::cp_async_commit();

    const unsigned char* base = stage_at(kt);
    uint32_t afrag[4][4];  // k16 step s: rows m_lo, m_hi at k = 16s + 2t, +1, then at 16s + 8 + 2t, +1
    if constexpr (kTiled) {
      device::tile_layout_fragments<T>(base + L::kXBytes, base + L::kXBytes + L::kWBytes, m_lo, lane, afrag);
    } else {
      const uint32_t* ws = reinterpret_cast<const uint32_t*>(base + L::kXBytes);
      const uint32_t* ss = ws + kCtaRows * kWordsPerRow;
      const uint32_t* bs = ss + kCtaRows;
      const int tile_parity = ((kt * kBK) >> a.q.group_shift) & 1;
      const bool high_lo = (parity_lo ^ tile_parity) != 0, high_hi = (parity_hi ^ tile_parity) != 0;
      const uint32_t s_lo = device::broadcast_half(ss[m_lo], high_lo), b_lo = device::broadcast_half(bs[m_lo], high_lo);
      const uint32_t s_hi = device::broadcast_half(ss[m_hi], high_hi), b_hi = device::broadcast_half(bs[m_hi], high_hi);
      // kFp: the rows' scale codes of this k tile, byte s for k16 step s (tile_gemm's col_codes).
      uint32_t codes_lo = 0, codes_hi = 0;
      if constexpr (kFp) {
        codes_lo = e4m3_scales ? ss[m_lo] : __byte_perm(ss[m_lo], 0u, high_lo ? 0x3322u : 0x1100u);
        codes_hi = e4m3_scales ? ss[m_hi] : __byte_perm(ss[m_hi], 0u, high_hi ? 0x3322u : 0x1100u);
      }
      if constexpr (L::kBits == 8) {
        // Word w holds k = 4w .. 4w + 3: step s's k pairs are halfword t % 2 of words 4s + t / 2 and
        // 4s + 2 + t / 2, both in chunk s.
  #pragma unroll
        for (int s = 0; s < 4; ++s) {
          const uint32_t* lo = ws + m_lo * kWordsPerRow + (L::w_chunk(m_lo, s) << 2) + (t >> 1);
          const uint32_t* hi = ws + m_hi * kWordsPerRow + (L::w_chunk(m_hi, s) << 2) + (t >> 1);
          afrag[s][0] = Dequant::bytes(lo[0], selector, s_lo, b_lo);
          afrag[s][1] = Dequant::bytes(hi[0], selector, s_hi, b_hi);
          afrag[s][2] = Dequant::bytes(lo[2], selector, s_lo, b_lo);
          afrag[s][3] = Dequant::bytes(hi[2], selector, s_hi, b_hi);
        }
      } else {
        // Row words: word i holds k = 8i .. 8i + 7; chunk 0 = words 0-3, chunk 1 = words 4-7.
        auto chunk_of = [&](int m, int c) {
          return *reinterpret_cast<const uint4*>(ws + m * kWordsPerRow + (L::w_chunk(m, c) << 2));
        };
        const uint4 lo0 = chunk_of(m_lo, 0), lo1 = chunk_of(m_lo, 1);
        const uint4 hi0 = chunk_of(m_hi, 0), hi1 = chunk_of(m_hi, 1);
        const uint32_t lo[8] = {lo0.x, lo0.y, lo0.z, lo0.w, lo1.x, lo1.y, lo1.z, lo1.w};
        const uint32_t hi[8] = {hi0.x, hi0.y, hi0.z, hi0.w, hi1.x, hi1.y, hi1.z, hi1.w};
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          if constexpr (kFp) {
            using Fp = device::FpDequantBf16;
            const uint32_t sl = Fp::scale_pair((codes_lo >> (8 * s)) & 0xFFu, e4m3_scales);
            const uint32_t sh = Fp::scale_pair((codes_hi >> (8 * s)) & 0xFFu, e4m3_scales);
            afrag[s][0] = Fp::e2m1(lo[2 * s], selector, sl);
            afrag[s][1] = Fp::e2m1(hi[2 * s], selector, sh);
            afrag[s][2] = Fp::e2m1(lo[2 * s + 1], selector, sl);
            afrag[s][3] = Fp::e2m1(hi[2 * s + 1], selector, sh);
            continue;
          }
          afrag[s][0] = Dequant::nibbles(lo[2 * s], selector, s_lo, b_lo);
          afrag[s][1] = Dequant::nibbles(hi[2 * s], selector, s_hi, b_hi);
          afrag[s][2] = Dequant::nibbles(lo[2 * s + 1], selector, s_lo, b_lo);
          afrag[s][3] = Dequant::nibbles(hi[2 * s + 1], selector, s_hi, b_hi);
        }
      }
    }
    // The descriptor's address field counts 16 bytes.
    const uint64_t desc = smem_desc + ((kt % L::kStages) * L::kStageBytes >> 4);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) device::fence_operand(acc[i]);
    device::wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s)  // +32 bytes per k16 step: 2 in the descriptor's address field
      device::WgmmaRS<T, kTokens>::run(acc, afrag[s], desc + 2 * s);
    device::wgmma_commit();
    // Retire this tile's wgmmas before the next tile's barrier: the stage they read is reloaded
    // once that barrier has passed, and their A registers are rewritten by the next tile.
    device::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) device::fence_operand(acc[i]);
  }
  device::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kAcc; ++i) device::fence_operand(acc[i]);
  device::cp_async_wait<0>();
  __syncthreads();  // every stage read: the epilogue reuses them

  // Stage the tile's outputs as T: out_s[token][m], m the smem weight row.
  T* out_s = reinterpret_cast<T*>(smem);
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
    const int tok = 8 * j + 2 * t;
    out_s[tok * L::kOutStride + m_lo] = device::Elem<T>::from_float(acc[4 * j + 0]);
    out_s[(tok + 1) * L::kOutStride + m_lo] = device::Elem<T>::from_float(acc[4 * j + 1]);
    out_s[tok * L::kOutStride + m_hi] = device::Elem<T>::from_float(acc[4 * j + 2]);
    out_s[(tok + 1) * L::kOutStride + m_hi] = device::Elem<T>::from_float(acc[4 * j + 3]);
  }
  __syncthreads();

  // 16-byte stores of 8 outputs: plain 16 chunks per row (128 columns), glu 8 (64 columns).
  constexpr int kChunksPerRow = kGlu ? 8 : 16;
  const int col0 = col_block * (kGlu ? 64 : kCtaRows);
  T* out = static_cast<T*>(a.out);
  for (int i = tid; i < kTokens * kChunksPerRow; i += kThreads) {
    const int tok = i / kChunksPerRow, chunk = i % kChunksPerRow;
    const int col = col0 + chunk * 8;
    if (tok < store_begin || tok >= store_end || row_offset[tok] < 0 || col >= a.N) continue;
    const T* src = out_s + tok * L::kOutStride + chunk * 8;
    uint4 v = *reinterpret_cast<const uint4*>(src);
    if constexpr (kGlu) v = device::glu8<kAct, T>(v, *reinterpret_cast<const uint4*>(src + 64));
    *reinterpret_cast<uint4*>(out + (row0 + tok) * a.N + col) = v;
  }
  __syncthreads();  // row offsets and the staging are rewritten by the next tile
}

// Grid (column blocks, min(tile slots, 65535)), 256 threads, L::kAllocBytes of dynamic shared
// memory. With a valid plan CTA (x, y) runs plan tiles y, y + gridDim.y, ... against column block x
// with the wgmma width of the tile's class (n16 / n32 / n64 / n128). With a retracted plan the same CTAs
// stride over the 16-row tiles of all rows and run each maximal run of equal ids as one n16 tile
// (the rhs_tiles algorithm), so any order of ids still gives the right answer.
// kFp: MLX's mxfp4 / nvfp4 codes (bf16, plain form; wgmma_tile's kFp).
template <class T, WgmmaForm kForm, int kMaxTokens, bool kFp, int kBits, bool kTiled>
__global__ void __launch_bounds__(kThreads, PipelineDepth<kMaxTokens, kBits>::kCtasPerSm)
    expert_tiles_wgmma_kernel(WgmmaTileArgs p, const ExpertTile* __restrict__ tiles,
                              const TilePlanHeader* __restrict__ header) {
#if EXPERTQMM_WGMMA_ENABLED
  using L = Layout<kMaxTokens, kBits>;
  extern __shared__ unsigned char smem_raw[];
  // 1024-byte aligned for the swizzle; indexing smem_raw keeps the pointer in the shared window
  // (integer-cast pointers compile to generic loads).
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  unsigned char* smem = smem_raw + ((1024u - (raw & 1023u)) & 1023u);
  const int sorted = header->sorted;
  if (!sorted && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && p.retractions)
    atomicAdd(p.retractions, static_cast<unsigned long long>(p.calls));
  if (sorted) {
    if (p.retracted_only) return;  // the warp-specialized kernel ran the plan
    const int tile_count = header->tile_count;
    for (int i = blockIdx.y; i < tile_count; i += gridDim.y) {
      const ExpertTile tile = tiles[i];
      // A 128-row class tile of at most 96 rows (an expert with 65-96 rows, e.g. ~half of them at
      // T=1024) runs one n96 wgmma: 25% less tensor work than n128 for the same single pass over
      // its weights (bench/NOTES.md step 7g).
      if constexpr (kMaxTokens == 128) {
        if (tile.bm == 128 && tile.rows <= 96) {
          wgmma_tile<T, 96, kForm, L, kFp, kTiled>(p, tile.expert, tile.row_begin, tile.rows, 0, tile.rows, blockIdx.x, smem);
          continue;
        }
      }
      if (tile.bm >= kMaxTokens) {  // the widest wgmma; a taller tile runs as pieces of kMaxTokens rows
        for (int piece = 0; piece < tile.rows; piece += kMaxTokens) {
          const int rows = min(kMaxTokens, tile.rows - piece);
          wgmma_tile<T, kMaxTokens, kForm, L, kFp, kTiled>(p, tile.expert, tile.row_begin + piece, rows, 0, rows, blockIdx.x, smem);
        }
        continue;
      }
      // Narrower tile classes (16, 32, 64) below the build's width.
      if constexpr (kMaxTokens > 64) {
        if (tile.bm == 64) {
          wgmma_tile<T, 64, kForm, L, kFp, kTiled>(p, tile.expert, tile.row_begin, tile.rows, 0, tile.rows, blockIdx.x, smem);
          continue;
        }
      }
      if constexpr (kMaxTokens > 32) {
        if (tile.bm == 32) {
          wgmma_tile<T, 32, kForm, L, kFp, kTiled>(p, tile.expert, tile.row_begin, tile.rows, 0, tile.rows, blockIdx.x, smem);
          continue;
        }
      }
      wgmma_tile<T, 16, kForm, L, kFp, kTiled>(p, tile.expert, tile.row_begin, tile.rows, 0, tile.rows, blockIdx.x, smem);
    }
    return;
  }
  __shared__ int tile_expert[16];
  const int64_t row_tiles = (p.tile.rows + 15) / 16;
  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y)
    device::for_each_expert_run<16>(p.tile, tile, tile_expert, [&](int expert, int64_t row0, int load_rows, int begin,
                                                                   int end) {
      wgmma_tile<T, 16, kForm, L, kFp, kTiled>(p, expert, row0, load_rows, begin, end, blockIdx.x, smem);
    });
#else
  // Compiled for an architecture without wgmma: never selected (wgmma_available), so never run.
  (void)p;
  (void)tiles;
  (void)header;
  __trap();
#endif
}

template <class T, WgmmaForm kForm, int kMaxTokens, bool kFp = false, int kBits = 4, bool kTiled = false>
void launch_variant(const WgmmaTileArgs& p, const ExpertTile* tiles, const TilePlanHeader* header,
                    int64_t tile_slots) {
  constexpr int kSmem = Layout<kMaxTokens, kBits>::kAllocBytes;
  static const bool smem_configured = [] {
    EXPERTQMM_CUDA_CHECK(cudaFuncSetAttribute(expert_tiles_wgmma_kernel<T, kForm, kMaxTokens, kFp, kBits, kTiled>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    return true;
  }();
  (void)smem_configured;
  const int64_t slots = std::max<int64_t>(tile_slots, (p.tile.rows + 15) / 16);
  constexpr bool kGlu = is_glu(kForm);
  const int cols_per_cta = kGlu ? 64 : kCtaRows;
  // retracted_only: CTAs that exit at once under a valid plan (few: this launch follows every
  // warp-specialized one), enough for a retracted plan's walk over its rows to fill the device.
  const int64_t col_blocks = ceil_div(p.tile.N, cols_per_cta);
  const int64_t walk_rows = std::max<int64_t>(1, ceil_div(3 * device_sm_count(), col_blocks));
  const dim3 grid(static_cast<unsigned>(col_blocks),
                  static_cast<unsigned>(std::min<int64_t>(slots, p.retracted_only ? walk_rows : 65535)));
  expert_tiles_wgmma_kernel<T, kForm, kMaxTokens, kFp, kBits, kTiled><<<grid, kThreads, kSmem, current_stream()>>>(
      p, tiles, header);
  EXPERTQMM_CUDA_CHECK_LAUNCH("expert_tiles_wgmma_kernel");
  if (kTiled && !p.retracted_only) g_tiled_launches.fetch_add(1, std::memory_order_relaxed);
}

// The instantiations, as data: activation dtype x form x widest wgmma x code width. Narrower builds
// (fewer accumulators, less shared memory) win where experts get few rows; see kWidths. 8-bit codes
// (the QAT uploads' 8-bit dense MLP, 8-bit experts) have one build, bf16 n128, which also runs the
// narrower tile classes: each instance costs minutes of nvcc in CI.
struct WgmmaVariant {
  DType dtype;
  WgmmaForm form;
  int max_tokens;
  bool fp;  // mxfp4 / nvfp4 codes (bf16, plain form only: the layer's fusions stay affine)
  void (*launch)(const WgmmaTileArgs&, const ExpertTile*, const TilePlanHeader*, int64_t);
  int bits = 4;
  bool tiled = false;  // reads the weights' tile layout (docs/tile-layout.md; 4-bit affine only)
};
const WgmmaVariant kVariants[] = {
    {DType::bf16, WgmmaForm::plain, 128, false, launch_variant<__nv_bfloat16, WgmmaForm::plain, 128>},
    {DType::bf16, WgmmaForm::geglu, 128, false, launch_variant<__nv_bfloat16, WgmmaForm::geglu, 128>},
    {DType::bf16, WgmmaForm::swiglu, 128, false, launch_variant<__nv_bfloat16, WgmmaForm::swiglu, 128>},
    {DType::f16, WgmmaForm::plain, 128, false, launch_variant<__half, WgmmaForm::plain, 128>},
    {DType::f16, WgmmaForm::geglu, 128, false, launch_variant<__half, WgmmaForm::geglu, 128>},
    {DType::f16, WgmmaForm::swiglu, 128, false, launch_variant<__half, WgmmaForm::swiglu, 128>},
    {DType::bf16, WgmmaForm::plain, 64, false, launch_variant<__nv_bfloat16, WgmmaForm::plain, 64>},
    {DType::bf16, WgmmaForm::geglu, 64, false, launch_variant<__nv_bfloat16, WgmmaForm::geglu, 64>},
    {DType::bf16, WgmmaForm::swiglu, 64, false, launch_variant<__nv_bfloat16, WgmmaForm::swiglu, 64>},
    {DType::f16, WgmmaForm::plain, 64, false, launch_variant<__half, WgmmaForm::plain, 64>},
    {DType::f16, WgmmaForm::geglu, 64, false, launch_variant<__half, WgmmaForm::geglu, 64>},
    {DType::f16, WgmmaForm::swiglu, 64, false, launch_variant<__half, WgmmaForm::swiglu, 64>},
    {DType::bf16, WgmmaForm::plain, 32, false, launch_variant<__nv_bfloat16, WgmmaForm::plain, 32>},
    {DType::bf16, WgmmaForm::geglu, 32, false, launch_variant<__nv_bfloat16, WgmmaForm::geglu, 32>},
    {DType::bf16, WgmmaForm::swiglu, 32, false, launch_variant<__nv_bfloat16, WgmmaForm::swiglu, 32>},
    {DType::f16, WgmmaForm::plain, 32, false, launch_variant<__half, WgmmaForm::plain, 32>},
    {DType::f16, WgmmaForm::geglu, 32, false, launch_variant<__half, WgmmaForm::geglu, 32>},
    {DType::f16, WgmmaForm::swiglu, 32, false, launch_variant<__half, WgmmaForm::swiglu, 32>},
    {DType::bf16, WgmmaForm::plain, 128, true, launch_variant<__nv_bfloat16, WgmmaForm::plain, 128, true>},
    {DType::bf16, WgmmaForm::plain, 64, true, launch_variant<__nv_bfloat16, WgmmaForm::plain, 64, true>},
    {DType::bf16, WgmmaForm::plain, 32, true, launch_variant<__nv_bfloat16, WgmmaForm::plain, 32, true>},
    {DType::bf16, WgmmaForm::plain, 128, false, launch_variant<__nv_bfloat16, WgmmaForm::plain, 128, false, 8>, 8},
    {DType::bf16, WgmmaForm::geglu, 128, false, launch_variant<__nv_bfloat16, WgmmaForm::geglu, 128, false, 8>, 8},
    {DType::bf16, WgmmaForm::swiglu, 128, false, launch_variant<__nv_bfloat16, WgmmaForm::swiglu, 128, false, 8>, 8},
    // The 4-bit affine builds again, reading the tile layout.
    {DType::bf16, WgmmaForm::plain, 128, false, launch_variant<__nv_bfloat16, WgmmaForm::plain, 128, false, 4, true>, 4, true},
    {DType::bf16, WgmmaForm::geglu, 128, false, launch_variant<__nv_bfloat16, WgmmaForm::geglu, 128, false, 4, true>, 4, true},
    {DType::bf16, WgmmaForm::swiglu, 128, false, launch_variant<__nv_bfloat16, WgmmaForm::swiglu, 128, false, 4, true>, 4, true},
    {DType::f16, WgmmaForm::plain, 128, false, launch_variant<__half, WgmmaForm::plain, 128, false, 4, true>, 4, true},
    {DType::f16, WgmmaForm::geglu, 128, false, launch_variant<__half, WgmmaForm::geglu, 128, false, 4, true>, 4, true},
    {DType::f16, WgmmaForm::swiglu, 128, false, launch_variant<__half, WgmmaForm::swiglu, 128, false, 4, true>, 4, true},
    {DType::bf16, WgmmaForm::plain, 64, false, launch_variant<__nv_bfloat16, WgmmaForm::plain, 64, false, 4, true>, 4, true},
    {DType::bf16, WgmmaForm::geglu, 64, false, launch_variant<__nv_bfloat16, WgmmaForm::geglu, 64, false, 4, true>, 4, true},
    {DType::bf16, WgmmaForm::swiglu, 64, false, launch_variant<__nv_bfloat16, WgmmaForm::swiglu, 64, false, 4, true>, 4, true},
    {DType::f16, WgmmaForm::plain, 64, false, launch_variant<__half, WgmmaForm::plain, 64, false, 4, true>, 4, true},
    {DType::f16, WgmmaForm::geglu, 64, false, launch_variant<__half, WgmmaForm::geglu, 64, false, 4, true>, 4, true},
    {DType::f16, WgmmaForm::swiglu, 64, false, launch_variant<__half, WgmmaForm::swiglu, 64, false, 4, true>, 4, true},
    {DType::bf16, WgmmaForm::plain, 32, false, launch_variant<__nv_bfloat16, WgmmaForm::plain, 32, false, 4, true>, 4, true},
    {DType::bf16, WgmmaForm::geglu, 32, false, launch_variant<__nv_bfloat16, WgmmaForm::geglu, 32, false, 4, true>, 4, true},
    {DType::bf16, WgmmaForm::swiglu, 32, false, launch_variant<__nv_bfloat16, WgmmaForm::swiglu, 32, false, 4, true>, 4, true},
    {DType::f16, WgmmaForm::plain, 32, false, launch_variant<__half, WgmmaForm::plain, 32, false, 4, true>, 4, true},
    {DType::f16, WgmmaForm::geglu, 32, false, launch_variant<__half, WgmmaForm::geglu, 32, false, 4, true>, 4, true},
    {DType::f16, WgmmaForm::swiglu, 32, false, launch_variant<__half, WgmmaForm::swiglu, 32, false, 4, true>, 4, true},
};
constexpr int kWide8BitTokens = 128;  // the one 8-bit build

// The build by mean rows per expert (rows / E), first entry with rows <= max_rows_per_expert * E
// (measured, bench/NOTES.md: n64 beats n128 at 4 and 32 rows per expert, n128 wins at 64 and 128;
// n32 against n64 in step 6b).
struct WidthChoice {
  int64_t max_rows_per_expert;
  int max_tokens;
};
constexpr WidthChoice kWidths[] = {{16, 32}, {32, 64}, {INT64_MAX / 1024, 128}};

}  // namespace

uint64_t wgmma_tiled_launches() { return g_tiled_launches.load(std::memory_order_relaxed); }

bool wgmma_available() {
#if defined(EXPERTQMM_HAVE_SM90A)
  static const bool device_has_it = [] {
    int device = 0, major = 0, minor = 0;
    EXPERTQMM_CUDA_CHECK(cudaGetDevice(&device));
    EXPERTQMM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    EXPERTQMM_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return major == 9 && minor == 0;  // sm_90a code runs on compute capability 9.0 only
  }();
  return device_has_it && wgmma_setting() != RouteSwitch::off;
#else
  return false;
#endif
}

bool wgmma_builds_take(const detail::GatherQmmProblem& p) {
  const bool affine = p.mode == QuantMode::affine && (p.dtype == DType::bf16 || p.dtype == DType::f16) &&
                      (p.group_size == 64 || p.group_size == 128);
  const bool fp4 = (p.mode == QuantMode::mxfp4 || p.mode == QuantMode::nvfp4) && p.dtype == DType::bf16;
  const bool codes = p.bits == 4 || (p.bits == 8 && affine && p.dtype == DType::bf16);  // kVariants
  return wgmma_available() && (affine || fp4) && codes && p.M == 1 && p.K % kBK == 0 && p.N % 8 == 0 &&
         supports_tile_operands(p).ok;
}

bool wgmma_tiles_fit(const detail::GatherQmmProblem& p) {
  return wgmma_builds_take(p) && (p.bits == 4 || wgmma_8bit_rows_enough(p) || wgmma_setting() == RouteSwitch::on);
}

void launch_expert_tiles_wgmma(const WgmmaTileArgs& p, WgmmaForm form, DType dtype, const ExpertTile* tiles,
                               const TilePlanHeader* header, int64_t tile_slots, bool fp) {
  const int bits = p.tile.q.words_per_row * 32 / p.tile.K;  // codes per row: K * bits / 32 words
  int max_tokens = wgmma_width();  // EXPERTQMM_WGMMA_WIDTH / set_wgmma_width pins a build
  for (const WidthChoice& w : kWidths)
    if (max_tokens == 0 && p.tile.rows <= w.max_rows_per_expert * p.tile.E) max_tokens = w.max_tokens;
  if (bits == 8) max_tokens = kWide8BitTokens;
  // The tile layout where the weights (both, glu) carry one that quant_view found to be theirs.
  const bool tiled = bits == 4 && !fp && p.tile.q.tiled_codes != nullptr &&
                     (!is_glu(form) || p.up.tiled_codes != nullptr);
  auto launch_build = [&](const WgmmaTileArgs& args, int width) {
    for (const WgmmaVariant& v : kVariants)
      if (v.dtype == dtype && v.form == form && v.max_tokens == width && v.fp == fp && v.bits == bits &&
          v.tiled == tiled) {
        v.launch(args, tiles, header, tile_slots);
        return true;
      }
    return false;
  };
  if (wgmma_ws_takes(dtype, bits, fp, max_tokens)) {
    launch_expert_tiles_ws(p, form, dtype, tiles, header);
    // A retracted plan: the narrowest two-CTA build walks its rows (nothing else runs).
    WgmmaTileArgs fallback = p;
    fallback.retracted_only = true;
    if (launch_build(fallback, 32)) return;
  } else if (launch_build(p, max_tokens)) {
    return;
  }
  throw Error("gather_qmm", detail::cat("expert_tiles_wgmma has no kernel for dtype=", dtype_name(dtype), " form=",
                                        static_cast<int>(form), " bits=", bits, " width=", max_tokens,
                                        fp ? " (fp codes)" : ""));
}

}  // namespace expertqmm::cuda

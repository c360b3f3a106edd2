// Probe (issue 15, bench/NOTES.md step 47): how fast can the expert GEMMs' k loop run on the MLX
// layout when copies and math are split between warpgroups (warp specialization), against today's
// wgmma tile kernel (the library's expert tile route) on the same problem?
//
// Problem: the prefill layer's two expert GEMMs at Gemma 4's shapes, plain form, bf16, 4-bit affine
// g64 codes in MLX's layout ([E, N, K/8] words, [E, N, K/64] bf16 scales and biases), rows sorted by
// expert from a uniform top-8 routing of T tokens:
//   gate/up  out [T*8, 1408] = x[lhs] [T*8, 2816] @ W^T   (x rows gathered by token, as the layer does)
//   down     out [T*8, 2816] = h [T*8, 704] @ W^T          (the GLU rows in sorted order)
// Variants: today's route (gather_qmm: tile plan + the two-CTA wgmma kernel), the same with the
// route's warp-specialized build (EXPERTQMM_WGMMA_WS; "+ws" in the JSON), and this file's own
// warp-specialized kernel below (token width 128 or 256, one-shot or persistent: the design space
// the route build took one point of).
// Each variant's output is checked against a plain fp32 kernel on the same dequantized weights
// (bf16(fma(q, s, b)), MLX's tile dequantization) before it is timed with the bench protocol (one
// launch captured as a graph, L2 flushed before each of 50 replays, median).
//
// The warp-specialized kernel (ws_tiles_kernel): one CTA per (plan tile, 128 weight rows), 384
// threads, one CTA per SM.
//   warpgroup 0, the producer (40 registers after setmaxnreg): per 64-wide k tile, cp.async copies of
//     the tile's x rows (kN rows x 128 bytes, 128-byte swizzled: wgmma's B), the 128 weight rows'
//     32 bytes of codes and their scale / bias words into stage kt % kStages, then one
//     cp.async.mbarrier.arrive.noinc on the stage's `full` barrier (128 arrivals complete it). Before
//     refilling a stage it waits for the stage's `empty` barrier.
//   warpgroups 1 and 2, the consumers (232 registers): weight rows 0-63 and 64-127. Per k tile: wait
//     `full`, dequantize the lane's A fragments (rows g and g + 8 of its warp's 16, k 2t..2t+1 and
//     2t+8..2t+9 of each k16 step) from two 16-byte shared loads per row into one of two register
//     buffers, issue the 4 wgmmas (m64 x kN x k16) as one group, then wait until only that group is
//     in flight: the previous tile's wgmmas have retired, so its stage is released (`empty`, 256
//     arrivals) and its A buffer may be rewritten. A warpgroup's dequantization of tile kt + 1 thus
//     overlaps its own wgmmas of tile kt, with no CTA-wide barrier in the k loop.
//   Epilogue: fp32 accumulators -> T into shared memory (tokens x 136), a barrier of the consumers,
//     16-byte stores of the tile's rows.
// kN is the token width of a tile (128 or 256): the 256 build takes an expert's 129-256 rows in one
// tile (one pass over its weights) where the 128 build runs a second, mostly empty tile.
//
// Built as ws_tiles_probe with the CUDA build (sm_90a only does the work); run by hand or by
// gpu-check's bench-extra stage: prints JSON.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "cuda/device/cp_async.cuh"
#include "cuda/device/dequant.cuh"
#include "cuda/device/elem.cuh"
#include "cuda/device/mbarrier.cuh"
#include "cuda/device/wgmma.cuh"
#include "cuda/gather_qmm.h"
#include "expertqmm/backend.h"
#include "expertqmm/settings.h"
#include "probe_check.cuh"
#include "replay_timing.h"

namespace timing = expertqmm::timing;
namespace device = expertqmm::cuda::device;
using namespace expertqmm;
using bf16 = __nv_bfloat16;

namespace {

constexpr int kProducerThreads = 128, kConsumerThreads = 256, kThreads = 384;
constexpr int kCtaRows = 128;  // weight rows per CTA, 64 per consumer warpgroup
constexpr int kBK = 64;        // k per stage: one quantization group

// Shared memory per stage (1024-byte aligned):
//   xs  (kN, 64) bf16, 128-byte rows, chunk c of row r at c ^ (r % 8)   (wgmma B, K-major, swizzled)
//   ws  (128, 8) uint32 codes, two 16-byte chunks per row, chunk c of row r at c ^ ((r / 4) % 2)
//   ss, bs (128,) uint32: the aligned word holding the row's group scale / bias
// then, persistent only, the epilogue staging (kN, 136) T (one-shot CTAs stage in the ring, which
// is idle by then), the full[kStages] and empty[kStages] mbarriers and the tile's x row offsets (kN
// int32, -1: no row; the producer's alone).
template <int kN, bool kPersistent>
struct WsLayout {
  static constexpr int kStages = kN == 256 ? (kPersistent ? 4 : 5) : (kPersistent ? 7 : 9);
  static constexpr int kXBytes = kN * 128;
  static constexpr int kWBytes = kCtaRows * 32;
  static constexpr int kStageBytes = kXBytes + kWBytes + 2 * kCtaRows * 4;
  static constexpr int kOutStride = kCtaRows + 8;  // epilogue staging row, elements
  static constexpr int kStagingOffset = kPersistent ? kStages * kStageBytes : 0;
  static constexpr int kBarOffset = kStages * kStageBytes + (kPersistent ? kN * kOutStride * 2 : 0);
  static constexpr int kRowsOffset = kBarOffset + 2 * kStages * 8;
  static constexpr int kBytes = kRowsOffset + kN * 4;
  static constexpr int kAllocBytes = kBytes + 1024;
  static_assert(kStageBytes % 1024 == 0, "stages stay 1024-byte aligned for the swizzle");
  static_assert(kPersistent || kN * kOutStride * 2 <= kBarOffset, "the epilogue staging fits in the stages");
  static_assert(kAllocBytes <= 227 * 1024, "one CTA per SM");
};

using device::shared_address;
__device__ __forceinline__ void consumers_sync() { device::named_barrier_sync<1, kConsumerThreads>(); }
__device__ __forceinline__ void producers_sync() { device::named_barrier_sync<2, kProducerThreads>(); }

struct WsArgs {
  const bf16* x;          // [x_rows, K]
  const int32_t* lhs;     // x row of each sorted row (null: the row itself)
  const uint32_t* w;      // [E, N, K/8]
  const uint16_t* scales; // [E, N, K/64] bf16 bits
  const uint16_t* biases;
  bf16* out;              // [rows, N]
  const int4* tiles;      // {expert, first sorted row, rows, 0}
  int tile_count;
  int N, K;
};

// Work item i: plan tile i / col_blocks against weight rows 128 (i % col_blocks) .. + 127, so the
// CTAs of one tile's column blocks run together and share its x rows in the L2. One-shot: one item
// per CTA. Persistent: a grid of at most one CTA per SM strides over the items; the producer fills
// the ring for the next item while the consumers store this one, and a global k-tile counter keeps
// the ring's slots and phases running across items.
template <int kN, bool kPersistent>
__global__ void __launch_bounds__(kThreads, 1) ws_tiles_kernel(WsArgs a) {
#if EXPERTQMM_WGMMA_ENABLED
  using L = WsLayout<kN, kPersistent>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = shared_address(smem_raw);
  unsigned char* smem = smem_raw + ((1024u - (raw & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarOffset);
  uint64_t* empty = full + L::kStages;
  int32_t* row_offset = reinterpret_cast<int32_t*>(smem + L::kRowsOffset);
  const int col_blocks = a.N / kCtaRows;
  const int items = a.tile_count * col_blocks;
  const int item_stride = kPersistent ? static_cast<int>(gridDim.x) : items;
  const int k_tiles = a.K / kBK;
  const int groups = a.K / kBK;
  const int tid = threadIdx.x;

  if (tid == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      device::mbarrier_init(&full[s], kProducerThreads);
      device::mbarrier_init(&empty[s], kConsumerThreads);
    }
    device::mbarrier_init_fence();
  }
  __syncthreads();

  if (tid < kProducerThreads) {
    device::setmaxnreg_dec<40>();
    // Weight row p (both 16-byte chunks) and its scale and bias words; x: rows p / 8 + 16 i, chunk p % 8.
    const int p = tid;
    const int xr = p >> 3, xc = p & 7;
    int ring = 0;  // k tiles issued so far: slot ring % kStages, round ring / kStages
    for (int item = blockIdx.x; item < items; item += item_stride) {
      const int4 tile = a.tiles[item / col_blocks];
      const int col0 = (item % col_blocks) * kCtaRows;
      producers_sync();  // the previous item's copies were issued: its offsets may be replaced
      for (int r = p; r < kN; r += kProducerThreads)
        row_offset[r] = r < tile.z ? (a.lhs ? a.lhs[tile.y + r] : tile.y + r) * a.K : -1;
      producers_sync();
      const int64_t w_row = static_cast<int64_t>(tile.x) * a.N + col0 + p;
      const uint32_t* w_src = a.w + w_row * (a.K / 8);
      const uint16_t* s_src = a.scales + w_row * groups;
      const uint16_t* b_src = a.biases + w_row * groups;
      for (int kt = 0; kt < k_tiles; ++kt, ++ring) {
        const int s = ring % L::kStages;
        if (ring >= L::kStages) device::mbarrier_wait(&empty[s], ((ring / L::kStages) - 1) & 1);
        unsigned char* stage = smem + s * L::kStageBytes;
#pragma unroll 4
        for (int r = xr; r < kN; r += 16) {
          const int32_t off = row_offset[r];
          device::cp_async_16(stage + r * 128 + ((xc ^ (r & 7)) << 4), a.x + (off >= 0 ? off + kt * kBK + xc * 8 : 0),
                              off >= 0);
        }
        unsigned char* ws = stage + L::kXBytes;
#pragma unroll
        for (int c = 0; c < 2; ++c)
          device::cp_async_16(ws + p * 32 + ((c ^ ((p >> 2) & 1)) << 4), w_src + kt * 8 + 4 * c, true);
        // The group's 2-byte element sits in the aligned word at el & ~1 (odd: the high half).
        const uint16_t* se = s_src + kt;
        const uint16_t* be = b_src + kt;
        const int odd = static_cast<int>((reinterpret_cast<uintptr_t>(se) >> 1) & 1);
        device::cp_async_4(ws + L::kWBytes + p * 4, se - odd, odd ? 4 : 2);
        device::cp_async_4(ws + L::kWBytes + kCtaRows * 4 + p * 4, be - odd, odd ? 4 : 2);
        device::cp_async_mbarrier_arrive(&full[s]);
      }
    }
    return;
  }

  device::setmaxnreg_inc<232>();
  const int ct = tid - kProducerThreads;
  const int warp = ct >> 5, lane = ct & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m_lo = (warp >> 2) * 64 + (warp & 3) * 16 + g, m_hi = m_lo + 8;
  using Dequant = device::PackedDequant<bf16>;
  const uint32_t selector = Dequant::nibble_selector(t);
  const uint64_t desc0 = device::wgmma_desc_k128(smem);
  bf16* out_s = reinterpret_cast<bf16*>(smem + L::kStagingOffset);
  int ring0 = 0;  // the ring position of this item's first k tile
  for (int item = blockIdx.x; item < items; item += item_stride, ring0 += k_tiles) {
    const int4 tile = a.tiles[item / col_blocks];
    const int col0 = (item % col_blocks) * kCtaRows;
    // Half of the staged word holding this row's group kt: the parity of the element's index.
    const int64_t first_lo = (static_cast<int64_t>(tile.x) * a.N + col0 + m_lo) * groups;
    const int64_t first_hi = (static_cast<int64_t>(tile.x) * a.N + col0 + m_hi) * groups;

    float acc[kN / 2];
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[i] = 0.f;
    uint32_t afrag[2][4][4];

    auto k_tile = [&](int kt, uint32_t(&af)[4][4]) {
      const int ring = ring0 + kt;
      const int s = ring % L::kStages;
      device::mbarrier_wait(&full[s], (ring / L::kStages) & 1);
      const unsigned char* base = smem + s * L::kStageBytes;
      const uint32_t* ws = reinterpret_cast<const uint32_t*>(base + L::kXBytes);
      const uint32_t* ss = ws + kCtaRows * 8;
      const uint32_t* bs = ss + kCtaRows;
      const bool high_lo = ((first_lo + kt) & 1) != 0, high_hi = ((first_hi + kt) & 1) != 0;
      const uint32_t s_lo = device::broadcast_half(ss[m_lo], high_lo), b_lo = device::broadcast_half(bs[m_lo], high_lo);
      const uint32_t s_hi = device::broadcast_half(ss[m_hi], high_hi), b_hi = device::broadcast_half(bs[m_hi], high_hi);
      auto chunk_of = [&](int m, int c) { return *reinterpret_cast<const uint4*>(ws + m * 8 + ((c ^ ((m >> 2) & 1)) << 2)); };
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
      // x written by cp.async (generic proxy), read by wgmma (async proxy).
      device::fence_proxy_async_shared();
      device::wgmma_fence();
      const uint64_t desc = desc0 + ((s * L::kStageBytes) >> 4);
#pragma unroll
      for (int k16 = 0; k16 < 4; ++k16) device::WgmmaRS<bf16, kN>::run(acc, af[k16], desc + 2 * k16);
      device::wgmma_commit();
      device::wgmma_wait<1>();  // tile kt - 1's group retired: its stage and A buffer are free
      if (kt > 0) device::mbarrier_arrive(&empty[(ring - 1) % L::kStages]);
    };
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) device::fence_operand(acc[i]);
    // Pairs of k tiles, so that each buffer is a fixed set of registers; an odd count's first tile
    // alone before them (a conditional second tile inside the loop made ptxas serialize the wgmmas, C7513).
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
    device::mbarrier_arrive(&empty[(ring0 + k_tiles - 1) % L::kStages]);  // the item's last stage

    // One-shot: every consumer is past its last stage read, so the ring becomes the staging.
    // Persistent: the previous item's stores have read the staging.
    consumers_sync();
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      const int tok = 8 * j + 2 * t;
      out_s[tok * L::kOutStride + m_lo] = __float2bfloat16_rn(acc[4 * j + 0]);
      out_s[(tok + 1) * L::kOutStride + m_lo] = __float2bfloat16_rn(acc[4 * j + 1]);
      out_s[tok * L::kOutStride + m_hi] = __float2bfloat16_rn(acc[4 * j + 2]);
      out_s[(tok + 1) * L::kOutStride + m_hi] = __float2bfloat16_rn(acc[4 * j + 3]);
    }
    consumers_sync();
    for (int i = ct; i < tile.z * 16; i += kConsumerThreads) {
      const int tok = i >> 4, chunk = i & 15;
      *reinterpret_cast<uint4*>(a.out + static_cast<int64_t>(tile.y + tok) * a.N + col0 + chunk * 8) =
          *reinterpret_cast<const uint4*>(out_s + tok * L::kOutStride + chunk * 8);
    }
  }
#endif
}

// Plain fp32 reference: one thread per output, weights dequantized as MLX's tiles do (fp32 fma, bf16).
__global__ void reference_kernel(WsArgs a, const int32_t* rhs, int rows, float* ref) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<int64_t>(rows) * a.N) return;
  const int r = static_cast<int>(i / a.N), n = static_cast<int>(i % a.N);
  const int64_t w_row = static_cast<int64_t>(rhs[r]) * a.N + n;
  const bf16* x = a.x + static_cast<int64_t>(a.lhs ? a.lhs[r] : r) * a.K;
  float sum = 0.f;
  for (int k = 0; k < a.K; ++k) {
    const uint32_t q = (a.w[w_row * (a.K / 8) + k / 8] >> (4 * (k % 8))) & 15u;
    const float s = __uint_as_float(uint32_t(a.scales[w_row * (a.K / 64) + k / 64]) << 16);
    const float b = __uint_as_float(uint32_t(a.biases[w_row * (a.K / 64) + k / 64]) << 16);
    sum += __bfloat162float(x[k]) * __bfloat162float(__float2bfloat16_rn(__fmaf_rn(s, float(q), b)));
  }
  ref[i] = sum;
}

// Deterministic pseudo-random fill: codes uniform, scales ~1/64, biases ~ -8 scales, x ~ N(0, 1)-ish.
__global__ void fill_kernel(uint32_t* w, int64_t words, uint16_t* scales, uint16_t* biases, int64_t groups,
                            bf16* x, int64_t xn, uint32_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  auto hash = [&](int64_t i) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    return h;
  };
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words; i += stride) w[i] = hash(i);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < groups; i += stride) {
    const float s = (1.f + (hash(i + words) & 255) / 256.f) / 64.f;
    const bf16 sb = __float2bfloat16_rn(s), bb = __float2bfloat16_rn(-8.f * s);
    scales[i] = *reinterpret_cast<const uint16_t*>(&sb);
    biases[i] = *reinterpret_cast<const uint16_t*>(&bb);
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < xn; i += stride)
    x[i] = __float2bfloat16_rn((static_cast<int>(hash(i + 7 * words) & 1023) - 512) / 256.f);
}

template <class Call>
double median_us(const timing::DeviceBuffer& flush, cudaStream_t s, Call call) {
  call();
  CHECK(cudaStreamSynchronize(s));
  timing::Graphs g;
  timing::capture_into(g, s, "the probe's GEMM", call);
  CHECK(cudaGraphLaunch(g.execs[0], s));
  return timing::stats_of(timing::timed_replays(g.execs, 50, s, flush)).median;
}

// ‖out − ref‖ / ‖ref‖ over every output.
double rel_error(const bf16* out_d, const float* ref_d, int64_t n) {
  std::vector<bf16> out(n);
  std::vector<float> ref(n);
  CHECK(cudaMemcpy(out.data(), out_d, n * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(ref.data(), ref_d, n * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = double(__bfloat162float(out[i])) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace

int main(int argc, char** argv) {
  // argv[1]: one variant only (route, route_ws, ws_n128, ws_n128_persistent, ws_n256, ws_n256_persistent), so
  // that a script can give each its own time limit; none: all.
  const std::string only = argc > 1 ? argv[1] : "";
  auto wanted = [&](const std::string& v) { return only.empty() || only == v; };
  constexpr int E = 128, top_k = 8;
  struct Gemm {
    const char* name;
    int N, K;
    bool gathered;
  };
  const Gemm gemms[] = {{"gate_up", 1408, 2816, true}, {"down", 2816, 704, false}};
  const int token_counts[] = {512, 1024, 2048};
  const timing::DeviceBuffer flush(timing::l2_flush_bytes());
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CudaStreamScope scope(0, stream);
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("{\"probe\": \"ws_tiles\", \"rows\": [\n");
  bool first_row = true;
  for (const Gemm& gm : gemms) {
    const int64_t words = int64_t(E) * gm.N * gm.K / 8, groups = int64_t(E) * gm.N * gm.K / 64;
    const Tensor w = Tensor::empty({E, gm.N, gm.K / 8}, DType::u32, Device::cuda);
    const Tensor scales = Tensor::empty({E, gm.N, gm.K / 64}, DType::bf16, Device::cuda);
    const Tensor biases = Tensor::empty({E, gm.N, gm.K / 64}, DType::bf16, Device::cuda);
    for (int T : token_counts) {
      // Uniform top-8 routing, rows sorted by expert (stable in token order).
      std::mt19937 rng(1234 + T);
      std::vector<std::pair<int, int>> pairs;  // (expert, token)
      std::vector<int> ids(E);
      for (int tok = 0; tok < T; ++tok) {
        std::iota(ids.begin(), ids.end(), 0);
        for (int j = 0; j < top_k; ++j) {
          std::swap(ids[j], ids[j + rng() % (E - j)]);
          pairs.push_back({ids[j], tok});
        }
      }
      std::stable_sort(pairs.begin(), pairs.end(), [](auto& l, auto& r) { return l.first < r.first; });
      const int rows = T * top_k;
      std::vector<int32_t> lhs_h(rows), rhs_h(rows);
      for (int r = 0; r < rows; ++r) {
        lhs_h[r] = gm.gathered ? pairs[r].second : r;
        rhs_h[r] = pairs[r].first;
      }
      const int x_rows = gm.gathered ? T : rows;
      const Tensor x = Tensor::empty({x_rows, 1, gm.K}, DType::bf16, Device::cuda);
      fill_kernel<<<1024, 256, 0, stream>>>(w.data_as<uint32_t>(), words, scales.data_as<uint16_t>(),
                                            biases.data_as<uint16_t>(), groups, x.data_as<bf16>(),
                                            int64_t(x_rows) * gm.K, 77u + T);
      CHECK(cudaGetLastError());
      const Tensor lhs = Tensor::from_host(lhs_h.data(), {rows}, DType::i32, Device::cuda);
      const Tensor rhs = Tensor::from_host(rhs_h.data(), {rows}, DType::i32, Device::cuda);
      Tensor out = Tensor::empty({rows, gm.N}, DType::bf16, Device::cuda);
      const Tensor ref = Tensor::empty({rows, gm.N}, DType::f32, Device::cuda);
      WsArgs a{x.data_as<bf16>(), gm.gathered ? lhs.data_as<int32_t>() : nullptr, w.data_as<uint32_t>(),
               scales.data_as<uint16_t>(), biases.data_as<uint16_t>(), out.data_as<bf16>(), nullptr, 0, gm.N, gm.K};
      const int64_t outputs = int64_t(rows) * gm.N;
      reference_kernel<<<static_cast<unsigned>((outputs + 255) / 256), 256, 0, stream>>>(a, rhs.data_as<int32_t>(), rows,
                                                                                       ref.data_as<float>());
      CHECK(cudaGetLastError());
      const double flops = 2.0 * rows * gm.N * gm.K;

      auto report = [&](const char* variant, double us, double err, int tiles) {
        std::printf("%s  {\"gemm\": \"%s\", \"tokens\": %d, \"variant\": \"%s\", \"tiles\": %d, \"us_median\": %.2f, "
                    "\"tflops\": %.1f, \"rel_error\": %.2e}",
                    first_row ? "" : ",\n", gm.name, T, variant, tiles, us, flops / us / 1e6, err);
        first_row = false;
        std::fflush(stdout);
      };
      // Today's route: gather_qmm with sorted ids (tile plan + the wgmma expert tile kernel).
      // Today's route, and the same call with the route's warp-specialized build (EXPERTQMM_WGMMA_WS,
      // gather_qmm_expert_tiles_ws.cu: persistent, n128 + n32 tails merged) where the selector picks
      // the 128-token build (above 32 rows per expert).
      for (const bool ws_build : {false, true}) {
        if (!wanted(ws_build ? "route_ws" : "route")) continue;
        set_wgmma_ws(ws_build ? RouteSwitch::on : RouteSwitch::off);
        const detail::GatherQmmProblem p =
            detail::make_gather_qmm_problem(x, w, scales, biases,
                                            gm.gathered ? lhs : Tensor(), rhs, true, 64, 4, true);
        Workspace ws;
        CHECK(cudaMemsetAsync(out.data(), 0xff, outputs * 2, stream));
        cuda::gather_qmm_into(p, out.data(), &ws);
        CHECK(cudaStreamSynchronize(stream));
        const double err = rel_error(out.data_as<bf16>(), ref.data_as<float>(), outputs);
        const double us = median_us(flush, stream, [&] { cuda::gather_qmm_into(p, out.data(), &ws); });
        set_wgmma_ws(RouteSwitch::automatic);
        report((cuda::gather_qmm_selected_route(p) + (ws_build ? "+ws" : "")).c_str(), us, err, 0);
      }
      // The warp-specialized kernel: token widths 128 and 256, one-shot and persistent CTAs.
      auto run_ws = [&](auto width, auto persistent) {
        constexpr int kN = decltype(width)::value;
        constexpr bool kPersistent = decltype(persistent)::value;
        using L = WsLayout<kN, kPersistent>;
        char name[32];
        std::snprintf(name, sizeof name, "ws_n%d%s", kN, kPersistent ? "_persistent" : "");
        if (!wanted(name)) return;
        CHECK(cudaFuncSetAttribute(ws_tiles_kernel<kN, kPersistent>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   L::kAllocBytes));
        std::vector<int4> tiles_h;
        for (int r = 0; r < rows;) {
          int end = r;
          while (end < rows && rhs_h[end] == rhs_h[r]) ++end;
          for (int t0 = r; t0 < end; t0 += kN) tiles_h.push_back({rhs_h[r], t0, std::min(kN, end - t0), 0});
          r = end;
        }
        const Tensor tiles = Tensor::from_host(tiles_h.data(), {int64_t(tiles_h.size()) * 4}, DType::i32, Device::cuda);
        WsArgs wa = a;
        wa.tiles = reinterpret_cast<const int4*>(tiles.data());
        wa.tile_count = static_cast<int>(tiles_h.size());
        const int items = wa.tile_count * (gm.N / kCtaRows);
        const unsigned grid = kPersistent ? std::min(items, sms) : items;
        auto launch = [&] {
          ws_tiles_kernel<kN, kPersistent><<<grid, kThreads, L::kAllocBytes, stream>>>(wa);
          CHECK(cudaGetLastError());
        };
        CHECK(cudaMemsetAsync(out.data(), 0xff, outputs * 2, stream));
        launch();
        CHECK(cudaStreamSynchronize(stream));
        const double err = rel_error(out.data_as<bf16>(), ref.data_as<float>(), outputs);
        const double us = err < 1e-2 ? median_us(flush, stream, launch) : -1.0;
        report(name, us, err, wa.tile_count);
      };
      using std::integral_constant;
      run_ws(integral_constant<int, 128>(), integral_constant<bool, false>());
      run_ws(integral_constant<int, 128>(), integral_constant<bool, true>());
      run_ws(integral_constant<int, 256>(), integral_constant<bool, false>());
      run_ws(integral_constant<int, 256>(), integral_constant<bool, true>());
    }
  }
  std::printf("\n]}\n");
  CHECK(cudaStreamDestroy(stream));
  return 0;
}

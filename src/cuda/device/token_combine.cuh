// The MoE layer's weighted combine inside the down GEMM's epilogue (bench/NOTES.md step 56):
//   out[t, c] = sum_j w[t, j] * y[slot_row[t*k + j], c]
// with combine.cu's arithmetic (fp32 products and sums in slot order j = 0..k-1, explicit
// round-to-nearest, no FMA, one rounding to the output dtype), so the bits are the combine kernel's.
//
// Why: at 2048 tokens the separate combine read back the down output y (92 MB in four column
// windows) for ~52 us on an H100 after the GEMM had written it. Here the combine of a token's
// 128-column block runs as soon as its k rows are written, in the CTA that wrote the last of them,
// while y is in the L2 and other CTAs keep the tensor cores busy.
//
// How a CTA knows it wrote the last row: one counter per (token, 128-column block of the whole
// output), zeroed before the launch. After storing its tile, every thread fences its stores
// (device scope), the CTA meets at a barrier, then one thread per stored row adds 1 to its token's
// counter; the thread that reads k - 1 lists the token. The listed tokens' other rows were fenced
// before their counts, so the CTA reads them (L1 bypassed) after its own fence.
#pragma once
#include <cstdint>

#include "cuda/device/elem.cuh"
#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

// What the epilogue needs to combine (counters null: off). y is the GEMM's output (TileArgs::out,
// rows N apart: the column window's width).
struct TokenCombine {
  unsigned* counters = nullptr;           // [T, col_blocks] zero before the first window's launch
  const int32_t* token_of_row = nullptr;  // [y_rows] y row -> token
  const int32_t* slot_row = nullptr;      // [T * k] slot t*k + j -> y row (the layer's inv_order)
  const void* weights = nullptr;          // [T, k] of weight_dtype
  DType weight_dtype = DType::bf16;
  int k = 0;
  int64_t T = 0, y_rows = 0;
  int col_blocks = 0;                     // 128-column blocks of the whole output (ceil(D / 128))
  int col_block0 = 0;                     // the window's first block
  void* out = nullptr;                    // out[0, 0] at the window's first column, the GEMM's dtype
  int64_t out_ld = 0;                     // elements between out rows (D)
};

namespace device {

constexpr int kCombineColumns = 128;  // columns per counter: the plain GEMM's CTA block

template <DType Y, int VEC>
struct alignas(sizeof(typename cuda::Elem<Y>::storage) * VEC) CombinePack {
  typename cuda::Elem<Y>::storage v[VEC];
};

// acc[i] = sum_j w[t, j] * y[row(t, j), c + i] for one token t and VEC columns from c: fp32 products
// and sums in slot order (explicit round-to-nearest, no FMA: the CPU backend's sequence of
// operations). Slot j reads y row slot_row[t*k + j] (identity t*k + j when slot_row is null); a row
// outside [0, y_rows) is recorded as a fault (once, by the thread of column 0) and skipped. The
// slots go kBatch at a time: their row ids and weights, then their loads in flight, then the math.
// kBypassL1: y was written by other CTAs of the running kernel (loads at L2 scope).
template <DType Y, int VEC, bool kBypassL1, int kBatch = 8>
__device__ __forceinline__ void weighted_rows_sum(const typename cuda::Elem<Y>::storage* __restrict__ y, int64_t y_rows,
                                                  int64_t y_ld, const int32_t* __restrict__ slot_row,
                                                  const void* __restrict__ w, DType w_dtype, int64_t t, int64_t k,
                                                  int64_t c, float (&acc)[VEC], uint32_t* faults) {
  using Pack = CombinePack<Y, VEC>;
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
  for (int64_t j0 = 0; j0 < k; j0 += kBatch) {
    int64_t row[kBatch];
    float wj[kBatch];
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      const int64_t slot = t * k + j0 + s;
      const bool live = j0 + s < k;
      row[s] = !live ? -1 : slot_row ? slot_row[slot] : slot;
      wj[s] = live ? load_any(w, w_dtype, slot) : 0.0f;
    }
    Pack yv[kBatch];
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      if (row[s] < 0 || row[s] >= y_rows) continue;
      const Pack* src = reinterpret_cast<const Pack*>(y + row[s] * y_ld + c);
      if constexpr (kBypassL1 && sizeof(Pack) == 16) {
        const uint4 bits = __ldcg(reinterpret_cast<const uint4*>(src));
        yv[s] = *reinterpret_cast<const Pack*>(&bits);
      } else {
        yv[s] = *src;
      }
    }
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      if (j0 + s >= k) break;
      if (row[s] < 0 || row[s] >= y_rows) {
        if (c == 0)
          record_fault(faults, kFaultRowOutOfRange, static_cast<uint32_t>(row[s]), static_cast<uint32_t>(y_rows));
        continue;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wj[s], cuda::Elem<Y>::load(yv[s].v[i])));
    }
  }
}

// Counts the rows [row0 + begin, row0 + end) this CTA stored for column block `col_block` of its
// window and combines every token whose k-th row that was. All kThreads threads call it with the
// same arguments after the tile's stores and their barrier; `list` is kMaxRows + 1 ints of shared
// memory nobody reads until the function's final barrier. y: the window's output, rows N apart.
// Work split: the count, one thread per row; the combine, one thread per (listed token, 8-column
// chunk): 16 chunks per token, 16 tokens per pass of 256 threads; 4 slots' loads in flight per
// thread (8 left the kernel's plain builds spilling).
// Called once per plan tile from the kernel's loop, not from each tile width's epilogue (inlined in
// all five, the plain n128 build spilled 2.5-4 KB).
template <class T, int kThreads, int kMaxRows>
__device__ __forceinline__ void combine_landed_rows(const TokenCombine& c, const T* __restrict__ y, int N,
                                                    int64_t row0, int begin, int end, int col_block, int* list,
                                                    uint32_t* faults) {
  constexpr DType Y = dtype_of<T>();
  static_assert(sizeof(T) == 2, "16-bit outputs: 8 per 16-byte chunk");
  using Storage = typename cuda::Elem<Y>::storage;
  const int tid = threadIdx.x;
  int* listed = list + kMaxRows;
  __threadfence();  // this thread's y stores, device-wide, before any count of them
  if (tid == 0) *listed = 0;
  __syncthreads();
  if (tid < end - begin) {
    const int64_t t = c.token_of_row[row0 + begin + tid];
    if (t >= 0 && t < c.T) {
      const unsigned done = atomicAdd(c.counters + t * c.col_blocks + c.col_block0 + col_block, 1u);
      if (done == static_cast<unsigned>(c.k - 1)) list[atomicAdd(listed, 1)] = static_cast<int>(t);
    }
  }
  __syncthreads();
  const int tokens = *listed;
  if (tokens > 0) __threadfence();  // the other CTAs' rows, counted before ours, before reading them
  constexpr int kChunks = kCombineColumns / 8;
  for (int i = tid; i < tokens * kChunks; i += kThreads) {
    const int64_t t = list[i / kChunks];
    const int col = col_block * kCombineColumns + (i % kChunks) * 8;
    if (col >= N) continue;
    float acc[8];
    weighted_rows_sum<Y, 8, true, 4>(reinterpret_cast<const Storage*>(y), c.y_rows, N, c.slot_row, c.weights,
                                  c.weight_dtype, t, c.k, col, acc, faults);
    CombinePack<Y, 8> o;
#pragma unroll
    for (int e = 0; e < 8; ++e) o.v[e] = cuda::Elem<Y>::store(acc[e]);
    *reinterpret_cast<CombinePack<Y, 8>*>(static_cast<Storage*>(c.out) + t * c.out_ld + col) = o;
  }
  __syncthreads();  // the list (in the stages' memory) is rewritten by the next tile
}

}  // namespace device
}  // namespace expertqmm::cuda

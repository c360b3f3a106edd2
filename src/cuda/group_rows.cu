// The layer's rows grouped by expert in one kernel (bench/NOTES.md step 54): what the stable sort
// (sort.cu: positions, CUB's radix sort, the inverse) and the tile plan builder (tile_plan.cu) give
// in five to seven launches, for up to kGroupRowsMaxExperts experts and kGroupRowsMaxRows rows (the
// layer takes it up to kGroupRowsOneCtaMaxRows, where it measured faster: one CTA does all the work;
// past it, the grid form below).
// For ids in [0, E) every output is the stable sort's and the plan builder's, bit for bit (the
// tests compare them): a counting sort is stable when each bucket's rows keep their flat order.
#include "cuda/cuda_backend.h"
#include "cuda/device/tile_plan_emit.cuh"
#include "cuda/moe_internal.h"
#include "cuda/tile_plan.cuh"

namespace expertqmm::cuda {

namespace {

constexpr int kThreads = device::kPlanThreads;  // one CTA of 1024 threads
constexpr int kWarps = kThreads / 32;
constexpr int kBatch = 16;  // ids a lane loads before it uses any (one memory latency per 16 of its rows)

struct GroupRowsSmem {
  // Per warp and bucket (E buckets, then bucket E for ids outside [0, E)): the warp's count of the
  // bucket's rows, then (after the scan) the next output position of the warp's rows in it.
  int32_t offset[kWarps][kGroupRowsMaxExperts + 1];
  int32_t first_row[kGroupRowsMaxExperts + 2];  // (E + 2,): first output row of each bucket, then n
  device::TilePlanEmitSmem emit;                // the plan's emission; its scan buffers also scan the buckets
};

__device__ __forceinline__ unsigned lanes_below() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// The lanes of the warp whose label equals this lane's, from one ballot per label bit (the first
// build of this kernel ranked with __match_any_sync and counted with it too: 53 us at 16384 rows,
// 30 us with this and shared atomics for the counts; bench/NOTES.md step 54).
__device__ __forceinline__ unsigned same_label_lanes(int label, int label_bits) {
  unsigned peers = 0xffffffffu;
  for (int bit = 0; bit < label_bits; ++bit) {
    const bool set = (label >> bit) & 1;
    const unsigned ones = __ballot_sync(0xffffffffu, set);
    peers &= set ? ones : ~ones;
  }
  return peers;
}

__device__ __forceinline__ int bucket_of(int32_t id, int E) { return id >= 0 && id < E ? id : E; }

// Labels of buckets 0 .. E and of lanes past the end (all ones): label_bits covers E + 1.
__device__ __forceinline__ int label_bits_for(int E) {
  int bits = 1;
  while ((1 << bits) - 1 <= E) ++bits;
  return bits;
}

// sorted_ids of the in-range rows: runs of each expert, written in position order by the CTA
// (position p finds its expert by a binary search of first_row (E + 1,)).
__device__ __forceinline__ void write_expert_runs(const int32_t* first_row, int E, int32_t* __restrict__ sorted_ids) {
  const int in_range = first_row[E];
  for (int pos = threadIdx.x; pos < in_range; pos += blockDim.x) {
    int lo = 0, hi = E - 1;  // the last expert whose first row is <= pos
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (first_row[mid] <= pos) lo = mid;
      else hi = mid - 1;
    }
    sorted_ids[pos] = lo;
  }
}

// One pass of a warp over its rows i = base + lane (< end): each row goes to offset[bucket] + its
// rank among this pass's lanes of the same bucket, and the lowest of those lanes advances the
// offset, so rows keep their flat order within a bucket. offset: this warp's row of the shared
// table, at each bucket's next output position.
__device__ __forceinline__ void place_pass(int32_t id, int i, int end, int E, int k, int label_bits,
                                           int32_t* offset, int32_t* __restrict__ sorted_ids,
                                           int32_t* __restrict__ inv_order, int32_t* __restrict__ token_of_row) {
  const bool live = i < end;
  const int b = live ? bucket_of(id, E) : (1 << label_bits) - 1;
  const unsigned below = lanes_below();
  const unsigned peers = same_label_lanes(b, label_bits);
  const int pos = live ? offset[b] + __popc(peers & below) : 0;
  __syncwarp();
  if (live && (peers & below) == 0) offset[b] += __popc(peers);
  __syncwarp();
  if (live) {
    if (b == E) sorted_ids[pos] = id;  // out of range: the raw id, for the GEMMs to report
    inv_order[i] = pos;
    token_of_row[pos] = i / k;
  }
}

// Pointers and layout (n rows, row b = slot b % k of token b / k):
//   ids          (n,) int32 flat expert ids; read twice
//   sorted_ids   (n,) int32: the ids in output order (each expert's rows in flat order, experts
//                ascending, ids outside [0, E) last in flat order, unchanged)
//   inv_order    (n,) int32: output position of flat row b
//   token_of_row (n,) int32: token of the row at each output position (flat row / k)
//   tiles, header: the tile plan (tile_plan.h) of sorted_ids, or null for none; retracted
//                (kPlanOutOfRange) when an id is outside [0, E)
// Work split: ONE CTA of 1024 threads. Warp w owns the flat rows [w * chunk, (w + 1) * chunk),
// chunk a multiple of 32; it walks them 32 at a time in order, lane l taking row base + l, each lane
// loading kBatch of its rows before it uses any. Phase 1: each lane adds 1 to offset[w][bucket]
// (a shared atomic: the count only, so the order does not matter). Phase 2: thread t < E + 1 turns
// bucket t's column into warp-exclusive prefixes, a scan of the bucket totals over the CTA gives each
// bucket's first row, and thread t adds it to the column; then the CTA writes sorted_ids of the
// in-range buckets as runs (coalesced: position p finds its bucket by a binary search of first_row).
// Phase 3: each row goes to offset[w][bucket] + (its rank among this pass's lanes of the same bucket:
// same_label_lanes), and the lowest of those lanes advances the offset, so rows keep their flat order
// within a bucket and the grouping is the stable sort; token_of_row is written at the position
// (scattered), inv_order at the row (coalesced). Phase 4: the plan, from first_row
// (device::emit_tile_plan, the plan builder's own emission).
__global__ void __launch_bounds__(kThreads, 1)
    group_rows_kernel(const int32_t* __restrict__ ids, int n, int k, int E, int32_t* __restrict__ sorted_ids,
                      int32_t* __restrict__ inv_order, int32_t* __restrict__ token_of_row,
                      detail::ExpertTile* __restrict__ tiles, detail::TilePlanHeader* __restrict__ header) {
  __shared__ GroupRowsSmem sm;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < kWarps * (kGroupRowsMaxExperts + 1); i += kThreads) (&sm.offset[0][0])[i] = 0;
  __syncthreads();

  const int chunk = (n + kThreads - 1) / kThreads * 32;
  const int begin = min(n, warp * chunk), end = min(n, begin + chunk);
  const int label_bits = label_bits_for(E);
  // The warp's next 32 * kBatch ids from row `base`, all loads issued before any is used.
  auto load_ids = [&](int base, int32_t (&id)[kBatch]) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + 32 * u + lane;
      id[u] = i < end ? __ldg(ids + i) : 0;
    }
  };

  // Phase 1: each warp's count per bucket.
  int out_of_range = 0;
  for (int base = begin; base < end; base += 32 * kBatch) {
    int32_t id[kBatch];
    load_ids(base, id);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (base + 32 * u + lane >= end) break;
      const int b = bucket_of(id[u], E);
      atomicAdd(&sm.offset[warp][b], 1);
      out_of_range |= b == E;
    }
  }
  out_of_range = __syncthreads_or(out_of_range);

  // Phase 2: warp prefixes per bucket, the buckets' first rows, then each warp's first position.
  const int buckets = E + 1;
  int32_t total = 0;
  if (tid < buckets) {
    for (int w = 0; w < kWarps; ++w) {
      const int32_t c = sm.offset[w][tid];
      sm.offset[w][tid] = total;
      total += c;
    }
  }
  int32_t all_rows;  // n: every row has a bucket
  // Each bucket's first output row (total is 0 past the buckets).
  const int32_t first = device::cta_inclusive_scan(total, sm.emit, all_rows) - total;
  if (tid < buckets) {
    sm.first_row[tid] = first;
    for (int w = 0; w < kWarps; ++w) sm.offset[w][tid] += first;
  }
  if (tid == 0) sm.first_row[buckets] = n;
  __syncthreads();
  write_expert_runs(sm.first_row, E, sorted_ids);

  // Phase 3: each row to its output position, in flat order within its bucket.
  for (int base = begin; base < end; base += 32 * kBatch) {
    int32_t id[kBatch];
    load_ids(base, id);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (base + 32 * u >= end) break;  // uniform over the warp
      place_pass(id[u], base + 32 * u + lane, end, E, k, label_bits, sm.offset[warp], sorted_ids, inv_order,
                 token_of_row);
    }
  }
  if (tiles == nullptr) return;
  __syncthreads();  // the scan buffers are the emission's again

  // Phase 4: the tile plan of the grouped rows.
  if (out_of_range) {
    device::retract_tile_plan(header, detail::kPlanOutOfRange, nullptr);
    return;
  }
  device::emit_tile_plan(sm.first_row, E, tiles, header, sm.emit);
}

// The grid form (n past kGroupRowsOneCtaMaxRows: one CTA's time grows with n), the same outputs in
// three launches over chunks of kThreads flat rows, CTA c owning rows [c * kThreads, +kThreads):
//   counts    (C, E + 1) int32 in scratch: CTA c's rows per bucket, then (after the bases kernel)
//             the rows of bucket b in CTAs before c
//   first_row (E + 2,) int32 in scratch after counts: each bucket's first output row, then n
// 1. count: each thread one row, shared atomics per bucket, the CTA's counts written out.
// 2. bases, one CTA: thread b < E + 1 turns column b of counts into exclusive prefixes over the
//    CTAs (16 loads in flight per step), the CTA scan of the bucket totals gives first_row; then
//    sorted_ids' runs and the plan, as the one-CTA kernel's phases 2 and 4.
// 3. scatter: CTA c's warp w owns rows c * kThreads + 32 w .. +31 (one pass): the warp counts
//    them per bucket (phase 1), thread b adds the CTA's base first_row[b] + counts[c][b] to the
//    warps' prefixes (phase 2), each warp places its pass (phase 3). Flat order within each bucket
//    across CTAs, warps and lanes: the stable sort again.
constexpr int kCountBatch = 16;

__global__ void __launch_bounds__(kThreads)
    group_rows_count_kernel(const int32_t* __restrict__ ids, int n, int E, int32_t* __restrict__ counts) {
  __shared__ int32_t count[kGroupRowsMaxExperts + 1];
  const int tid = threadIdx.x;
  for (int b = tid; b <= E; b += kThreads) count[b] = 0;
  __syncthreads();
  const int row = blockIdx.x * kThreads + tid;
  if (row < n) atomicAdd(&count[bucket_of(__ldg(ids + row), E)], 1);
  __syncthreads();
  for (int b = tid; b <= E; b += kThreads) counts[static_cast<int64_t>(blockIdx.x) * (E + 1) + b] = count[b];
}

__global__ void __launch_bounds__(kThreads, 1)
    group_rows_bases_kernel(int n, int E, int ctas, int32_t* __restrict__ counts, int32_t* __restrict__ first_row_out,
                            int32_t* __restrict__ sorted_ids, detail::ExpertTile* __restrict__ tiles,
                            detail::TilePlanHeader* __restrict__ header) {
  __shared__ int32_t first_row[kGroupRowsMaxExperts + 2];
  __shared__ device::TilePlanEmitSmem emit;
  const int tid = threadIdx.x, buckets = E + 1;
  int32_t total = 0;
  if (tid < buckets) {
    for (int c0 = 0; c0 < ctas; c0 += kCountBatch) {
      int32_t v[kCountBatch];
#pragma unroll
      for (int u = 0; u < kCountBatch; ++u)
        v[u] = c0 + u < ctas ? counts[static_cast<int64_t>(c0 + u) * buckets + tid] : 0;
#pragma unroll
      for (int u = 0; u < kCountBatch; ++u) {
        if (c0 + u >= ctas) break;
        counts[static_cast<int64_t>(c0 + u) * buckets + tid] = total;
        total += v[u];
      }
    }
  }
  int32_t all_rows;
  const int32_t first = device::cta_inclusive_scan(total, emit, all_rows) - total;
  if (tid < buckets) first_row[tid] = first_row_out[tid] = first;
  if (tid == 0) first_row[buckets] = first_row_out[buckets] = n;
  __syncthreads();
  write_expert_runs(first_row, E, sorted_ids);
  if (tiles == nullptr) return;
  __syncthreads();  // the scan buffers are the emission's again
  if (first_row[E + 1] > first_row[E]) {  // ids out of range
    device::retract_tile_plan(header, detail::kPlanOutOfRange, nullptr);
    return;
  }
  device::emit_tile_plan(first_row, E, tiles, header, emit);
}

__global__ void __launch_bounds__(kThreads)
    group_rows_scatter_kernel(const int32_t* __restrict__ ids, int n, int k, int E, const int32_t* __restrict__ counts,
                              const int32_t* __restrict__ first_row, int32_t* __restrict__ sorted_ids,
                              int32_t* __restrict__ inv_order, int32_t* __restrict__ token_of_row) {
  __shared__ int32_t offset[kWarps][kGroupRowsMaxExperts + 1];
  const int tid = threadIdx.x, warp = tid >> 5, buckets = E + 1;
  for (int i = tid; i < kWarps * buckets; i += kThreads) offset[i / buckets][i % buckets] = 0;
  __syncthreads();
  const int row = blockIdx.x * kThreads + tid;
  const int end = min(n, blockIdx.x * kThreads + 32 * (warp + 1));
  const int32_t id = row < n ? __ldg(ids + row) : 0;
  if (row < n) atomicAdd(&offset[warp][bucket_of(id, E)], 1);
  __syncthreads();
  if (tid < buckets) {
    int32_t base = first_row[tid] + counts[static_cast<int64_t>(blockIdx.x) * buckets + tid];
    for (int w = 0; w < kWarps; ++w) {
      const int32_t c = offset[w][tid];
      offset[w][tid] = base;
      base += c;
    }
  }
  __syncthreads();
  if (blockIdx.x * kThreads + 32 * warp >= n) return;  // uniform over the warp: no rows
  place_pass(id, row, end, E, k, label_bits_for(E), offset[warp], sorted_ids, inv_order, token_of_row);
}

}  // namespace

size_t group_rows_grid_scratch_bytes(int64_t n, int64_t E) {
  const int64_t ctas = (n + kThreads - 1) / kThreads;
  return static_cast<size_t>(ctas * (E + 1) + E + 2) * sizeof(int32_t);
}

bool group_rows_fits(int64_t n, int64_t E) {
  return n >= 1 && n <= kGroupRowsMaxRows && E >= 1 && E <= kGroupRowsMaxExperts;
}

void launch_group_rows(const int32_t* ids, int64_t n, int k, int E, int32_t* sorted_ids, int32_t* inv_order,
                       int32_t* token_of_row, void* plan, cudaStream_t stream, int32_t* grid_scratch) {
  constexpr const char* op = "group_rows";
  EXPERTQMM_CHECK(group_rows_fits(n, E) && k >= 1, op, "n=", n, " rows over E=", E, " experts (k=", k,
                  ") outside the kernel's limits: 1 <= n <= ", kGroupRowsMaxRows, ", 1 <= E <= ", kGroupRowsMaxExperts);
  EXPERTQMM_CHECK(ids && sorted_ids && inv_order && token_of_row, op, "null pointer among ids, sorted_ids, inv_order, token_of_row");
  detail::ExpertTile* tiles = nullptr;
  detail::TilePlanHeader* header = nullptr;
  if (plan) {
    const TilePlanView v = tile_plan_view(plan, n, E);
    tiles = const_cast<detail::ExpertTile*>(v.tiles);
    header = const_cast<detail::TilePlanHeader*>(v.header);
  }
  if (grid_scratch == nullptr) {
    group_rows_kernel<<<1, kThreads, 0, stream>>>(ids, static_cast<int>(n), k, E, sorted_ids, inv_order, token_of_row,
                                                  tiles, header);
    EXPERTQMM_CUDA_CHECK_LAUNCH(group_rows_kernel);
    return;
  }
  const int ctas = static_cast<int>((n + kThreads - 1) / kThreads);
  int32_t* counts = grid_scratch;
  int32_t* first_row = grid_scratch + static_cast<int64_t>(ctas) * (E + 1);
  group_rows_count_kernel<<<ctas, kThreads, 0, stream>>>(ids, static_cast<int>(n), E, counts);
  EXPERTQMM_CUDA_CHECK_LAUNCH(group_rows_count_kernel);
  group_rows_bases_kernel<<<1, kThreads, 0, stream>>>(static_cast<int>(n), E, ctas, counts, first_row, sorted_ids,
                                                      tiles, header);
  EXPERTQMM_CUDA_CHECK_LAUNCH(group_rows_bases_kernel);
  group_rows_scatter_kernel<<<ctas, kThreads, 0, stream>>>(ids, static_cast<int>(n), k, E, counts, first_row,
                                                           sorted_ids, inv_order, token_of_row);
  EXPERTQMM_CUDA_CHECK_LAUNCH(group_rows_scatter_kernel);
}

}  // namespace expertqmm::cuda

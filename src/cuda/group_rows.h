// The MoE layer's rows grouped by expert, with the expert tile plan, in one kernel (group_rows.cu).
// Host declarations only, so that tests (.cpp) can call it.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace expertqmm::cuda {

constexpr int kGroupRowsMaxExperts = 256;                // the per-warp count table fits 48 KB of shared memory
constexpr int64_t kGroupRowsMaxRows = int64_t{1} << 18;  // one CTA: past this CUB's sort scales better

// The most rows the layer groups with the one-CTA kernel; past it, the grid form. One CTA does it
// all, so its time grows with n: measured on an H100 against CUB's path (bench/NOTES.md "Step 54
// measured", Gemma layer, tile layout) -2.0 / -1.5 / -0.5 / -3.0% at 256 / 1024 / 4096 / 8192 rows,
// +0.9% at 16384 (30 us in the kernel there), where the grid form measured -1.9% against CUB's
// path (step 58).
constexpr int64_t kGroupRowsOneCtaMaxRows = 8192;

// Whether launch_group_rows takes n rows over E experts.
bool group_rows_fits(int64_t n, int64_t E);

// The same outputs as launch_sort_rows (sort.cu: sorted_ids, inv_order and token_of_row, all [n]
// int32; no `order`) and, when plan is not null, the tile plan of sorted_ids (tile_plan_bytes(n, E)
// bytes laid out as tile_plan.cuh says), in one kernel of one CTA on `stream`, with no host
// synchronization. ids in [0, E) come out exactly as the stable sort and the plan builder give them;
// ids outside it go last, in flat order, and retract the plan (kPlanOutOfRange), so that the GEMMs
// report them as they do for an unsorted plan. Throws Error("group_rows", ...) outside
// group_rows_fits or k < 1, or for null pointers.
// grid_scratch (group_rows_grid_scratch_bytes(n, E), 4-byte aligned): the grid form instead, three
// launches over chunks of 1024 rows (count, bases and plan, scatter) with the same outputs, for
// sizes where one CTA is slow (bench/NOTES.md step 58).
void launch_group_rows(const int32_t* ids, int64_t n, int k, int E, int32_t* sorted_ids, int32_t* inv_order,
                       int32_t* token_of_row, void* plan, cudaStream_t stream, int32_t* grid_scratch = nullptr);
// Bytes of the grid form's scratch: per 1024-row chunk a count per bucket, and the buckets' first rows.
size_t group_rows_grid_scratch_bytes(int64_t n, int64_t E);

}  // namespace expertqmm::cuda

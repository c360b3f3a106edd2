// The CUDA gather_qmm routes (internal). Each route is a supports_* predicate, which returns the
// first reason it cannot take a problem (flat early returns, one Fallback class per miss), and a
// call_* that runs it on the current stream. gather_qmm.cu holds the ordered table.
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>

#include "core/gather_qmm_problem.h"
#include "core/workspace_slots.h"
#include "cuda/route_table.h"
#include "cuda/device/quant_view.cuh"
#include "expertqmm/diagnostics.h"
#include "expertqmm/moe.h"

namespace expertqmm::cuda {

namespace device {
struct TileArgs;
}

using GatherQmmRoute = Route<detail::GatherQmmProblem>;  // route_table.h

// --- expert_tiles: the sorted tile route (gather_qmm_expert_tiles.cu) ------------------------
// Sorted problems with fewer rows than kExpertTilesMinRows (defined below: the rows qmv takes,
// plus one) go to qmv (Fallback::shape): at decode sizes most plan tiles would hold one row.
// The predicate without the on/off setting (the selector applies that).
RouteSupport supports_expert_tiles(const detail::GatherQmmProblem& p);
void call_expert_tiles(const detail::GatherQmmProblem& p, void* out, Workspace* ws);
// The route with its kernel pinned (tests): the sm_80 mma.sync kernel, or the sm_90a wgmma one
// (supported where a build takes the problem, wgmma_builds_take: also the 8-bit build below its
// rows-per-expert rule; gather_qmm_wgmma.h).
void call_expert_tiles_mma_sync(const detail::GatherQmmProblem& p, void* out, Workspace* ws);
RouteSupport supports_expert_tiles_wgmma(const detail::GatherQmmProblem& p);
// The layer plan's down GEMM in column windows (moe.cu): out (B, count) = x rows times rows
// [begin, begin + count) of every expert's weight, on p.tile_plan, through the kernel
// call_expert_tiles would pick. begin a multiple of kTileColumnsAlign (every tile kernel's column
// block divides it, so a window's blocks are the whole GEMM's), count too unless the window ends at
// N; out 16-byte aligned. count_retraction: this launch counts a retracted plan (the first window).
constexpr int64_t kTileColumnsAlign = 128;
void launch_expert_tiles_columns(const detail::GatherQmmProblem& p, int64_t begin, int64_t count, void* out,
                                 bool count_retraction);
// The fused form of the wgmma kernels (gather_qmm_expert_tiles.cu). The layer plan (layer_plan.cu)
// decides this fusion, once, and counts its GEMMs through the route selector; this launches what it
// decided.

// Whether gate and up can run as one wgmma launch with the GLU product in its epilogue: the same
// shapes, dtype and quantization, affine, and wgmma_tiles_fit for both (the plan has already chosen
// the expert tile route for both).
bool gate_up_glu_fits(const detail::GatherQmmProblem& gate, const detail::GatherQmmProblem& up);
// hidden[r] = T(act(T(x[lhs[r]] gate[rhs[r]]^T)) * T(x[lhs[r]] up[rhs[r]]^T)), hidden (B, N)
// contiguous and 16-byte aligned; gate and up share one prebuilt tile_plan.
void launch_gate_up_glu(const detail::GatherQmmProblem& gate, const detail::GatherQmmProblem& up, Activation act,
                        void* hidden);

// True when this build carries sm_90a code and the current device is compute capability 9.0
// (queried once; EXPERTQMM_WGMMA=0 in the environment turns the kernels off, for comparison).
bool wgmma_available();
void call_expert_tiles_wgmma(const detail::GatherQmmProblem& p, void* out, Workspace* ws);
// The wgmma kernel's 8-bit codes have one build (n128 tiles), which the selector and the layer plan
// choose from this many rows per expert on average (B >= 32 * E); below, the mma.sync kernel.
// Measured (bench/NOTES.md step 26, H200): the q8 layer at 4 / 32 / 128 rows per expert (T = 64 /
// 512 / 2048) 427 / 499 / 897 us on the 8-bit build against 368 / 520 / 1330 on mma.sync; the
// block's 8-bit dense MLP as rows of one expert, 30 layers at 512 / 2048 tokens, 416.5 / 1040.5 us
// per layer against 431.5 / 1160.4 for rhs_tiles.
constexpr int64_t kWgmma8BitMinRowsPerExpert = 32;
inline bool wgmma_8bit_rows_enough(const detail::GatherQmmProblem& p) {
  return p.B >= kWgmma8BitMinRowsPerExpert * p.w_batch;
}

// --- qmv: decode sizes (gather_qmm_qmv.cu) -------------------------------------------------------
// Problems with at most this many rows (B * M) go to qmv; the benchmark tunes it.
constexpr int64_t kQmvMaxRows = 64;  // 8 tokens x top-8; why: supports_qmv in gather_qmm_qmv.cu
constexpr int64_t kExpertTilesMinRows = kQmvMaxRows + 1;
// The rows of one batch element (M) share its weight matrix: qmv reads that matrix once per 1-8 rows,
// rhs_tiles' tensor-core tiles once per 16-64. From 3 such rows qmv gives way to rhs_tiles where
// rhs_tiles takes the problem and the matrix is wider than kQmvNarrowN (bench/NOTES.md step 30, the
// dense-linear probe, each linear alone: rhs_tiles ~13-14 us flat from 2 to 8 rows of Gemma 4's
// dense MLP, qmv 12-14 at 2-3 rows and 15-25 at 4-7; the router's 128-row projection stays on qmv,
// 8.7 against 10.9, as its 2 column tiles leave rhs_tiles' grid small). At most kQmvMaxSharedRowsNarrow
// shared rows in any case (from 8 rhs_tiles wins everywhere: step 25).
constexpr int64_t kQmvMaxSharedRows = 2;
constexpr int64_t kQmvNarrowN = 256;
constexpr int64_t kQmvMaxSharedRowsNarrow = 7;
RouteSupport supports_qmv(const detail::GatherQmmProblem& p);
void call_qmv(const detail::GatherQmmProblem& p, void* out, Workspace* ws);
// The test hook's qmv_one_row: one row per CTA whatever M (the multi-row kernels' comparison).
void call_qmv_one_row(const detail::GatherQmmProblem& p, void* out, Workspace* ws);
// qmv with the GLU product in its epilogue: out [M, N] = act(T(x gate^T)) * T(x up^T) for two single
// weight matrices of one geometry read by one launch, one row per CTA (the Gemma 4 block's 8-bit
// dense MLP at one token: one launch for gate, up and the GeGLU). The table has geglu for 8-bit
// affine 16-byte weight rows; gate and up must be single_matrix_problem's of the same x.
RouteSupport supports_qmv_glu(const detail::GatherQmmProblem& gate, const detail::GatherQmmProblem& up, Activation act);
void call_qmv_glu(const detail::GatherQmmProblem& gate, const detail::GatherQmmProblem& up, Activation act, void* out);

// --- rhs_tiles: the generic tensor-core route (gather_qmm_rhs_tiles.cu) ------------------------
// Operand checks shared by every route built on device/tile_gemm.cuh (dtype, bits, group size,
// layout, K % 64, 16-byte aligned x rows and weights).
RouteSupport supports_tile_operands(const detail::GatherQmmProblem& p);
// tile_gemm arguments for p writing to out (also used by the expert tile route).
device::TileArgs make_tile_args(const detail::GatherQmmProblem& p, void* out);
RouteSupport supports_rhs_tiles(const detail::GatherQmmProblem& p);
void call_rhs_tiles(const detail::GatherQmmProblem& p, void* out, Workspace* ws);
// K slices of rhs_tiles' tiles of height bm (16 or 64) for `rows` rows (1: unsplit): enough CTAs for
// the GPU (a few-column problem with many rows, e.g. the router's projection), at least 4 k tiles
// per slice, at most 16 slices and 4 MB (bm 16) / 8 MB (bm 64) of fp32 slices, N % 4 == 0; bm 64
// only for N <= 128 and at least 2048 rows (where it measured faster).
int64_t rhs_tiles_split_slices(int64_t rows, int64_t N, int64_t K, int bm);
// rhs_tiles with a pinned tile height (16, 32 or 64) instead of the table's choice; for tests. The
// fp modes have BM=16 kernels only: supports_rhs_tiles_tall (BM 32 / 64) refuses them.
RouteSupport supports_rhs_tiles_tall(const detail::GatherQmmProblem& p);
void call_rhs_tiles_bm16(const detail::GatherQmmProblem& p, void* out, Workspace* ws);
void call_rhs_tiles_bm32(const detail::GatherQmmProblem& p, void* out, Workspace* ws);
void call_rhs_tiles_bm64(const detail::GatherQmmProblem& p, void* out, Workspace* ws);

// --- simt: every other combination, CUDA cores (gather_qmm_simt.cu) ----------------------------
RouteSupport supports_simt(const detail::GatherQmmProblem& p);
void call_simt(const detail::GatherQmmProblem& p, void* out, Workspace* ws);

// --- shared host helpers ----------------------------------------------------------------------
// p's weight as the kernels read it (device/quant_view.cuh); scales/biases as raw 16-bit pointers
// (simt reinterprets them as p.dtype). Row geometry must fit int32 (every route's supports_* checks).
device::QuantView quant_view(const detail::GatherQmmProblem& p);
// A quantized weight [..., N, K*bits/32] with K values per row, as the decode kernels read it.
device::QuantView quant_view(const QuantizedWeight& q, int64_t K);
int device_sm_count();  // multiprocessors of the current device (queried once)
size_t device_smem_optin();  // its dynamic shared memory per CTA with the opt-in (queried once)
inline bool is_aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }
inline bool fits_int32(int64_t v) { return v >= 0 && v <= std::numeric_limits<int32_t>::max(); }
inline int log2_of(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

}  // namespace expertqmm::cuda

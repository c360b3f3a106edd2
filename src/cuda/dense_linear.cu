// The dense linear on CUDA (dense_linear.h) as a gather_mm problem, and the public backend op.
//
// The problem: T rows with M = 1 (problem row r reads x row r: lhs identity), rhs ids r / G, and
// E = ceil(T / G) weight matrices that are all w: w broadcast to [E, N, K] (batch stride 0, as
// MLX's broadcast_to hands gather_mm). The ids are sorted, so each run of G rows is one expert of
// the tile plan and the tile route's grid is ceil(N / 128) x (plan tiles) CTAs. With one expert
// (G = T) the router's N = 128 would give T / 128 CTAs (4 at T = 512) on a GPU of 132 SMs, so G is
// the largest tile class height that still makes 2 CTAs per SM (gemv's threshold of an idle GPU),
// else the smallest class (16 rows). At and below kGemvMaxRows rows G = T: the ids are all zero
// (one memset) and gemv takes the problem. Whatever those refuse (f32, misaligned or strided
// operands) goes to simt.
//
// dtypes: out_dtype is promote(x, w) (every caller's rule, as MLX's), which is gather_mm's own
// rule: x is widened to it in the arena when it differs (exact), a 16-bit output meets only its own
// weight dtype, an f32 one any weight (simt).
//
// Scratch (slot kSlotDenseLinear, one arena): [x in out_dtype] (when cast), ids [T] int32, and
// the tile plan, sized for the smallest class so that a warm arena holds every smaller call's plan.
#include "cuda/dense_linear.h"

#include <algorithm>

#include "core/tile_plan.h"
#include "core/workspace_slots.h"
#include "cuda/cuda_backend.h"
#include "cuda/gather_mm.h"
#include "cuda/layer_plan.h"
#include "cuda/moe_internal.h"
#include "cuda/tile_plan.cuh"

namespace expertqmm::cuda {

namespace {

constexpr const char* kOp = "linear";
// Tile-route CTAs per SM below which a smaller row group is taken (gemv's rule for an idle GPU).
constexpr int64_t kCtasPerSm = 2;

size_t bytes_of(int64_t count, DType t) { return static_cast<size_t>(count) * dtype_size(t); }
int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows per expert id (see the file comment).
int64_t row_group(int64_t T, int64_t N) {
  if (T <= kGemvMaxRows) return T;
  const int64_t col_blocks = ceil_div64(N, kMmTileCols);
  const int64_t wanted_ctas = kCtasPerSm * device_sm_count();
  int64_t group = detail::tile_class(0).max_rows;
  for (int c = detail::kTileClassCount - 1; c >= 0; --c) {
    const int64_t rows = detail::tile_class(c).max_rows;
    if (col_blocks * ceil_div64(T, rows) >= wanted_ctas) {
      group = rows;
      break;
    }
  }
  return std::max(group, ceil_div64(T, detail::kTilePlanMaxExperts));
}

// Plan bytes for any group row_group picks at T rows: max_tiles grows with E, which is largest at the
// smallest class (capped by the plan's expert limit).
size_t plan_bytes_bound(int64_t T) {
  if (T <= kGemvMaxRows) return 0;
  const int64_t experts = std::min<int64_t>(ceil_div64(T, detail::tile_class(0).max_rows), detail::kTilePlanMaxExperts);
  return tile_plan_bytes(T, static_cast<int>(experts));
}

}  // namespace

void dense_linear_into(const void* x, DType x_dtype, int64_t T, const Tensor& w, DType out_dtype, void* out,
                       Workspace& ws) {
  EXPERTQMM_CHECK(w.device() == Device::cuda && w.ndim() == 2 && is_floating(w.dtype()), kOp,
                  "the weight must be a float [N, K] device tensor, got ", w.describe());
  EXPERTQMM_CHECK(is_floating(x_dtype) && T >= 0 && T <= INT32_MAX &&
                      out_dtype == promote_floating(x_dtype, w.dtype()),
                  kOp, "x [T=", T, ", K=", w.size(1), "] in ", dtype_name(x_dtype), " times a ",
                  dtype_name(w.dtype()), " weight into ", dtype_name(out_dtype),
                  ": float dtypes, out in promote(x, w) and T in [0, 2^31) expected");
  const int64_t N = w.size(0), K = w.size(1);
  if (T == 0 || N == 0) return;
  const bool cast_x = x_dtype != out_dtype;
  const int64_t group = row_group(T, N), E = ceil_div64(T, group);

  ArenaLayout layout;
  const size_t x_off = cast_x ? layout.reserve(bytes_of(T * K, out_dtype)) : 0;
  const size_t ids_off = layout.reserve(bytes_of(T, DType::i32));
  const size_t plan_bytes = plan_bytes_bound(T);
  const size_t plan_off = plan_bytes ? layout.reserve(plan_bytes) : 0;
  void* base = ws.get(detail::kSlotDenseLinear, layout.bytes());
  cudaStream_t stream = current_stream();

  void* x_out_dtype = const_cast<void*>(x);
  if (cast_x) {
    x_out_dtype = arena_at(base, x_off);
    launch_cast(x_dtype, x, out_dtype, x_out_dtype, T * K, stream);
  }
  int32_t* ids = static_cast<int32_t*>(arena_at(base, ids_off));
  if (E == 1) EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(ids, 0, bytes_of(T, DType::i32), stream));
  else launch_token_of_row(ids, T, static_cast<int>(group), stream);

  const Tensor w_experts = Tensor::view(w.data(), {E, N, K}, w.dtype(), Device::cuda, {0, w.stride(0), w.stride(1)});
  detail::GatherMmProblem p =
      dense_problem(w_experts, out_dtype, x_out_dtype, T, K, K, N, T, nullptr, ids, /*sorted=*/true, nullptr);
  const GatherMmRoute& route = select_gather_mm_route(p);
  if (is_mm_tiles(route)) {
    EXPERTQMM_CHECK(plan_bytes >= tile_plan_bytes(T, static_cast<int>(E)), kOp, "no room for the tile plan of ",
                    p.describe());
    void* plan = arena_at(base, plan_off);
    launch_build_tile_plan_at(ids, T, static_cast<int>(E), plan, stream);
    p.tile_plan = plan;
  }
  run_gather_mm_route(route, p, out, &ws);
}

Tensor dense_linear(const Tensor& x, const Tensor& w, DType out_dtype) {
  const Tensor xc = x.contiguous();
  Tensor out = Tensor::empty({xc.size(0), w.size(0)}, out_dtype, Device::cuda);
  Workspace ws;  // the allocating public path: scratch lives for this call only
  dense_linear_into(xc.data(), xc.dtype(), xc.size(0), w, out_dtype, out.data(), ws);
  return out;
}

}  // namespace expertqmm::cuda

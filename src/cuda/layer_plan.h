// The plan of one MoE layer call on CUDA (moe_layer_into, switch_glu), made once from the problem
// before anything is launched (FlashInfer's plan/run split: the plan is data):
//   - the path: the three-kernel decode layer (moe_decode_layer.cu), or the experts path
//     route -> sort -> tile plan -> gate/up (+GLU) -> down -> combine (moe.cu);
//   - on the experts path, the route of each GEMM (picked and counted by the route selector of its
//     kind, once per GEMM whether or not it is then fused: gather_qmm.cu for a quantized projection,
//     gather_mm.cu for a 16-bit one), the casts, and the fusions, only between quantized GEMMs:
//     gate/up with the GLU product in one wgmma launch; down and the slot-order combine per window
//     of output columns where the whole down output would be large;
//   - every scratch buffer, as an offset into the layer arena (workspace slot kSlotLayerArena), and
//     the down window's size (slot kSlotRouterArena, free once the routing is written).
// moe.cu runs the plan and decides nothing. docs/design.md ("The layer") shows the data flow.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/gather_mm_problem.h"
#include "core/gather_qmm_problem.h"
#include "cuda/gather_mm.h"
#include "cuda/gather_qmm.h"
#include "cuda/layer_plan_hooks.h"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

// Dimensions and dtypes of one SwitchGLU call (validated by the op front, src/ops/moe.cpp).
struct ExpertShape {
  int64_t T = 0, k = 0, n = 0, D = 0, I = 0, E = 0;  // n = T * k (token, slot) rows
  bool fused = false;   // one gate_up weight [E, 2I, D] (HF layout) instead of gate and up
  bool sorted = false;  // rows sorted by expert (mlx-lm sorts when n >= 64)
  // 16-bit (MLX gather_mm) instead of quantized projections; with a fused gate_up both gate flags
  // are the gate_up weight's.
  bool gate_dense = false, up_dense = false, down_dense = false;
  DType x_dtype = DType::bf16;
  // gate/up outputs and the product: promote(x, the gate/up scales, or the 16-bit weight), as the
  // CPU's switch_linear (src/ops/moe.cpp) gets from gather_qmm or gather_mm
  DType hidden_dtype = DType::bf16;
  DType out_dtype = DType::bf16;  // down output: promote(hidden, down scales or 16-bit weight)
};
ExpertShape expert_shape(const Tensor& x, int64_t k, const SwitchGLUWeights& w);

enum class LayerPath : uint8_t { decode, experts };

// One GEMM of the layer: a quantized projection (gather_qmm problem) or a 16-bit one (gather_mm).
struct LayerGemm {
  bool dense = false;
  detail::GatherQmmProblem q;   // !dense
  detail::GatherMmProblem mm;   // dense
};
// The route picked for a LayerGemm: exactly one of the two is set when the GEMM runs on its own.
struct GemmRoute {
  const GatherQmmRoute* qmm = nullptr;
  const GatherMmRoute* mm = nullptr;
  bool on_tiles() const { return qmm ? is_expert_tiles(*qmm) : mm != nullptr && is_mm_tiles(*mm); }
};
// The selector of g's kind picks (and counts) its route.
GemmRoute select_layer_route(const LayerGemm& g);
// Runs g on the route the plan picked.
void run_layer_gemm(const GemmRoute& route, const LayerGemm& g, void* out, Workspace* ws);

// The gather_mm problem of n rows with M = 1: row b multiplies x row lhs[b] (lhs null: row b) by
// the 16-bit weight w[rhs[b]], w [E, N, K] (mlx-lm's layout, read through its strides as
// w.swapaxes(-1, -2), as the CPU's switch_linear passes it; batch stride 0 repeats one matrix). x
// holds x_rows rows of K values, x_row_stride apart; plan: a tile plan of rhs already built, or null.
detail::GatherMmProblem dense_problem(const Tensor& w, DType dtype, void* x, int64_t x_rows, int64_t x_row_stride,
                                      int64_t K, int64_t N, int64_t n, int32_t* lhs, int32_t* rhs, bool sorted,
                                      const void* plan);

// Offsets in the layer arena (ArenaLayout pieces, each 256-byte aligned wherever the arena lands).
// kNotReserved: the plan needs no such buffer.
constexpr size_t kNotReserved = SIZE_MAX;
struct ExpertScratch {
  size_t route_indices = kNotReserved, route_weights = kNotReserved;  // moe_layer_into: [T, k]
  size_t token_of_row = kNotReserved;                                  // [n] int32: lhs of gate/up
  size_t sorted_ids = kNotReserved, order = kNotReserved, positions = kNotReserved, inv_order = kNotReserved;
  size_t sort_temp = kNotReserved, sort_temp_bytes = 0;
  size_t group_rows_scratch = kNotReserved;  // LayerPlan::group_rows_grid: group_rows_grid_scratch_bytes
  size_t x_cast = kNotReserved;                                        // [T, D] in hidden_dtype
  size_t gu_scales[2] = {kNotReserved, kNotReserved}, gu_biases[2] = {kNotReserved, kNotReserved};
  size_t down_scales = kNotReserved, down_biases = kNotReserved;
  size_t hidden = kNotReserved, hidden_cast = kNotReserved;            // [n, I]
  size_t tile_plan = kNotReserved;                                     // header + tiles
  size_t gate_up_out = kNotReserved, gate_out = kNotReserved, up_out = kNotReserved, intermediate = kNotReserved;
  size_t y = kNotReserved;  // [n, D] down output of switch_glu (moe_layer_into's: LayerPlan::router_slot_bytes)
  size_t bytes = 0;                                                    // the arena
};

struct LayerPlan {
  LayerPath path = LayerPath::experts;
  ExpertShape shape;
  DecodeScratch decode;  // path == decode
  // --- the experts path
  ExpertScratch scratch;
  bool ids_unsigned = false;  // switch_glu with uint32 ids (sort keys)
  ProductMode mode = ProductMode::fused;
  bool cast_x = false, cast_gate_up = false, cast_hidden = false, cast_down = false;
  bool tiles = false;          // a tile plan is built once and shared by the GEMMs on the tile route
  bool group_rows = false;     // sorted: one kernel groups the rows and builds the plan (group_rows.cu), no CUB sort
  bool group_rows_grid = false;  // group_rows in its grid form (three launches past 8192 rows)
  bool glu_fused = false;      // gate, up and the GLU product in one wgmma launch
  // > 0: the down GEMM and the slot-order combine run per window of this many output columns (the
  // last one narrower), so y holds [n, down_window_cols] instead of [n, D] (moe_layer_into only).
  int64_t down_window_cols = 0;
  // moe_layer_into: workspace slot kSlotRouterArena holds route_into's scratch, then (dead once the
  // routing is written) the down output y (one window, or [n, D]): router_slot_bytes is the larger,
  // fetched once before routing. It grows with T, so a workspace warmed at the largest call serves
  // every smaller one without allocating.
  size_t router_slot_bytes = 0;
  // The selector's route of each GEMM that runs on its own (empty for those the plan fused, and for
  // gate_up / up+gate of the other weight layout).
  GemmRoute gate_up_route, up_route, gate_route, down_route;
};

// moe_layer_into: h, x [T, H] and out [T, H] on the device, validated by the op front.
LayerPlan plan_moe_layer(const Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& w);
// switch_glu: x [T, D], indices [T, k] (int32 or uint32) on the device.
LayerPlan plan_switch_glu(const Tensor& x, const Tensor& indices, const SwitchGLUWeights& w);

// The layer's GEMM problems over the arena at `base`: the plan builds them over a nominal base to
// choose routes and fusions (only alignment is read from arena pointers, and every piece is 256-byte
// aligned wherever the arena lands), moe.cu over the real one to launch them. ids: the flat expert
// ids of the (token, slot) rows when the layer does not route them itself (switch_glu), else null.
struct LayerGemms {
  LayerGemm gate_up, up, gate, down;  // gate_up or up/gate, by the weight layout
};
LayerGemms layer_gemms(const LayerPlan& plan, const Tensor& x, const int32_t* ids, const SwitchGLUWeights& w,
                       void* base);

}  // namespace expertqmm::cuda

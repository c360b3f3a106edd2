// The plan of one MoE layer call on CUDA (moe_layer_into, switch_glu), made once from the problem
// before anything is launched (FlashInfer's plan/run split: the plan is data):
//   - the path: the three-kernel decode layer (moe_decode_layer.cu), or the experts path
//     route -> sort -> tile plan -> gate/up (+GLU) -> down (+combine) (moe.cu);
//   - on the experts path, the route of each GEMM (picked and counted by the route selector,
//     gather_qmm.cu, once per GEMM whether or not it is then fused), the casts, and the fusions:
//     gate/up with the GLU product in one wgmma launch, the weighted combine in the down GEMM;
//   - every scratch buffer, as an offset into the layer arena (workspace slot kSlotLayerArena), and
//     the fp32 combine accumulator's size (slot kSlotRouterArena, free once the routing is written).
// moe.cu runs the plan and decides nothing. docs/design.md ("The layer") shows the data flow.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/gather_qmm_problem.h"
#include "cuda/gather_qmm_routes.h"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

// Dimensions and dtypes of one SwitchGLU call (validated by the op front, src/ops/moe.cpp).
struct ExpertShape {
  int64_t T = 0, k = 0, n = 0, D = 0, I = 0, E = 0;  // n = T * k (token, slot) rows
  bool fused = false;   // one gate_up weight [E, 2I, D] (HF layout) instead of gate and up
  bool sorted = false;  // rows sorted by expert (mlx-lm sorts when n >= 64)
  DType x_dtype = DType::bf16;
  DType gate_up_scales_dtype = DType::bf16;
  DType down_scales_dtype = DType::bf16;
  DType hidden_dtype = DType::bf16;  // gate/up outputs and the product: promote(x, gate/up scales)
  DType out_dtype = DType::bf16;     // down output: promote(hidden, down scales)
};
ExpertShape expert_shape(const Tensor& x, int64_t k, const SwitchGLUWeights& w);

enum class LayerPath : uint8_t { decode, experts };

// Offsets in the layer arena (ArenaLayout pieces, each 256-byte aligned wherever the arena lands).
// kNotReserved: the plan needs no such buffer.
constexpr size_t kNotReserved = SIZE_MAX;
struct ExpertScratch {
  size_t route_indices = kNotReserved, route_weights = kNotReserved;  // moe_layer_into: [T, k]
  size_t token_of_row = kNotReserved;                                  // [n] int32: lhs of gate/up
  size_t sorted_ids = kNotReserved, order = kNotReserved, positions = kNotReserved, inv_order = kNotReserved;
  size_t sort_temp = kNotReserved, sort_temp_bytes = 0;
  size_t x_cast = kNotReserved;                                        // [T, D] in hidden_dtype
  size_t gu_scales[2] = {kNotReserved, kNotReserved}, gu_biases[2] = {kNotReserved, kNotReserved};
  size_t down_scales = kNotReserved, down_biases = kNotReserved;
  size_t hidden = kNotReserved, hidden_cast = kNotReserved;            // [n, I]
  size_t tile_plan = kNotReserved;                                     // header + tiles
  size_t gate_up_out = kNotReserved, gate_out = kNotReserved, up_out = kNotReserved, intermediate = kNotReserved;
  size_t y = kNotReserved;                                             // [n, D] down output
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
  bool glu_fused = false;      // gate, up and the GLU product in one wgmma launch
  bool combine_fused = false;  // the down GEMM adds w * y into an fp32 [T, D] accumulator
  size_t combine_acc_bytes = 0;
  // The selector's route of each GEMM that runs on its own (null for those the plan fused, and for
  // gate_up / up+gate of the other weight layout).
  const GatherQmmRoute* gate_up_route = nullptr;
  const GatherQmmRoute* up_route = nullptr;
  const GatherQmmRoute* gate_route = nullptr;
  const GatherQmmRoute* down_route = nullptr;
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
  detail::GatherQmmProblem gate_up, up, gate, down;  // gate_up or up/gate, by the weight layout
};
LayerGemms layer_gemms(const LayerPlan& plan, const Tensor& x, const int32_t* ids, const SwitchGLUWeights& w,
                       void* base);

}  // namespace expertqmm::cuda

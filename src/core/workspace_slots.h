// The slots of a Workspace (include/expertqmm/moe.h), in one place: which code owns each. A slot
// is one grow-only device buffer; code that owns a slot carves it with an arena (ArenaLayout) when
// it needs several pieces. Slots 5-11 are free.
#pragma once

namespace expertqmm::detail {

enum WorkspaceSlot : int {
  // gather_qmm called alone (not inside a layer, whose plan holds its own): the expert tile route's
  // plan (header + tiles) and rhs_tiles' split-K fp32 slices (at most 4 MB).
  kSlotTilePlan = 0,
  kSlotSplitK = 1,
  // dense_linear_into (cuda/dense_linear.h): its expert ids, tile plan and dtype casts.
  kSlotDenseLinear = 2,
  // The Gemma 4 block's dense MLP on cuBLAS (gemma4_ffn.cu, cuda/dense_cublas.h): its weights
  // dequantized to 16 bits (gate and up, then down in the same bytes), and cuBLAS's own scratch.
  kSlotDenseWeights = 3,
  kSlotCublas = 4,
  // Device counters that kernels leave zero once done (Workspace::get_zeroed): the decode layer's
  // count of finished router CTAs. One per workspace, so that layers on other workspaces (other
  // threads and streams) never share one.
  kSlotCounters = 12,
  kSlotFfnArena = 13,     // gemma4_ffn_into / qwen3_moe_ffn_into: the dense MLP, norm and residual buffers
  kSlotRouterArena = 14,  // route_into's scratch; then the MoE layer's down window (LayerPlan)
  kSlotLayerArena = 15,   // the MoE layer plan's buffers (cuda/layer_plan.h)
  kSlotCount = 16,
};

}  // namespace expertqmm::detail

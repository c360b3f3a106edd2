// The device MoE path: switch_glu and moe_layer_into (include/expertqmm/moe.h) run the layer plan
// (layer_plan.h) as a fixed sequence of launches on the current stream, with no host
// synchronization and, once the workspace has grown to a size, no allocation, so that a call can be
// captured in a CUDA graph:
//   route(h) -> [T*k >= 64: the (token, slot) rows grouped by expert (stable) and the tile plan, one
//   kernel (group_rows.cu) or CUB's sort and the plan builder] -> gate/up
//   (separate, or one fused gate_up; with the GLU product in one launch where planned) -> down ->
//   combine read through inv_order (slot order: the same bits every run), or unsort (switch_glu);
//   down and the combine per window of output columns where the plan made windows.
// Nothing here decides: every branch reads the plan.
// x is never copied: the gate/up GEMMs gather their x rows through lhs = token_of_row (order / k
// when sorted, b / k when not), which saves writing and re-reading a [T*k, D] copy of x (92 MB at
// T = 2048, k = 8, D = 2816) for the price of an index load per row inside the GEMM.
#include <algorithm>

#include "cuda/cuda_backend.h"
#include "cuda/gather_qmm.h"
#include "cuda/gather_qmm_wgmma.h"
#include "cuda/layer_plan.h"
#include "cuda/tile_plan.cuh"

namespace expertqmm::cuda {

namespace {

size_t bytes_of(int64_t count, DType t) { return static_cast<size_t>(count) * dtype_size(t); }

// The plan's arena, fetched: offsets to pointers.
struct Arena {
  void* base;
  void* at(size_t offset) const { return static_cast<char*>(base) + offset; }
  int32_t* i32(size_t offset) const { return static_cast<int32_t*>(at(offset)); }
};

// Casts q's scales and biases into the arena pieces the plan reserved for them.
void cast_params(const QuantizedWeight& q, DType dtype, const Arena& a, size_t s_off, size_t b_off,
                 cudaStream_t stream) {
  if (!q.defined() || q.mode != QuantMode::affine) return;  // 16-bit or fp mode: nothing to cast
  const Tensor s = q.scales.contiguous(), b = q.biases.contiguous();
  launch_cast(s.dtype(), s.data(), dtype, a.at(s_off), s.numel(), stream);
  launch_cast(b.dtype(), b.data(), dtype, a.at(b_off), b.numel(), stream);
}

// The expert half. ids: the flat expert ids of the n rows. The down output goes to the arena's y
// (sorted switch_glu: in sorted row order; inv_order maps flat slot -> y row) or to y_out (unsorted
// switch_glu: already in flat slot order; moe_layer_into: the router's slot, rows in sorted order
// when sorted); with down windows down is left to the caller, which runs it per window. Returns the
// GEMMs it built.
LayerGemms run_experts(const LayerPlan& p, const Tensor& x, const int32_t* ids, const int32_t* user_ids,
                 const SwitchGLUWeights& w, const Arena& a, void* y_out, Workspace& ws) {
  cudaStream_t stream = current_stream();
  const ExpertShape& s = p.shape;
  const ExpertScratch& sc = p.scratch;
  if (s.sorted && p.group_rows) {
    // One kernel for the grouping and the plan; ids outside [0, E) (user ids) go last and retract
    // the plan, so the GEMMs report them.
    launch_group_rows(ids, s.n, static_cast<int>(s.k), static_cast<int>(s.E), a.i32(sc.sorted_ids), a.i32(sc.inv_order),
                      a.i32(sc.token_of_row), p.tiles ? a.at(sc.tile_plan) : nullptr, stream,
                      p.group_rows_grid ? a.i32(sc.group_rows_scratch) : nullptr);
  } else if (s.sorted) {
    // Arbitrary user ids still give a permutation (out-of-range ids fault in the GEMMs); ids from
    // [0, E) need only id_bits(E) key bits.
    launch_sort_rows(ids, s.n, static_cast<int>(s.k), p.ids_unsigned, id_bits(s.E), a.i32(sc.sorted_ids),
                     a.i32(sc.order), a.i32(sc.positions), a.i32(sc.inv_order), a.i32(sc.token_of_row),
                     a.at(sc.sort_temp), sc.sort_temp_bytes, stream);
  } else {
    launch_token_of_row(a.i32(sc.token_of_row), s.n, static_cast<int>(s.k), stream);
  }
  if (p.cast_x) {
    const Tensor xc = x.contiguous();
    launch_cast(s.x_dtype, xc.data(), s.hidden_dtype, a.at(sc.x_cast), s.T * s.D, stream);
  }
  if (p.cast_gate_up) {
    if (s.fused) {
      cast_params(w.gate_up, s.hidden_dtype, a, sc.gu_scales[0], sc.gu_biases[0], stream);
    } else {
      cast_params(w.gate, s.hidden_dtype, a, sc.gu_scales[0], sc.gu_biases[0], stream);
      cast_params(w.up, s.hidden_dtype, a, sc.gu_scales[1], sc.gu_biases[1], stream);
    }
  }
  if (p.cast_down) cast_params(w.down, s.out_dtype, a, sc.down_scales, sc.down_biases, stream);

  const LayerGemms g = layer_gemms(p, x, user_ids, w, a.base);
  // One tile plan per layer: the GEMMs share the sorted ids (built on the stream before the first;
  // the quantized and the 16-bit tile routes read the same plan).
  if (p.tiles && !p.group_rows)
    launch_build_tile_plan_at(a.i32(sc.sorted_ids), s.n, static_cast<int>(s.E), a.at(sc.tile_plan), stream);

  // gate/up (mlx-lm order: up first, then gate) -> product
  void* hidden = a.at(sc.hidden);
  void* intermediate = p.mode == ProductMode::separate ? a.at(sc.intermediate) : nullptr;
  if (s.fused) {
    void* gate_up = a.at(sc.gate_up_out);  // [n, 2I]: gate columns [0, I), up columns [I, 2I)
    run_layer_gemm(p.gate_up_route, g.gate_up, gate_up, &ws);
    const char* up = static_cast<const char*>(gate_up) + bytes_of(s.I, s.hidden_dtype);
    launch_glu_product(w.activation, p.mode, s.hidden_dtype, gate_up, up, s.n, s.I, 2 * s.I, hidden, intermediate,
                       stream);
  } else if (p.glu_fused) {
    launch_gate_up_glu(g.gate.q, g.up.q, w.activation, hidden);  // no [n, I] gate/up intermediates
  } else {
    run_layer_gemm(p.up_route, g.up, a.at(sc.up_out), &ws);
    run_layer_gemm(p.gate_route, g.gate, a.at(sc.gate_out), &ws);
    launch_glu_product(w.activation, p.mode, s.hidden_dtype, a.at(sc.gate_out), a.at(sc.up_out), s.n, s.I, s.I,
                       hidden, intermediate, stream);
  }

  // down
  if (p.cast_hidden) launch_cast(s.hidden_dtype, hidden, s.out_dtype, a.at(sc.hidden_cast), s.n * s.I, stream);
  if (p.down_window_cols == 0) run_layer_gemm(p.down_route, g.down, sc.y != kNotReserved ? a.at(sc.y) : y_out, &ws);
  return g;
}

// Flat int32 view of [T, k] ids (uint32 ids keep their bits: >= 2^31 reads as negative, out of range).
const int32_t* flat_ids(const Tensor& indices) {
  EXPERTQMM_CHECK(indices.is_contiguous(), "switch_glu", "indices must be contiguous, got ", indices.describe());
  return indices.data_as<const int32_t>();
}

}  // namespace

void switch_glu_into(Tensor& out, const Tensor& x, const Tensor& indices, const SwitchGLUWeights& weights,
                     Workspace& ws) {
  EXPERTQMM_CHECK(x.device() == Device::cuda && indices.device() == Device::cuda, "switch_glu",
                  "cuda::switch_glu needs device tensors, got x ", x.describe(), " and indices ", indices.describe());
  EXPERTQMM_CHECK(x.ndim() == 2 && indices.ndim() == 2 && indices.size(0) == x.size(0), "switch_glu",
                  "expected x [T, D] and indices [T, k], got x ", x.describe(), " and indices ", indices.describe());
  const Tensor xc = x.contiguous();
  const Tensor ids = indices.contiguous();
  const ExpertShape shape = expert_shape(xc, ids.size(1), weights);
  EXPERTQMM_CHECK(out.is_contiguous() && out.shape() == (Shape{shape.T, shape.k, shape.D}) &&
                      out.dtype() == shape.out_dtype,
                  "switch_glu", "out must be a contiguous ", dtype_name(shape.out_dtype), " [", shape.T, ", ", shape.k,
                  ", ", shape.D, "], got ", out.describe());
  if (shape.n == 0 || shape.D == 0) return;
  const int32_t* flat = flat_ids(ids);
  const LayerPlan p = plan_switch_glu(xc, ids, weights);
  const Arena a{ws.get(detail::kSlotLayerArena, p.scratch.bytes)};
  run_experts(p, xc, flat, flat, weights, a, out.data(), ws);
  if (p.shape.sorted) {
    const int64_t row_bytes = static_cast<int64_t>(bytes_of(p.shape.D, p.shape.out_dtype));
    // out row i = y row inv_order[i]
    launch_gather_rows(a.at(p.scratch.y), p.shape.n, row_bytes, a.i32(p.scratch.inv_order), 1, p.shape.n, row_bytes,
                       out.data(), current_stream());
  }
}

Tensor switch_glu(const Tensor& x, const Tensor& indices, const SwitchGLUWeights& weights) {
  const ExpertShape shape = expert_shape(x, indices.size(1), weights);
  Tensor out = Tensor::empty({shape.T, shape.k, shape.D}, shape.out_dtype, Device::cuda);
  Workspace ws;  // the allocating public path: scratch for this call only
  cuda::switch_glu_into(out, x, indices, weights, ws);  // qualified: the public op has the same signature
  return out;
}

void moe_layer_into(Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& weights, Workspace& ws) {
  moe_layer_into_chained(out, h, x, weights, ws, /*router_overlaps_previous=*/false);
}

void moe_layer_into_chained(Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& weights, Workspace& ws,
                            bool router_overlaps_previous) {
  const char* op = "moe_layer_into";
  EXPERTQMM_CHECK(out.device() == Device::cuda && h.device() == Device::cuda && x.device() == Device::cuda, op,
                  "cuda::moe_layer_into needs device tensors, got out ", out.describe(), ", h ", h.describe(), ", x ",
                  x.describe());
  EXPERTQMM_CHECK(x.ndim() == 2 && h.ndim() == 2 && h.size(0) == x.size(0) && (x.size(1) <= 1 || x.stride(1) == 1),
                  op, "expected h and x [T, H] with contiguous rows, got h ", h.describe(), " and x ", x.describe());
  const ExpertShape shape = expert_shape(x, weights.router.top_k, weights.experts);
  EXPERTQMM_CHECK(out.is_contiguous() && out.shape() == (Shape{shape.T, shape.D}), op, "out must be contiguous [",
                  shape.T, ", ", shape.D, "], got ", out.describe());
  if (shape.n == 0 || shape.D == 0) return;
  const LayerPlan p = plan_moe_layer(out, h, x, weights);
  // The layer's device counter (the decode router's count of finished CTAs, zero between calls),
  // fetched on both paths: a workspace warmed on either serves the other without allocating.
  auto* counter = static_cast<unsigned*>(ws.get_zeroed(detail::kSlotCounters, sizeof(unsigned)));
  if (p.path == LayerPath::decode)
    return call_decode_layer(p.decode, counter, out, h, x, weights, ws, router_overlaps_previous);

  // One arena for the routing outputs and every expert buffer (grow-only: a warmed-up workspace
  // serves any call at the same or a smaller size without allocating).
  const Arena a{ws.get(detail::kSlotLayerArena, p.scratch.bytes)};
  int32_t* route_indices = a.i32(p.scratch.route_indices);
  void* route_weights = a.at(p.scratch.route_weights);
  // The router's slot at its largest use, fetched before route_into, which then finds it large
  // enough: nothing reallocates it while the router's kernels may still read it.
  void* y = ws.get(detail::kSlotRouterArena, p.router_slot_bytes);

  route_into(h, weights.router, route_indices, route_weights, ws);
  const LayerGemms g = run_experts(p, x, route_indices, nullptr, weights.experts, a, y, ws);
  const ExpertShape& s = p.shape;
  cudaStream_t stream = current_stream();
  // Combine in token order, reading the down output in sorted order through inv_order; with down
  // windows, down then the combine per window of columns, y holding one window.
  const bool windows = p.down_window_cols > 0;
  const int32_t* slot_row = s.sorted ? a.i32(p.scratch.inv_order) : nullptr;
  const int64_t window = windows ? p.down_window_cols : s.D;
  for (int64_t c0 = 0; c0 < s.D; c0 += window) {
    const int64_t cols = std::min(window, s.D - c0);
    if (windows) launch_expert_tiles_columns(g.down.q, c0, cols, y, /*count_retraction=*/c0 == 0);
    launch_weighted_combine(s.out_dtype, y, s.n, cols, slot_row, h.dtype(), route_weights, out.dtype(),
                            static_cast<char*>(out.data()) + bytes_of(c0, out.dtype()), s.D, s.T, s.k, cols, stream);
  }
}

}  // namespace expertqmm::cuda

// Internal pieces shared by the CUDA ops files (quantize, sort, activation, router, combine, moe):
// a dtype dispatcher, the arena layout of a workspace slot, and the launch entry points each file
// exports to the device MoE path (element types: device/elem.cuh). Included by .cu files only.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/device/elem.cuh"
#include "core/workspace_slots.h"
#include "cuda/gather_qmm_routes.h"
#include "cuda/group_rows.h"
#include "cuda/runtime.cuh"
#include "expertqmm/moe.h"

namespace expertqmm::cuda {

// Element types: cuda/device/elem.cuh (Elem<D>, round_to, kVec16).
template <DType D>
using DTypeTag = std::integral_constant<DType, D>;

// Calls f(DTypeTag<D>{}) for the float dtype t; other dtypes are an Error naming `op`.
template <class F>
void dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::bf16: f(DTypeTag<DType::bf16>{}); return;
    case DType::f16: f(DTypeTag<DType::f16>{}); return;
    case DType::f32: f(DTypeTag<DType::f32>{}); return;
    default: break;
  }
  throw Error(op, detail::cat("expected a float dtype (bfloat16, float16, float32), got ", dtype_name(t)));
}

// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------
// Scratch arenas (the slots themselves: core/workspace_slots.h).
// Two-pass carving: reserve() offsets while sizing, then base + offset once the slot is fetched.
class ArenaLayout {
 public:
  static constexpr size_t kAlign = 256;  // keeps every piece 16-byte (and CUB) aligned
  size_t reserve(size_t bytes) {
    const size_t off = used_;
    used_ += (bytes + kAlign - 1) / kAlign * kAlign;
    return off;
  }
  size_t bytes() const { return used_ ? used_ : kAlign; }

 private:
  size_t used_ = 0;
};
inline void* arena_at(void* base, size_t offset) { return static_cast<char*>(base) + offset; }

// ---------------------------------------------------------------------------------------------
// Launch entry points (all on `stream`, no host synchronization, no allocation).

// Elementwise dtype conversion of n contiguous values (the MoE path uses it when activations and
// weight scales differ in dtype, so that every gather_qmm operand is in the problem's dtype).
void launch_cast(DType from, const void* src, DType to, void* dst, int64_t n, cudaStream_t stream);

// activation.cu: out[r, c] = act(gate[r, c]) * up[r, c] for r < rows, c < width; gate and
// up rows are `in_row_stride` elements apart (width for separate tensors, 2*width when both point
// into one fused [rows, 2*width] gate_up output). out is contiguous [rows, width]. `mode` picks one
// fused kernel or act-then-multiply through `intermediate` ([rows, width], dtype, only for
// ProductMode::separate).
void launch_glu_product(Activation act, ProductMode mode, DType dtype, const void* gate, const void* up,
                        int64_t rows, int64_t width, int64_t in_row_stride, void* out, void* intermediate,
                        cudaStream_t stream);

// sort.cu: stable sort of n flat expert ids (int32, or uint32 when ids_unsigned) over bits
// [0, end_bit). Outputs: sorted_ids [n], order [n] (flat positions); then inv_order[order[i]] = i
// and, when token_of_row is non-null, token_of_row[i] = order[i] / k.
size_t sort_temp_bytes(int64_t n, bool ids_unsigned);
void launch_sort_rows(const int32_t* ids, int64_t n, int k, bool ids_unsigned, int end_bit, int32_t* sorted_ids,
                      int32_t* order, int32_t* positions, int32_t* inv_order, int32_t* token_of_row,
                      void* temp, size_t temp_bytes, cudaStream_t stream);
// dst row i = src row (source_row[i] / divisor), row_bytes per row (16-byte copies when aligned);
// src rows src_row_stride_bytes apart, dst contiguous; out-of-range rows are recorded as faults.
void launch_gather_rows(const void* src, int64_t src_rows, int64_t src_row_stride_bytes, const int32_t* source_row,
                        int divisor, int64_t n, int64_t row_bytes, void* dst, cudaStream_t stream);
// token_of_row[b] = b / k for b < n (the unsorted path's lhs: row b belongs to token b / k).
void launch_token_of_row(int32_t* token_of_row, int64_t n, int k, cudaStream_t stream);
// Number of key bits that distinguish ids in [0, E).
int id_bits(int64_t E);

// combine.cu: out[t, :] = sum_j w[t, j] * y[row(t, j), :], fp32 products and sums in slot order,
// one rounding to out's dtype. row(t, j) = slot_row ? slot_row[t*k + j] : t*k + j; a row outside
// [0, y_rows) is recorded as a fault and skipped. y: [y_rows, D] with rows y_ld apart, out: [T, D]
// with rows out_ld apart (a column window of wider matrices), w: [T, k] contiguous.
void launch_weighted_combine(DType y_dtype, const void* y, int64_t y_rows, int64_t y_ld, const int32_t* slot_row,
                             DType w_dtype, const void* w, DType out_dtype, void* out, int64_t out_ld, int64_t T,
                             int64_t k, int64_t D, cudaStream_t stream);

// router.cu: the Gemma 4 router on the device. Writes indices [T, k] int32 and weights [T, k] in
// h's dtype (both contiguous device memory owned by the caller); scratch from `ws` (slot
// detail::kSlotRouterArena and whatever gather_qmm_into takes). h: [T, H] on the device, rows contiguous.
void route_into(const Tensor& h, const RouterWeights& router, int32_t* indices, void* weights, Workspace& ws);
// The bytes of workspace slot kSlotRouterArena that route_into(h, router, ...) asks for (0 when h has
// no rows); the MoE layer fetches the slot at least this large before routing, so that it can hand the
// slot on once routed without route_into growing it.
size_t route_scratch_bytes(const Tensor& h, const RouterWeights& router);

// moe_decode_layer.cu: the decode layer, moe_layer_into in three kernels (router with top-k and the
// expert grouping; gate/up with the GLU product; down with the weighted combine; four with the down
// groups, decode_down_groups: by default from 12 tokens) for at most
// kDecodeMaxRows (token, slot) rows. supports_decode_layer: the first Fallback class that rules a
// call out (dtype, quantization, topology, shape, alignment); the layer plan (layer_plan.cu) applies
// the setting and records the choice. call_decode_layer runs it on the current stream with the
// scratch laid out by decode_scratch in the layer arena (slot kSlotLayerArena), no host sync.
constexpr int64_t kDecodeMaxRows = 128;  // T*k; also T <= 16 and k <= 8 (moe_decode.h)
struct DecodeScratch {
  size_t logits = 0, indices = 0, weights = 0, plan = 0, hidden = 0;  // offsets in the arena
  size_t partials = 0;      // down_groups: the fp32 down products [T*k, H]
  bool down_groups = false;  // the down product per expert group (decode_down_groups), decided at plan time
  size_t bytes = 0;
};
RouteSupport supports_decode_layer(const Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& weights);
DecodeScratch decode_scratch(int64_t T, int64_t k, int64_t E, int64_t I, int64_t H, const QuantizedWeight& down);
// counter: one zeroed unsigned of ws's kSlotCounters, zero again when the kernels finish (one per
// workspace, as the arena: a workspace serves one call at a time).
// chain_router: launch the router as a programmatic dependent launch (the caller's promise: the
// kernel ahead of it on the stream writes nothing the router reads).
void call_decode_layer(const DecodeScratch& scratch, unsigned* counter, Tensor& out, const Tensor& h, const Tensor& x,
                       const MoeWeights& weights, Workspace& ws, bool chain_router = false);

// cuda::moe_layer_into for a caller that promises, with router_overlaps_previous, that the kernel
// ahead of this call on the stream writes nothing the router reads (h is complete before it starts):
// the Gemma 4 block, whose entry norms write only the experts' x. At decode sizes the router then
// starts while that kernel runs (programmatic dependent launch; the router waits for it before it
// ends, so the experts' kernels find x written).
void moe_layer_into_chained(Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& weights, Workspace& ws,
                            bool router_overlaps_previous);

// The decode gate/up kernel on one dense quantized MLP (moe_decode_layer.cu): hidden [T, I] =
// act(x @ gate^T) * (x @ up^T) in one launch, the MLP run as a single always-chosen expert (the
// identity plan, moe_decode.h plan_group). x: [T, H] contiguous on the device; gate, up: [I, H]
// 4-bit (the tensor-core kernel), group 32/64/128, scales and biases in x's dtype, I % 32 == 0. The Gemma 4 block's dense branch
// takes it for T <= 8 (one plan group: the mma's n) in the fused product mode; the numerics are qmv's followed
// by launch_glu_product's fused product (gate and up rounded to the dtype, one rounding after).
RouteSupport supports_decode_glu(const Tensor& x, const QuantizedWeight& gate, const QuantizedWeight& up,
                                 Activation act);
void launch_decode_glu(const Tensor& x, const QuantizedWeight& gate, const QuantizedWeight& up, Activation act,
                       void* hidden);

}  // namespace expertqmm::cuda

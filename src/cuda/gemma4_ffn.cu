// The Gemma 4 feed-forward part on the device (include/expertqmm/gemma4.h, gemma4_ffn_into): a
// fixed sequence of launches into one workspace arena, no host synchronization and, once the arena
// has grown to a size, no allocation (graph-capturable):
//   entry norms (one kernel): x1 = rms_norm(h, pre_ff), x2 = rms_norm(h, pre_ff_2)
//   then two branches that share nothing but their inputs:
//     side stream:   a = GLU(x1 @ gate^T, x1 @ up^T) -> d = a @ down^T, one of four ways (DenseMlpWay):
//                    T <= 8 (4-bit): one decode gate/up launch; T = 1 (8-bit): one qmv launch with
//                    the GeGLU in its epilogue; T >= 512: the weights dequantized to 16 bits and
//                    cuBLAS (gate and up as one GEMM, the GLU product, down), or where that does not
//                    fit (sm_90a; 4-bit, or 8-bit bf16) the linears as T rows of one expert on the
//                    expert tile route, gate and up in one wgmma launch with the GeGLU; else two
//                    gather_qmm calls (M = T, B = 1) and the GLU product
//     thread stream: m = moe_layer_into(h, x2) (router and experts)
//   exit (one kernel, once both are done): out = (h + rms_norm(rms_norm(d, post_ff_1)
//                                               + rms_norm(m, post_ff_2), post_ff)) * layer_scalar
// The dense branch is issued on a side stream (stream_branch.h) with its own scratch
// (Workspace::branch), so that in a graph it is a parallel path: at decode the dense MLP's weights
// stream while the router and the experts run, instead of after them.
// Every buffer is [T, H] or [T, I_dense] in h's dtype (validated by src/ops/gemma4_ffn.cpp).
#include "core/route_counters.h"
#include "core/workspace_slots.h"
#include "cuda/dense_cublas.h"
#include "cuda/dense_linear.h"
#include "cuda/gather_qmm.h"
#include "cuda/gather_qmm_wgmma.h"
#include "cuda/norm.h"
#include "cuda/moe_internal.h"
#include "cuda/stream_branch.h"
#include "cuda/tile_plan.cuh"
#include "expertqmm/settings.h"

namespace expertqmm::cuda {

namespace {

size_t bytes_of(int64_t count, DType t) { return static_cast<size_t>(count) * dtype_size(t); }

// out [T, N] = x [T, K] @ W^T: quantized through gather_qmm's selector as one batch of M = T rows
// (B = 1, identity indices: rhs_tiles for prefill, qmv for decode), 16-bit through the dense linear
// (gather_mm's routes).
void linear_into(const Linear& l, DType dtype, const void* x, int64_t T, void* out, Workspace& ws) {
  if (!l.is_quantized()) {
    dense_linear_into(x, dtype, T, l.dense, dtype, out, ws);
    return;
  }
  gather_qmm_into(single_matrix_problem(x, T, l.in_features(), dtype, l.quantized), out, &ws);
}

// From this many tokens the dense MLP runs as T rows of one expert (x [T, 1, K], ids all 0, sorted)
// on the expert tile route's wgmma kernel: 128-row tiles where rhs_tiles (mma.sync) takes the one
// matrix, gate and up in one launch with the GeGLU in its epilogue. bench/NOTES.md step 24
// (probe-dense-linear.json, 4-bit g64 alone, 512 / 1024 / 2048 tokens): gate or up 44.6 / 64.5 / 97.2
// us against rhs_tiles' 55.9 / 89.5 / 139.8, down 48.8 / 50.4 / 76.5 against 45.0 / 71.3 / 124.7. Below
// 512 the 128-row tiles leave SMs idle (4 x 17 CTAs for gate at 512). 8-bit codes likewise, on the
// kernel's 8-bit build (T rows of one expert pass its 32 rows per expert; bench/NOTES.md step 26:
// the block at 512 / 2048 tokens 416.5 / 1040.5 us per layer against 431.5 / 1160.4 on rhs_tiles).
constexpr int64_t kDenseRowsMinTokens = 512;

// Up to this many tokens a dense MLP the decode GLU kernel does not take (8-bit) runs gate, up and the
// GeGLU as one qmv launch (one row per CTA). At T = 2-7 the multi-row qmv kernels read each weight
// once per 4-8 rows (step 21), which one-row GLU launches would give up (bench/NOTES.md step 27).
constexpr int64_t kQmvGluMaxTokens = 1;

// From this many tokens (EXPERTQMM_DENSE_CUBLAS unset) the quantized dense MLP runs on cuBLAS: its
// weights dequantized to 16 bits into the branch's scratch each call (gate and up, then down), gate
// and up as one GEMM of 2 I columns, the GLU product, down. A single [T, K] x [K, N] matrix leaves the
// expert tile kernel one wave of 128-row tiles and a few CTAs over; cuBLAS picks its tiles per shape.
// bench/NOTES.md step 59 (H100, 10-layer block per layer, this way against the expert tile route, MLX
// layout / tile layout): 2048 tokens -9.6 / -11.3%, 1024 -5.9 / -7.1%, 512 +2.8 / +0.7% (beside the
// experts the fixed ~40 us of dequantization and cuBLAS's whole-GPU grids lost there). Step 60's
// dequantization (4 units per thread, 512-byte warp stores) then measured at 512 / 768 tokens -2.5 to
// -3.0% / -1.6% on the MLX layout and +0.2% / -3.0% on the tile layout, so from 512.
constexpr int64_t kDenseCublasMinTokens = 512;

enum class DenseMlpWay { decode_glu, qmv_glu, cublas, expert_rows, linears };

// Whether the dense MLP runs on cuBLAS (the arena then lays gate and up out as one [T, 2 I] GEMM
// output): the setting, the size and the weights' rules (dense_cublas_fits; gate's [I, H] bytes a
// multiple of 16, so that up's dequantized rows follow gate's aligned). The decode ways come first.
bool dense_cublas_wanted(const Gemma4Mlp& m, int64_t T, ProductMode mode, DType dt) {
  const RouteSwitch s = dense_cublas_setting();
  const int64_t from = s == RouteSwitch::on ? kQmvGluMaxTokens + 1 : kDenseCublasMinTokens;
  if (s == RouteSwitch::off || T < from || mode != ProductMode::fused) return false;
  if (!m.gate.is_quantized() || !m.up.is_quantized() || !m.down.is_quantized()) return false;
  const int64_t I = m.gate.out_features(), H = m.gate.in_features();
  return dense_cublas_fits(m.gate.quantized, dt) && dense_cublas_fits(m.up.quantized, dt) &&
         dense_cublas_fits(m.down.quantized, dt) && (I * H) % 8 == 0;
}

// Whether the dense MLP may run as expert rows, from the shapes alone (the arena then reserves its
// ids and plan); the kernels' own rules are checked once the buffers are placed (gemma4_ffn_into).
bool dense_rows_wanted(const Gemma4Mlp& m, int64_t T, ProductMode mode, bool cublas) {
  return !cublas && T >= kDenseRowsMinTokens && mode == ProductMode::fused &&
         m.gate.is_quantized() && m.up.is_quantized() && m.down.is_quantized() &&
         expert_tiles_setting() != RouteSwitch::off && wgmma_available();
}

// The dense branch's choice, made once the arena is placed, with the problems it runs.
struct DenseMlpPlan {
  DenseMlpWay way = DenseMlpWay::linears;
  detail::GatherQmmProblem gate, up, down;  // qmv_glu: gate and up as single matrices; expert_rows: all three
};

// x1 [T, H] the MLP's input, act [T, I] its GLU output, d [T, H] its output; ids / plan: the arena's
// expert_rows slots (null when dense_rows_wanted said no); cublas: dense_cublas_wanted's answer, asked
// once per call by gemma4_ffn_into. Counts the choice under
// Primitive::dense_mlp_glu: a hit is any fused way; a miss names why the last candidate refused.
DenseMlpPlan plan_dense_mlp(const Gemma4Mlp& m, ProductMode mode, bool cublas, const Tensor& x1, void* act, void* d,
                            int32_t* ids, void* plan) {
  const DType dt = x1.dtype();
  const int64_t T = x1.size(0), H = x1.size(1), I = m.gate.out_features();
  DenseMlpPlan p;
  auto choose = [&]() -> Fallback {  // sets p.way on a fused way; else the miss class
    if (!m.gate.is_quantized() || !m.up.is_quantized()) return Fallback::quantization;  // codes only
    const RouteSupport decode = supports_decode_glu(x1, m.gate.quantized, m.up.quantized, Activation::geglu);
    if (decode.ok) {
      p.way = DenseMlpWay::decode_glu;
      return Fallback::disabled;
    }
    if (cublas) {
      p.way = DenseMlpWay::cublas;
      return Fallback::disabled;
    }
    if (T <= kQmvGluMaxTokens) {
      p.gate = single_matrix_problem(x1.data(), T, H, dt, m.gate.quantized);
      p.up = single_matrix_problem(x1.data(), T, H, dt, m.up.quantized);
      const RouteSupport glu = supports_qmv_glu(p.gate, p.up, Activation::geglu);
      if (glu.ok) p.way = DenseMlpWay::qmv_glu;
      return glu.reason;
    }
    if (ids == nullptr) return T < kDenseRowsMinTokens ? Fallback::shape : Fallback::quantization;
    p.gate = one_expert_rows_problem(single_matrix_problem(x1.data(), T, H, dt, m.gate.quantized), ids, plan);
    p.up = one_expert_rows_problem(single_matrix_problem(x1.data(), T, H, dt, m.up.quantized), ids, plan);
    p.down = one_expert_rows_problem(single_matrix_problem(act, T, I, dt, m.down.quantized), ids, plan);
    // The kernels' shape and alignment rules (group 64 / 128, K % 64, 16-byte outputs).
    if (!gate_up_glu_fits(p.gate, p.up) || !wgmma_tiles_fit(p.down)) return Fallback::quantization;
    if (!is_aligned(act, 16) || !is_aligned(d, 16)) return Fallback::alignment;
    p.way = DenseMlpWay::expert_rows;
    return Fallback::disabled;
  };
  const bool requested = mode == ProductMode::fused;  // the separate mode asks for the GLU apart
  const Fallback why = requested ? choose() : Fallback::disabled;
  const bool fused = p.way != DenseMlpWay::linears;
  detail::record_selection(detail::Primitive::dense_mlp_glu, requested, fused, fused, why);
  return p;
}

}  // namespace

void gemma4_ffn_into(Tensor& out, const Tensor& h, const Gemma4FfnWeights& w, Workspace& ws) {
  const char* op = "gemma4_ffn";
  EXPERTQMM_CHECK(h.device() == Device::cuda && out.device() == Device::cuda && h.is_contiguous(), op,
                  "cuda::gemma4_ffn_into needs contiguous device tensors, got h ", h.describe(), " and out ",
                  out.describe());
  const DType dt = h.dtype();
  const int64_t T = h.size(0), H = h.size(1), I = w.mlp.gate.out_features();
  const float eps = w.eps;

  ArenaLayout layout;
  const size_t x1_off = layout.reserve(bytes_of(T * H, dt));
  const size_t x2_off = layout.reserve(bytes_of(T * H, dt));
  // gate and up: two [T, I] outputs; on cuBLAS one [T, 2 I] from gate_off over both (adjacent pieces).
  const size_t gate_off = layout.reserve(bytes_of(T * I, dt));
  const size_t up_off = layout.reserve(bytes_of(T * I, dt));
  const size_t act_off = layout.reserve(bytes_of(T * I, dt));
  const ProductMode mode = product_mode();  // read once: the plan and the launch agree
  const size_t inter_off = mode == ProductMode::separate ? layout.reserve(bytes_of(T * I, dt)) : 0;
  const size_t d_off = layout.reserve(bytes_of(T * H, dt));
  const size_t moe_off = layout.reserve(bytes_of(T * H, dt));
  const bool cublas = dense_cublas_wanted(w.mlp, T, mode, dt);
  const bool rows = dense_rows_wanted(w.mlp, T, mode, cublas);
  const size_t ids_off = rows ? layout.reserve(bytes_of(T, DType::i32)) : 0;
  const size_t plan_off = rows ? layout.reserve(tile_plan_bytes(T, 1)) : 0;
  void* base = ws.get(detail::kSlotFfnArena, layout.bytes());
  auto at = [&](size_t off) { return arena_at(base, off); };

  Gemma4NormArgs na;
  na.T = T;
  na.H = H;
  na.eps = eps;
  na.h = h.data();
  const Tensor pre_ff = w.pre_feedforward_layernorm.contiguous(), pre_ff_2 = w.pre_feedforward_layernorm_2.contiguous();
  const Tensor post_ff_1 = w.post_feedforward_layernorm_1.contiguous();
  const Tensor post_ff_2 = w.post_feedforward_layernorm_2.contiguous();
  const Tensor post_ff = w.post_feedforward_layernorm.contiguous(), scalar = w.layer_scalar.contiguous();
  na.pre_ff = pre_ff.data();
  na.pre_ff_dtype = pre_ff.dtype();
  na.pre_ff_2 = pre_ff_2.data();
  na.pre_ff_2_dtype = pre_ff_2.dtype();
  na.x1 = at(x1_off);
  na.x2 = at(x2_off);
  na.d = at(d_off);
  na.m = at(moe_off);
  na.post_ff_1 = post_ff_1.data();
  na.post_ff_1_dtype = post_ff_1.dtype();
  na.post_ff_2 = post_ff_2.data();
  na.post_ff_2_dtype = post_ff_2.dtype();
  na.post_ff = post_ff.data();
  na.post_ff_dtype = post_ff.dtype();
  na.layer_scalar = scalar.data();
  na.layer_scalar_dtype = scalar.dtype();
  na.out = out.data();

  // Chained launches (on unless EXPERTQMM_CHAINED_LAUNCH=0): the router starts while the entry norms
  // run (it reads h, they write x1 and x2), and the exit loads h, d and its weights while the experts'
  // last kernel finishes (bench/NOTES.md step 20: -9.3 us per layer at T = 1, -8 at T = 8).
  const bool chained = chained_launches();
  launch_gemma4_entry_norms(dt, na);
  // Dense branch on the side stream: d = down(geglu(gate(x1), up(x1))), with its own scratch.
  StreamBranch branch;
  branch.enter();
  Workspace& side_ws = ws.branch();
  const Tensor x1 = Tensor::view(at(x1_off), {T, H}, dt, Device::cuda);
  const DenseMlpPlan dense = plan_dense_mlp(w.mlp, mode, cublas, x1, at(act_off), at(d_off),
                                            rows ? static_cast<int32_t*>(at(ids_off)) : nullptr,
                                            rows ? at(plan_off) : nullptr);
  if (dense.way == DenseMlpWay::decode_glu) {
    // Decode sizes: gate, up and the GeGLU in one launch (the dense MLP as one always-chosen expert).
    launch_decode_glu(x1, w.mlp.gate.quantized, w.mlp.up.quantized, Activation::geglu, at(act_off));
  } else if (dense.way == DenseMlpWay::qmv_glu) {
    call_qmv_glu(dense.gate, dense.up, Activation::geglu, at(act_off));
  } else if (dense.way == DenseMlpWay::cublas) {
    // Prefill sizes on cuBLAS: gate's and up's weights dequantized into one [2 I, H] matrix, one GEMM
    // into [T, 2 I], the GLU product, then down's weight dequantized into the same bytes and its GEMM.
    cudaStream_t side = current_stream();
    const QuantizedWeight &gq = w.mlp.gate.quantized, &uq = w.mlp.up.quantized, &dq = w.mlp.down.quantized;
    void* weights = side_ws.get(detail::kSlotDenseWeights, bytes_of(2 * I * H, dt));
    dequantize_for_gemm(gq, weights, side);
    dequantize_for_gemm(uq, arena_at(weights, bytes_of(I * H, dt)), side);
    cublas_linear(dt, weights, at(x1_off), H, at(gate_off), 2 * I, T, 2 * I, H, side_ws, side);
    launch_glu_product(Activation::geglu, mode, dt, at(gate_off), arena_at(at(gate_off), bytes_of(I, dt)), T, I,
                       2 * I, at(act_off), nullptr, side);
    dequantize_for_gemm(dq, weights, side);
    cublas_linear(dt, weights, at(act_off), I, at(d_off), H, T, H, I, side_ws, side);
  } else if (dense.way == DenseMlpWay::expert_rows) {
    // Prefill sizes: every row is expert 0's, so the plan is T / 128 full tiles; the selector counts
    // the three GEMMs on the tile route as the MoE layer's plan does.
    cudaStream_t side = current_stream();
    EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(at(ids_off), 0, bytes_of(T, DType::i32), side));
    launch_build_tile_plan_at(static_cast<const int32_t*>(at(ids_off)), T, 1, at(plan_off), side);
    for (const detail::GatherQmmProblem* g : {&dense.gate, &dense.up})
      EXPERTQMM_CHECK(is_expert_tiles(select_gather_qmm_route(*g)), op, "the dense MLP's rows missed the tile route: ",
                      g->describe());
    launch_gate_up_glu(dense.gate, dense.up, Activation::geglu, at(act_off));
    const GatherQmmRoute& down_route = select_gather_qmm_route(dense.down);
    EXPERTQMM_CHECK(is_expert_tiles(down_route), op, "the dense MLP's rows missed the tile route: ",
                    dense.down.describe());
    run_gather_qmm_route(down_route, dense.down, at(d_off), &side_ws);
  } else {
    linear_into(w.mlp.gate, dt, at(x1_off), T, at(gate_off), side_ws);
    linear_into(w.mlp.up, dt, at(x1_off), T, at(up_off), side_ws);
    launch_glu_product(Activation::geglu, mode, dt, at(gate_off), at(up_off), T, I, I, at(act_off),
                       mode == ProductMode::separate ? at(inter_off) : nullptr, current_stream());
  }
  const bool down_done = dense.way == DenseMlpWay::expert_rows || dense.way == DenseMlpWay::cublas;
  if (!down_done) linear_into(w.mlp.down, dt, at(act_off), T, at(d_off), side_ws);
  branch.leave();
  // Expert branch on the thread's stream, beside the dense one: the router reads h itself, the
  // experts x2. Then the exit waits for both.
  const Tensor x2 = Tensor::view(at(x2_off), {T, H}, dt, Device::cuda);
  Tensor moe_out = Tensor::view(at(moe_off), {T, H}, dt, Device::cuda);
  cuda::moe_layer_into_chained(moe_out, h, x2, w.moe, ws, /*router_overlaps_previous=*/chained);
  branch.join();
  launch_gemma4_exit(dt, na, chained);
}

}  // namespace expertqmm::cuda

// The decode MoE layer's host side (moe_decode.h has the kernels' story): which calls it takes,
// its scratch, and the three launches.
#include <algorithm>
#include <cmath>
#include <mutex>
#include <unordered_set>

#include "cuda/gather_qmm_routes.h"  // device_smem_optin
#include "cuda/moe_decode.h"
#include "cuda/moe_decode_select.h"
#include "cuda/moe_internal.h"
#include "expertqmm/settings.h"

namespace expertqmm::cuda {

namespace decode {

size_t decode_max_smem() {
  const size_t optin = device_smem_optin();
  return optin > kDecodeStaticSmem ? optin - kDecodeStaticSmem : 0;
}

void allow_smem(const void* kernel) {
  static std::mutex mu;
  static std::unordered_set<const void*> done;
  std::lock_guard<std::mutex> lock(mu);
  if (!done.insert(kernel).second) return;
  EXPERTQMM_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(decode_max_smem())));
}

}  // namespace decode

using namespace decode;

namespace {

bool rows_aligned(const Tensor& t) {
  return is_aligned(t.data(), 16) && (t.size(0) <= 1 || t.stride(0) % 8 == 0);
}

// Which fp modes a decode kernel reads: none (the dense GLU), 4-bit ones (the experts' tensor-core
// kernels; mxfp8 experts would need the scalar 8-bit kernels, which are affine) or all (the router).
enum class FpCodes { none, fp4, any };

// A quantized weight [E, N, K*bits/32] that the decode kernels can read: 4/8-bit, group 32/64/128,
// scales and biases in `dtype`, contiguous, 16-byte aligned rows; or, as `fp` allows, an fp mode
// (uint8 scales, no biases, no global scale) under bf16.
RouteSupport check_weight(const QuantizedWeight& q, int64_t E, int64_t N, int64_t K, DType dtype,
                          FpCodes fp_ok = FpCodes::none) {
  if (!q.defined() || !q.scales.defined()) return route_miss(Fallback::quantization);
  const bool fp = q.mode != QuantMode::affine;
  if (fp) {
    if (fp_ok == FpCodes::none || (fp_ok == FpCodes::fp4 && q.bits != 4) || q.global_scale.defined())
      return route_miss(Fallback::quantization);
    if (dtype != DType::bf16) return route_miss(Fallback::dtype);
    if (q.scales.dtype() != DType::u8 || q.biases.defined()) return route_miss(Fallback::quantization);
  } else {
    if (!q.biases.defined()) return route_miss(Fallback::quantization);
    if (q.bits != 4 && q.bits != 8) return route_miss(Fallback::quantization);
    if (q.group_size != 32 && q.group_size != 64 && q.group_size != 128) return route_miss(Fallback::quantization);
    if (q.scales.dtype() != dtype || q.biases.dtype() != dtype) return route_miss(Fallback::dtype);
  }
  if (q.w.dtype() != DType::u32 && q.w.dtype() != DType::i32) return route_miss(Fallback::quantization);
  const bool batched = E > 0;
  const int64_t dims = batched ? 3 : 2;
  if (q.w.ndim() != dims || q.scales.ndim() != dims || (!fp && q.biases.ndim() != dims)) return route_miss(Fallback::topology);
  if (batched && (q.w.size(0) != E || q.scales.size(0) != E)) return route_miss(Fallback::topology);
  if (q.w.size(-2) != N || q.w.size(-1) * 32 != K * q.bits) return route_miss(Fallback::topology);
  if (K % q.group_size != 0 || q.scales.size(-1) != K / q.group_size || (!fp && q.biases.shape() != q.scales.shape()) ||
      q.scales.size(-2) != N)
    return route_miss(Fallback::topology);
  if (!q.w.is_contiguous() || !q.scales.is_contiguous() || (!fp && !q.biases.is_contiguous()))
    return route_miss(Fallback::alignment);
  if (K % (128 / q.bits) != 0 || !is_aligned(q.w.data(), 16)) return route_miss(Fallback::alignment);
  return route_ok();
}

}  // namespace


RouteSupport supports_decode_layer(const Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& w) {
  const RouterWeights& rt = w.router;
  const SwitchGLUWeights& ex = w.experts;
  const int64_t T = x.size(0), H = x.size(1);
  const int64_t k = rt.top_k;
  if (T < 1 || T > kDecodeMaxTokens || k < 1 || k > kDecodeMaxTopK || T * k > kDecodeMaxRows)
    return route_miss(Fallback::shape);
  const DType D = x.dtype();
  if (D != DType::bf16 && D != DType::f16) return route_miss(Fallback::dtype);
  if (h.dtype() != D || out.dtype() != D) return route_miss(Fallback::dtype);
  if (h.ndim() != 2 || h.size(0) != T || h.size(1) != H || (H > 1 && (h.stride(1) != 1 || x.stride(1) != 1)))
    return route_miss(Fallback::topology);
  if (H % 32 != 0 || H > INT32_MAX / 4) return route_miss(Fallback::shape);
  if (!rows_aligned(h) || !rows_aligned(x) || !is_aligned(out.data(), 16)) return route_miss(Fallback::alignment);

  // Experts: quantized only (16-bit experts take the experts path, gather_mm's GEMV at these sizes).
  if (ex.has_dense()) return route_miss(Fallback::quantization);
  const QuantizedWeight& first = ex.fused() ? ex.gate_up : ex.gate;
  if (!first.defined() || first.w.ndim() != 3) return route_miss(Fallback::topology);
  const int64_t E = first.w.size(0);
  const int64_t I = ex.fused() ? first.w.size(1) / 2 : first.w.size(1);
  if (E < 1 || E > INT32_MAX || I < 1 || I > INT32_MAX / 8 || k > E) return route_miss(Fallback::shape);
  RouteSupport s;
  if (ex.fused()) {
    if (first.w.size(1) != 2 * I) return route_miss(Fallback::topology);
    if (!(s = check_weight(ex.gate_up, E, 2 * I, H, D, FpCodes::fp4)).ok) return s;
  } else {
    if (!(s = check_weight(ex.gate, E, I, H, D, FpCodes::fp4)).ok) return s;
    if (!(s = check_weight(ex.up, E, I, H, D, FpCodes::fp4)).ok) return s;
    if (ex.gate.bits != ex.up.bits || ex.gate.group_size != ex.up.group_size || ex.gate.mode != ex.up.mode)
      return route_miss(Fallback::quantization);
  }
  if (!(s = check_weight(ex.down, E, H, I, D, FpCodes::fp4)).ok) return s;
  // 4-bit experts run on the tensor-core kernels, which copy scale and bias spans in 16-byte units
  // (an fp mode's spans of 16 rows of uint8 codes start at row multiples of 16 times the codes per
  // row: whole 16-byte units when gate / up's I * (H / group) is; down's H % 32 == 0 makes its own).
  for (const QuantizedWeight* q : {&first, &ex.up, &ex.down})
    if (q->defined() && q->bits == 4 && (!is_aligned(q->scales.data(), 16) || !is_aligned(q->biases.data(), 16)))
      return route_miss(Fallback::alignment);
  const bool fp_gate = first.mode != QuantMode::affine, fp_down = ex.down.mode != QuantMode::affine;
  if (fp_gate && I * (H / first.group_size) % 16 != 0) return route_miss(Fallback::alignment);
  if (I % 8 != 0) return route_miss(Fallback::alignment);
  if (ex.activation != Activation::geglu && ex.activation != Activation::swiglu) return route_miss(Fallback::topology);

  // Router: Gemma 4's (norm weight and per_expert_scale) or softmax_topk (neither).
  if (rt.kind != RouterKind::gemma4 && rt.kind != RouterKind::softmax_topk) return route_miss(Fallback::topology);
  if (rt.kind == RouterKind::gemma4) {
    if (!rt.scale.defined() || !is_floating(rt.scale.dtype()) || rt.scale.numel() != H || !rt.scale.is_contiguous())
      return route_miss(Fallback::dtype);
    if (!is_aligned(rt.scale.data(), 16)) return route_miss(Fallback::alignment);  // read in 16-byte units
    if (!rt.per_expert_scale.defined() || !is_floating(rt.per_expert_scale.dtype()) ||
        rt.per_expert_scale.numel() != E || !rt.per_expert_scale.is_contiguous())
      return route_miss(Fallback::dtype);
  }
  if (rt.proj.defined()) {
    if (!(s = check_weight(rt.proj, 0, E, H, D, FpCodes::any)).ok) return s;
  } else {
    const Tensor& p = rt.proj_dense;
    if (!p.defined() || p.dtype() != D) return route_miss(Fallback::dtype);
    if (p.ndim() != 2 || p.size(0) != E || p.size(1) != H) return route_miss(Fallback::topology);
    if (!p.is_contiguous() || !is_aligned(p.data(), 16)) return route_miss(Fallback::alignment);
  }

  const size_t gate_up_bytes =
      first.bits == 4 ? gate_up_mma_smem(H, first.group_size, fp_gate) : gate_up_scalar_smem(T, H);
  const size_t down_bytes =
      ex.down.bits == 4 ? down_mma_smem(k, I, ex.down.group_size, fp_down) : down_scalar_smem(k, I);
  // The scalar (8-bit) kernels: measured and tested up to 8 tokens only (they would take split plan
  // groups too, their grid being GateUpArgs::group_rows, but are not yet measured beyond).
  if ((first.bits != 4 || ex.down.bits != 4) && T > kScalarMaxTokens) return route_miss(Fallback::shape);
  const size_t limit = decode_max_smem();
  if (router_smem(T, H) > limit || gate_up_bytes > limit || down_bytes > limit) return route_miss(Fallback::shape);
  return route_ok();
}


RouteSupport supports_decode_glu(const Tensor& x, const QuantizedWeight& gate, const QuantizedWeight& up,
                                 Activation act) {
  const DType D = x.dtype();
  if (D != DType::bf16 && D != DType::f16) return route_miss(Fallback::dtype);
  if (x.ndim() != 2 || !x.is_contiguous() || x.device() != Device::cuda) return route_miss(Fallback::topology);
  const int64_t T = x.size(0), H = x.size(1);
  if (T < 1 || T > kPlanGroupRows) return route_miss(Fallback::shape);  // the identity plan's one group
  if (H % 32 != 0 || H > INT32_MAX / 4 || !rows_aligned(x)) return route_miss(Fallback::alignment);
  if (act != Activation::geglu && act != Activation::swiglu) return route_miss(Fallback::topology);
  if (!gate.defined() || gate.w.ndim() != 2) return route_miss(Fallback::topology);
  const int64_t I = gate.w.size(0);
  if (I < 1 || I > INT32_MAX / 8 || I % 32 != 0) return route_miss(Fallback::shape);  // whole column blocks
  RouteSupport s;
  if (!(s = check_weight(gate, 0, I, H, D)).ok) return s;
  if (!(s = check_weight(up, 0, I, H, D)).ok) return s;
  if (gate.bits != up.bits || gate.group_size != up.group_size) return route_miss(Fallback::quantization);
  // 4-bit only: the tensor-core kernel. The scalar 8-bit one lost to two qmv launches and the GLU
  // kernel on the block's 8-bit dense MLP (bench/NOTES.md step 11: 188 vs 168 us per layer at T = 8).
  if (gate.bits != 4) return route_miss(Fallback::quantization);
  for (const QuantizedWeight* q : {&gate, &up})  // scale and bias spans are copied in 16-byte units
    if (!is_aligned(q->scales.data(), 16) || !is_aligned(q->biases.data(), 16)) return route_miss(Fallback::alignment);
  if (gate_up_mma_smem(H, gate.group_size) > decode_max_smem()) return route_miss(Fallback::shape);
  return route_ok();
}

void launch_decode_glu(const Tensor& x, const QuantizedWeight& gate, const QuantizedWeight& up, Activation act,
                       void* hidden) {
  const int T = static_cast<int>(x.size(0)), H = static_cast<int>(x.size(1));
  const int I = static_cast<int>(gate.w.size(0));
  GateUpArgs ga{};
  ga.x = x.data_as<const uint16_t>();
  ga.x_stride = H;
  ga.gate = quant_view(gate, H);
  ga.up = quant_view(up, H);
  ga.gate_rows_per_expert = I;
  ga.up_rows_per_expert = I;
  ga.H = H;
  ga.I = I;
  ga.E = 1;
  ga.k = 1;
  ga.plan = nullptr;
  ga.identity_rows = T;
  ga.group_rows = 1;  // the identity plan's one group
  ga.hidden = static_cast<uint16_t*>(hidden);
  ga.faults = device_faults();
  launch_gate_up_mma(x.dtype(), gate.group_size, act, ga, gate_up_mma_smem(H, gate.group_size), current_stream());
}

DecodeScratch decode_scratch(int64_t T, int64_t k, int64_t E, int64_t I, int64_t H, const QuantizedWeight& down) {
  DecodeScratch sc;
  ArenaLayout layout;
  const int64_t n = T * k;
  const size_t groups_smem = down.bits == 4 ? down_groups_smem(I, down.group_size, down.mode != QuantMode::affine) : 0;
  sc.down_groups = decode_down_groups(T, down.bits, groups_smem);
  if (sc.down_groups) sc.partials = layout.reserve(static_cast<size_t>(n * H) * sizeof(float));
  sc.logits = layout.reserve(static_cast<size_t>(T * E) * sizeof(float));
  sc.indices = layout.reserve(static_cast<size_t>(n) * sizeof(int32_t));
  sc.weights = layout.reserve(static_cast<size_t>(n) * sizeof(uint16_t));
  sc.plan = layout.reserve(sizeof(DecodePlan));
  sc.hidden = layout.reserve(static_cast<size_t>(n * I) * sizeof(uint16_t));
  sc.bytes = layout.bytes();
  return sc;
}

bool decode_routes_in_gate_up(int64_t T, int gate_bits, int64_t E, int64_t k, bool router_chained) {
  const RouteSwitch s = decode_route_in_gate_up_setting();
  const bool wanted = s == RouteSwitch::on || (s == RouteSwitch::automatic && !router_chained);
  return wanted && T == 1 && gate_bits == 4 && E <= decode::kThreads && k <= decode::kDecodeMaxTopK;
}

int decode_group_rows(int64_t T, int64_t k, int64_t E) {
  const int64_t n = T * k, hit = std::min(n, E);
  const int64_t more = T > kPlanGroupRows ? n / kPlanGroupRows : 0;  // sum of ceil(c_e / 8) <= hit + n / 8
  return static_cast<int>(std::min(n, hit + more));
}

bool decode_down_groups(int64_t T, int down_bits, size_t smem) {
  const RouteSwitch s = decode_down_groups_setting();
  const bool wanted = s == RouteSwitch::on ? T >= 2 : s == RouteSwitch::automatic && T >= kDecodeDownGroupsMinTokens;
  return wanted && down_bits == 4 && smem <= decode_max_smem();
}

bool decode_router_fits(int64_t T, int64_t H) { return router_smem(T, H) <= decode_max_smem(); }

void call_decode_layer(const DecodeScratch& sc, unsigned* counter, Tensor& out, const Tensor& h, const Tensor& x,
                       const MoeWeights& w, Workspace& ws, bool chain_router) {
  const RouterWeights& rt = w.router;
  const SwitchGLUWeights& ex = w.experts;
  const int T = static_cast<int>(x.size(0)), H = static_cast<int>(x.size(1)), k = rt.top_k;
  const QuantizedWeight& gate = ex.fused() ? ex.gate_up : ex.gate;
  const QuantizedWeight& up = ex.fused() ? ex.gate_up : ex.up;
  const int E = static_cast<int>(gate.w.size(0));
  const int I = static_cast<int>(ex.fused() ? gate.w.size(1) / 2 : gate.w.size(1));
  const DType D = x.dtype();

  void* base = ws.get(detail::kSlotLayerArena, sc.bytes);
  cudaStream_t stream = current_stream();
  auto* plan = static_cast<DecodePlan*>(arena_at(base, sc.plan));

  RouterArgs ra{};
  ra.h = h.data_as<const uint16_t>();
  ra.h_stride = T > 1 ? h.stride(0) : H;
  const bool gemma4 = rt.kind == RouterKind::gemma4;
  ra.softmax_topk = !gemma4;
  ra.renormalize = rt.norm_topk_prob;
  ra.scale = gemma4 ? rt.scale.data() : nullptr;
  ra.scale_dtype = gemma4 ? rt.scale.dtype() : D;
  ra.root_size = gemma4 ? 1.0f / std::sqrt(static_cast<float>(H)) : 1.0f;
  ra.eps = rt.eps;
  const bool quantized = rt.proj.defined();
  if (quantized) ra.proj = quant_view(rt.proj, H);
  else ra.proj_dense = rt.proj_dense.data();
  ra.per_expert_scale = gemma4 ? rt.per_expert_scale.data() : nullptr;
  ra.pes_dtype = gemma4 ? rt.per_expert_scale.dtype() : D;
  ra.T = T;
  ra.H = H;
  ra.E = E;
  ra.k = k;
  ra.logits = static_cast<float*>(arena_at(base, sc.logits));
  ra.counter = counter;
  ra.indices = static_cast<int32_t*>(arena_at(base, sc.indices));
  ra.weights = static_cast<uint16_t*>(arena_at(base, sc.weights));
  ra.plan = plan;

  GateUpArgs ga{};
  ga.x = x.data_as<const uint16_t>();
  ga.x_stride = T > 1 ? x.stride(0) : H;
  ga.gate = quant_view(gate, H);
  ga.up = quant_view(up, H);
  ga.gate_rows_per_expert = gate.w.size(1);
  ga.up_rows_per_expert = up.w.size(1);
  ga.gate_row0 = 0;
  ga.up_row0 = ex.fused() ? I : 0;
  ga.H = H;
  ga.I = I;
  ga.E = E;
  ga.k = k;
  ga.rows_per_pass = gate_up_scalar_rows_per_pass(T);  // scalar kernel only
  ga.plan = plan;
  ga.group_rows = decode_group_rows(T, k, E);
  ga.hidden = static_cast<uint16_t*>(arena_at(base, sc.hidden));
  ga.faults = device_faults();

  const bool route_in_gate_up = decode_routes_in_gate_up(T, gate.bits, E, k, chain_router);
  ra.route_in_gate_up = route_in_gate_up;
  if (route_in_gate_up) {
    ga.logits = ra.logits;
    ga.per_expert_scale = ra.per_expert_scale;
    ga.pes_dtype = ra.pes_dtype;
    ga.softmax_topk = ra.softmax_topk;
    ga.renormalize = ra.renormalize;
    ga.indices = ra.indices;
    ga.weights = ra.weights;
  }

  DownArgs da{};
  da.hidden = ga.hidden;
  da.down = quant_view(ex.down, I);
  da.indices = ra.indices;
  da.weights = ra.weights;
  da.H = H;
  da.I = I;
  da.E = E;
  da.k = k;
  da.out = out.data_as<uint16_t>();
  da.faults = ga.faults;

  // 4-bit experts run on the tensor-core kernels (mxfp4 / nvfp4: their kFp form), 8-bit ones on the
  // scalar kernels.
  const int proj_bits = quantized ? rt.proj.bits : 0;
  const bool fp_gate = gate.mode != QuantMode::affine, fp_down = ex.down.mode != QuantMode::affine;
  launch_router(D, proj_bits, ra, router_smem(T, H), stream, quantized && rt.proj.mode != QuantMode::affine,
                chain_router);
  if (gate.bits == 4)
    launch_gate_up_mma(D, gate.group_size, ex.activation, ga, gate_up_mma_smem(H, gate.group_size, fp_gate), stream,
                       fp_gate);
  else
    launch_gate_up_scalar(D, ex.activation, ga, gate_up_scalar_smem(T, H), stream);
  if (sc.down_groups) {  // per (plan group, 128 columns) into fp32 partials, then the slot-order combine
    DownGroupArgs dg{};
    dg.hidden = ga.hidden;
    dg.down = da.down;
    dg.plan = plan;
    dg.H = H;
    dg.I = I;
    dg.E = E;
    dg.faults = da.faults;
    dg.partials = static_cast<float*>(arena_at(base, sc.partials));
    launch_down_groups(D, ex.down.group_size, dg, ga.group_rows, down_groups_smem(I, ex.down.group_size, fp_down),
                       stream, fp_down);
    launch_slot_combine(D, da, dg.partials, T, stream);
  } else if (ex.down.bits == 4) {
    launch_down_mma(D, ex.down.group_size, da, T, down_mma_smem(k, I, ex.down.group_size, fp_down), stream, fp_down);
  } else {
    launch_down_scalar(D, da, T, down_scalar_smem(k, I), stream);
  }
}

}  // namespace expertqmm::cuda

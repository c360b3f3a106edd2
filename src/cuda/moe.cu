// The device MoE path: switch_glu and moe_layer_into (include/expertqmm/moe.h) as a fixed sequence
// of launches on the current stream, with no host synchronization and, once the workspace has grown
// to a size, no allocation, so that a call can be captured in a CUDA graph:
//   route(h) -> [T*k >= 64: stable sort of the (token, slot) rows by expert] -> gate/up gather_qmm
//   (separate, or one fused gate_up) -> GLU product -> down gather_qmm -> weighted combine read
//   through inv_order (moe_layer_into) or unsort (switch_glu).
// x is never copied: the gate/up GEMMs gather their x rows through lhs = token_of_row (order / k
// when sorted, b / k when not), which saves writing and re-reading a [T*k, D] copy of x (92 MB at
// T = 2048, k = 8, D = 2816) for the price of an index load per row inside the GEMM.
#include "cuda/cuda_backend.h"
#include "cuda/gather_qmm.h"
#include "cuda/gather_qmm_routes.h"
#include "cuda/gather_qmm_wgmma.h"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kSortThreshold = 64;  // mlx-lm SwitchGLU sorts when indices.size >= 64

// dst[i] = To(From(src[i])): (n) contiguous values. Work split: one thread per value, grid-stride.
template <DType From, DType To>
__global__ void cast_kernel(const typename Elem<From>::storage* __restrict__ src,
                            typename Elem<To>::storage* __restrict__ dst, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = Elem<To>::store(Elem<From>::load(src[i]));
}

// The same cast, 8 values per thread: (n8, 8) values, src and dst aligned to 8 values, so each
// thread moves them with 16-byte loads and stores (the layer's last step, the fp32 accumulator to
// the output dtype: 2-byte scalar stores ran at ~1.5 TB/s, bench/NOTES.md step 7b).
template <DType From, DType To>
__global__ void cast8_kernel(const typename Elem<From>::storage* __restrict__ src,
                             typename Elem<To>::storage* __restrict__ dst, int64_t n8) {
  using SF = typename Elem<From>::storage;
  using ST = typename Elem<To>::storage;
  struct alignas(8 * sizeof(SF)) In { SF v[8]; };
  struct alignas(8 * sizeof(ST)) Out { ST v[8]; };
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const In a = reinterpret_cast<const In*>(src)[i];
    Out b;
#pragma unroll
    for (int e = 0; e < 8; ++e) b.v[e] = Elem<To>::store(Elem<From>::load(a.v[e]));
    reinterpret_cast<Out*>(dst)[i] = b;
  }
}

// Dimensions and dtypes of one SwitchGLU call (validated by src/core/moe.cpp).
struct ExpertShape {
  int64_t T = 0, k = 0, n = 0, D = 0, I = 0, E = 0;
  bool fused = false, sorted = false;
  DType x_dtype = DType::bf16;
  DType gate_up_scales_dtype = DType::bf16;
  DType down_scales_dtype = DType::bf16;
  DType hidden_dtype = DType::bf16;  // gate/up outputs and the product: promote(x, gate/up scales)
  DType out_dtype = DType::bf16;     // down output: promote(hidden, down scales)
};

ExpertShape expert_shape(const Tensor& x, int64_t k, const SwitchGLUWeights& w) {
  ExpertShape s;
  s.T = x.size(0);
  s.D = x.size(1);
  s.k = k;
  s.n = s.T * k;
  s.fused = w.fused();
  const QuantizedWeight& first = s.fused ? w.gate_up : w.gate;
  s.E = first.w.size(0);
  s.I = s.fused ? first.w.size(1) / 2 : first.w.size(1);
  s.sorted = s.n >= kSortThreshold;
  s.x_dtype = x.dtype();
  s.gate_up_scales_dtype = first.scales.dtype();
  s.down_scales_dtype = w.down.scales.dtype();
  s.hidden_dtype = promote_floating(s.x_dtype, s.gate_up_scales_dtype);
  s.out_dtype = promote_floating(s.hidden_dtype, s.down_scales_dtype);
  EXPERTQMM_CHECK(s.n <= INT32_MAX && s.T <= INT32_MAX, "switch_glu", "T*k=", s.n, " rows exceed int32 indexing");
  return s;
}

// Scratch of one call, all in one workspace slot: offsets are planned first, then resolved.
struct ExpertScratch {
  // offsets (plan)
  size_t sorted_ids = 0, order = 0, positions = 0, inv_order = 0, token_of_row = 0, sort_temp = 0;
  size_t sort_temp_bytes = 0;
  size_t x_cast = 0, gate_up_out = 0, gate_out = 0, up_out = 0, intermediate = 0, hidden = 0, hidden_cast = 0;
  size_t y = 0;
  size_t gu_scales[2] = {0, 0}, gu_biases[2] = {0, 0}, down_scales = 0, down_biases = 0;
  bool cast_x = false, cast_gate_up = false, cast_hidden = false, cast_down = false, own_y = true;
  bool glu_fused = false;  // gate, up and the product in one launch (no gate_out / up_out)
  // moe_layer_into only: the down GEMM adds w * y into an fp32 (T, D) accumulator (no y buffer);
  // route_weights (T * k,) in out_dtype is set by the caller before run_experts.
  bool fused_combine = false;
  float* combine_acc_ptr = nullptr;  // (T, D) fp32
  const void* route_weights = nullptr;
  ProductMode mode = ProductMode::fused;  // read once per call: the plan and the launches agree
  void* base = nullptr;

  void* at(size_t off) const { return arena_at(base, off); }
  int32_t* i32(size_t off) const { return static_cast<int32_t*>(at(off)); }
};

size_t bytes_of(int64_t count, DType t) { return static_cast<size_t>(count) * dtype_size(t); }

// A device view of workspace memory.
Tensor view(void* p, const Shape& shape, DType dtype, const Shape& strides = {}) {
  return Tensor::view(p, shape, dtype, Device::cuda, strides);
}

// scales/biases of q in `dtype`: the weight's own tensors, or converted copies in the workspace.
void weight_params(const QuantizedWeight& q, DType dtype, bool cast, void* scales_dst, void* biases_dst,
                   cudaStream_t stream, Tensor& scales, Tensor& biases) {
  const Tensor s = q.scales.contiguous(), b = q.biases.contiguous();
  if (!cast) {
    scales = s;
    biases = b;
    return;
  }
  launch_cast(s.dtype(), s.data(), dtype, scales_dst, s.numel(), stream);
  launch_cast(b.dtype(), b.data(), dtype, biases_dst, b.numel(), stream);
  scales = view(scales_dst, s.shape(), dtype);
  biases = view(biases_dst, b.shape(), dtype);
}

// The gather_qmm problem over the n (token, slot) rows with M = 1: row b multiplies x row lhs[b]
// (lhs null: row b) by expert rhs[b]'s weight. x holds x_rows rows of K values, x_row_stride apart.
// plan: the layer's tile plan for rhs, or null.
detail::GatherQmmProblem expert_problem(const QuantizedWeight& q, const Tensor& scales, const Tensor& biases,
                                        DType dtype, void* x, int64_t x_rows, int64_t x_row_stride, int64_t K, int64_t N,
                                        int64_t n, int32_t* lhs, int32_t* rhs, bool sorted, const void* plan) {
  detail::GatherQmmProblem p;
  p.M = 1;
  p.N = N;
  p.K = K;
  p.bits = q.bits;
  p.group_size = q.group_size;
  p.transpose = true;
  p.sorted_indices = sorted;
  p.batch = {n};
  p.B = n;
  p.x_batch = x_rows;
  p.w_batch = q.w.size(0);
  p.dtype = dtype;
  p.device = Device::cuda;
  p.x = view(x, {x_rows, 1, K}, dtype, {x_row_stride, K, 1});
  p.x_batch_stride = x_row_stride;
  p.w = q.w.contiguous();
  p.scales = scales;
  p.biases = biases;
  p.lhs_is_identity = lhs == nullptr;
  if (lhs) p.lhs = view(lhs, {n}, DType::i32);
  p.rhs_is_identity = false;
  p.rhs = view(rhs, {n}, DType::i32);
  p.tile_plan = plan;
  return p;
}

// One tile plan per layer: the gate/up and down GEMMs share the sorted ids, so the plan is built
// once (on the stream, before the first GEMM) when the expert tile route takes the first GEMM.
const void* layer_tile_plan(const detail::GatherQmmProblem& first, Workspace& ws) {
  if (!first.sorted_indices || expert_tiles_setting() == RouteSwitch::off || !supports_expert_tiles(first).ok)
    return nullptr;
  return build_expert_tile_plan(first, ws);
}

// Whether run_experts will compute gate, up and the GLU product in one wgmma launch
// (gate_up_glu_expert_tiles), decided while planning so that the [n, I] gate and up buffers are
// not reserved then. Mirrors that function's checks on problems built from the real x and
// weights; the index pointers are placeholders (the checks never read them).
bool glu_fusion_applies(const ExpertShape& s, const SwitchGLUWeights& w, const Tensor& x, const ExpertScratch& sc) {
  if (!s.sorted || s.fused || sc.mode != ProductMode::fused || sc.cast_x || sc.cast_gate_up) return false;
  auto* placeholder = const_cast<int32_t*>(static_cast<const int32_t*>(x.data()));
  const int64_t x_stride = s.D > 1 ? x.stride(0) : s.D;
  const detail::GatherQmmProblem gate = expert_problem(w.gate, w.gate.scales.contiguous(), w.gate.biases.contiguous(),
                                                       s.hidden_dtype, x.data(), s.T, x_stride, s.D, s.I, s.n,
                                                       placeholder, placeholder, true, nullptr);
  const detail::GatherQmmProblem up = expert_problem(w.up, w.up.scales.contiguous(), w.up.biases.contiguous(),
                                                     s.hidden_dtype, x.data(), s.T, x_stride, s.D, s.I, s.n,
                                                     placeholder, placeholder, true, nullptr);
  return gate_up_glu_fits(gate, up);
}

// Whether the down GEMM can carry the weighted combine (down_combine_expert_tiles): not in
// deterministic mode, sorted rows, no dtype casts on the way, route weights in the output dtype
// (checked by the caller). The down problem's x is the hidden buffer in this arena; the placeholder
// stands for it (256-byte aligned, as every arena piece; the checks read only pointer alignment).
bool combine_fusion_applies(const ExpertShape& s, const SwitchGLUWeights& w, const ExpertScratch& sc) {
  if (deterministic() || !s.sorted || sc.cast_hidden || sc.cast_down || s.out_dtype != s.hidden_dtype) return false;
  void* arena_placeholder = reinterpret_cast<void*>(uintptr_t{ArenaLayout::kAlign});
  auto* ids_placeholder = static_cast<int32_t*>(arena_placeholder);
  const detail::GatherQmmProblem down =
      expert_problem(w.down, w.down.scales.contiguous(), w.down.biases.contiguous(), s.out_dtype, arena_placeholder,
                     s.n, s.I, s.I, s.D, s.n, nullptr, ids_placeholder, true, nullptr);
  return down_combine_fits(down);
}

// Reserves everything the expert half needs. own_y = false: the caller provides y's memory.
// x: the layer input (its pointer and strides decide whether the fused gate/up/GLU kernel applies).
// try_fused_combine: the caller can hand the down GEMM its route weights (moe_layer_into).
void plan_expert_scratch(const ExpertShape& s, const SwitchGLUWeights& w, const Tensor& x, bool ids_unsigned,
                         bool own_y, bool try_fused_combine, ArenaLayout& layout, ExpertScratch& sc) {
  const int64_t n = s.n;
  sc.token_of_row = layout.reserve(bytes_of(n, DType::i32));
  if (s.sorted) {
    sc.sorted_ids = layout.reserve(bytes_of(n, DType::i32));
    sc.order = layout.reserve(bytes_of(n, DType::i32));
    sc.positions = layout.reserve(bytes_of(n, DType::i32));
    sc.inv_order = layout.reserve(bytes_of(n, DType::i32));
    sc.sort_temp_bytes = sort_temp_bytes(n, ids_unsigned);
    sc.sort_temp = layout.reserve(sc.sort_temp_bytes);
  }
  sc.cast_x = s.x_dtype != s.hidden_dtype;
  if (sc.cast_x) sc.x_cast = layout.reserve(bytes_of(s.T * s.D, s.hidden_dtype));
  sc.cast_gate_up = s.gate_up_scales_dtype != s.hidden_dtype;
  if (sc.cast_gate_up) {
    const QuantizedWeight* parts[2] = {s.fused ? &w.gate_up : &w.gate, s.fused ? nullptr : &w.up};
    for (int i = 0; i < 2; ++i) {
      if (!parts[i]) continue;
      sc.gu_scales[i] = layout.reserve(bytes_of(parts[i]->scales.numel(), s.hidden_dtype));
      sc.gu_biases[i] = layout.reserve(bytes_of(parts[i]->biases.numel(), s.hidden_dtype));
    }
  }
  sc.mode = product_mode();
  sc.glu_fused = glu_fusion_applies(s, w, x, sc);
  if (s.fused) {
    sc.gate_up_out = layout.reserve(bytes_of(n * 2 * s.I, s.hidden_dtype));
  } else if (!sc.glu_fused) {  // the fused kernel never materializes gate and up
    sc.gate_out = layout.reserve(bytes_of(n * s.I, s.hidden_dtype));
    sc.up_out = layout.reserve(bytes_of(n * s.I, s.hidden_dtype));
  }
  if (sc.mode == ProductMode::separate) sc.intermediate = layout.reserve(bytes_of(n * s.I, s.hidden_dtype));
  sc.hidden = layout.reserve(bytes_of(n * s.I, s.hidden_dtype));
  sc.cast_hidden = s.hidden_dtype != s.out_dtype;
  if (sc.cast_hidden) sc.hidden_cast = layout.reserve(bytes_of(n * s.I, s.out_dtype));
  sc.cast_down = s.down_scales_dtype != s.out_dtype;
  if (sc.cast_down) {
    sc.down_scales = layout.reserve(bytes_of(w.down.scales.numel(), s.out_dtype));
    sc.down_biases = layout.reserve(bytes_of(w.down.biases.numel(), s.out_dtype));
  }
  sc.fused_combine = try_fused_combine && combine_fusion_applies(s, w, sc);
  sc.own_y = own_y && !sc.fused_combine;
  if (sc.own_y) sc.y = layout.reserve(bytes_of(n * s.D, s.out_dtype));
  // The fused combine's fp32 accumulator is not in this arena: the caller puts it in the router's
  // slot, whose contents are dead once the routing is written (sc.combine_acc_ptr).
}

// The expert half: y [n, D] in out_dtype holds row b = (token, slot) in sorted order when s.sorted
// (then inv_order maps flat slot -> y row), else in flat slot order. ids: [n] flat expert ids.
struct ExpertResult {
  void* y = nullptr;
  const int32_t* inv_order = nullptr;  // null when unsorted
};

ExpertResult run_experts(const ExpertShape& s, const Tensor& x, const int32_t* ids, bool ids_unsigned,
                         const SwitchGLUWeights& w, const ExpertScratch& sc, void* y_out, Workspace& ws) {
  cudaStream_t stream = current_stream();
  const int64_t n = s.n;
  int32_t* token_of_row = sc.i32(sc.token_of_row);
  int32_t* rhs = const_cast<int32_t*>(ids);
  if (s.sorted) {
    // Arbitrary user ids still give a permutation (out-of-range ids fault in the GEMMs); ids from
    // [0, E) need only id_bits(E) key bits.
    launch_sort_rows(ids, n, static_cast<int>(s.k), ids_unsigned, id_bits(s.E), sc.i32(sc.sorted_ids), sc.i32(sc.order),
                     sc.i32(sc.positions), sc.i32(sc.inv_order), token_of_row, sc.at(sc.sort_temp), sc.sort_temp_bytes,
                     stream);
    rhs = sc.i32(sc.sorted_ids);
  } else {
    launch_token_of_row(token_of_row, n, static_cast<int>(s.k), stream);
  }

  void* x_rows = x.data();
  int64_t x_stride = s.D > 1 ? x.stride(0) : s.D;
  if (sc.cast_x) {
    x_rows = sc.at(sc.x_cast);
    const Tensor xc = x.contiguous();
    launch_cast(s.x_dtype, xc.data(), s.hidden_dtype, x_rows, s.T * s.D, stream);
    x_stride = s.D;
  }

  // gate/up (mlx-lm order: up first, then gate) -> product
  void* hidden = sc.at(sc.hidden);
  const void* plan = nullptr;  // the layer's tile plan, shared by every GEMM below
  void* intermediate = sc.mode == ProductMode::separate ? sc.at(sc.intermediate) : nullptr;
  if (s.fused) {
    Tensor scales, biases;
    weight_params(w.gate_up, s.hidden_dtype, sc.cast_gate_up, sc.at(sc.gu_scales[0]), sc.at(sc.gu_biases[0]), stream,
                  scales, biases);
    void* gate_up = sc.at(sc.gate_up_out);  // [n, 2I]: gate columns [0, I), up columns [I, 2I)
    detail::GatherQmmProblem p = expert_problem(w.gate_up, scales, biases, s.hidden_dtype, x_rows, s.T, x_stride, s.D,
                                                2 * s.I, n, token_of_row, rhs, s.sorted, nullptr);
    plan = p.tile_plan = layer_tile_plan(p, ws);
    gather_qmm_into(p, gate_up, &ws);
    const char* up = static_cast<const char*>(gate_up) + bytes_of(s.I, s.hidden_dtype);
    launch_glu_product(w.activation, sc.mode, s.hidden_dtype, gate_up, up, n, s.I, 2 * s.I, hidden,
                       intermediate, stream);
  } else {
    Tensor up_scales, up_biases, gate_scales, gate_biases;
    weight_params(w.up, s.hidden_dtype, sc.cast_gate_up, sc.at(sc.gu_scales[1]), sc.at(sc.gu_biases[1]), stream,
                  up_scales, up_biases);
    weight_params(w.gate, s.hidden_dtype, sc.cast_gate_up, sc.at(sc.gu_scales[0]), sc.at(sc.gu_biases[0]), stream,
                  gate_scales, gate_biases);
    detail::GatherQmmProblem up_p = expert_problem(w.up, up_scales, up_biases, s.hidden_dtype, x_rows, s.T, x_stride,
                                                   s.D, s.I, n, token_of_row, rhs, s.sorted, nullptr);
    detail::GatherQmmProblem gate_p = expert_problem(w.gate, gate_scales, gate_biases, s.hidden_dtype, x_rows, s.T,
                                                     x_stride, s.D, s.I, n, token_of_row, rhs, s.sorted, nullptr);
    plan = up_p.tile_plan = gate_p.tile_plan = layer_tile_plan(up_p, ws);
    // Fused product mode on Hopper: gate, up and the GLU product in one launch, no [n, I] gate/up
    // intermediates (decided when planning). Otherwise the two GEMMs, then the product kernel(s).
    if (sc.glu_fused) {
      EXPERTQMM_CHECK(gate_up_glu_expert_tiles(gate_p, up_p, w.activation, hidden), "switch_glu",
                      "the fused gate/up/GLU kernel was planned but does not take ", gate_p.describe());
    } else {
      void* up = sc.at(sc.up_out);
      void* gate = sc.at(sc.gate_out);
      gather_qmm_into(up_p, up, &ws);
      gather_qmm_into(gate_p, gate, &ws);
      launch_glu_product(w.activation, sc.mode, s.hidden_dtype, gate, up, n, s.I, s.I, hidden, intermediate,
                         stream);
    }
  }

  // down: row b of hidden (already in row order) times expert rhs[b]
  void* down_in = hidden;
  if (sc.cast_hidden) {
    down_in = sc.at(sc.hidden_cast);
    launch_cast(s.hidden_dtype, hidden, s.out_dtype, down_in, n * s.I, stream);
  }
  Tensor down_scales, down_biases;
  weight_params(w.down, s.out_dtype, sc.cast_down, sc.at(sc.down_scales), sc.at(sc.down_biases), stream, down_scales,
                down_biases);
  ExpertResult r;
  const detail::GatherQmmProblem down =
      expert_problem(w.down, down_scales, down_biases, s.out_dtype, down_in, n, s.I, s.I, s.D, n, nullptr, rhs, s.sorted,
                     plan);
  if (sc.fused_combine) {
    // acc[t] = sum over the token's slots of w * y, added inside the down GEMM.
    float* acc = sc.combine_acc_ptr;
    EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(acc, 0, bytes_of(s.T * s.D, DType::f32), stream));
    EXPERTQMM_CHECK(down_combine_expert_tiles(down, sc.i32(sc.order), sc.route_weights, static_cast<int>(s.k), acc),
                    "moe_layer_into", "the down GEMM with the combine was planned but does not take ",
                    down.describe());
    return r;
  }
  r.y = sc.own_y ? sc.at(sc.y) : y_out;
  gather_qmm_into(down, r.y, &ws);
  r.inv_order = s.sorted ? sc.i32(sc.inv_order) : nullptr;
  return r;
}

// Flat int32 view of [T, k] ids (uint32 ids keep their bits: >= 2^31 reads as negative, out of range).
const int32_t* flat_ids(const Tensor& indices) {
  EXPERTQMM_CHECK(indices.is_contiguous(), "switch_glu", "indices must be contiguous, got ", indices.describe());
  return indices.data_as<const int32_t>();
}

}  // namespace

void launch_cast(DType from, const void* src, DType to, void* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  dispatch_float(from, "cast", [&](auto ftag) {
    constexpr DType F = decltype(ftag)::value;
    dispatch_float(to, "cast", [&](auto ttag) {
      constexpr DType D = decltype(ttag)::value;
      using SF = typename Elem<F>::storage;
      using SD = typename Elem<D>::storage;
      const bool vector = n % 8 == 0 && reinterpret_cast<uintptr_t>(src) % (8 * sizeof(SF)) == 0 &&
                          reinterpret_cast<uintptr_t>(dst) % (8 * sizeof(SD)) == 0;
      const int64_t items = vector ? n / 8 : n;
      const int64_t blocks = (items + kThreads - 1) / kThreads;
      const unsigned grid = static_cast<unsigned>(blocks > 1048576 ? 1048576 : blocks);
      if (vector) {
        cast8_kernel<F, D><<<grid, kThreads, 0, stream>>>(static_cast<const SF*>(src), static_cast<SD*>(dst), items);
        EXPERTQMM_CUDA_CHECK_LAUNCH(cast8_kernel);
      } else {
        cast_kernel<F, D><<<grid, kThreads, 0, stream>>>(static_cast<const SF*>(src), static_cast<SD*>(dst), n);
        EXPERTQMM_CUDA_CHECK_LAUNCH(cast_kernel);
      }
    });
  });
}

Tensor switch_glu(const Tensor& x, const Tensor& indices, const SwitchGLUWeights& weights) {
  EXPERTQMM_CHECK(x.device() == Device::cuda && indices.device() == Device::cuda, "switch_glu",
                  "cuda::switch_glu needs device tensors, got x ", x.describe(), " and indices ", indices.describe());
  EXPERTQMM_CHECK(x.ndim() == 2 && indices.ndim() == 2 && indices.size(0) == x.size(0), "switch_glu",
                  "expected x [T, D] and indices [T, k], got x ", x.describe(), " and indices ", indices.describe());
  const Tensor xc = x.contiguous();
  const ExpertShape s = expert_shape(xc, indices.size(1), weights);
  Tensor out = Tensor::empty({s.T, s.k, s.D}, s.out_dtype, Device::cuda);
  if (s.n == 0 || s.D == 0) return out;
  const Tensor ids = indices.contiguous();
  const bool ids_unsigned = ids.dtype() == DType::u32;

  Workspace ws;  // the allocating public path: scratch for this call only
  ArenaLayout layout;
  ExpertScratch sc;
  // Unsorted rows are already in (token, slot) order: the down GEMM writes straight into out.
  plan_expert_scratch(s, weights, xc, ids_unsigned, /*own_y=*/s.sorted, /*try_fused_combine=*/false, layout, sc);
  sc.base = ws.get(detail::kSlotLayerArena, layout.bytes());
  const ExpertResult r = run_experts(s, xc, flat_ids(ids), ids_unsigned, weights, sc, out.data(), ws);
  if (s.sorted) {
    const int64_t row_bytes = static_cast<int64_t>(bytes_of(s.D, s.out_dtype));
    // out row i = y row inv_order[i]
    launch_gather_rows(r.y, s.n, row_bytes, r.inv_order, 1, s.n, row_bytes, out.data(), current_stream());
  }
  return out;
}

void moe_layer_into(Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& weights, Workspace& ws) {
  const char* op = "moe_layer_into";
  EXPERTQMM_CHECK(out.device() == Device::cuda && h.device() == Device::cuda && x.device() == Device::cuda, op,
                  "cuda::moe_layer_into needs device tensors, got out ", out.describe(), ", h ", h.describe(), ", x ",
                  x.describe());
  EXPERTQMM_CHECK(x.ndim() == 2 && h.ndim() == 2 && h.size(0) == x.size(0) && (x.size(1) <= 1 || x.stride(1) == 1),
                  op, "expected h and x [T, H] with contiguous rows, got h ", h.describe(), " and x ", x.describe());
  const int k = weights.router.top_k;
  const ExpertShape s = expert_shape(x, k, weights.experts);
  EXPERTQMM_CHECK(out.is_contiguous() && out.shape() == (Shape{s.T, s.D}), op, "out must be contiguous [", s.T, ", ",
                  s.D, "], got ", out.describe());
  if (s.n == 0 || s.D == 0) return;
  // Decode sizes: the whole layer in three kernels (moe_decode.cu) when it supports the call.
  if (use_decode_layer(out, h, x, weights)) return call_decode_layer(out, h, x, weights, ws);

  // One arena for the routing outputs and every expert buffer (grow-only: a warmed-up workspace
  // serves any call at the same or a smaller size without allocating).
  ArenaLayout layout;
  const size_t indices_off = layout.reserve(bytes_of(s.n, DType::i32));
  const size_t weights_off = layout.reserve(bytes_of(s.n, h.dtype()));
  ExpertScratch sc;
  plan_expert_scratch(s, weights.experts, x, /*ids_unsigned=*/false, /*own_y=*/true,
                      /*try_fused_combine=*/h.dtype() == s.out_dtype, layout, sc);
  sc.base = ws.get(detail::kSlotLayerArena, layout.bytes());
  int32_t* route_indices = sc.i32(indices_off);
  void* route_weights = sc.at(weights_off);
  sc.route_weights = route_weights;
  if (sc.fused_combine)  // before route_into, which then reuses the (larger) slot for its scratch
    sc.combine_acc_ptr = static_cast<float*>(ws.get(detail::kSlotRouterArena, bytes_of(s.T * s.D, DType::f32)));

  route_into(h, weights.router, route_indices, route_weights, ws);
  const ExpertResult r = run_experts(s, x, route_indices, /*ids_unsigned=*/false, weights.experts, sc, nullptr, ws);
  if (sc.fused_combine) {  // the down GEMM summed into the fp32 accumulator: one rounding to out
    launch_cast(DType::f32, sc.combine_acc_ptr, out.dtype(), out.data(), s.T * s.D, current_stream());
    return;
  }
  // Combine in token order, reading the down output in sorted order through inv_order.
  launch_weighted_combine(s.out_dtype, r.y, s.n, r.inv_order, h.dtype(), route_weights, out.dtype(), out.data(), s.T,
                          s.k, s.D, current_stream());
}

}  // namespace expertqmm::cuda

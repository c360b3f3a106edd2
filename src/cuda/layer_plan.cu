// The layer plan (layer_plan.h): every decision of an MoE layer call on CUDA, made here once.
#include "cuda/layer_plan.h"

#include <algorithm>
#include <atomic>

#include "core/route_counters.h"
#include "cuda/gather_qmm.h"
#include "cuda/gather_qmm_wgmma.h"
#include "cuda/layer_plan_hooks.h"
#include "cuda/tile_plan.cuh"

namespace expertqmm::cuda {

namespace {

constexpr int64_t kSortThreshold = 64;  // mlx-lm SwitchGLU sorts when indices.size >= 64

size_t bytes_of(int64_t count, DType t) { return static_cast<size_t>(count) * dtype_size(t); }

// The most bytes of down output the layer holds at once before it runs down and the combine per
// column window: [n, D] would be 92 MB at T = 2048 (Gemma 4), a 768-column window 25 MB, which
// keeps the layer's scratch under 64 MB and a window's output in the L2 until the combine reads it
// (bench/NOTES.md step 46).
constexpr size_t kDownWindowBytes = size_t{24} << 20;
std::atomic<size_t> g_down_window_bytes{0};  // set_down_window_bytes (tests); 0: the setting's
// The cap in force: the tests' hook, else EXPERTQMM_DOWN_WINDOW_MIB, else kDownWindowBytes.
size_t down_window_cap() {
  const size_t v = g_down_window_bytes.load(std::memory_order_relaxed);
  if (v) return v;
  const int mib = down_window_mib();
  return mib ? size_t(mib) << 20 : kDownWindowBytes;
}

// Output columns per down window for an [n, D] output of `dtype`: 0 when it fits the cap
// (kDownWindowBytes) whole, else the widest multiple of kTileColumnsAlign (at least one) whose window fits it.
int64_t down_window_cols(int64_t n, int64_t D, DType dtype) {
  const size_t cap = down_window_cap();
  if (bytes_of(n * D, dtype) <= cap) return 0;
  const int64_t fit = static_cast<int64_t>(cap / bytes_of(n, dtype));
  const int64_t cols = std::max<int64_t>(kTileColumnsAlign, fit / kTileColumnsAlign * kTileColumnsAlign);
  return cols < D ? cols : 0;
}

// The bytes of y that moe_layer_into asks of the router's slot: the whole [n, D] up to
// the cap (kDownWindowBytes), past it the cap (or one narrowest window, if larger). Non-decreasing in n,
// whatever the window's own size, so the slot never grows at a smaller call.
size_t y_request_bytes(int64_t n, int64_t D, DType dtype, int64_t window_cols) {
  const size_t whole = bytes_of(n * D, dtype);
  if (window_cols == 0) return whole;
  return std::max(down_window_cap(), bytes_of(n * kTileColumnsAlign, dtype));
}

Tensor view(void* p, const Shape& shape, DType dtype, const Shape& strides = {}) {
  return Tensor::view(p, shape, dtype, Device::cuda, strides);
}

// The arena piece at `offset` from `base`.
void* at(void* base, size_t offset) { return static_cast<char*>(base) + offset; }
int32_t* i32_at(void* base, size_t offset) { return static_cast<int32_t*>(at(base, offset)); }

// A nominal arena base for planning: as aligned as any real one (ArenaLayout::kAlign).
void* nominal_base() { return reinterpret_cast<void*>(uintptr_t{ArenaLayout::kAlign}); }

// An fp-mode weight (mxfp4, mxfp8, nvfp4): uint8 scale codes, no biases, computed in x's dtype; the
// plan never casts its parameters, and the fusions stay affine (the tile routes take its plain GEMMs,
// down windows included).
bool fp_mode(const QuantizedWeight& q) { return q.defined() && q.mode != QuantMode::affine; }

// The dtype a quantized projection promotes its input with: its scales' (affine), the input's (fp).
DType param_dtype(const QuantizedWeight& q, DType in) { return fp_mode(q) ? in : q.scales.dtype(); }

// scales/biases of q as a GEMM reads them: the weight's own, or the arena's copies cast to the
// problem's dtype (offsets s_off / b_off).
void gemm_params(const QuantizedWeight& q, bool cast, DType dtype, void* base, size_t s_off, size_t b_off,
                 Tensor& scales, Tensor& biases) {
  if (!q.defined()) {  // a 16-bit projection: no parameters
    scales = biases = Tensor();
    return;
  }
  if (fp_mode(q)) {
    scales = q.scales.contiguous();
    biases = Tensor();
    return;
  }
  if (!cast) {
    scales = q.scales.contiguous();
    biases = q.biases.contiguous();
    return;
  }
  scales = view(at(base, s_off), q.scales.shape(), dtype);
  biases = view(at(base, b_off), q.biases.shape(), dtype);
}

// The fields gather_qmm's and gather_mm's problems share for the n (token, slot) rows with M = 1:
// row b multiplies x row lhs[b] (lhs null: row b) by expert rhs[b]'s weight, one of w_batch. x holds
// x_rows rows of K values, x_row_stride apart.
template <class Problem>
Problem gathered_rows_problem(DType dtype, void* x, int64_t x_rows, int64_t x_row_stride, int64_t K, int64_t N,
                              int64_t n, int32_t* lhs, int32_t* rhs, bool sorted, const void* plan, int64_t w_batch) {
  Problem p;
  p.M = 1;
  p.N = N;
  p.K = K;
  p.sorted_indices = sorted;
  p.batch = {n};
  p.B = n;
  p.x_batch = x_rows;
  p.w_batch = w_batch;
  p.dtype = dtype;
  p.device = Device::cuda;
  p.x = view(x, {x_rows, 1, K}, dtype, {x_row_stride, K, 1});
  p.x_batch_stride = x_row_stride;
  p.lhs_is_identity = lhs == nullptr;
  if (lhs) p.lhs = view(lhs, {n}, DType::i32);
  p.rhs_is_identity = false;
  p.rhs = view(rhs, {n}, DType::i32);
  p.tile_plan = plan;
  return p;
}

// The gather_qmm problem of those rows for the quantized weight q (scales/biases as the GEMM reads them).
detail::GatherQmmProblem quantized_problem(const QuantizedWeight& q, const Tensor& scales, const Tensor& biases,
                                        DType dtype, void* x, int64_t x_rows, int64_t x_row_stride, int64_t K, int64_t N,
                                        int64_t n, int32_t* lhs, int32_t* rhs, bool sorted, const void* plan) {
  auto p = gathered_rows_problem<detail::GatherQmmProblem>(dtype, x, x_rows, x_row_stride, K, N, n, lhs, rhs, sorted,
                                                           plan, q.w.size(0));
  p.bits = q.bits;
  p.group_size = q.group_size;
  p.mode = q.mode;
  p.transpose = true;
  p.w = q.w.contiguous();
  p.scales = scales;
  p.biases = biases;
  if (scales.data() == q.scales.data()) p.tiled = q.tiled;  // not when the GEMM reads cast parameters
  return p;
}

// One projection's GEMM: quantized (q, with scales/biases as the GEMM reads them) or 16-bit (dense).
LayerGemm expert_gemm(const QuantizedWeight& q, const Tensor& dense, const Tensor& scales, const Tensor& biases,
                      DType dtype, void* x, int64_t x_rows, int64_t x_row_stride, int64_t K, int64_t N, int64_t n,
                      int32_t* lhs, int32_t* rhs, bool sorted, const void* plan) {
  LayerGemm g;
  g.dense = dense.defined();
  if (g.dense) g.mm = dense_problem(dense, dtype, x, x_rows, x_row_stride, K, N, n, lhs, rhs, sorted, plan);
  else g.q = quantized_problem(q, scales, biases, dtype, x, x_rows, x_row_stride, K, N, n, lhs, rhs, sorted, plan);
  return g;
}

// Reserves the buffers every experts-path plan has, whatever the fusions: the routing outputs (when
// the layer routes), the sort, the casts, the hidden rows.
void reserve_fixed(LayerPlan& p, const SwitchGLUWeights& w, bool routes, DType route_weight_dtype,
                   ArenaLayout& layout) {
  const ExpertShape& s = p.shape;
  ExpertScratch& sc = p.scratch;
  if (routes) {
    sc.route_indices = layout.reserve(bytes_of(s.n, DType::i32));
    sc.route_weights = layout.reserve(bytes_of(s.n, route_weight_dtype));
  }
  sc.token_of_row = layout.reserve(bytes_of(s.n, DType::i32));
  if (s.sorted) {
    const RouteSwitch grouping = group_rows_setting();
    p.group_rows = group_rows_fits(s.n, s.E) && grouping != RouteSwitch::off;
    // Past the one CTA's measured range: the grid form (three launches) and its scratch.
    p.group_rows_grid = p.group_rows && s.n > kGroupRowsOneCtaMaxRows;
    if (p.group_rows_grid) sc.group_rows_scratch = layout.reserve(group_rows_grid_scratch_bytes(s.n, s.E));
    sc.sorted_ids = layout.reserve(bytes_of(s.n, DType::i32));
    sc.inv_order = layout.reserve(bytes_of(s.n, DType::i32));
    if (!p.group_rows) {  // CUB's sort: its values in and out, and its temporary storage
      sc.order = layout.reserve(bytes_of(s.n, DType::i32));
      sc.positions = layout.reserve(bytes_of(s.n, DType::i32));
      sc.sort_temp_bytes = sort_temp_bytes(s.n, p.ids_unsigned);
      sc.sort_temp = layout.reserve(sc.sort_temp_bytes);
    }
  }
  p.cast_x = s.x_dtype != s.hidden_dtype;
  if (p.cast_x) sc.x_cast = layout.reserve(bytes_of(s.T * s.D, s.hidden_dtype));
  // Quantized gate/up parts read scales and biases in hidden_dtype: when one part's differ, every
  // quantized part gets a cast copy (16-bit parts read their weight widened, with no copy).
  const QuantizedWeight* parts[2] = {s.fused ? &w.gate_up : &w.gate, s.fused ? nullptr : &w.up};
  for (const QuantizedWeight* q : parts)
    if (q && q->defined() && !fp_mode(*q) && q->scales.dtype() != s.hidden_dtype) p.cast_gate_up = true;
  if (p.cast_gate_up) {
    for (int i = 0; i < 2; ++i) {
      if (!parts[i] || !parts[i]->defined() || fp_mode(*parts[i])) continue;
      sc.gu_scales[i] = layout.reserve(bytes_of(parts[i]->scales.numel(), s.hidden_dtype));
      sc.gu_biases[i] = layout.reserve(bytes_of(parts[i]->biases.numel(), s.hidden_dtype));
    }
  }
  sc.hidden = layout.reserve(bytes_of(s.n * s.I, s.hidden_dtype));
  p.cast_hidden = s.hidden_dtype != s.out_dtype;
  if (p.cast_hidden) sc.hidden_cast = layout.reserve(bytes_of(s.n * s.I, s.out_dtype));
  p.cast_down = !s.down_dense && !fp_mode(w.down) && w.down.scales.dtype() != s.out_dtype;
  if (p.cast_down) {
    sc.down_scales = layout.reserve(bytes_of(w.down.scales.numel(), s.out_dtype));
    sc.down_biases = layout.reserve(bytes_of(w.down.biases.numel(), s.out_dtype));
  }
}

// Picks every GEMM's route (the selector counts each once), the tile plan and the fusions, then
// reserves what they need. x: the layer input; ids: see layer_gemms. combines: the caller combines
// the down output per token (moe_layer_into), so it may run in column windows. own_y: the down
// output needs an arena buffer (not when the caller's output takes it as it is).
void plan_experts(LayerPlan& p, const Tensor& x, const int32_t* ids, const SwitchGLUWeights& w, bool combines,
                  bool own_y, ArenaLayout& layout) {
  const ExpertShape& s = p.shape;
  p.mode = product_mode();  // read once: the plan and the launches agree
  LayerGemms g = layer_gemms(p, x, ids, w, nominal_base());
  // The selector's choice for each GEMM, in mlx-lm's order (up, gate, down). The GEMMs of one layer
  // share their sorted ids, so when the tile route takes the first, one plan serves them all.
  // The tile plan (quantized and 16-bit tile routes read the same format) is built when the first
  // GEMM takes a tile route; the fusions exist only for quantized GEMMs.
  if (s.fused) {
    p.gate_up_route = select_layer_route(g.gate_up);
    p.tiles = p.gate_up_route.on_tiles();
  } else {
    p.up_route = select_layer_route(g.up);
    p.gate_route = select_layer_route(g.gate);
    p.tiles = p.up_route.on_tiles();
    p.glu_fused = p.mode == ProductMode::fused && !s.gate_dense && !s.up_dense && !p.cast_x && !p.cast_gate_up &&
                  p.tiles && p.gate_route.on_tiles() && gate_up_glu_fits(g.gate.q, g.up.q);
  }
  p.down_route = select_layer_route(g.down);
  if (p.glu_fused) p.up_route = p.gate_route = GemmRoute{};

  ExpertScratch& sc = p.scratch;
  if (p.tiles) sc.tile_plan = layout.reserve(tile_plan_bytes(s.n, static_cast<int>(s.E)));
  if (s.fused) {
    sc.gate_up_out = layout.reserve(bytes_of(s.n * 2 * s.I, s.hidden_dtype));
  } else if (!p.glu_fused) {  // the fused kernel never materializes gate and up
    sc.gate_out = layout.reserve(bytes_of(s.n * s.I, s.hidden_dtype));
    sc.up_out = layout.reserve(bytes_of(s.n * s.I, s.hidden_dtype));
  }
  if (p.mode == ProductMode::separate) sc.intermediate = layout.reserve(bytes_of(s.n * s.I, s.hidden_dtype));
  // Windows need the expert tile route for down (launch_expert_tiles_columns) and the shared plan.
  if (combines && s.sorted && !s.down_dense && p.tiles && p.down_route.on_tiles())
    p.down_window_cols = down_window_cols(s.n, s.D, s.out_dtype);
  // moe_layer_into's down output (one window or whole) goes into the router's slot, dead once the
  // routing is written: the layer then holds its hidden rows and one window (~61 MB at T = 2048 with
  // the workspace's growth margin). plan_moe_layer sizes the slot.
  if (own_y && !combines) sc.y = layout.reserve(bytes_of(s.n * s.D, s.out_dtype));
}

}  // namespace

detail::GatherMmProblem dense_problem(const Tensor& w, DType dtype, void* x, int64_t x_rows, int64_t x_row_stride,
                                      int64_t K, int64_t N, int64_t n, int32_t* lhs, int32_t* rhs, bool sorted,
                                      const void* plan) {
  auto p = gathered_rows_problem<detail::GatherMmProblem>(dtype, x, x_rows, x_row_stride, K, N, n, lhs, rhs, sorted,
                                                          plan, w.size(0));
  p.w = w.swapaxes(-1, -2);
  p.w_batch_stride = w.stride(0);
  p.w_stride_k = w.stride(2);
  p.w_stride_n = w.stride(1);
  return p;
}

ExpertShape expert_shape(const Tensor& x, int64_t k, const SwitchGLUWeights& w) {
  ExpertShape s;
  s.T = x.size(0);
  s.D = x.size(1);
  s.k = k;
  s.n = s.T * k;
  s.fused = w.fused();
  s.gate_dense = s.fused ? w.gate_up_dense.defined() : w.gate_dense.defined();
  s.up_dense = s.fused ? s.gate_dense : w.up_dense.defined();
  s.down_dense = w.down_dense.defined();
  const QuantizedWeight& first = s.fused ? w.gate_up : w.gate;
  const Tensor& first_dense = s.fused ? w.gate_up_dense : w.gate_dense;
  // A quantized projection widens x by its scales, a 16-bit one by its weight (the front checked
  // that gate and up agree).
  const Tensor& first_w = s.gate_dense ? first_dense : first.w;
  s.E = first_w.size(0);
  s.I = s.fused ? first_w.size(1) / 2 : first_w.size(1);
  s.sorted = s.n >= kSortThreshold;
  s.x_dtype = x.dtype();
  s.hidden_dtype = promote_floating(s.x_dtype, s.gate_dense ? first_dense.dtype() : param_dtype(first, s.x_dtype));
  s.out_dtype =
      promote_floating(s.hidden_dtype, s.down_dense ? w.down_dense.dtype() : param_dtype(w.down, s.hidden_dtype));
  EXPERTQMM_CHECK(s.n <= INT32_MAX && s.T <= INT32_MAX, "switch_glu", "T*k=", s.n, " rows exceed int32 indexing");
  return s;
}

GemmRoute select_layer_route(const LayerGemm& g) {
  GemmRoute r;
  if (g.dense) r.mm = &select_gather_mm_route(g.mm);
  else r.qmm = &select_gather_qmm_route(g.q);
  return r;
}

void run_layer_gemm(const GemmRoute& route, const LayerGemm& g, void* out, Workspace* ws) {
  EXPERTQMM_CHECK(g.dense ? route.mm != nullptr : route.qmm != nullptr, "moe_layer", "the layer plan gave a ",
                  g.dense ? "16-bit" : "quantized", " GEMM no route");
  if (g.dense) run_gather_mm_route(*route.mm, g.mm, out, ws);
  else run_gather_qmm_route(*route.qmm, g.q, out, ws);
}

LayerGemms layer_gemms(const LayerPlan& p, const Tensor& x, const int32_t* ids, const SwitchGLUWeights& w,
                       void* base) {
  const ExpertShape& s = p.shape;
  const ExpertScratch& sc = p.scratch;
  int32_t* token_of_row = i32_at(base, sc.token_of_row);
  int32_t* rhs = s.sorted ? i32_at(base, sc.sorted_ids)
                          : ids ? const_cast<int32_t*>(ids) : i32_at(base, sc.route_indices);
  void* x_rows = p.cast_x ? at(base, sc.x_cast) : x.data();
  const int64_t x_stride = p.cast_x || s.D <= 1 ? s.D : x.stride(0);
  const void* plan = p.tiles ? at(base, sc.tile_plan) : nullptr;
  LayerGemms g;
  Tensor scales, biases;
  if (s.fused) {
    gemm_params(w.gate_up, p.cast_gate_up, s.hidden_dtype, base, sc.gu_scales[0], sc.gu_biases[0], scales, biases);
    g.gate_up = expert_gemm(w.gate_up, w.gate_up_dense, scales, biases, s.hidden_dtype, x_rows, s.T, x_stride, s.D,
                            2 * s.I, s.n, token_of_row, rhs, s.sorted, plan);
  } else {
    gemm_params(w.up, p.cast_gate_up, s.hidden_dtype, base, sc.gu_scales[1], sc.gu_biases[1], scales, biases);
    g.up = expert_gemm(w.up, w.up_dense, scales, biases, s.hidden_dtype, x_rows, s.T, x_stride, s.D, s.I, s.n,
                       token_of_row, rhs, s.sorted, plan);
    gemm_params(w.gate, p.cast_gate_up, s.hidden_dtype, base, sc.gu_scales[0], sc.gu_biases[0], scales, biases);
    g.gate = expert_gemm(w.gate, w.gate_dense, scales, biases, s.hidden_dtype, x_rows, s.T, x_stride, s.D, s.I, s.n,
                         token_of_row, rhs, s.sorted, plan);
  }
  // down: row b of hidden (already in row order) times expert rhs[b]
  void* down_in = at(base, p.cast_hidden ? sc.hidden_cast : sc.hidden);
  gemm_params(w.down, p.cast_down, s.out_dtype, base, sc.down_scales, sc.down_biases, scales, biases);
  g.down = expert_gemm(w.down, w.down_dense, scales, biases, s.out_dtype, down_in, s.n, s.I, s.I, s.D, s.n, nullptr,
                       rhs, s.sorted, plan);
  return g;
}

void set_down_window_bytes(size_t bytes) { g_down_window_bytes.store(bytes, std::memory_order_relaxed); }

int64_t planned_down_window_cols(const Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& w) {
  return plan_moe_layer(out, h, x, w).down_window_cols;
}

bool planned_group_rows(const Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& w) {
  return plan_moe_layer(out, h, x, w).group_rows;
}

LayerPlan plan_moe_layer(const Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& w) {
  LayerPlan p;
  p.shape = expert_shape(x, w.router.top_k, w.experts);
  const ExpertShape& s = p.shape;
  // Decode sizes: the whole layer in three (or four) kernels when it supports the call (counted under
  // Primitive::moe_decode_layer; a miss falls to the experts path below).
  const bool requested = decode_layer_setting() != RouteSwitch::off;
  const RouteSupport decode = supports_decode_layer(out, h, x, w);
  detail::record_selection(detail::Primitive::moe_decode_layer, requested, decode.ok, requested && decode.ok,
                           !requested ? Fallback::disabled : decode.reason);
  if (requested && decode.ok) {
    p.path = LayerPath::decode;
    p.decode = decode_scratch(s.T, s.k, s.E, s.I, s.D, w.experts.down);
    return p;
  }
  ArenaLayout layout;
  reserve_fixed(p, w.experts, /*routes=*/true, h.dtype(), layout);
  plan_experts(p, x, nullptr, w.experts, /*combines=*/true, /*own_y=*/true, layout);
  p.scratch.bytes = layout.bytes();
  p.router_slot_bytes =
      std::max(route_scratch_bytes(h, w.router), y_request_bytes(s.n, s.D, s.out_dtype, p.down_window_cols));
  return p;
}

LayerPlan plan_switch_glu(const Tensor& x, const Tensor& indices, const SwitchGLUWeights& w) {
  LayerPlan p;
  p.shape = expert_shape(x, indices.size(1), w);
  p.ids_unsigned = indices.dtype() == DType::u32;
  ArenaLayout layout;
  reserve_fixed(p, w, /*routes=*/false, DType::bf16, layout);
  // Unsorted rows are already in (token, slot) order: the down GEMM then writes straight into out.
  plan_experts(p, x, indices.data_as<const int32_t>(), w, /*combines=*/false, /*own_y=*/p.shape.sorted, layout);
  p.scratch.bytes = layout.bytes();
  return p;
}

}  // namespace expertqmm::cuda

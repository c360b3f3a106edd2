// gather_qmm on CUDA: the route selector, the internal entry gather_qmm_into and the op.
#include <string>
#include <vector>

#include "core/route_counters.h"
#include "core/tile_layout.h"
#include "cuda/cuda_backend.h"
#include "cuda/gather_qmm.h"
#include "cuda/gather_qmm_routes.h"
#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

namespace {

constexpr const char* kOp = "gather_qmm";

// The selector's routes, tried in order; the first whose supports_* holds runs. expert_tiles (the
// sorted tile route) is first and is also gated by the on/off setting; every miss of it is counted
// with its reason and falls through to the generic routes below it. simt takes every valid problem,
// so a miss of all of them means a malformed problem.
const GatherQmmRoute kRoutes[] = {
    {"expert_tiles", supports_expert_tiles, call_expert_tiles},
    {"qmv", supports_qmv, call_qmv},
    {"rhs_tiles", supports_rhs_tiles, call_rhs_tiles},
    {"simt", supports_simt, call_simt},
};

// Routes reachable only through the test hook.
const GatherQmmRoute kTestRoutes[] = {
    {"qmv_one_row", supports_qmv, call_qmv_one_row},
    {"expert_tiles_mma_sync", supports_expert_tiles, call_expert_tiles_mma_sync},
    {"expert_tiles_wgmma", supports_expert_tiles_wgmma, call_expert_tiles_wgmma},
    {"rhs_tiles_bm16", supports_rhs_tiles, call_rhs_tiles_bm16},
    {"rhs_tiles_bm32", supports_rhs_tiles_tall, call_rhs_tiles_bm32},
    {"rhs_tiles_bm64", supports_rhs_tiles_tall, call_rhs_tiles_bm64},
};

// The problem arrives validated by make_gather_qmm_problem; this checks what the CUDA routes rely on.
// Returns false when there is nothing to compute.
bool check_problem(const detail::GatherQmmProblem& p, const void* out) {
  EXPERTQMM_CHECK(p.device == Device::cuda, kOp, "the CUDA backend got a problem on ", device_name(p.device));
  EXPERTQMM_CHECK(p.B >= 0 && p.M >= 0 && p.N >= 0 && p.K >= 0, kOp, "negative size in ", p.describe());
  EXPERTQMM_CHECK(is_floating(p.dtype), kOp, "activation dtype must be a float type, got ", dtype_name(p.dtype));
  if (p.B == 0 || p.M == 0 || p.N == 0) return false;
  EXPERTQMM_CHECK(out != nullptr, kOp, "output pointer is null for ", p.describe());
  if (p.mode != QuantMode::affine) {  // uint8 scale codes, no biases
    EXPERTQMM_CHECK(p.x.device() == Device::cuda && p.w.device() == Device::cuda && p.scales.device() == Device::cuda,
                    kOp, "operands must be on cuda: ", p.describe());
    EXPERTQMM_CHECK(p.x.dtype() == p.dtype && p.scales.dtype() == DType::u8 && !p.biases.defined(), kOp, "x ",
                    p.x.describe(), " must be in dtype ", dtype_name(p.dtype), " and mode ", quant_mode_name(p.mode),
                    " needs uint8 scales ", p.scales.describe(), " and no biases");
    EXPERTQMM_CHECK(p.w.dtype() == DType::u32 && p.w.is_contiguous() && p.scales.is_contiguous(), kOp,
                    "w must be contiguous uint32 and scales contiguous: ", p.describe());
  } else {
    EXPERTQMM_CHECK(p.x.device() == Device::cuda && p.w.device() == Device::cuda &&
                        p.scales.device() == Device::cuda && p.biases.device() == Device::cuda,
                    kOp, "operands must be on cuda: ", p.describe());
    EXPERTQMM_CHECK(p.x.dtype() == p.dtype && p.scales.dtype() == p.dtype && p.biases.dtype() == p.dtype, kOp,
                    "x ", p.x.describe(), ", scales ", p.scales.describe(), " and biases must be in dtype ",
                    dtype_name(p.dtype));
    EXPERTQMM_CHECK(p.w.dtype() == DType::u32 && p.w.is_contiguous() && p.scales.is_contiguous() &&
                        p.biases.is_contiguous(),
                    kOp, "w must be contiguous uint32 and scales/biases contiguous: ", p.describe());
  }
  if (!p.lhs_is_identity) check_index_tensor(kOp, p.lhs, "lhs", p.B);
  if (!p.rhs_is_identity) check_index_tensor(kOp, p.rhs, "rhs", p.B);
  return true;
}

// Picks the route; with `record`, counts the tile route's hit or the class of its miss.
const GatherQmmRoute& pick_route(const detail::GatherQmmProblem& p, bool record) {
  return select_route(kOp, detail::Primitive::gather_qmm, kRoutes, p, record);
}

}  // namespace

namespace {
int current_device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  EXPERTQMM_CUDA_CHECK(cudaGetDevice(&device));
  EXPERTQMM_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}
}  // namespace

int device_sm_count() {
  static const int count = current_device_attribute(cudaDevAttrMultiProcessorCount);
  return count;
}
size_t device_smem_optin() {
  static const size_t bytes = current_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  return bytes;
}

device::QuantView quant_view(const detail::GatherQmmProblem& p) {
  device::QuantView q;
  q.w = static_cast<const uint32_t*>(p.w.data());
  if (p.mode != QuantMode::affine) {
    q.fp_scales = static_cast<const uint8_t*>(p.scales.data());
    q.fp_mode = static_cast<int>(p.mode);
  } else {
    q.scales = static_cast<const uint16_t*>(p.scales.data());
    q.biases = static_cast<const uint16_t*>(p.biases.data());
  }
  q.words_per_row = static_cast<int>(p.w_row_words());
  q.groups_per_row = static_cast<int>(p.groups_per_row());
  q.group_shift = log2_of(p.group_size);
  // The tile layout only where it is this weight's: its shape from (E, N, K, group size) and its N, its
  // parameters in the call's dtype, contiguous on the call's device (TiledWeight is the caller's data).
  const TiledWeight& t = p.tiled;
  const detail::TileGeometry g = detail::tile_geometry(p.w_batch, p.N, p.K, p.group_size);
  if (t.defined() && p.mode == QuantMode::affine && p.bits == 4 && p.transpose && t.rows == p.N &&
      t.group_size == p.group_size &&
      t.param_dtype == p.dtype && t.codes.device() == p.device && t.params.device() == p.device &&
      t.codes.dtype() == DType::u32 && t.params.dtype() == DType::u32 && t.codes.is_contiguous() &&
      t.params.is_contiguous() &&
      t.codes.shape() == g.codes_shape() && t.params.shape() == g.params_shape()) {
    q.tiled_codes = t.codes.data_as<const uint32_t>();
    q.tiled_params = t.params.data_as<const uint32_t>();
  }
  return q;
}

device::QuantView quant_view(const QuantizedWeight& w, int64_t K) {
  device::QuantView q;
  q.w = w.w.data_as<const uint32_t>();
  if (w.mode != QuantMode::affine) {
    q.fp_scales = w.scales.data_as<const uint8_t>();
    q.fp_mode = static_cast<int>(w.mode);
  } else {
    q.scales = w.scales.data_as<const uint16_t>();
    q.biases = w.biases.data_as<const uint16_t>();
  }
  q.words_per_row = static_cast<int>(K * w.bits / 32);
  q.groups_per_row = static_cast<int>(K / w.group_size);
  q.group_shift = log2_of(w.group_size);
  return q;
}

void gather_qmm_into(const detail::GatherQmmProblem& p, void* out, Workspace* ws) {
  if (!check_problem(p, out)) return;
  pick_route(p, /*record=*/true).call(p, out, ws);
}

const GatherQmmRoute& select_gather_qmm_route(const detail::GatherQmmProblem& p) { return pick_route(p, true); }

bool is_expert_tiles(const GatherQmmRoute& route) { return &route == &kRoutes[0]; }

void run_gather_qmm_route(const GatherQmmRoute& route, const detail::GatherQmmProblem& p, void* out, Workspace* ws) {
  if (!check_problem(p, out)) return;
  route.call(p, out, ws);
}

detail::GatherQmmProblem single_matrix_problem(const void* x, int64_t T, int64_t K, DType dtype,
                                               const QuantizedWeight& q, const Tensor& scales, const Tensor& biases) {
  detail::GatherQmmProblem p;
  p.M = T;
  p.N = q.w.size(-2);
  p.K = K;
  p.bits = q.bits;
  p.group_size = q.group_size;
  p.mode = q.mode;
  p.transpose = true;
  p.sorted_indices = false;
  p.batch = {};
  p.B = 1;
  p.x_batch = 1;
  p.w_batch = 1;
  p.dtype = dtype;
  p.device = Device::cuda;
  p.x = Tensor::view(const_cast<void*>(x), {T, K}, dtype, Device::cuda);
  p.x_batch_stride = T * K;
  p.w = q.w.contiguous();
  p.scales = scales.defined() ? scales : q.scales.contiguous();
  if (q.mode == QuantMode::affine) p.biases = biases.defined() ? biases : q.biases.contiguous();
  p.lhs_is_identity = true;
  p.rhs_is_identity = true;
  return p;
}

detail::GatherQmmProblem one_expert_rows_problem(const detail::GatherQmmProblem& single, int32_t* zero_ids,
                                                 const void* plan) {
  EXPERTQMM_CHECK(single.B == 1 && single.w_batch == 1 && single.rhs_is_identity && single.lhs_is_identity, kOp,
                  "one_expert_rows_problem takes a single-matrix problem, got ", single.describe());
  detail::GatherQmmProblem p = single;
  const int64_t T = single.M;
  p.M = 1;
  p.B = T;
  p.batch = {T};
  p.x_batch = T;
  p.x_batch_stride = p.K;
  p.x = Tensor::view(single.x.data(), {T, 1, p.K}, p.dtype, Device::cuda);
  p.rhs = Tensor::view(zero_ids, {T}, DType::i32, Device::cuda);
  p.rhs_is_identity = false;
  p.sorted_indices = true;
  p.tile_plan = plan;
  return p;
}

Tensor gather_qmm(const detail::GatherQmmProblem& p) {
  Tensor out = gathered_output(p);
  gather_qmm_into(p, out.data(), nullptr);
  return out;
}

// The backend table's entry (core/backend_ops.h): the op front has checked `out`.
void gather_qmm_into(const detail::GatherQmmProblem& p, Tensor& out, Workspace* ws) {
  gather_qmm_into(p, out.data(), ws);
}

std::vector<std::string> gather_qmm_route_names() { return route_names(kRoutes); }

std::string gather_qmm_selected_route(const detail::GatherQmmProblem& p) { return pick_route(p, false).name; }

void gather_qmm_into_route(const std::string& route, const detail::GatherQmmProblem& p, void* out, Workspace* ws) {
  const GatherQmmRoute& r = route_named(kOp, route, kRoutes, kTestRoutes, p);
  if (!check_problem(p, out)) return;
  r.call(p, out, ws);
}

uint64_t gather_qmm_device_retractions() { return device_retractions(detail::Primitive::gather_qmm); }

}  // namespace expertqmm::cuda

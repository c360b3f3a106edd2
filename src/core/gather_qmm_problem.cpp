#include "core/gather_qmm_problem.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "core/float16.h"
#include "expertqmm/error.h"
#include "expertqmm/quant.h"

namespace expertqmm::detail {

namespace {
constexpr const char* kOp = "gather_qmm";

Shape broadcast_shapes(const char* op, const Shape& a, const Shape& b) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    EXPERTQMM_CHECK(da == db || da == 1 || db == 1, op, "index shapes ", shape_str(a), " and ",
                    shape_str(b), " cannot be broadcast together");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// Reads an integer index tensor (int32/uint32, any device, any strides) into host int64 values.
std::vector<int64_t> read_indices(const Tensor& t) {
  std::vector<uint8_t> bytes = t.to_host_bytes();
  std::vector<int64_t> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint32_t v;
    std::memcpy(&v, bytes.data() + 4 * i, 4);
    out[i] = t.dtype() == DType::i32 ? static_cast<int64_t>(static_cast<int32_t>(v)) : static_cast<int64_t>(v);
  }
  return out;
}

// Broadcasts `values` of shape `src` to `dst` (numpy rules, src right-aligned).
std::vector<int64_t> broadcast_values(const std::vector<int64_t>& values, const Shape& src, const Shape& dst) {
  Shape src_strides = contiguous_strides(src);
  const size_t off = dst.size() - src.size();
  std::vector<int64_t> out(shape_numel(dst));
  std::vector<int64_t> idx(dst.size(), 0);
  for (size_t flat = 0; flat < out.size(); ++flat) {
    int64_t s = 0;
    for (size_t i = off; i < dst.size(); ++i)
      if (src[i - off] != 1) s += idx[i] * src_strides[i - off];
    out[flat] = values[s];
    for (int i = static_cast<int>(dst.size()) - 1; i >= 0; --i) {
      if (++idx[i] < dst[i]) break;
      idx[i] = 0;
    }
  }
  return out;
}

Tensor to_index_tensor(const std::vector<int64_t>& v, Device device) {
  std::vector<int32_t> i32(v.begin(), v.end());
  return Tensor::from_host(i32.data(), {static_cast<int64_t>(i32.size())}, DType::i32, device);
}
}  // namespace

void check_quant_params(const char* op, QuantMode mode, int bits, int group_size) {
  if (mode == QuantMode::affine) {
    EXPERTQMM_CHECK(valid_bits(bits), op, "bits must be one of 2, 3, 4, 5, 6, 8; got bits=", bits);
    EXPERTQMM_CHECK(valid_group_size(group_size), op,
                    "group_size must be one of 32, 64, 128; got group_size=", group_size);
    return;
  }
  EXPERTQMM_CHECK(mode == QuantMode::mxfp4 || mode == QuantMode::mxfp8 || mode == QuantMode::nvfp4, op,
                  "unknown quantization mode ", static_cast<int>(mode));
  EXPERTQMM_CHECK(valid_quant_params(mode, bits, group_size), op, "mode ", quant_mode_name(mode),
                  " takes bits=", quant_mode_bits(mode), " and group_size=", quant_mode_group_size(mode),
                  " only; got bits=", bits, " group_size=", group_size);
}

void check_quantized(const char* op, const Tensor& w, const Tensor& scales, const Tensor& biases,
                     int group_size, int bits, QuantMode mode) {
  check_quant_params(op, mode, bits, group_size);
  EXPERTQMM_CHECK(w.defined(), op, "w is undefined");
  EXPERTQMM_CHECK(scales.defined(), op, "scales are undefined");
  EXPERTQMM_CHECK(w.dtype() == DType::u32, op, "w must be uint32, got ", w.describe());
  EXPERTQMM_CHECK(w.ndim() >= 2, op, "w must have at least 2 dims, got ", w.describe());
  if (mode == QuantMode::affine) {
    EXPERTQMM_CHECK(biases.defined(), op, "biases are required for affine quantization");
    EXPERTQMM_CHECK(is_floating(scales.dtype()), op, "scales must be a float type, got ", scales.describe());
    EXPERTQMM_CHECK(biases.dtype() == scales.dtype(), op, "biases dtype ", dtype_name(biases.dtype()),
                    " differs from scales dtype ", dtype_name(scales.dtype()));
    EXPERTQMM_CHECK(scales.shape() == biases.shape(), op, "scales ", shape_str(scales.shape()),
                    " and biases ", shape_str(biases.shape()), " must have the same shape");
    EXPERTQMM_CHECK(w.device() == biases.device(), op, "w, scales and biases must be on one device");
  } else {
    EXPERTQMM_CHECK(!biases.defined(), op, "mode ", quant_mode_name(mode), " has no biases, got ",
                    biases.describe());
    EXPERTQMM_CHECK(scales.dtype() == DType::u8, op, "mode ", quant_mode_name(mode),
                    " needs uint8 scales, got ", scales.describe());
  }
  EXPERTQMM_CHECK(scales.ndim() == w.ndim(), op, "scales ", shape_str(scales.shape()), " and w ",
                  shape_str(w.shape()), " must have the same rank");
  for (int i = 0; i < w.ndim() - 1; ++i)
    EXPERTQMM_CHECK(scales.size(i) == w.size(i), op, "scales ", shape_str(scales.shape()),
                    " do not match w ", shape_str(w.shape()), " in dim ", i);
  EXPERTQMM_CHECK(w.size(-1) * 32 == scales.size(-1) * group_size * bits, op, "w ", shape_str(w.shape()),
                  " holds ", w.size(-1) * 32 / bits, " values per row (bits=", bits, ") but scales ",
                  shape_str(scales.shape()), " cover ", scales.size(-1) * group_size,
                  " (group_size=", group_size, ")");
  EXPERTQMM_CHECK(w.device() == scales.device(), op, "w and scales must be on one device");
}

void check_global_scale(const char* op, QuantMode mode, const Tensor& global_scale) {
  if (!global_scale.defined()) return;
  EXPERTQMM_CHECK(mode == QuantMode::nvfp4, op, "a global scale is only supported for mode nvfp4, got mode ",
                  quant_mode_name(mode));
  EXPERTQMM_CHECK(global_scale.dtype() == DType::f32 && global_scale.numel() == 1, op,
                  "the global scale must be a float32 scalar, got ", global_scale.describe());
}

void check_quantized_weight(const char* op, const QuantizedWeight& q) {
  check_quantized(op, q.w, q.scales, q.biases, q.group_size, q.bits, q.mode);
  check_global_scale(op, q.mode, q.global_scale);
}

Tensor cast_floating(const Tensor& t, DType to) {
  EXPERTQMM_CHECK(is_floating(t.dtype()) && is_floating(to), "cast", "cannot cast ", t.describe(), " to ",
                  dtype_name(to));
  if (t.dtype() == to) return t;
  std::vector<uint8_t> src = t.to_host_bytes();
  const int64_t n = t.numel();
  std::vector<float> f(n);
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    switch (t.dtype()) {
      case DType::f32: std::memcpy(&f[i], src.data() + 4 * i, 4); break;
      case DType::bf16: std::memcpy(&h, src.data() + 2 * i, 2); f[i] = bf16_to_float(h); break;
      default: std::memcpy(&h, src.data() + 2 * i, 2); f[i] = f16_to_float(h); break;
    }
  }
  std::vector<uint8_t> dst(n * dtype_size(to));
  for (int64_t i = 0; i < n; ++i) {
    if (to == DType::f32) { std::memcpy(dst.data() + 4 * i, &f[i], 4); continue; }
    uint16_t h = to == DType::bf16 ? float_to_bf16(f[i]) : float_to_f16(f[i]);
    std::memcpy(dst.data() + 2 * i, &h, 2);
  }
  return Tensor::from_host(dst.data(), t.shape(), to, t.device());
}

GatherBatch make_gather_batch(const char* op, const Tensor& x, DType dtype, const Shape& w_batch_shape,
                              const Tensor& lhs_indices, const Tensor& rhs_indices) {
  for (const Tensor* idx : {&lhs_indices, &rhs_indices}) {
    if (!idx->defined()) continue;
    EXPERTQMM_CHECK(is_integer(idx->dtype()), op, "indices must be int32 or uint32, got ", idx->describe());
    EXPERTQMM_CHECK(idx->device() == x.device(), op, "indices are on ", device_name(idx->device()),
                    " but x is on ", device_name(x.device()));
  }
  GatherBatch g;
  const int64_t M = x.size(-2), K = x.size(-1);
  const Device device = x.device();
  Shape x_batch_shape(x.shape().begin(), x.shape().end() - 2);
  g.x_batch = shape_numel(x_batch_shape);
  g.w_batch = shape_numel(w_batch_shape);
  const Shape lhs_shape = lhs_indices.defined() ? lhs_indices.shape() : x_batch_shape;
  const Shape rhs_shape = rhs_indices.defined() ? rhs_indices.shape() : w_batch_shape;
  g.batch = broadcast_shapes(op, lhs_shape, rhs_shape);
  g.B = shape_numel(g.batch);

  Tensor xp = cast_floating(x, dtype);
  // x: each batch matrix must be row-major; batch dims must collapse to one stride.
  bool batch_uniform = true;
  int64_t expect = xp.ndim() > 2 ? xp.stride(-3) : M * K;
  for (int i = xp.ndim() - 3; i >= 0; --i) {
    if (xp.size(i) == 1) continue;
    if (xp.stride(i) != expect) batch_uniform = false;
    expect *= xp.size(i);
  }
  if (!xp.rows_contiguous() || !batch_uniform) xp = xp.contiguous();
  g.x = xp;
  g.x_batch_stride = xp.ndim() > 2 && g.x_batch > 1 ? xp.stride(-3) : M * K;
  if (xp.ndim() > 2 && g.x_batch > 1) {
    // the innermost non-unit batch dim sets the stride
    for (int i = xp.ndim() - 3; i >= 0; --i)
      if (xp.size(i) != 1) { g.x_batch_stride = xp.stride(i); break; }
  }

  // Indices: identity when absent and not broadcast; else a contiguous int32 [B] tensor.
  auto resolve = [&](const Tensor& given, const Shape& batch_shape, int64_t limit, const char* name,
                     bool& identity) -> Tensor {
    identity = false;
    if (g.B == 0) return Tensor::empty({0}, DType::i32, device);
    if (!given.defined() && batch_shape == g.batch) {
      identity = true;
      return Tensor();
    }
    if (given.defined() && given.shape() == g.batch && given.is_contiguous() && device == Device::cuda) {
      // Device fast path: reinterpret (uint32 ids >= 2^31 read as negative: out of range on device).
      return Tensor::view(given.data(), {g.B}, DType::i32, device).reshape({g.B});
    }
    std::vector<int64_t> vals;
    Shape src;
    if (given.defined()) {
      vals = read_indices(given);
      src = given.shape();
    } else {
      vals.resize(shape_numel(batch_shape));
      for (size_t i = 0; i < vals.size(); ++i) vals[i] = static_cast<int64_t>(i);
      src = batch_shape;
    }
    for (int64_t v : vals)
      EXPERTQMM_CHECK(v >= 0 && v < limit, op, name, " index ", v, " is out of range [0, ", limit, ")");
    return to_index_tensor(broadcast_values(vals, src, g.batch), device);
  };
  g.lhs = resolve(lhs_indices, x_batch_shape, g.x_batch, "lhs", g.lhs_is_identity);
  g.rhs = resolve(rhs_indices, w_batch_shape, g.w_batch, "rhs", g.rhs_is_identity);
  return g;
}

GatherQmmProblem make_gather_qmm_problem(const Tensor& x, const Tensor& w, const Tensor& scales,
                                         const Tensor& biases, const Tensor& lhs_indices,
                                         const Tensor& rhs_indices, bool transpose, int group_size,
                                         int bits, bool sorted_indices, QuantMode mode) {
  check_quantized(kOp, w, scales, biases, group_size, bits, mode);
  EXPERTQMM_CHECK(x.defined(), kOp, "x is undefined");
  EXPERTQMM_CHECK(is_floating(x.dtype()), kOp, "x must be a float type, got ", x.describe());
  EXPERTQMM_CHECK(x.ndim() >= 2, kOp, "x must have at least 2 dims [..., M, K], got ", x.describe());
  EXPERTQMM_CHECK(x.device() == w.device(), kOp, "x is on ", device_name(x.device()), " but w is on ",
                  device_name(w.device()));

  GatherQmmProblem p;
  p.bits = bits;
  p.group_size = group_size;
  p.mode = mode;
  p.transpose = transpose;
  p.sorted_indices = sorted_indices;
  p.device = x.device();
  p.K = x.size(-1);
  p.M = x.size(-2);
  const int64_t w_values = w.size(-1) * 32 / bits;  // unpacked values per w row
  if (transpose) {
    EXPERTQMM_CHECK(w_values == p.K, kOp, "x ", shape_str(x.shape()), " has K=", p.K, " but w ",
                    shape_str(w.shape()), " holds rows of ", w_values, " values (bits=", bits,
                    ", transpose=true)");
    p.N = w.size(-2);
  } else {
    EXPERTQMM_CHECK(w.size(-2) == p.K, kOp, "x ", shape_str(x.shape()), " has K=", p.K, " but w ",
                    shape_str(w.shape()), " has ", w.size(-2), " rows (transpose=false)");
    p.N = w_values;
  }
  EXPERTQMM_CHECK((transpose ? p.K : p.N) % group_size == 0, kOp, transpose ? "K=" : "N=",
                  transpose ? p.K : p.N, " is not a multiple of group_size=", group_size);

  // MLX: affine promotes x with the scales; the fp modes compute in x's dtype.
  p.dtype = mode == QuantMode::affine ? promote_floating(x.dtype(), scales.dtype()) : x.dtype();
  GatherBatch g = make_gather_batch(kOp, x, p.dtype, Shape(w.shape().begin(), w.shape().end() - 2), lhs_indices,
                                    rhs_indices);
  p.batch = std::move(g.batch);
  p.B = g.B;
  p.x_batch = g.x_batch;
  p.w_batch = g.w_batch;
  p.x = std::move(g.x);
  p.x_batch_stride = g.x_batch_stride;
  p.lhs = std::move(g.lhs);
  p.rhs = std::move(g.rhs);
  p.lhs_is_identity = g.lhs_is_identity;
  p.rhs_is_identity = g.rhs_is_identity;
  p.w = w.contiguous();
  if (mode == QuantMode::affine) {
    p.scales = cast_floating(scales, p.dtype).contiguous();
    p.biases = cast_floating(biases, p.dtype).contiguous();
  } else {
    p.scales = scales.contiguous();
  }
  return p;
}

std::string GatherQmmProblem::describe() const {
  return cat("gather_qmm problem {M=", M, " N=", N, " K=", K, " mode=", quant_mode_name(mode), " bits=", bits,
             " group_size=", group_size,
             " transpose=", transpose, " sorted_indices=", sorted_indices, " batch=", shape_str(batch),
             " x_batch=", x_batch, " w_batch(E)=", w_batch, " dtype=", dtype_name(dtype),
             " device=", device_name(device), " x=", x.describe(), " w=", w.describe(),
             tiled.defined() ? cat(" tiled=", tiled.codes.describe()) : std::string(), "}");
}

}  // namespace expertqmm::detail

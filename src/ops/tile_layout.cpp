// Public tile layout (include/expertqmm/quant.h TiledWeight, docs/tile-layout.md): the rule
// (tileable), validation, and dispatch of tile_weight / untile_weight to the backend of the input.
#include <string>

#include "core/tile_layout.h"
#include "expertqmm/error.h"
#include "expertqmm/quant.h"
#include "ops/op_checks.h"

namespace expertqmm {

namespace {

void expect(bool ok, std::string* why, const std::string& reason) {
  if (!ok && why->empty()) *why = reason;
}

}  // namespace

bool tileable(const QuantizedWeight& q, std::string* why) {
  std::string local;
  std::string* w = why ? why : &local;
  w->clear();
  expect(q.defined(), w, "the weight is undefined");
  if (!w->empty()) return false;
  expect(q.mode == QuantMode::affine, w, detail::cat("mode ", quant_mode_name(q.mode), " (affine only)"));
  expect(q.bits == 4, w, detail::cat("bits ", q.bits, " (4 only)"));
  expect(q.group_size == 64 || q.group_size == 128, w, detail::cat("group_size ", q.group_size, " (64 or 128)"));
  expect(q.w.dtype() == DType::u32 && q.w.ndim() >= 2, w, detail::cat("w ", q.w.describe(), " (uint32, rank >= 2)"));
  expect(q.scales.defined() && q.biases.defined() && q.scales.dtype() == q.biases.dtype() &&
             (q.scales.dtype() == DType::bf16 || q.scales.dtype() == DType::f16),
         w, "scales and biases must both be bf16 or both f16");
  if (!w->empty()) return false;
  const int64_t K = q.w.size(-1) * 8;
  expect(q.w.numel() > 0, w, detail::cat("w ", q.w.describe(), " is empty"));
  expect(K % detail::kTileK == 0, w, detail::cat("K ", K, " (a multiple of 64)"));
  Shape param_shape = q.w.shape();
  param_shape.back() = K / q.group_size;
  expect(q.scales.shape() == param_shape && q.biases.shape() == param_shape, w,
         detail::cat("scales ", q.scales.describe(), " and biases ", q.biases.describe(), " do not match w ",
                     q.w.describe()));
  expect(q.scales.device() == q.w.device() && q.biases.device() == q.w.device(), w,
         "w, scales and biases must be on one device");
  return w->empty();
}

TiledWeight tile_weight(const QuantizedWeight& q_in) {
  constexpr const char* kOp = "tile_weight";
  std::string why;
  EXPERTQMM_CHECK(tileable(q_in, &why), kOp, why);
  QuantizedWeight q = q_in;
  q.w = q.w.contiguous();
  q.scales = q.scales.contiguous();
  q.biases = q.biases.contiguous();
  TiledWeight t = detail::backend_ops(kOp, q.w.device()).tile_weight(q);
  t.rows = q.w.size(-2);
  t.group_size = q.group_size;
  t.param_dtype = q.scales.dtype();
  return t;
}

QuantizedWeight untile_weight(const TiledWeight& t) {
  constexpr const char* kOp = "untile_weight";
  const int64_t N = t.rows;
  EXPERTQMM_CHECK(t.codes.defined() && t.params.defined() && t.codes.ndim() == 4 && t.params.ndim() == 4 &&
                      t.codes.dtype() == DType::u32 && t.params.dtype() == DType::u32 &&
                      t.codes.size(3) == detail::kTileWords && t.params.size(3) == detail::kTileRows &&
                      t.codes.device() == t.params.device(),
                  kOp, "codes ", t.codes.describe(), " and params ", t.params.describe(), " are not a tile layout");
  EXPERTQMM_CHECK(t.group_size == 64 || t.group_size == 128, kOp, "group_size ", t.group_size, " (64 or 128)");
  EXPERTQMM_CHECK(t.param_dtype == DType::bf16 || t.param_dtype == DType::f16, kOp, "param dtype ",
                  dtype_name(t.param_dtype), " (bf16 or f16)");
  const int64_t E = t.codes.size(0), K = t.codes.size(2) * detail::kTileK;
  const detail::TileGeometry g = detail::tile_geometry(E, N, K, t.group_size);
  EXPERTQMM_CHECK(N > 0 && t.codes.shape() == g.codes_shape() && t.params.shape() == g.params_shape(),
                  kOp, "codes ", t.codes.describe(), " and params ", t.params.describe(), " do not hold N=", N,
                  " group_size=", t.group_size);
  TiledWeight c = t;
  c.codes = t.codes.contiguous();
  c.params = t.params.contiguous();
  QuantizedWeight q = detail::backend_ops(kOp, c.codes.device()).untile_weight(c, N);
  q.bits = 4;
  q.group_size = t.group_size;
  q.mode = QuantMode::affine;
  return q;
}

}  // namespace expertqmm

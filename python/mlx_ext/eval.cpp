#include "eval.h"

#include <mlx/backend/cpu/encoder.h>

#include <sstream>

#include "expertqmm/error.h"

namespace expertqmm::mlx_ext {

// The element types both sides carry, as data.
namespace {
struct DtypePair {
  mx::Dtype::Val mlx;
  DType ours;
};
constexpr DtypePair kDtypes[] = {
    {mx::Dtype::Val::bfloat16, DType::bf16}, {mx::Dtype::Val::float16, DType::f16},
    {mx::Dtype::Val::float32, DType::f32},   {mx::Dtype::Val::uint32, DType::u32},
    {mx::Dtype::Val::int32, DType::i32},     {mx::Dtype::Val::uint8, DType::u8},
};
}  // namespace

DType expertqmm_dtype(mx::Dtype t, const char* op) {
  for (const DtypePair& p : kDtypes)
    if (p.mlx == t.val()) return p.ours;
  std::ostringstream name;
  name << t;
  throw Error(op, "MLX arrays of " + name.str() +
                      " are not supported (bfloat16, float16, float32, uint32, int32, uint8)");
}

mx::Dtype mlx_dtype(DType t) {
  switch (t) {
    case DType::bf16: return mx::bfloat16;
    case DType::f16: return mx::float16;
    case DType::f32: return mx::float32;
    case DType::u32: return mx::uint32;
    case DType::i32: return mx::int32;
    case DType::u8: return mx::uint8;
  }
  throw Error("mlx", "unknown dtype");
}

namespace {

Shape shape_of(const mx::array& a) { return Shape(a.shape().begin(), a.shape().end()); }

// A view of a row-contiguous CPU array (the ops make their inputs contiguous).
Tensor cpu_view(const mx::array& a, const char* op) {
  EXPERTQMM_CHECK(a.flags().row_contiguous, op, "expects row-contiguous inputs");
  return Tensor::view(const_cast<void*>(a.data<void>()), shape_of(a), expertqmm_dtype(a.dtype(), op));
}

}  // namespace

void eval_on_cpu(const mx::Stream& s, const std::vector<mx::array>& inputs, mx::array& out, Body body) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(s);
  for (const mx::array& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  // The arrays are held by the task (copies of the handles) until it has run.
  encoder.dispatch([inputs, out = mx::array(out), body = std::move(body)]() mutable {
    std::vector<Tensor> views;
    views.reserve(inputs.size());
    for (const mx::array& a : inputs) views.push_back(cpu_view(a, "mlx eval_cpu"));
    Tensor o = Tensor::view(out.data<void>(), shape_of(out), expertqmm_dtype(out.dtype(), "mlx eval_cpu"));
    body(views, o, nullptr);
  });
}

mx::array row_contiguous(const mx::array& a, const mx::Stream& s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

}  // namespace expertqmm::mlx_ext

#include "bridge.h"

#include "expertqmm/error.h"

namespace expertqmm::python {

namespace {

constexpr const char* kOp = "python";

// DLPack (code, bits) -> DType; the element types expertqmm carries.
DType dtype_of(const nb::dlpack::dtype& d) {
  using C = nb::dlpack::dtype_code;
  EXPERTQMM_CHECK(d.lanes == 1, kOp, "vector dtypes (lanes=", int(d.lanes), ") are not supported");
  const auto code = static_cast<C>(d.code);
  if (code == C::Float && d.bits == 32) return DType::f32;
  if (code == C::Float && d.bits == 16) return DType::f16;
  if (code == C::Bfloat && d.bits == 16) return DType::bf16;
  if (code == C::UInt && d.bits == 32) return DType::u32;
  if (code == C::Int && d.bits == 32) return DType::i32;
  if (code == C::UInt && d.bits == 8) return DType::u8;  // the scales of MLX's fp quantization modes
  if (code == C::UInt && d.bits == 16) return DType::bf16;  // only reached with dtype="bfloat16" (checked below)
  static const char* names[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  throw Error(kOp, detail::cat("unsupported element type ", d.code < 7 ? names[d.code] : "code?", int(d.bits),
                               "; expertqmm takes bfloat16, float16, float32, uint32, int32 and uint8"));
}

nb::dlpack::dtype dlpack_of(DType t) {
  using C = nb::dlpack::dtype_code;
  auto make = [](C code, int bits) { return nb::dlpack::dtype{uint8_t(code), uint8_t(bits), 1}; };
  switch (t) {
    case DType::bf16: return make(C::Bfloat, 16);
    case DType::f16: return make(C::Float, 16);
    case DType::f32: return make(C::Float, 32);
    case DType::u32: return make(C::UInt, 32);
    case DType::i32: return make(C::Int, 32);
    case DType::u8: return make(C::UInt, 8);
  }
  throw Error(kOp, "unknown dtype");
}

}  // namespace

DType parse_dtype(const std::string& name, const char* op) {
  for (DType t : {DType::bf16, DType::f16, DType::f32, DType::u32, DType::i32, DType::u8})
    if (name == dtype_name(t)) return t;
  throw Error(op, "unknown dtype '" + name + "' (bfloat16, float16, float32, uint32, int32, uint8)");
}

PyTensor PyTensor::wrap(nb::handle obj, const std::optional<std::string>& dtype, bool writable) {
  nb::ndarray<nb::ro> a;
  bool ok;
  if (writable) {
    nb::ndarray<> w;
    ok = nb::try_cast(obj, w);
    if (ok) a = nb::ndarray<nb::ro>(w);
  } else {
    ok = nb::try_cast(obj, a);
  }
  EXPERTQMM_CHECK(ok, kOp, "cannot view a ", nb::type_name(obj.type()).c_str(),
                  writable ? " as a writable array" : " as an array",
                  " (expertqmm takes objects with __dlpack__, DLPack capsules and buffers)");
  const nb::dlpack::dtype raw = a.dtype();
  const bool u16 = raw.code == uint8_t(nb::dlpack::dtype_code::UInt) && raw.bits == 16;
  EXPERTQMM_CHECK(!u16 || dtype == std::string("bfloat16"), kOp,
                  "uint16 arrays are taken only as the bits of bfloat16 (dtype='bfloat16')");
  DType t = dtype_of(raw);
  if (dtype) {
    const DType want = parse_dtype(*dtype, kOp);
    EXPERTQMM_CHECK(dtype_size(want) == dtype_size(t), kOp, "cannot reinterpret ", dtype_name(t), " as ",
                    dtype_name(want), ": the element sizes differ");
    t = want;
  }
  Device dev;
  const int dt = a.device_type();
  if (dt == nb::device::cpu::value || dt == nb::device::cuda_host::value) {
    dev = Device::cpu;
  } else if (dt == nb::device::cuda::value || dt == nb::device::cuda_managed::value) {
    dev = Device::cuda;
    EXPERTQMM_CHECK(cuda_built(), kOp, "a CUDA array was passed but this expertqmm was built without CUDA");
  } else {
    throw Error(kOp, detail::cat("arrays on DLPack device type ", dt, " are not supported (CPU and CUDA only)"));
  }
  Shape shape(a.ndim()), strides(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    shape[i] = static_cast<int64_t>(a.shape(i));
    strides[i] = a.stride(i);
  }
  PyTensor p;
  p.tensor = Tensor::view(const_cast<void*>(a.data()), shape, t, dev, strides);
  p.source = a;
  p.device_id = dev == Device::cuda ? a.device_id() : 0;
  return p;
}

nb::ndarray<nb::array_api> to_ndarray(nb::handle self, bool bits_only) {
  const PyTensor& p = nb::cast<const PyTensor&>(self);
  const Tensor& t = p.tensor;
  std::vector<size_t> shape(t.shape().begin(), t.shape().end());
  nb::dlpack::dtype d = dlpack_of(t.dtype());
  if (bits_only && t.dtype() == DType::bf16) d = nb::dlpack::dtype{uint8_t(nb::dlpack::dtype_code::UInt), 16, 1};
  const int device_type = t.device() == Device::cuda ? nb::device::cuda::value : nb::device::cpu::value;
  return nb::ndarray<nb::array_api>(t.data(), shape.size(), shape.data(), self, t.strides().data(), d, device_type,
                       p.device_id);
}

}  // namespace expertqmm::python

#include "expertqmm/dtype.h"

#include "expertqmm/error.h"

namespace expertqmm {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::bf16:
    case DType::f16: return 2;
    case DType::f32:
    case DType::u32:
    case DType::i32: return 4;
    case DType::u8: return 1;
  }
  throw Error("dtype_size", "unknown dtype");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::f32: return "float32";
    case DType::u32: return "uint32";
    case DType::i32: return "int32";
    case DType::u8: return "uint8";
  }
  return "unknown";
}

const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

DType promote_floating(DType a, DType b) {
  EXPERTQMM_CHECK(is_floating(a) && is_floating(b), "promote", "cannot promote ", dtype_name(a),
                  " with ", dtype_name(b));
  if (a == b) return a;
  return DType::f32;  // f32 with anything is f32; bf16 with f16 is f32 (as MLX)
}

}  // namespace expertqmm

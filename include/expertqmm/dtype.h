// Element types and devices of expertqmm tensors.
#pragma once
#include <cstddef>
#include <cstdint>

namespace expertqmm {

enum class DType : uint8_t { bf16, f16, f32, u32, i32, u8 };  // u8: the scales of MLX's fp modes
enum class Device : uint8_t { cpu, cuda };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* device_name(Device d);
inline bool is_floating(DType t) { return t == DType::bf16 || t == DType::f16 || t == DType::f32; }
inline bool is_integer(DType t) { return t == DType::u32 || t == DType::i32; }  // index types (u8 is a byte code, not an index)

// MLX type promotion restricted to the float types we carry: f32 wins, bf16 with f16 gives f32.
DType promote_floating(DType a, DType b);

}  // namespace expertqmm

// Tensor-core primitives for sm_80 and up: ldmatrix and mma.sync m16n8k16 (bf16 or f16 inputs,
// fp32 accumulators). Fragment layouts (PTX ISA, "mma.m16n8k16"), with g = lane / 4, t = lane % 4:
//   A (16 x 16, row-major)  a0: (g, 2t..2t+1)  a1: (g+8, 2t..2t+1)  a2: (g, 2t+8..+9)  a3: (g+8, 2t+8..+9)
//   B (16 x 8, k x n)       b0: (k 2t..2t+1, n g)  b1: (k 2t+8..2t+9, n g)
//   C (16 x 8, fp32)        c0,c1: (g, 2t..2t+1)  c2,c3: (g+8, 2t..2t+1)
// Each 32-bit register holds two 16-bit values, the lower k (or column) in the low half.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace expertqmm::cuda::device {

// Four 8x8 b16 matrices from shared memory. Lanes 8i..8i+7 give the row addresses (16 bytes each)
// of matrix i; register i receives matrix i in the A/B fragment layout above.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b for one m16n8k16 tile; T selects the input type of a and b.
template <class T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

}  // namespace expertqmm::cuda::device

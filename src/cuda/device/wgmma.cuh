// Hopper warpgroup MMA (wgmma, sm_90a only) with the A operand in registers and B in shared memory.
// Compiled to real instructions only where __CUDA_ARCH_FEAT_SM90_ALL is defined (nvcc
// -arch=sm_90a); elsewhere every primitive traps, and the host never selects a kernel built on them
// (cuda/arch.h: wgmma_available()).
//
// Layouts (PTX ISA "wgmma", with w = warp % 4 of the warpgroup, g = lane / 4, t = lane % 4):
//   A (64 x 16, registers) warp w owns rows 16w..16w+15 in the mma.sync m16n8k16 A layout:
//     a[0] (16w+g, k 2t..2t+1)  a[1] (16w+g+8, 2t..2t+1)  a[2] (16w+g, 2t+8..+9)  a[3] (16w+g+8, 2t+8..+9)
//   B (16 x N, shared memory, "K-major"): N rows of 64 contiguous k values (128 bytes), the 16-byte
//     chunk c of row r stored at chunk c ^ (r % 8) (the 128-byte swizzle), 8-row groups 1024 bytes
//     apart, the tile 1024-byte aligned. Step s of a 64-wide k tile starts 32 * s bytes in.
//   D (64 x N, fp32 registers) d[4j + 0..1] (16w+g, 8j+2t..+1), d[4j + 2..3] (16w+g+8, 8j+2t..+1).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace expertqmm::cuda::device {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EXPERTQMM_WGMMA_ENABLED 1
#else
#define EXPERTQMM_WGMMA_ENABLED 0
#endif

// Shared-memory matrix descriptor of a K-major, 128-byte-swizzled tile starting at `smem`
// (PTX "matrix-descriptor-format"): start address >> 4 in bits 0-13, leading byte offset (unused
// for swizzled K-major tiles, 1 by convention) in 16-29, stride byte offset >> 4 (1024: the next
// 8-row group) in 32-45, base offset 0 (the tile is 1024-byte aligned), swizzle mode 1 (128 B) in 62-63.
__device__ __forceinline__ uint64_t wgmma_desc_k128(const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t d = static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>(1) << 16;
  d |= static_cast<uint64_t>(1024 >> 4) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}

__device__ __forceinline__ void wgmma_fence() {
#if EXPERTQMM_WGMMA_ENABLED
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if EXPERTQMM_WGMMA_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most kPending committed wgmma groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if EXPERTQMM_WGMMA_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Keeps the compiler from moving reads or writes of a register across this point: wgmma reads
// and writes its registers asynchronously, which the compiler does not know.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// d (64 x N) += a (64 x 16, registers) * b (16 x N, descriptor), N in {16, 32, 64, 96, 128, 256}, fp32
// accumulators; T (bf16 or f16) is the type of a and b. Asynchronous: d must not be touched until
// wgmma_wait has retired the group, and a must not be overwritten before that either.
template <class T, int N>
struct WgmmaRS;

// The instruction's operand lists per N (n/2 accumulators, then the 4 A registers and the B
// descriptor), spelled once and shared by the bf16 and f16 wrappers below.
#define EXPERTQMM_WGMMA_ACC_16 \
  "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define EXPERTQMM_WGMMA_AB_16 "{%8, %9, %10, %11}, %12"
#define EXPERTQMM_WGMMA_D_16 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define EXPERTQMM_WGMMA_ACC_32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define EXPERTQMM_WGMMA_AB_32 "{%16, %17, %18, %19}, %20"
#define EXPERTQMM_WGMMA_D_32 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define EXPERTQMM_WGMMA_ACC_64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define EXPERTQMM_WGMMA_AB_64 "{%32, %33, %34, %35}, %36"
#define EXPERTQMM_WGMMA_D_64 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define EXPERTQMM_WGMMA_ACC_96 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define EXPERTQMM_WGMMA_AB_96 "{%48, %49, %50, %51}, %52"
#define EXPERTQMM_WGMMA_D_96 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define EXPERTQMM_WGMMA_ACC_128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define EXPERTQMM_WGMMA_AB_128 "{%64, %65, %66, %67}, %68"
#define EXPERTQMM_WGMMA_D_128 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define EXPERTQMM_WGMMA_ACC_256 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define EXPERTQMM_WGMMA_AB_256 "{%128, %129, %130, %131}, %132"
#define EXPERTQMM_WGMMA_D_256 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

#if EXPERTQMM_WGMMA_ENABLED
#define EXPERTQMM_WGMMA_RS_BODY(TY, N)                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " EXPERTQMM_WGMMA_ACC_##N \
               ", " EXPERTQMM_WGMMA_AB_##N ", p, 1, 1, 0;\n}\n"                                      \
               : EXPERTQMM_WGMMA_D_##N                                                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
#else
#define EXPERTQMM_WGMMA_RS_BODY(TY, N) \
  (void)d;                             \
  (void)a;                             \
  (void)b_desc;                        \
  __trap();
#endif

#define EXPERTQMM_DEFINE_WGMMA_RS(T, TY, N)                                                          \
  template <>                                                                                       \
  struct WgmmaRS<T, N> {                                                                            \
    static __device__ __forceinline__ void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b_desc) { \
      EXPERTQMM_WGMMA_RS_BODY(TY, N)                                                                \
    }                                                                                               \
  };

EXPERTQMM_DEFINE_WGMMA_RS(__nv_bfloat16, "bf16", 16)
EXPERTQMM_DEFINE_WGMMA_RS(__half, "f16", 16)
EXPERTQMM_DEFINE_WGMMA_RS(__nv_bfloat16, "bf16", 32)
EXPERTQMM_DEFINE_WGMMA_RS(__half, "f16", 32)
EXPERTQMM_DEFINE_WGMMA_RS(__nv_bfloat16, "bf16", 64)
EXPERTQMM_DEFINE_WGMMA_RS(__half, "f16", 64)
EXPERTQMM_DEFINE_WGMMA_RS(__nv_bfloat16, "bf16", 96)
EXPERTQMM_DEFINE_WGMMA_RS(__half, "f16", 96)
EXPERTQMM_DEFINE_WGMMA_RS(__nv_bfloat16, "bf16", 128)
EXPERTQMM_DEFINE_WGMMA_RS(__half, "f16", 128)
EXPERTQMM_DEFINE_WGMMA_RS(__nv_bfloat16, "bf16", 256)
EXPERTQMM_DEFINE_WGMMA_RS(__half, "f16", 256)

}  // namespace expertqmm::cuda::device

// A quantized dense linear as a dequantization into 16 bits and cuBLAS's GEMM (dense_cublas.h).
// cuBLAS is the dense GEMM to beat on NVIDIA GPUs; what it cannot read is MLX's codes, so they are
// expanded first: for the Gemma 4 block's 8-bit dense MLP at 2048 tokens the 35.7 MB of 16-bit
// weights cost a few µs of streaming against the wave quantization of a single matrix on our own
// tile kernel (bench/NOTES.md step 59 has the measurement that chose it).
#include "cuda/dense_cublas.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <map>
#include <type_traits>

#include "core/workspace_slots.h"
#include "cuda/cuda_backend.h"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

namespace {

constexpr const char* kOp = "dense_cublas";
constexpr int kThreads = 256;
// cuBLAS's scratch (its split-K and stream-K partials). NVIDIA recommends 32 MiB on Hopper; the
// Gemma shapes at 512-2048 rows are large enough that 8 MiB leaves its choice of kernels alone.
constexpr size_t kCublasWorkspaceBytes = size_t(8) << 20;

// Two 16-bit values of D in one register, as the type __hfma2 takes for D.
template <DType D>
using Pair = std::conditional_t<D == DType::bf16, __nv_bfloat162, __half2>;
template <DType D>
__device__ __forceinline__ Pair<D> as_pair(uint32_t bits) {
  return *reinterpret_cast<const Pair<D>*>(&bits);
}

// The codes of one unit, 8 values of one row (one 16-byte output store): 4 or 8 bytes.
template <int kBits>
using UnitCodes = std::conditional_t<kBits == 4, uint32_t, uint2>;
constexpr int kUnitsPerThread = 4;  // loads in flight per thread before any math

// q as an exact fp32 value: 2^23 + q has q in its low mantissa bits (FADD, not the quarter-rate I2F).
__device__ __forceinline__ float code_to_float(uint32_t q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }

// out[n, k] = T(q[n, k] * s + b), the fma in T (exact product and sum, one rounding), as the
// tensor-core routes dequantize (docs/numerics.md); q up to 255 is exact in bf16 and f16.
//   codes  [N, K * kBits / 32] uint32, LSB-first per row; scales, biases [N, K / group] of D
//   out    [N, K] of D
// Work split: a unit is 8 consecutive values of one row, i.e. one 16-byte store; rows are
// contiguous and K is a multiple of the group, so unit u lies in group u / (group / 8) counted over
// the whole matrix and no row index is needed. A CTA takes kUnitsPerThread * blockDim contiguous
// units, a thread every blockDim-th of them: each warp load reads 128 or 256 contiguous code bytes
// and each warp store writes 512 contiguous bytes, and a thread has kUnitsPerThread code loads in
// flight before it converts (bench/NOTES.md step 60: ~2.6 TB/s at the margin on an H100).
template <DType D, int kBits>
__global__ void dequantize_for_gemm_kernel(const UnitCodes<kBits>* __restrict__ codes,
                                           const uint16_t* __restrict__ scales, const uint16_t* __restrict__ biases,
                                           uint32_t units, uint32_t units_per_group, uint4* __restrict__ out) {
  constexpr uint32_t kMask = (1u << kBits) - 1;
  const uint32_t first = blockIdx.x * (blockDim.x * kUnitsPerThread) + threadIdx.x;
  UnitCodes<kBits> q[kUnitsPerThread];
  uint16_t s16[kUnitsPerThread], b16[kUnitsPerThread];
#pragma unroll
  for (int i = 0; i < kUnitsPerThread; ++i) {
    const uint32_t u = first + i * blockDim.x;
    if (u >= units) break;
    q[i] = codes[u];
    s16[i] = scales[u / units_per_group];
    b16[i] = biases[u / units_per_group];
  }
#pragma unroll
  for (int i = 0; i < kUnitsPerThread; ++i) {
    const uint32_t u = first + i * blockDim.x;
    if (u >= units) break;
    const Pair<D> s = as_pair<D>(s16[i] * 0x10001u), b = as_pair<D>(b16[i] * 0x10001u);
    uint32_t words[kBits / 4];
    if constexpr (kBits == 4) {
      words[0] = q[i];
    } else {
      words[0] = q[i].x;
      words[1] = q[i].y;
    }
    uint32_t packed[4];
#pragma unroll
    for (int v = 0; v < 8; v += 2) {
      const uint32_t w = words[v * kBits / 32];
      const int shift = (v * kBits) % 32;
      const Pair<D> qv = as_pair<D>(
          Elem<D>::pack2(code_to_float((w >> shift) & kMask), code_to_float((w >> (shift + kBits)) & kMask)));
      const Pair<D> r = __hfma2(qv, s, b);
      packed[v / 2] = *reinterpret_cast<const uint32_t*>(&r);
    }
    out[u] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

// One cuBLAS handle per host thread and device: a handle is not to be shared by threads issuing
// work at once, and each is bound to the device current when it was made.
cublasHandle_t handle_for_current_device() {
  struct Handles {
    std::map<int, cublasHandle_t> by_device;
    ~Handles() {
      for (auto& [device, h] : by_device) cublasDestroy(h);
    }
  };
  thread_local Handles handles;
  int device = 0;
  EXPERTQMM_CUDA_CHECK(cudaGetDevice(&device));
  auto it = handles.by_device.find(device);
  if (it != handles.by_device.end()) return it->second;
  cublasHandle_t h = nullptr;
  const cublasStatus_t st = cublasCreate(&h);
  EXPERTQMM_CHECK(st == CUBLAS_STATUS_SUCCESS, kOp, "cublasCreate failed on device ", device, ": ",
                  cublasGetStatusString(st));
  handles.by_device.emplace(device, h);
  return h;
}

void check_cublas(cublasStatus_t st, const char* what, int64_t T, int64_t N, int64_t K) {
  EXPERTQMM_CHECK(st == CUBLAS_STATUS_SUCCESS, kOp, what, " failed for out [", T, ", ", N, "] = x [", T, ", ", K,
                  "] @ w^T: ", cublasGetStatusString(st));
}

}  // namespace

bool dense_cublas_fits(const QuantizedWeight& q, DType x_dtype, const char** why) {
  auto no = [&](const char* reason) {
    if (why) *why = reason;
    return false;
  };
  if (q.mode != QuantMode::affine) return no("not affine codes");
  if (q.bits != 4 && q.bits != 8) return no("codes of other than 4 or 8 bits");
  if (q.group_size != 32 && q.group_size != 64 && q.group_size != 128) return no("a group other than 32, 64 or 128");
  if (x_dtype != DType::bf16 && x_dtype != DType::f16) return no("activations other than bf16 or f16");
  if (q.scales.dtype() != x_dtype || q.biases.dtype() != x_dtype) return no("scales or biases of another dtype");
  if (q.w.ndim() != 2 || !q.w.is_contiguous() || !q.scales.is_contiguous() || !q.biases.is_contiguous())
    return no("not one contiguous [N, K] matrix");
  if (!is_aligned(q.w.data(), 16)) return no("codes not 16-byte aligned");
  return true;
}

void dequantize_for_gemm(const QuantizedWeight& q, void* out, cudaStream_t stream) {
  const char* why = "";
  EXPERTQMM_CHECK(dense_cublas_fits(q, q.scales.dtype(), &why), kOp, "cannot dequantize ", q.w.describe(), " (",
                  q.bits, "-bit, group ", q.group_size, "): ", why);
  EXPERTQMM_CHECK(is_aligned(out, 16), kOp, "the dequantized weight's buffer must be 16-byte aligned");
  const int64_t rows = q.w.size(0), K = q.w.size(1) * 32 / q.bits;
  const int64_t units = rows * K / 8;  // K is a multiple of the group, so of 8
  if (units == 0) return;
  EXPERTQMM_CHECK(units <= UINT32_MAX, kOp, "a weight of ", rows, " x ", K, " values is past 32-bit unit indices");
  const int64_t per_cta = int64_t{kThreads} * kUnitsPerThread;
  const unsigned grid = static_cast<unsigned>((units + per_cta - 1) / per_cta);
  const uint32_t units_per_group = static_cast<uint32_t>(q.group_size / 8);
  dispatch_float(q.scales.dtype(), kOp, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if constexpr (D == DType::f32) {
      EXPERTQMM_CHECK(false, kOp, "f32 scales are not dequantized for cuBLAS");
    } else {
      auto* s = q.scales.data_as<const uint16_t>();
      auto* b = q.biases.data_as<const uint16_t>();
      auto* o = static_cast<uint4*>(out);
      const auto n = static_cast<uint32_t>(units);
      if (q.bits == 4)
        dequantize_for_gemm_kernel<D, 4>
            <<<grid, kThreads, 0, stream>>>(static_cast<const UnitCodes<4>*>(q.w.data()), s, b, n, units_per_group, o);
      else
        dequantize_for_gemm_kernel<D, 8>
            <<<grid, kThreads, 0, stream>>>(static_cast<const UnitCodes<8>*>(q.w.data()), s, b, n, units_per_group, o);
      EXPERTQMM_CUDA_CHECK_LAUNCH(dequantize_for_gemm_kernel);
    }
  });
}

void cublas_linear(DType dtype, const void* w, const void* x, int64_t ldx, void* out, int64_t ldo, int64_t T,
                   int64_t N, int64_t K, Workspace& ws, cudaStream_t stream) {
  EXPERTQMM_CHECK(dtype == DType::bf16 || dtype == DType::f16, kOp, "cuBLAS linears take bf16 or f16, got ",
                  dtype_name(dtype));
  EXPERTQMM_CHECK(T <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX && ldx <= INT32_MAX && ldo <= INT32_MAX, kOp,
                  "a dimension past int32: out [", T, ", ", N, "], K ", K);
  if (T == 0 || N == 0) return;
  cublasHandle_t h = handle_for_current_device();
  check_cublas(cublasSetStream(h, stream), "cublasSetStream", T, N, K);
  void* scratch = ws.get(detail::kSlotCublas, kCublasWorkspaceBytes);
  check_cublas(cublasSetWorkspace(h, scratch, kCublasWorkspaceBytes), "cublasSetWorkspace", T, N, K);
  const cudaDataType_t t = dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_16F;
  const float one = 1.0f, zero = 0.0f;
  // Column-major view: out^T [N, T] = w [N, K] (w^T stored, op T) x^T [K, T].
  check_cublas(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(T), static_cast<int>(K),
                            &one, w, t, static_cast<int>(K), x, t, static_cast<int>(ldx), &zero, out, t,
                            static_cast<int>(ldo), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx", T, N, K);
}

}  // namespace expertqmm::cuda

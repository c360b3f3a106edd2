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

// out[n, k] = T(q[n, k] * s + b), the fma in T (exact product and sum, one rounding), as the
// tensor-core routes dequantize (docs/numerics.md); q up to 255 is exact in bf16 and f16.
//   codes  [N, K * kBits / 32] uint32, LSB-first per row; scales, biases [N, K / group] of D
//   out    [N, K] of D
// Work split: one thread per 16-byte chunk of codes (32 4-bit or 16 8-bit values of one row, so of
// one group: group >= 32), one 16-byte load and 4 or 2 16-byte stores; consecutive threads take
// consecutive chunks, so a warp reads 512 contiguous code bytes and writes 1-2 KB.
template <DType D, int kBits>
__global__ void dequantize_for_gemm_kernel(const uint4* __restrict__ codes, const uint16_t* __restrict__ scales,
                                           const uint16_t* __restrict__ biases, int64_t chunks, int64_t chunks_per_row,
                                           int group, uint4* __restrict__ out) {
  constexpr int kValues = 128 / kBits;  // per chunk
  constexpr uint32_t kMask = (1u << kBits) - 1;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= chunks) return;
  const int64_t row = c / chunks_per_row;
  const int64_t k0 = (c - row * chunks_per_row) * kValues;
  const int64_t g = row * (chunks_per_row * kValues / group) + k0 / group;
  const Pair<D> s = as_pair<D>(scales[g] * 0x10001u), b = as_pair<D>(biases[g] * 0x10001u);
  const uint4 q4 = codes[c];
  const uint32_t words[4] = {q4.x, q4.y, q4.z, q4.w};
  uint32_t packed[kValues / 2];
#pragma unroll
  for (int i = 0; i < kValues; i += 2) {
    const uint32_t w = words[i * kBits / 32];
    const int shift = (i * kBits) % 32;
    const Pair<D> q = as_pair<D>(Elem<D>::pack2(float((w >> shift) & kMask), float((w >> (shift + kBits)) & kMask)));
    const Pair<D> v = __hfma2(q, s, b);
    packed[i / 2] = *reinterpret_cast<const uint32_t*>(&v);
  }
#pragma unroll
  for (int j = 0; j < kValues / 8; ++j)
    out[c * (kValues / 8) + j] = make_uint4(packed[4 * j], packed[4 * j + 1], packed[4 * j + 2], packed[4 * j + 3]);
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
  const int64_t chunks_per_row = K * q.bits / 128, chunks = rows * chunks_per_row;
  if (chunks == 0) return;
  const unsigned grid = static_cast<unsigned>((chunks + kThreads - 1) / kThreads);
  dispatch_float(q.scales.dtype(), kOp, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if constexpr (D == DType::f32) {
      EXPERTQMM_CHECK(false, kOp, "f32 scales are not dequantized for cuBLAS");
    } else {
      auto* codes = static_cast<const uint4*>(q.w.data());
      auto* s = q.scales.data_as<const uint16_t>();
      auto* b = q.biases.data_as<const uint16_t>();
      if (q.bits == 4)
        dequantize_for_gemm_kernel<D, 4><<<grid, kThreads, 0, stream>>>(codes, s, b, chunks, chunks_per_row, q.group_size,
                                                                        static_cast<uint4*>(out));
      else
        dequantize_for_gemm_kernel<D, 8><<<grid, kThreads, 0, stream>>>(codes, s, b, chunks, chunks_per_row, q.group_size,
                                                                        static_cast<uint4*>(out));
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

// The peer's own kernels (kernels.h): simple and obviously right rather than fast, except
// group_sums and bias_term, which are inside the timed affine GEMMs.
#include <cuda_bf16.h>

#include <cmath>

#include "cuda/check.cuh"
#include "kernels.h"

namespace expertqmm::peer {

namespace {

__device__ float bf16_to_float(uint16_t bits) { return __bfloat162float(__ushort_as_bfloat16(bits)); }
__device__ uint16_t float_to_bf16(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

// The row-per-block kernels put the row in blockIdx.y.
void check_rows(int rows, const char* kernel) {
  EXPERTQMM_CHECK(rows >= 1 && rows <= 65535, "cutlass peer", kernel, ": ", rows,
                  " rows; one block row per row allows 1 to 65535 (at most 8191 tokens at top-8)");
}

unsigned blocks_for(size_t count, unsigned threads) {
  const size_t b = (count + threads - 1) / threads;
  return unsigned(b < 65535u * 16u ? b : 65535u * 16u);  // grid-stride loops cover the rest
}

__global__ void flip_code_sign_kernel(uint32_t* words, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x)
    words[i] ^= 0x88888888u;
}

__global__ void transpose_groups_kernel(const uint16_t* src, uint16_t* dst, int experts, int n, int groups) {
  const size_t total = size_t(experts) * n * groups;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const size_t e = i / (size_t(n) * groups), rest = i % (size_t(n) * groups);
    const size_t g = rest / n, j = rest % n;  // i indexes dst [e][g][j]
    dst[i] = src[(e * n + j) * groups + g];
  }
}

// One warp per (row, group): 32 lanes x 2 values cover a group of 64 (group_size % 64 == 0).
__global__ void group_sums_kernel(const uint16_t* x, int rows, int k, int group_size, float* sums) {
  const int groups = k / group_size;
  const size_t warp = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= size_t(rows) * groups) return;
  const size_t r = warp / groups, g = warp % groups;
  const uint16_t* p = x + r * k + g * group_size;
  float s = 0;
  for (int c = 2 * lane; c < group_size; c += 64) {
    const uint32_t two = *reinterpret_cast<const uint32_t*>(p + c);
    s += bf16_to_float(uint16_t(two & 0xffff)) + bf16_to_float(uint16_t(two >> 16));
  }
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) sums[warp] = s;
}

__global__ void bias_term_kernel(const float* sums, const int32_t* expert_of_row, const uint16_t* biases_t, int n,
                                 int groups, uint16_t* c) {
  const int r = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const uint16_t* b = biases_t + size_t(expert_of_row[r]) * groups * n + j;
  const float* s = sums + size_t(r) * groups;
  float acc = 0;
  for (int g = 0; g < groups; ++g) acc += s[g] * bf16_to_float(b[size_t(g) * n]);
  c[size_t(r) * n + j] = float_to_bf16(acc);
}

__global__ void reference_gemm_kernel(const uint16_t* x, const int32_t* expert_of_row, const uint32_t* codes,
                                      const uint16_t* scales, const uint16_t* biases, int n, int k, int group_size,
                                      bool affine, float* out) {
  extern __shared__ float x_row[];
  const int r = blockIdx.y;
  for (int c = threadIdx.x; c < k; c += blockDim.x) x_row[c] = bf16_to_float(x[size_t(r) * k + c]);
  __syncthreads();
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const size_t row = size_t(expert_of_row[r]) * n + j;  // weight row [expert][j]
  const int groups = k / group_size;
  const uint32_t* q = codes + row * (k / 8);
  float acc = 0;
  for (int g = 0; g < groups; ++g) {
    const float s = bf16_to_float(scales[row * groups + g]);
    const float b = affine ? bf16_to_float(biases[row * groups + g]) : 0.0f;
    for (int w = g * group_size / 8; w < (g + 1) * group_size / 8; ++w) {
      const uint32_t word = q[w];
      for (int v = 0; v < 8; ++v) {
        const float code = float((word >> (4 * v)) & 0xf);
        const float wv = affine ? fmaf(s, code, b) : s * (code - 8.0f);
        acc += x_row[w * 8 + v] * __bfloat162float(__float2bfloat16_rn(wv));
      }
    }
  }
  out[size_t(r) * n + j] = acc;
}

__global__ void glu_rows_kernel(const float* gate_up, int rows, int i, bool swiglu, uint16_t* act) {
  const size_t total = size_t(rows) * i;
  for (size_t t = blockIdx.x * size_t(blockDim.x) + threadIdx.x; t < total; t += size_t(gridDim.x) * blockDim.x) {
    const size_t r = t / i, j = t % i;
    const float g = gate_up[r * 2 * i + j], u = gate_up[r * 2 * i + i + j];
    const float f = swiglu ? g / (1.0f + expf(-g))
                           : 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    act[t] = float_to_bf16(f * u);
  }
}

__global__ void fill_nan_kernel(uint16_t* d, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x)
    d[i] = 0x7fc0;  // bf16 quiet NaN
}

__global__ void rel_error_kernel(const uint16_t* got, const float* ref, size_t count, double* sums) {
  double diff = 0, norm = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    const double g = bf16_to_float(got[i]), f = ref[i];
    diff += (g - f) * (g - f);  // NaN propagates into the sum
    norm += f * f;
  }
  for (int off = 16; off > 0; off /= 2) {
    diff += __shfl_xor_sync(0xffffffffu, diff, off);
    norm += __shfl_xor_sync(0xffffffffu, norm, off);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums[0], diff);
    atomicAdd(&sums[1], norm);
  }
}

}  // namespace

void flip_code_sign(uint32_t* words, size_t count, cudaStream_t stream) {
  flip_code_sign_kernel<<<blocks_for(count, 256), 256, 0, stream>>>(words, count);
  EXPERTQMM_CUDA_CHECK_LAUNCH("flip_code_sign");
}

void transpose_groups(const uint16_t* src, uint16_t* dst, int experts, int n, int groups, cudaStream_t stream) {
  transpose_groups_kernel<<<blocks_for(size_t(experts) * n * groups, 256), 256, 0, stream>>>(src, dst, experts, n,
                                                                                            groups);
  EXPERTQMM_CUDA_CHECK_LAUNCH("transpose_groups");
}

void group_sums(const uint16_t* x, int rows, int k, int group_size, float* sums, cudaStream_t stream) {
  const size_t threads = size_t(rows) * (k / group_size) * 32;
  group_sums_kernel<<<unsigned((threads + 255) / 256), 256, 0, stream>>>(x, rows, k, group_size, sums);
  EXPERTQMM_CUDA_CHECK_LAUNCH("group_sums");
}

void bias_term(const float* sums, const int32_t* expert_of_row, const uint16_t* biases_t, int rows, int n,
               int groups, uint16_t* c, cudaStream_t stream) {
  check_rows(rows, "bias_term");
  bias_term_kernel<<<dim3(unsigned((n + 127) / 128), unsigned(rows)), 128, 0, stream>>>(sums, expert_of_row, biases_t,
                                                                                       n, groups, c);
  EXPERTQMM_CUDA_CHECK_LAUNCH("bias_term");
}

void reference_gemm(const uint16_t* x, const int32_t* expert_of_row, int rows, const uint32_t* codes,
                    const uint16_t* scales, const uint16_t* biases, int n, int k, int group_size, QuantForm form,
                    float* out, cudaStream_t stream) {
  check_rows(rows, "reference_gemm");
  reference_gemm_kernel<<<dim3(unsigned((n + 127) / 128), unsigned(rows)), 128, size_t(k) * sizeof(float), stream>>>(
      x, expert_of_row, codes, scales, biases, n, k, group_size, form == QuantForm::affine, out);
  EXPERTQMM_CUDA_CHECK_LAUNCH("reference_gemm");
}

void glu_rows(const float* gate_up, int rows, int i, bool swiglu, uint16_t* act, cudaStream_t stream) {
  glu_rows_kernel<<<blocks_for(size_t(rows) * i, 256), 256, 0, stream>>>(gate_up, rows, i, swiglu, act);
  EXPERTQMM_CUDA_CHECK_LAUNCH("glu_rows");
}

void fill_nan(uint16_t* d, size_t count, cudaStream_t stream) {
  fill_nan_kernel<<<blocks_for(count, 256), 256, 0, stream>>>(d, count);
  EXPERTQMM_CUDA_CHECK_LAUNCH("fill_nan");
}

double rel_error(const uint16_t* got, const float* ref, size_t count, cudaStream_t stream) {
  double* sums = nullptr;
  EXPERTQMM_CUDA_CHECK(cudaMalloc(&sums, 2 * sizeof(double)));
  double host[2] = {0, 0};
  try {
    EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(sums, 0, 2 * sizeof(double), stream));
    rel_error_kernel<<<blocks_for(count, 256) < 1024 ? blocks_for(count, 256) : 1024, 256, 0, stream>>>(got, ref,
                                                                                                       count, sums);
    EXPERTQMM_CUDA_CHECK_LAUNCH("rel_error");
    EXPERTQMM_CUDA_CHECK(cudaMemcpyAsync(host, sums, sizeof(host), cudaMemcpyDeviceToHost, stream));
    EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(stream));
  } catch (...) {
    cudaFree(sums);
    throw;
  }
  cudaFree(sums);
  return host[1] > 0 ? std::sqrt(host[0] / host[1]) : (host[0] == 0 ? 0.0 : NAN);
}

}  // namespace expertqmm::peer

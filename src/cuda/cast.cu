// launch_cast (moe_internal.h): elementwise dtype conversion of contiguous values.
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

namespace {

constexpr int kThreads = 256;

// dst[i] = To(From(src[i])): (n) contiguous values. Work split: one thread per value, grid-stride.
template <DType From, DType To>
__global__ void cast_kernel(const typename Elem<From>::storage* __restrict__ src,
                            typename Elem<To>::storage* __restrict__ dst, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = Elem<To>::store(Elem<From>::load(src[i]));
}

// The same cast, 8 values per thread: (n8, 8) values, src and dst aligned to 8 values, so each
// thread moves them with 16-byte loads and stores (2-byte scalar stores ran at ~1.5 TB/s,
// bench/NOTES.md step 7b).
template <DType From, DType To>
__global__ void cast8_kernel(const typename Elem<From>::storage* __restrict__ src,
                             typename Elem<To>::storage* __restrict__ dst, int64_t n8) {
  using SF = typename Elem<From>::storage;
  using ST = typename Elem<To>::storage;
  struct alignas(8 * sizeof(SF)) In { SF v[8]; };
  struct alignas(8 * sizeof(ST)) Out { ST v[8]; };
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const In a = reinterpret_cast<const In*>(src)[i];
    Out b;
#pragma unroll
    for (int e = 0; e < 8; ++e) b.v[e] = Elem<To>::store(Elem<From>::load(a.v[e]));
    reinterpret_cast<Out*>(dst)[i] = b;
  }
}

}  // namespace

void launch_cast(DType from, const void* src, DType to, void* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  dispatch_float(from, "cast", [&](auto ftag) {
    constexpr DType F = decltype(ftag)::value;
    dispatch_float(to, "cast", [&](auto ttag) {
      constexpr DType D = decltype(ttag)::value;
      using SF = typename Elem<F>::storage;
      using SD = typename Elem<D>::storage;
      const bool vector = n % 8 == 0 && reinterpret_cast<uintptr_t>(src) % (8 * sizeof(SF)) == 0 &&
                          reinterpret_cast<uintptr_t>(dst) % (8 * sizeof(SD)) == 0;
      const int64_t items = vector ? n / 8 : n;
      const int64_t blocks = (items + kThreads - 1) / kThreads;
      const unsigned grid = static_cast<unsigned>(blocks > 1048576 ? 1048576 : blocks);
      if (vector) {
        cast8_kernel<F, D><<<grid, kThreads, 0, stream>>>(static_cast<const SF*>(src), static_cast<SD*>(dst), items);
        EXPERTQMM_CUDA_CHECK_LAUNCH(cast8_kernel);
      } else {
        cast_kernel<F, D><<<grid, kThreads, 0, stream>>>(static_cast<const SF*>(src), static_cast<SD*>(dst), n);
        EXPERTQMM_CUDA_CHECK_LAUNCH(cast_kernel);
      }
    });
  });
}

}  // namespace expertqmm::cuda

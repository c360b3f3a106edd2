// Kernel 3 of the decode layer (moe_decode.h) on tensor cores, for 4-bit experts: each token's k
// down GEMVs, weighted and summed in slot order.
#include "cuda/device/pdl.cuh"
#include "cuda/moe_decode_tiles.cuh"

namespace expertqmm::cuda::decode {

namespace {

template <DType D, int G, bool kFp = false>
__global__ void __launch_bounds__(kThreads, 2) decode_down_combine_mma_kernel(DownArgs a) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  device::pdl_launch_dependents();  // a chained exit kernel may load its other inputs meanwhile
  down_combine_mma_tile<D, G, kFp>(a, blockIdx.x, blockIdx.y, tc_smem);
}

}  // namespace


size_t down_mma_smem(int64_t k, int64_t I, int G, bool fp) {
  return static_cast<size_t>(k) * DownTcLayout(static_cast<int>(I), fp ? kTcFpLayoutGroup : G).per_warp;
}

void launch_down_mma(DType dtype, int G, const DownArgs& a, int T, size_t smem, cudaStream_t stream, bool fp) {
  const dim3 grid(static_cast<unsigned>(T), ceil_div(a.H, kTcRows));
  auto launch = [&](auto kernel) {
    allow_smem(reinterpret_cast<const void*>(kernel));
    kernel<<<grid, kThreads, smem, stream>>>(a);
    EXPERTQMM_CUDA_CHECK_LAUNCH(decode_down_combine_mma_kernel);
  };
  const bool bf16 = dtype == DType::bf16;
  if (fp) launch(decode_down_combine_mma_kernel<DType::bf16, kTcFpLayoutGroup, true>);  // the mode's group at run time
  else if (G == 32) launch(bf16 ? decode_down_combine_mma_kernel<DType::bf16, 32> : decode_down_combine_mma_kernel<DType::f16, 32>);
  else if (G == 64) launch(bf16 ? decode_down_combine_mma_kernel<DType::bf16, 64> : decode_down_combine_mma_kernel<DType::f16, 64>);
  else launch(bf16 ? decode_down_combine_mma_kernel<DType::bf16, 128> : decode_down_combine_mma_kernel<DType::f16, 128>);
}

}  // namespace expertqmm::cuda::decode

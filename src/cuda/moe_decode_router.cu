// Kernel 1 of the decode layer (moe_decode.h): the router with top-k, softmax and the expert plan
// (the CTA's work: router_cta in moe_decode_router.cuh).
#include "cuda/moe_decode_router.cuh"

namespace expertqmm::cuda::decode {

namespace {

template <DType D, int kProj, bool kFp, bool kSoftmaxTopk>
__global__ void __launch_bounds__(kRouterThreads) decode_router_kernel(RouterArgs a) {
  extern __shared__ __align__(16) float smem[];  // scale*root_size row, then T raw h rows (padded)
  router_cta<D, kProj, kFp, kSoftmaxTopk>(a, blockIdx.x, smem);
}

}  // namespace

size_t router_smem(int64_t T, int64_t H) {
  return static_cast<size_t>((T + 1) * round_up4(padded(static_cast<int>(H)))) * 4;  // scale row + T h rows
}

void launch_router(DType dtype, int proj_bits, const RouterArgs& a, size_t smem, cudaStream_t stream, bool fp,
                   bool chained) {
  auto launch = [&](auto kernel) {
    allow_smem(reinterpret_cast<const void*>(kernel));
    launch_maybe_chained(kernel, static_cast<unsigned>(a.E), kRouterThreads, smem, stream, chained, a);
  };
  const bool bf16 = dtype == DType::bf16;
  auto with_kind = [&](auto dtag, auto ptag, auto fptag) {
    constexpr DType DT = decltype(dtag)::value;
    constexpr int P = decltype(ptag)::value;
    constexpr bool F = decltype(fptag)::value;
    if (a.softmax_topk) launch(decode_router_kernel<DT, P, F, true>);
    else launch(decode_router_kernel<DT, P, F, false>);
  };
  using BF16 = std::integral_constant<DType, DType::bf16>;
  using F16 = std::integral_constant<DType, DType::f16>;
  using Affine = std::false_type;
  auto with_bits = [&](auto dtag, auto fptag) {
    if (proj_bits == 0) with_kind(dtag, std::integral_constant<int, 0>{}, fptag);
    else if (proj_bits == 4) with_kind(dtag, std::integral_constant<int, 4>{}, fptag);
    else with_kind(dtag, std::integral_constant<int, 8>{}, fptag);
  };
  if (fp) {  // bf16, 4- or 8-bit codes (supports_decode_layer)
    if (proj_bits == 4) with_kind(BF16{}, std::integral_constant<int, 4>{}, std::true_type{});
    else with_kind(BF16{}, std::integral_constant<int, 8>{}, std::true_type{});
  } else if (bf16) {
    with_bits(BF16{}, Affine{});
  } else {
    with_bits(F16{}, Affine{});
  }
}

}  // namespace expertqmm::cuda::decode

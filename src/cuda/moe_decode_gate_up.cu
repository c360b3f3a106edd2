// Kernel 2 of the decode layer (moe_decode.h) on tensor cores, for 4-bit experts: gate and up of
// every row routed to an expert, then the GLU product; one CTA per work item (moe_decode_tiles.cuh).
#include "cuda/moe_decode_tiles.cuh"

namespace expertqmm::cuda::decode {

namespace {

// __launch_bounds__(256, 2): 72 registers, 3 CTAs per SM by registers. A 4-per-SM build (64
// registers) for multi-wave grids lost at T = 4 / 8 (bench/NOTES.md step 31: the kernel issues an
// instruction in 58% of its cycles at T = 8, so more warps per SM do not hide more).
// kSource: the plan, or a one-token call's CTAs ranking the router's logits (GateUpArgs::logits).
template <DType D, int G, Activation A, bool kFp, GroupSource kSource>
__global__ void __launch_bounds__(kThreads, 2) decode_gate_up_glu_mma_kernel(GateUpArgs a) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  gate_up_glu_mma_tile<D, G, A, kFp, kSource>(a, blockIdx.x, blockIdx.y, tc_smem);
}

// Calls f(dtype tag, group tag, fp tag, activation tag) with the compile-time values of the run-time ones.
template <class F>
void with_gate_up_instance(DType dtype, int G, Activation act, bool fp, F&& f) {
  auto with_form = [&](auto dtag, auto gtag, auto fptag) {
    if (act == Activation::geglu) f(dtag, gtag, fptag, std::integral_constant<Activation, Activation::geglu>{});
    else f(dtag, gtag, fptag, std::integral_constant<Activation, Activation::swiglu>{});
  };
  auto with_dtype = [&](auto dtag) {
    if (G == 32) with_form(dtag, std::integral_constant<int, 32>{}, std::false_type{});
    else if (G == 64) with_form(dtag, std::integral_constant<int, 64>{}, std::false_type{});
    else with_form(dtag, std::integral_constant<int, 128>{}, std::false_type{});
  };
  if (fp) {  // bf16, the mode's group read at run time (supports_decode_layer)
    with_form(std::integral_constant<DType, DType::bf16>{}, std::integral_constant<int, kTcFpLayoutGroup>{},
              std::true_type{});
  } else if (dtype == DType::bf16) {
    with_dtype(std::integral_constant<DType, DType::bf16>{});
  } else {
    with_dtype(std::integral_constant<DType, DType::f16>{});
  }
}

}  // namespace


size_t gate_up_mma_smem(int64_t H, int G, bool fp) {
  return GateUpTcLayout(static_cast<int>(H), fp ? kTcFpLayoutGroup : G).total;
}

void launch_gate_up_mma(DType dtype, int G, Activation act, const GateUpArgs& a, size_t smem, cudaStream_t stream,
                        bool fp) {
  const dim3 grid(ceil_div(a.I, kTcRows), static_cast<unsigned>(a.group_rows));
  auto launch = [&](auto kernel) {
    allow_smem(reinterpret_cast<const void*>(kernel));
    kernel<<<grid, kThreads, smem, stream>>>(a);
    EXPERTQMM_CUDA_CHECK_LAUNCH(decode_gate_up_glu_mma_kernel);
  };
  const GroupSource source = a.logits == nullptr ? GroupSource::plan
                             : a.softmax_topk      ? GroupSource::rank_softmax
                                                   : GroupSource::rank_logits;
  with_gate_up_instance(dtype, G, act, fp, [&](auto dtag, auto gtag, auto fptag, auto atag) {
    constexpr DType DT = decltype(dtag)::value;
    constexpr int GS = decltype(gtag)::value;
    constexpr bool F = decltype(fptag)::value;
    constexpr Activation AC = decltype(atag)::value;
    if (source == GroupSource::plan) launch(decode_gate_up_glu_mma_kernel<DT, GS, AC, F, GroupSource::plan>);
    else if (source == GroupSource::rank_logits) launch(decode_gate_up_glu_mma_kernel<DT, GS, AC, F, GroupSource::rank_logits>);
    else launch(decode_gate_up_glu_mma_kernel<DT, GS, AC, F, GroupSource::rank_softmax>);
  });
}

}  // namespace expertqmm::cuda::decode

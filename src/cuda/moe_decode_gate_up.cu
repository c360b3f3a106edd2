// Kernel 2 of the decode layer (moe_decode.h) on tensor cores, for 4-bit experts: gate and up of
// every row routed to an expert, then the GLU product.
#include "cuda/gather_qmm_routes.h"  // device_sm_count, device_smem_per_sm
#include "cuda/moe_decode_tiles.cuh"

namespace expertqmm::cuda::decode {

namespace {

// kMinCtas: 2 (72 registers: 3 CTAs per SM by registers), or 4 (capped at 64 registers) for grids of
// more than one wave at 3 CTAs per SM (T >= 2 at Gemma's geometry) where 4 CTAs' shared memory fits
// the SM (Hopper at Gemma's H: 4 x 52 KB): more codes in flight per SM while other CTAs compute, the
// gate/up kernel at T = 8 being at 47% of DRAM bandwidth (bench/NOTES.md step 31). Built where the
// 2-per-SM build holds more than 64 registers and the cap spills nothing (bf16, g32 / g64: ptxas;
// the others already fit 4 by registers, or would spill); the one-wave grids of T = 1 keep the
// 2-per-SM build, which alone routes a one-token call itself (step 33).
template <DType D, int G, bool kFp>
constexpr bool kFourPerSm = !kFp && D == DType::bf16 && (G == 32 || G == 64);

template <DType D, int G, Activation A, bool kFp = false, int kMinCtas = 2>
__global__ void __launch_bounds__(kThreads, kMinCtas) decode_gate_up_glu_mma_kernel(GateUpArgs a) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  gate_up_glu_mma_tile<D, G, A, kFp, /*kRoutes=*/kMinCtas == 2>(a, blockIdx.x, blockIdx.y, tc_smem);
}

}  // namespace


size_t gate_up_mma_smem(int64_t H, int G, bool fp) {
  return GateUpTcLayout(static_cast<int>(H), fp ? kTcFpLayoutGroup : G).total;
}

void launch_gate_up_mma(DType dtype, int G, Activation act, const GateUpArgs& a, int n, size_t smem,
                        cudaStream_t stream, bool fp) {
  const dim3 grid(ceil_div(a.I, kTcRows), static_cast<unsigned>(std::min(n, a.E)));
  auto launch = [&](auto kernel) {
    allow_smem(reinterpret_cast<const void*>(kernel));
    kernel<<<grid, kThreads, smem, stream>>>(a);
    EXPERTQMM_CUDA_CHECK_LAUNCH(decode_gate_up_glu_mma_kernel);
  };
  constexpr size_t kReservedPerCta = 1024;  // the driver's shared memory per CTA
  const bool four_per_sm = static_cast<int64_t>(grid.x) * grid.y > 3 * static_cast<int64_t>(device_sm_count()) &&
                          4 * (smem + kReservedPerCta) <= device_smem_per_sm() &&
                          a.logits == nullptr;  // the 4-per-SM build does not route itself
  auto with_group = [&](auto dtag, auto gtag) {
    constexpr DType DT = decltype(dtag)::value;
    constexpr int GS = decltype(gtag)::value;
    constexpr int kWide = kFourPerSm<DT, GS, false> ? 4 : 2;
    if (act == Activation::geglu) {
      if (four_per_sm) launch(decode_gate_up_glu_mma_kernel<DT, GS, Activation::geglu, false, kWide>);
      else launch(decode_gate_up_glu_mma_kernel<DT, GS, Activation::geglu>);
    } else {
      if (four_per_sm) launch(decode_gate_up_glu_mma_kernel<DT, GS, Activation::swiglu, false, kWide>);
      else launch(decode_gate_up_glu_mma_kernel<DT, GS, Activation::swiglu>);
    }
  };
  auto with_dtype = [&](auto dtag) {
    if (G == 32) with_group(dtag, std::integral_constant<int, 32>{});
    else if (G == 64) with_group(dtag, std::integral_constant<int, 64>{});
    else with_group(dtag, std::integral_constant<int, 128>{});
  };
  if (fp) {  // bf16, the mode's group read at run time (supports_decode_layer)
    constexpr int kG = kTcFpLayoutGroup;
    if (act == Activation::geglu) launch(decode_gate_up_glu_mma_kernel<DType::bf16, kG, Activation::geglu, true>);
    else launch(decode_gate_up_glu_mma_kernel<DType::bf16, kG, Activation::swiglu, true>);
  } else if (dtype == DType::bf16) {
    with_dtype(std::integral_constant<DType, DType::bf16>{});
  } else {
    with_dtype(std::integral_constant<DType, DType::f16>{});
  }
}

}  // namespace expertqmm::cuda::decode

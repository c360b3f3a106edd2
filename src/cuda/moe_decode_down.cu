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

// The down groups (EXPERTQMM_DECODE_DOWN_GROUPS; moe_decode_tiles.cuh down_groups_mma_tile): CTA
// (x, g) computes down rows [128x, 128x + 128) of plan group g's expert for the group's <= 8 hidden
// rows into partials[flat row, ..] in fp32.
template <DType D, int G, bool kFp>
__global__ void __launch_bounds__(kThreads, 3) decode_down_groups_kernel(DownGroupArgs a) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  down_groups_mma_tile<D, G, kFp>(a, blockIdx.x, blockIdx.y, tc_smem);
}

// out[t, c] = the k slots' partials times their weights, summed in slot order in fp32, one rounding
// (store_slot_sum's arithmetic; a slot whose expert id is out of range is skipped and recorded as a
// fault). Grid (T, ceil(H / 256)), one column per thread: coalesced rows of partials. Every load
// (the k ids, weights and partials) is issued before the sum, one round trip (a loop that read the
// id first took 7.2 µs at T = 16 on the H100 for 1.4 MB: k dependent round trips; NOTES step 45).
template <DType D>
__global__ void __launch_bounds__(kThreads) decode_slot_combine_kernel(DownArgs a, const float* __restrict__ partials) {
  device::pdl_launch_dependents();  // a chained exit kernel may load its other inputs meanwhile
  const int t = blockIdx.x, c = blockIdx.y * kThreads + threadIdx.x;
  if (c >= a.H) return;
  int e[kDecodeMaxTopK];
  float w[kDecodeMaxTopK], v[kDecodeMaxTopK];
#pragma unroll
  for (int j = 0; j < kDecodeMaxTopK; ++j) {
    const int64_t b = static_cast<int64_t>(t) * a.k + j;
    const bool live = j < a.k;
    e[j] = live ? a.indices[b] : 0;
    w[j] = live ? Elem<D>::load(a.weights[b]) : 0.f;
    v[j] = live ? partials[b * a.H + c] : 0.f;  // every (token, slot) row was written by its group
  }
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kDecodeMaxTopK; ++j) {
    if (j >= a.k) break;
    if (e[j] < 0 || e[j] >= a.E) {
      if (c == 0) record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(e[j]), static_cast<uint32_t>(a.E));
      continue;
    }
    sum = __fadd_rn(sum, __fmul_rn(w[j], v[j]));
  }
  a.out[static_cast<int64_t>(t) * a.H + c] = Elem<D>::store(sum);
}

// Calls f(dtype tag, group tag, fp tag) with the compile-time values of the run-time ones (the mode's
// group read at run time for fp: bf16 only, supports_decode_layer).
template <class F>
void with_down_instance(DType dtype, int G, bool fp, F&& f) {
  auto with_group = [&](auto dtag) {
    if (G == 32) f(dtag, std::integral_constant<int, 32>{}, std::false_type{});
    else if (G == 64) f(dtag, std::integral_constant<int, 64>{}, std::false_type{});
    else f(dtag, std::integral_constant<int, 128>{}, std::false_type{});
  };
  if (fp) f(std::integral_constant<DType, DType::bf16>{}, std::integral_constant<int, kTcFpLayoutGroup>{}, std::true_type{});
  else if (dtype == DType::bf16) with_group(std::integral_constant<DType, DType::bf16>{});
  else with_group(std::integral_constant<DType, DType::f16>{});
}

}  // namespace


size_t down_groups_smem(int64_t I, int G, bool fp) {
  return DownStageLayout(static_cast<int>(I), fp ? kTcFpLayoutGroup : G, kWarps * kTcRows, kTcMaxN).total;
}

void launch_down_groups(DType dtype, int G, const DownGroupArgs& a, int group_rows, size_t smem, cudaStream_t stream,
                        bool fp) {
  const dim3 grid(ceil_div(a.H, kWarps * kTcRows), static_cast<unsigned>(group_rows));
  with_down_instance(dtype, G, fp, [&](auto dtag, auto gtag, auto fptag) {
    auto kernel = decode_down_groups_kernel<decltype(dtag)::value, decltype(gtag)::value, decltype(fptag)::value>;
    allow_smem(reinterpret_cast<const void*>(kernel));
    kernel<<<grid, kThreads, smem, stream>>>(a);
    EXPERTQMM_CUDA_CHECK_LAUNCH(decode_down_groups_kernel);
  });
}

void launch_slot_combine(DType dtype, const DownArgs& a, const float* partials, int T, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(T), ceil_div(a.H, kThreads));
  if (dtype == DType::bf16) decode_slot_combine_kernel<DType::bf16><<<grid, kThreads, 0, stream>>>(a, partials);
  else decode_slot_combine_kernel<DType::f16><<<grid, kThreads, 0, stream>>>(a, partials);
  EXPERTQMM_CUDA_CHECK_LAUNCH(decode_slot_combine_kernel);
}

size_t down_mma_smem(int64_t k, int64_t I, int G, bool fp) {
  return static_cast<size_t>(k) * DownStageLayout(static_cast<int>(I), fp ? kTcFpLayoutGroup : G, kTcRows, 1).total;
}

void launch_down_mma(DType dtype, int G, const DownArgs& a, int T, size_t smem, cudaStream_t stream, bool fp) {
  const dim3 grid(static_cast<unsigned>(T), ceil_div(a.H, kTcRows));
  with_down_instance(dtype, G, fp, [&](auto dtag, auto gtag, auto fptag) {
    auto kernel = decode_down_combine_mma_kernel<decltype(dtag)::value, decltype(gtag)::value, decltype(fptag)::value>;
    allow_smem(reinterpret_cast<const void*>(kernel));
    kernel<<<grid, kThreads, smem, stream>>>(a);
    EXPERTQMM_CUDA_CHECK_LAUNCH(decode_down_combine_mma_kernel);
  });
}

}  // namespace expertqmm::cuda::decode

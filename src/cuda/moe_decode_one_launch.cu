// Kernels 2 and 3 of the decode layer (moe_decode.h) in one launch, for 4-bit experts on tensor
// cores (EXPERTQMM_DECODE_ONE_LAUNCH; bench/NOTES.md step 19): the down tiles' weights are requested
// while the gate/up tiles still run, and the launch boundary between the two is gone.
//
// Work split: grid = G_up + G_down CTAs of 256 threads, G_up = ceil(I / 16) * min(n, E) gate/up tiles
// (moe_decode_tiles.cuh gate_up_glu_mma_tile, x fastest) then G_down = T * ceil(H / 16) down tiles
// (down_combine_mma_tile, tokens fastest). A CTA does not take its tile from blockIdx: thread 0 takes
// a ticket (an atomic counter, OneLaunchSync::ticket), so the tiles start in ticket order. A gate/up
// tile ends with its hidden values written, a fence and gate_up_done += 1; a down tile copies its
// weights (cp.async: they depend on the router's indices, written by the previous kernel), then
// thread 0 waits until gate_up_done == G_up (acquire loads with a back-off), then the CTA reads the
// hidden rows from the L2 and computes. Deadlock-free without co-residency: a waiting CTA only waits
// for tickets below its own, whose CTAs have started (they took them) and never wait on it. The last
// down tile to finish (down_done) zeroes the three counters for the next call (graph replays): every
// CTA has taken its ticket by then, one tile per CTA.
// Occupancy (Gemma, bf16, G = 64): dynamic shared memory max(gate/up 52 KB, down 72 KB), 72-80
// registers: 3 CTAs per SM (396 slots); T = 1: 352 gate/up + 176 down tiles, the first 44 down tiles
// resident while gate/up runs.
#include "cuda/device/pdl.cuh"
#include "cuda/moe_decode_tiles.cuh"

namespace expertqmm::cuda::decode {

namespace {

// The down tile's wait: thread 0 polls gate_up_done with acquire loads, then the CTA's barrier.
struct GateUpDone {
  static constexpr bool kHiddenAfter = true;
  const unsigned* done;
  unsigned expected;
  __device__ void operator()() const {
    if (threadIdx.x == 0) {
      unsigned seen;
      for (;;) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(done) : "memory");
        if (seen >= expected) break;
        __nanosleep(64);
      }
    }
    __syncthreads();
  }
};

template <DType D, int G, Activation A, bool kFp>
__global__ void __launch_bounds__(kThreads, 2)
    decode_experts_one_launch_kernel(GateUpArgs ga, DownArgs da, OneLaunchSync* sync, int up_col_blocks,
                                     int gate_up_tiles, int tokens, int down_tiles) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  __shared__ int ticket;
  device::pdl_launch_dependents();  // a chained exit kernel may load its other inputs meanwhile
  if (threadIdx.x == 0) ticket = static_cast<int>(atomicAdd(&sync->ticket, 1u));
  __syncthreads();
  const int tile = ticket;
  if (tile < gate_up_tiles) {
    gate_up_glu_mma_tile<D, G, A, kFp>(ga, tile % up_col_blocks, tile / up_col_blocks, tc_smem);
    __threadfence();  // this CTA's hidden values before its count (every thread's stores)
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&sync->gate_up_done, 1u);
    return;
  }
  const int item = tile - gate_up_tiles;
  down_combine_mma_tile<D, G, kFp>(da, item % tokens, item / tokens, tc_smem,
                                   GateUpDone{&sync->gate_up_done, static_cast<unsigned>(gate_up_tiles)});
  if (threadIdx.x == 0 && atomicAdd(&sync->down_done, 1u) == static_cast<unsigned>(down_tiles - 1)) {
    sync->ticket = 0u;  // every tile is done: ready for the next call
    sync->gate_up_done = 0u;
    sync->down_done = 0u;
    __threadfence();
  }
}

}  // namespace

size_t one_launch_smem(int64_t H, int64_t k, int64_t I, int G, bool fp) {
  return std::max(gate_up_mma_smem(H, G, fp), down_mma_smem(k, I, G, fp));
}

void launch_experts_one_launch(DType dtype, int G, Activation act, const GateUpArgs& ga, const DownArgs& da, int n,
                               int T, OneLaunchSync* sync, size_t smem, cudaStream_t stream, bool fp) {
  const int up_col_blocks = ceil_div(ga.I, kTcRows);
  const int gate_up_tiles = up_col_blocks * std::min(n, ga.E);
  const int down_tiles = T * ceil_div(da.H, kTcRows);
  auto launch = [&](auto kernel) {
    allow_smem(reinterpret_cast<const void*>(kernel));
    kernel<<<static_cast<unsigned>(gate_up_tiles + down_tiles), kThreads, smem, stream>>>(
        ga, da, sync, up_col_blocks, gate_up_tiles, T, down_tiles);
    EXPERTQMM_CUDA_CHECK_LAUNCH(decode_experts_one_launch_kernel);
  };
  auto with_act = [&](auto dtag, auto gtag, auto fptag) {
    constexpr DType DT = decltype(dtag)::value;
    constexpr int GS = decltype(gtag)::value;
    constexpr bool F = decltype(fptag)::value;
    if (act == Activation::geglu) launch(decode_experts_one_launch_kernel<DT, GS, Activation::geglu, F>);
    else launch(decode_experts_one_launch_kernel<DT, GS, Activation::swiglu, F>);
  };
  auto with_group = [&](auto dtag) {
    if (G == 32) with_act(dtag, std::integral_constant<int, 32>{}, std::false_type{});
    else if (G == 64) with_act(dtag, std::integral_constant<int, 64>{}, std::false_type{});
    else with_act(dtag, std::integral_constant<int, 128>{}, std::false_type{});
  };
  if (fp) {  // bf16, the mode's group read at run time (supports_decode_layer)
    with_act(std::integral_constant<DType, DType::bf16>{}, std::integral_constant<int, kTcFpLayoutGroup>{},
             std::true_type{});
  } else if (dtype == DType::bf16) {
    with_group(std::integral_constant<DType, DType::bf16>{});
  } else {
    with_group(std::integral_constant<DType, DType::f16>{});
  }
}

}  // namespace expertqmm::cuda::decode

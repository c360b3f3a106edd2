// The decode layer at one token as one persistent grid (EXPERTQMM_DECODE_PERSISTENT; moe_decode.h has
// the three-kernel layer's story, bench/NOTES.md step 35 this one's): the router's logits, the
// gate/up tiles and the down tiles of the three kernels, run by the same co-resident CTAs with a grid
// barrier where a kernel boundary was. The output bits are the three kernels' (the same CTA functions
// in the same order per output element).
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/gather_qmm_routes.h"  // device_sm_count
#include "cuda/moe_decode_router.cuh"
#include "cuda/moe_decode_tiles.cuh"

namespace expertqmm::cuda::decode {

namespace {

// Every CTA of a co-resident grid (a cooperative launch) arrives once at `count`, and none goes on
// before all have: thread 0 releases the CTA's writes (the fence before the arrival) and acquires
// the others' (the spin's ld.acquire, then a fence), and the CTA barrier hands that to its threads.
__device__ __forceinline__ void grid_barrier(unsigned* count) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(count, 1u);
    unsigned seen = 0;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
      if (seen >= gridDim.x) break;
      __nanosleep(64);
    }
    __threadfence();
  }
  __syncthreads();
}

// Work split: a grid of as many 256-thread CTAs as fit the device at once (2 per SM at Gemma's
// geometry: 264 on 132 SMs; occupancy from the runtime, the launch cooperative so the runtime refuses
// a grid that could not be co-resident), CTA c taking the work items c, c + grid, ... of each phase:
//   1. expert e's logit (router_cta, route_in_gate_up set: it ends at logits[e]); E = 128 items;
//   -- grid barrier (sync[0]) --
//   2. gate/up tile (x, g) of item i = g * ceil(I / 16) + x (gate_up_glu_mma_tile: the CTA ranks the E
//      logits itself, and item (0, 0) writes the k indices and weights); 44 x 8 = 352 items;
//   -- grid barrier (sync[1]) --
//   3. down tile y (down_combine_mma_tile, token 0): out[0, 16y .. 16y + 16); 176 items.
// Shared memory: the phases' dynamic regions overlap (the largest, down's k slots, sizes it); their
// static arrays are all resident. sync[2] counts the CTAs done; the last one zeroes sync[0..2] for
// the next call (graph replays).
template <DType D, int kProj, int G>
__global__ void __launch_bounds__(kThreads, 2) decode_layer_persistent_kernel(RouterArgs ra, GateUpArgs ga,
                                                                               DownArgs da, unsigned* sync) {
  extern __shared__ __align__(16) unsigned char pk_smem[];
  for (int e = blockIdx.x; e < ra.E; e += gridDim.x) {
    router_cta<D, kProj, /*kFp=*/false, /*kSoftmaxTopk=*/false, /*kLogitsOnly=*/true>(ra, e,
                                                                                   reinterpret_cast<float*>(pk_smem));
    __syncthreads();  // the next expert stages into the same shared memory
  }
  grid_barrier(sync + 0);
  const int col_blocks = (ga.I + kTcRows - 1) / kTcRows;
  for (int i = blockIdx.x; i < col_blocks * ga.k; i += gridDim.x) {
    gate_up_glu_mma_tile<D, G, Activation::geglu, /*kFp=*/false>(ga, i % col_blocks, i / col_blocks, pk_smem);
    __syncthreads();
  }
  grid_barrier(sync + 1);
  const int row_blocks = (da.H + kTcRows - 1) / kTcRows;
  for (int y = blockIdx.x; y < row_blocks; y += gridDim.x) {
    down_combine_mma_tile<D, G, /*kFp=*/false>(da, 0, y, pk_smem);
    __syncthreads();
  }
  if (threadIdx.x == 0 && atomicAdd(sync + 2, 1u) == gridDim.x - 1) {
    sync[0] = 0u;  // every CTA has passed both barriers
    sync[1] = 0u;
    sync[2] = 0u;
  }
}

using Kernel = void (*)(RouterArgs, GateUpArgs, DownArgs, unsigned*);

// The built instances: bf16, group 64 (Gemma 4's uploads), the router projection dense, 4- or 8-bit.
Kernel persistent_kernel(DType dtype, int proj_bits, int G) {
  if (dtype != DType::bf16 || G != 64) return nullptr;
  if (proj_bits == 0) return decode_layer_persistent_kernel<DType::bf16, 0, 64>;
  if (proj_bits == 4) return decode_layer_persistent_kernel<DType::bf16, 4, 64>;
  if (proj_bits == 8) return decode_layer_persistent_kernel<DType::bf16, 8, 64>;
  return nullptr;
}

// CTAs of `kernel` resident per SM at `smem` (after allowing it), or 0; asked of the runtime once per
// (kernel, smem).
int resident_ctas(Kernel kernel, size_t smem) {
  static std::mutex mutex;
  static std::map<std::pair<Kernel, size_t>, int> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find({kernel, smem});
  if (found != known.end()) return found->second;
  allow_smem(reinterpret_cast<const void*>(kernel));
  int per_sm = 0;
  EXPERTQMM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  known[{kernel, smem}] = per_sm;
  return per_sm;
}

}  // namespace

size_t persistent_smem(int64_t T, int64_t H, int64_t I, int64_t k, int G) {
  return std::max({router_smem(T, H), gate_up_mma_smem(H, G), down_mma_smem(k, I, G)});
}

bool launch_decode_persistent(DType dtype, int proj_bits, int G, const RouterArgs& ra, const GateUpArgs& ga,
                              const DownArgs& da, unsigned* sync, size_t smem, cudaStream_t stream) {
  const Kernel kernel = persistent_kernel(dtype, proj_bits, G);
  if (kernel == nullptr) return false;  // each phase's smem <= kDecodeMaxSmem: supports_decode_layer
  const int per_sm = resident_ctas(kernel, smem);
  if (per_sm == 0) return false;
  const int64_t items = std::max({static_cast<int64_t>(ra.E), ceil_div(ga.I, kTcRows) * static_cast<int64_t>(ga.k),
                                  static_cast<int64_t>(ceil_div(da.H, kTcRows))});
  const int64_t resident = static_cast<int64_t>(per_sm) * device_sm_count();
  const unsigned grid = static_cast<unsigned>(std::min(items, resident));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute cooperative[1];
  cooperative[0].id = cudaLaunchAttributeCooperative;  // a grid that cannot be co-resident is an error, not a hang
  cooperative[0].val.cooperative = 1;
  config.attrs = cooperative;
  config.numAttrs = 1;
  const cudaError_t launched = cudaLaunchKernelEx(&config, kernel, ra, ga, da, sync);
  if (launched == cudaErrorCooperativeLaunchTooLarge) {  // fewer SMs than counted (MPS, green contexts)
    (void)cudaGetLastError();
    return false;
  }
  EXPERTQMM_CUDA_CHECK(launched);
  return true;
}

}  // namespace expertqmm::cuda::decode

// The CUDA backend's tile_weight / untile_weight (docs/tile-layout.md): the index rules of
// core/tile_layout.h (the CPU backend's too) on the device, so that a checkpoint's experts are
// re-laid where they already are. Made once at load: plain grid-stride loops, no shared memory.
//
// Work split: one thread per MLX word (e, n, word w of the row: 8 codes) for the codes, one per
// (e, n, group) for the parameters, striding by the grid. Tiling ORs each word's 8 codes, two by two,
// into the 4 layout words that hold them (zeroed first; four threads meet in each layout word, so the
// OR is atomic); untiling gathers them back, no atomics.
#include <algorithm>

#include "core/tile_layout.h"
#include "cuda/check.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

namespace {

using detail::kTileK;
using detail::kTileRows;
using detail::TileGeometry;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

unsigned blocks_for(int64_t items) {
  return static_cast<unsigned>(std::min<int64_t>((items + kThreads - 1) / kThreads, kMaxBlocks));
}

// MLX word `i` of the codes [E, N, K/8] as (row index e * N + n, word in row).
struct MlxWord {
  int64_t e, n, kw;
};
__device__ __forceinline__ MlxWord mlx_word(const TileGeometry& g, int64_t i) {
  const int64_t words_per_row = g.K / 8;
  const int64_t row = i / words_per_row;
  return {row / g.N, row % g.N, i % words_per_row};
}

template <bool kTile>
__global__ void tile_codes_kernel(TileGeometry g, const uint32_t* __restrict__ w, uint32_t* __restrict__ codes,
                                  uint32_t* __restrict__ w_out, const uint32_t* __restrict__ codes_in) {
  const int64_t words = g.E * g.N * (g.K / 8);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const MlxWord m = mlx_word(g, i);
    const int64_t kt = m.kw / (kTileK / 8);
    const int r = static_cast<int>(m.n % kTileRows), kk0 = static_cast<int>(m.kw % (kTileK / 8)) * 8;
    const int64_t block = g.code_block(m.e, m.n / kTileRows, kt);
    if constexpr (kTile) {
      const uint32_t word = w[i];
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const detail::TileCodeSlot s = detail::tile_code_slot(r, kk0 + c);
        atomicOr(&codes[block + s.word], ((word >> (4 * c)) & 0xFu) << s.shift);
      }
    } else {
      uint32_t word = 0;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const detail::TileCodeSlot s = detail::tile_code_slot(r, kk0 + c);
        word |= ((codes_in[block + s.word] >> s.shift) & 0xFu) << (4 * c);
      }
      w_out[i] = word;
    }
  }
}

template <bool kTile>
__global__ void tile_params_kernel(TileGeometry g, const uint16_t* __restrict__ scales,
                                   const uint16_t* __restrict__ biases, uint32_t* __restrict__ params,
                                   uint16_t* __restrict__ scales_out, uint16_t* __restrict__ biases_out,
                                   const uint32_t* __restrict__ params_in) {
  const int64_t items = g.E * g.N * g.groups;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / g.groups, grp = i % g.groups, e = row / g.N, n = row % g.N;
    const int64_t at = g.param_block(e, n / kTileRows, grp) + detail::tile_param_slot(static_cast<int>(n % kTileRows));
    if constexpr (kTile) {
      params[at] = static_cast<uint32_t>(scales[i]) | (static_cast<uint32_t>(biases[i]) << 16);
    } else {
      const uint32_t word = params_in[at];
      scales_out[i] = static_cast<uint16_t>(word & 0xFFFFu);
      biases_out[i] = static_cast<uint16_t>(word >> 16);
    }
  }
}

Tensor zeros_u32(const Shape& shape, cudaStream_t stream) {
  Tensor t = Tensor::empty(shape, DType::u32, Device::cuda);
  EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.nbytes(), stream));
  return t;
}

}  // namespace

TiledWeight tile_weight(const QuantizedWeight& q) {
  const int64_t N = q.w.size(-2), K = q.w.size(-1) * 8, E = q.w.numel() / (N * (K / 8));
  const TileGeometry g = detail::tile_geometry(E, N, K, q.group_size);
  cudaStream_t stream = current_stream();
  TiledWeight t;
  t.codes = zeros_u32(g.codes_shape(), stream);  // rows past N stay zero
  t.params = zeros_u32(g.params_shape(), stream);
  const uint32_t* w = q.w.data_as<const uint32_t>();
  tile_codes_kernel<true><<<blocks_for(q.w.numel()), kThreads, 0, stream>>>(g, w, t.codes.data_as<uint32_t>(),
                                                                            nullptr, nullptr);
  EXPERTQMM_CUDA_CHECK_LAUNCH(tile_codes_kernel);
  tile_params_kernel<true><<<blocks_for(q.scales.numel()), kThreads, 0, stream>>>(
      g, q.scales.data_as<const uint16_t>(), q.biases.data_as<const uint16_t>(), t.params.data_as<uint32_t>(), nullptr,
      nullptr, nullptr);
  EXPERTQMM_CUDA_CHECK_LAUNCH(tile_params_kernel);
  return t;
}

QuantizedWeight untile_weight(const TiledWeight& t, int64_t N) {
  const int64_t E = t.codes.size(0), K = t.codes.size(2) * kTileK;
  const TileGeometry g = detail::tile_geometry(E, N, K, t.group_size);
  cudaStream_t stream = current_stream();
  QuantizedWeight q;
  q.w = Tensor::empty({E, N, K / 8}, DType::u32, Device::cuda);
  q.scales = Tensor::empty({E, N, g.groups}, t.param_dtype, Device::cuda);
  q.biases = Tensor::empty({E, N, g.groups}, t.param_dtype, Device::cuda);
  uint32_t* w = q.w.data_as<uint32_t>();
  tile_codes_kernel<false><<<blocks_for(q.w.numel()), kThreads, 0, stream>>>(g, nullptr, nullptr, w,
                                                                             t.codes.data_as<const uint32_t>());
  EXPERTQMM_CUDA_CHECK_LAUNCH(tile_codes_kernel);
  tile_params_kernel<false><<<blocks_for(q.scales.numel()), kThreads, 0, stream>>>(
      g, nullptr, nullptr, nullptr, q.scales.data_as<uint16_t>(), q.biases.data_as<uint16_t>(),
      t.params.data_as<const uint32_t>());
  EXPERTQMM_CUDA_CHECK_LAUNCH(tile_params_kernel);
  return q;
}

}  // namespace expertqmm::cuda

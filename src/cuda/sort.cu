// gather_sort / scatter_unsort on the GPU (mlx-lm _gather_sort / _scatter_unsort, spec 3.1):
// a stable radix sort of the flat expert ids with their flat positions (CUB), then the inverse
// permutation and the row gathers. Identical results to the CPU backend (a stable sort is unique).
#include <cub/device/device_radix_sort.cuh>

#include "cuda/cuda_backend.h"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

namespace {

constexpr int kThreads = 256;

unsigned grid_1d(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 1048576 ? 1048576 : blocks));
}

// positions[i] = i: the values CUB carries along with the ids. (n) int32.
// Work split: one thread per element, grid-stride.
__global__ void fill_positions_kernel(int32_t* __restrict__ positions, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    positions[i] = static_cast<int32_t>(i);
}

// From the sorted positions: inv_order[order[i]] = i (a scatter: order is a permutation of [0, n),
// so every inv_order element is written exactly once) and token_of_row[i] = order[i] / k (the token
// whose x row feeds sorted row i), when token_of_row is non-null. All (n) int32.
// Work split: one thread per sorted row, grid-stride.
__global__ void invert_order_kernel(const int32_t* __restrict__ order, int64_t n, int k,
                                    int32_t* __restrict__ inv_order, int32_t* __restrict__ token_of_row) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t src = order[i];
    inv_order[src] = static_cast<int32_t>(i);
    if (token_of_row) token_of_row[i] = src / k;
  }
}

// token_of_row[b] = b / k: the unsorted rows' x rows (row b is slot b % k of token b / k).
// (n) int32. Work split: one thread per row, grid-stride.
__global__ void token_of_row_kernel(int32_t* __restrict__ token_of_row, int64_t n, int k) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    token_of_row[i] = static_cast<int32_t>(i / k);
}

// dst row i = src row source_row[i] (or source_row[i] / divisor): row_bytes bytes per row, moved as
// 16-byte words when row_bytes and both bases allow it (Word = uint4), else bytes (Word = uint8_t).
//   src (src_rows, row_bytes) bytes, rows row_stride_words Words apart;  dst (n, row_bytes) contiguous
// A source row outside [0, src_rows) is recorded as a fault and the dst row left unwritten.
// Work split: one thread per Word of the output, grid-stride; a warp covers consecutive Words of one
// row (or the tail of one row and the head of the next), so loads and stores are coalesced.
template <class Word>
__global__ void gather_rows_kernel(const Word* __restrict__ src, int64_t src_rows, int64_t src_row_stride_words,
                                   const int32_t* __restrict__ source_row, int divisor, int64_t n,
                                   int64_t row_words, Word* __restrict__ dst, uint32_t* faults) {
  const int64_t total = n * row_words;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / row_words;
    const int64_t col = idx - row * row_words;
    const int64_t from = source_row[row] / divisor;
    if (from < 0 || from >= src_rows) {
      if (col == 0) record_fault(faults, kFaultRowOutOfRange, static_cast<uint32_t>(source_row[row]),
                                 static_cast<uint32_t>(src_rows * divisor));
      continue;
    }
    dst[idx] = src[from * src_row_stride_words + col];
  }
}

}  // namespace

// Copies rows through an index list; picks 16-byte words when everything is 16-byte aligned.
void launch_gather_rows(const void* src, int64_t src_rows, int64_t src_row_stride_bytes, const int32_t* source_row,
                        int divisor, int64_t n, int64_t row_bytes, void* dst, cudaStream_t stream) {
  if (n == 0 || row_bytes == 0) return;
  const bool wide = row_bytes % 16 == 0 && src_row_stride_bytes % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (wide) {
    gather_rows_kernel<uint4><<<grid_1d(n * row_bytes / 16), kThreads, 0, stream>>>(
        static_cast<const uint4*>(src), src_rows, src_row_stride_bytes / 16, source_row, divisor, n, row_bytes / 16,
        static_cast<uint4*>(dst), device_faults());
  } else {
    gather_rows_kernel<uint8_t><<<grid_1d(n * row_bytes), kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(src), src_rows, src_row_stride_bytes, source_row, divisor, n, row_bytes,
        static_cast<uint8_t*>(dst), device_faults());
  }
  EXPERTQMM_CUDA_CHECK_LAUNCH(gather_rows_kernel);
}

namespace {

template <class Key>
size_t cub_temp_bytes(int n) {
  size_t bytes = 0;
  EXPERTQMM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const Key*>(nullptr),
                                                       static_cast<Key*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                       static_cast<int32_t*>(nullptr), n));
  return bytes;
}

// Flat view of an index tensor, sharing (or owning a contiguous copy of) its storage.
Tensor flat_ids(const Tensor& indices) { return indices.contiguous().reshape({indices.numel()}); }

}  // namespace

int id_bits(int64_t E) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) < E) ++bits;
  return bits;
}

size_t sort_temp_bytes(int64_t n, bool ids_unsigned) {
  EXPERTQMM_CHECK(n <= INT32_MAX, "gather_sort", "too many rows to sort: ", n);
  return ids_unsigned ? cub_temp_bytes<uint32_t>(static_cast<int>(n)) : cub_temp_bytes<int32_t>(static_cast<int>(n));
}

void launch_sort_rows(const int32_t* ids, int64_t n, int k, bool ids_unsigned, int end_bit, int32_t* sorted_ids,
                      int32_t* order, int32_t* positions, int32_t* inv_order, int32_t* token_of_row, void* temp,
                      size_t temp_bytes, cudaStream_t stream) {
  if (n == 0) return;
  fill_positions_kernel<<<grid_1d(n), kThreads, 0, stream>>>(positions, n);
  EXPERTQMM_CUDA_CHECK_LAUNCH(fill_positions_kernel);
  const int count = static_cast<int>(n);
  if (ids_unsigned)
    EXPERTQMM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, reinterpret_cast<const uint32_t*>(ids),
                                                         reinterpret_cast<uint32_t*>(sorted_ids), positions, order,
                                                         count, 0, end_bit, stream));
  else
    EXPERTQMM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, sorted_ids, positions, order, count, 0,
                                                         end_bit, stream));
  invert_order_kernel<<<grid_1d(n), kThreads, 0, stream>>>(order, n, k, inv_order, token_of_row);
  EXPERTQMM_CUDA_CHECK_LAUNCH(invert_order_kernel);
}

void launch_token_of_row(int32_t* token_of_row, int64_t n, int k, cudaStream_t stream) {
  if (n == 0) return;
  token_of_row_kernel<<<grid_1d(n), kThreads, 0, stream>>>(token_of_row, n, k);
  EXPERTQMM_CUDA_CHECK_LAUNCH(token_of_row_kernel);
}

SortedRows gather_sort(const Tensor& x, const Tensor& indices) {
  EXPERTQMM_CHECK(x.device() == Device::cuda && indices.device() == Device::cuda, "gather_sort",
                  "cuda::gather_sort needs device tensors, got x ", x.describe(), " and indices ", indices.describe());
  EXPERTQMM_CHECK(indices.dtype() == DType::i32 || indices.dtype() == DType::u32, "gather_sort",
                  "indices must be int32 or uint32, got ", indices.describe());
  const int64_t k = indices.ndim() ? indices.size(-1) : 1;
  const int64_t n = indices.numel();
  const int64_t D = x.size(-1);
  EXPERTQMM_CHECK(n <= INT32_MAX && k <= INT32_MAX, "gather_sort", "too many rows: ", n);
  SortedRows out;
  out.x = Tensor::empty({n, 1, D}, x.dtype(), Device::cuda);
  out.indices = Tensor::empty({n}, DType::i32, Device::cuda);
  out.inv_order = Tensor::empty({n}, DType::i32, Device::cuda);
  if (n == 0) return out;

  const bool ids_unsigned = indices.dtype() == DType::u32;
  const Tensor ids = flat_ids(indices);
  const size_t temp_bytes = sort_temp_bytes(n, ids_unsigned);
  Tensor order = Tensor::empty({n}, DType::i32, Device::cuda);
  Tensor positions = Tensor::empty({n}, DType::i32, Device::cuda);
  Tensor temp = Tensor::empty({static_cast<int64_t>(temp_bytes / 4 + 1)}, DType::u32, Device::cuda);
  cudaStream_t stream = current_stream();
  // All 32 key bits: arbitrary (even negative) ids sort exactly as the CPU's stable argsort.
  launch_sort_rows(ids.data_as<const int32_t>(), n, static_cast<int>(k), ids_unsigned, 32,
                   out.indices.data_as<int32_t>(), order.data_as<int32_t>(), positions.data_as<int32_t>(),
                   out.inv_order.data_as<int32_t>(), nullptr, temp.data(), temp_bytes, stream);

  // x_sorted[i] = x_token[order[i] / k]: x viewed as (tokens, D) contiguous rows.
  const Tensor xc = x.contiguous();
  const int64_t tokens = D ? xc.numel() / D : 0;
  const int64_t row_bytes = D * static_cast<int64_t>(dtype_size(x.dtype()));
  launch_gather_rows(xc.data(), tokens, row_bytes, order.data_as<const int32_t>(), static_cast<int>(k), n, row_bytes,
                     out.x.data(), stream);
  return out;
}

Tensor scatter_unsort(const Tensor& x, const Tensor& inv_order, const Shape& shape) {
  EXPERTQMM_CHECK(x.device() == Device::cuda && inv_order.device() == Device::cuda, "scatter_unsort",
                  "cuda::scatter_unsort needs device tensors, got x ", x.describe(), " and inv_order ",
                  inv_order.describe());
  Shape out_shape = shape;
  out_shape.insert(out_shape.end(), x.shape().begin() + 1, x.shape().end());
  Tensor out = Tensor::empty(out_shape, x.dtype(), Device::cuda);
  const int64_t n = inv_order.numel();
  if (n == 0 || out.numel() == 0) return out;
  const Tensor xc = x.contiguous();
  const Tensor inv = flat_ids(inv_order);
  const Shape row_shape(x.shape().begin() + 1, x.shape().end());
  const int64_t row_bytes = shape_numel(row_shape) * static_cast<int64_t>(dtype_size(x.dtype()));
  // out row i = x row inv_order[i]
  launch_gather_rows(xc.data(), xc.size(0), row_bytes, inv.data_as<const int32_t>(), 1, n, row_bytes, out.data(),
                     current_stream());
  return out;
}

}  // namespace expertqmm::cuda

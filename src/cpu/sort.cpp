// CPU reference of mlx-lm's _gather_sort / _scatter_unsort (spec mlx-semantics.md 3.1):
//   order     = stable argsort of the flattened expert ids (equal ids keep token order)
//   inv_order = argsort(order), i.e. inv_order[order[i]] = i
//   x_sorted  = x_tokens[order // k]
//   unsorted  = x[inv_order] unflattened to `shape`
// Rows are moved as raw bytes, so every dtype is copied exactly.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "cpu/cpu_backend.h"

namespace expertqmm::cpu {

namespace {

// Integer ids (int32 or uint32, validated by the caller) as int64 in row-major order.
std::vector<int64_t> read_ids(const Tensor& t) {
  std::vector<uint8_t> bytes = t.to_host_bytes();
  std::vector<int64_t> ids(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < ids.size(); ++i) {
    if (t.dtype() == DType::i32) {
      int32_t v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      ids[i] = v;
    } else {
      uint32_t v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      ids[i] = v;
    }
  }
  return ids;
}

}  // namespace

SortedRows gather_sort(const Tensor& x, const Tensor& indices) {
  const int64_t k = indices.size(-1);
  const int64_t rows = indices.numel();  // T * k
  const int64_t D = x.size(-1);
  const std::vector<int64_t> ids = read_ids(indices);

  std::vector<int32_t> order(static_cast<size_t>(rows));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });

  std::vector<int32_t> sorted_ids(order.size()), inv_order(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    sorted_ids[i] = static_cast<int32_t>(ids[order[i]]);
    inv_order[order[i]] = static_cast<int32_t>(i);
  }

  const Tensor xc = x.contiguous();
  const size_t row_bytes = static_cast<size_t>(D) * dtype_size(x.dtype());
  SortedRows out;
  out.x = Tensor::empty({rows, 1, D}, x.dtype(), Device::cpu);
  const uint8_t* src = static_cast<const uint8_t*>(xc.data());
  uint8_t* dst = static_cast<uint8_t*>(out.x.data());
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t token = order[i] / k;
    if (row_bytes) std::memcpy(dst + i * row_bytes, src + token * row_bytes, row_bytes);
  }
  out.indices = Tensor::from_host(sorted_ids.data(), {rows}, DType::i32, Device::cpu);
  out.inv_order = Tensor::from_host(inv_order.data(), {rows}, DType::i32, Device::cpu);
  return out;
}

Tensor scatter_unsort(const Tensor& x, const Tensor& inv_order, const Shape& shape) {
  Shape out_shape = shape;
  out_shape.insert(out_shape.end(), x.shape().begin() + 1, x.shape().end());
  const std::vector<int64_t> inv = read_ids(inv_order);
  const Tensor xc = x.contiguous();
  const Shape row_shape(x.shape().begin() + 1, x.shape().end());
  const size_t row_bytes = static_cast<size_t>(shape_numel(row_shape)) * dtype_size(x.dtype());
  Tensor out = Tensor::empty(out_shape, x.dtype(), Device::cpu);
  const uint8_t* src = static_cast<const uint8_t*>(xc.data());
  uint8_t* dst = static_cast<uint8_t*>(out.data());
  for (size_t i = 0; i < inv.size(); ++i)
    if (row_bytes) std::memcpy(dst + i * row_bytes, src + inv[i] * row_bytes, row_bytes);
  return out;
}

}  // namespace expertqmm::cpu

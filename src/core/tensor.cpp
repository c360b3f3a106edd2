#include "expertqmm/tensor.h"

#include <cstring>
#include <new>
#include <sstream>
#include <utility>

#include "core/device_memory.h"
#include "expertqmm/error.h"

namespace expertqmm {

std::string shape_str(const Shape& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

// Every product below is overflow-checked: a shape from a file or a command line can hold dims
// whose product does not fit in int64, and a wrapped product would allocate or address too little.
Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t acc = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    EXPERTQMM_CHECK(!__builtin_mul_overflow(acc, shape[i], &acc), "contiguous_strides", "shape ", shape_str(shape),
                    " overflows 64-bit strides");
  }
  return st;
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    EXPERTQMM_CHECK(!__builtin_mul_overflow(n, d, &n), "shape_numel", "shape ", shape_str(shape),
                    " has more elements than int64 can count");
  return n;
}

// Dims >= 0, and the byte size with zero dims counted as 1 fits in int64: then every stride, element
// count and byte offset of the tensor fits too (they are products of some of these dims).
static void check_shape(const Shape& shape, DType dtype, const char* op) {
  int64_t bytes = static_cast<int64_t>(dtype_size(dtype));
  for (int64_t d : shape) {
    EXPERTQMM_CHECK(d >= 0, op, "negative dimension in shape ", shape_str(shape));
    EXPERTQMM_CHECK(!__builtin_mul_overflow(bytes, d == 0 ? 1 : d, &bytes), op, "shape ", shape_str(shape), " of ",
                    dtype_name(dtype), " is too large: its byte size overflows int64");
  }
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  check_shape(shape, dtype, "Tensor::empty");
  Tensor t;
  t.dtype_ = dtype;
  t.dtype_set_ = true;
  t.device_ = device;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  size_t bytes = t.nbytes();
  size_t alloc = bytes ? bytes : 1;
  if (device == Device::cpu) {
    void* p = ::operator new(alloc, std::nothrow);
    EXPERTQMM_CHECK(p, "Tensor::empty", "cannot allocate ", bytes, " bytes for ", dtype_name(dtype), shape_str(shape));
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { ::operator delete(q); });
  } else {
    t.storage_ = std::shared_ptr<void>(detail::device_alloc(alloc), [](void* p) { detail::device_free(p); });
  }
  t.data_ = t.storage_.get();
  return t;
}

Tensor Tensor::from_host(const void* src, const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  if (t.nbytes() == 0) return t;
  if (device == Device::cpu) std::memcpy(t.data_, src, t.nbytes());
  else detail::copy_host_to_device(t.data_, src, t.nbytes());
  return t;
}

Tensor Tensor::view(void* data, const Shape& shape, DType dtype, Device device, const Shape& strides) {
  check_shape(shape, dtype, "Tensor::view");
  EXPERTQMM_CHECK(strides.empty() || strides.size() == shape.size(), "Tensor::view", "strides ",
                  shape_str(strides), " do not match shape ", shape_str(shape));
  Tensor t;
  t.data_ = data;
  t.dtype_ = dtype;
  t.dtype_set_ = true;
  t.device_ = device;
  t.shape_ = shape;
  t.strides_ = strides.empty() ? contiguous_strides(shape) : strides;
  return t;
}

Tensor Tensor::view_owned(void* data, const Shape& shape, DType dtype, Device device,
                          std::shared_ptr<void> keep_alive) {
  Tensor t = view(data, shape, dtype, device);
  t.storage_ = std::move(keep_alive);
  return t;
}

int64_t Tensor::size(int dim) const {
  int d = dim < 0 ? dim + ndim() : dim;
  EXPERTQMM_CHECK(d >= 0 && d < ndim(), "Tensor::size", "dim ", dim, " out of range for ", describe());
  return shape_[d];
}

int64_t Tensor::stride(int dim) const {
  int d = dim < 0 ? dim + ndim() : dim;
  EXPERTQMM_CHECK(d >= 0 && d < ndim(), "Tensor::stride", "dim ", dim, " out of range for ", describe());
  return strides_[d];
}

bool Tensor::is_contiguous() const {
  int64_t acc = 1;
  for (int i = ndim() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != acc) return false;
    acc *= shape_[i];
  }
  return true;
}

bool Tensor::rows_contiguous() const {
  if (ndim() == 0) return true;
  if (shape_[ndim() - 1] != 1 && strides_[ndim() - 1] != 1) return false;
  if (ndim() >= 2 && shape_[ndim() - 2] != 1 && strides_[ndim() - 2] != shape_[ndim() - 1]) return false;
  return true;
}

// Gathers a strided tensor into row-major host bytes.
std::vector<uint8_t> Tensor::to_host_bytes() const {
  std::vector<uint8_t> out(nbytes());
  if (out.empty()) return out;
  const size_t es = dtype_size(dtype_);
  if (is_contiguous()) {
    if (device_ == Device::cpu) std::memcpy(out.data(), data_, out.size());
    else detail::copy_device_to_host(out.data(), data_, out.size());
    return out;
  }
  // Strided: copy the spanned range to the host once, then walk it.
  int64_t lo = 0, hi = 0;
  for (int i = 0; i < ndim(); ++i) {
    if (shape_[i] == 0) return out;
    int64_t span = (shape_[i] - 1) * strides_[i];
    (span < 0 ? lo : hi) += span;
  }
  std::vector<uint8_t> src((hi - lo + 1) * es);
  const uint8_t* base = static_cast<const uint8_t*>(data_) + lo * static_cast<int64_t>(es);
  if (device_ == Device::cpu) std::memcpy(src.data(), base, src.size());
  else detail::copy_device_to_host(src.data(), base, src.size());
  std::vector<int64_t> idx(ndim(), 0);
  const int64_t n = numel();
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t off = -lo;
    for (int i = 0; i < ndim(); ++i) off += idx[i] * strides_[i];
    std::memcpy(out.data() + flat * es, src.data() + off * es, es);
    for (int i = ndim() - 1; i >= 0; --i) {
      if (++idx[i] < shape_[i]) break;
      idx[i] = 0;
    }
  }
  return out;
}

Tensor Tensor::to(Device device) const {
  if (device_ == device && is_contiguous()) {
    Tensor t = empty(shape_, dtype_, device);
    if (nbytes() == 0) return t;
    if (device == Device::cpu) std::memcpy(t.data_, data_, nbytes());
    else detail::copy_device_to_device(t.data_, data_, nbytes());
    return t;
  }
  std::vector<uint8_t> host = to_host_bytes();
  return from_host(host.data(), shape_, dtype_, device);
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return to(device_);
}

Tensor Tensor::reshape(const Shape& shape) const {
  EXPERTQMM_CHECK(is_contiguous(), "Tensor::reshape", "needs a contiguous tensor, got ", describe());
  check_shape(shape, dtype_, "Tensor::reshape");
  EXPERTQMM_CHECK(shape_numel(shape) == numel(), "Tensor::reshape", "cannot reshape ", describe(),
                  " to ", shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  return t;
}

Tensor Tensor::swapaxes(int a, int b) const {
  const int da = a < 0 ? a + ndim() : a, db = b < 0 ? b + ndim() : b;
  EXPERTQMM_CHECK(da >= 0 && da < ndim() && db >= 0 && db < ndim(), "Tensor::swapaxes", "dims ", a, " and ", b,
                  " out of range for ", describe());
  Tensor t = *this;
  std::swap(t.shape_[da], t.shape_[db]);
  std::swap(t.strides_[da], t.strides_[db]);
  return t;
}

std::string Tensor::describe() const {
  if (!defined()) return "<undefined>";
  return detail::cat(dtype_name(dtype_), shape_str(shape_), " strides ", shape_str(strides_), " on ",
                     device_name(device_));
}

}  // namespace expertqmm

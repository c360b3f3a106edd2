// Tensor: a strided view (pointer, dtype, shape, strides, device) with optional shared ownership.
// Strides count elements, not bytes. A default-constructed Tensor is "undefined" and stands for
// an absent optional argument (MLX's None).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "expertqmm/dtype.h"

namespace expertqmm {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);
Shape contiguous_strides(const Shape& shape);
int64_t shape_numel(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  // Owning, uninitialised, row-contiguous.
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu);
  // Owning copy of `nbytes = numel * dtype_size` bytes from host memory.
  static Tensor from_host(const void* src, const Shape& shape, DType dtype, Device device = Device::cpu);
  // Non-owning view of memory the caller keeps alive. Empty strides mean row-contiguous.
  static Tensor view(void* data, const Shape& shape, DType dtype, Device device = Device::cpu,
                     const Shape& strides = {});
  // Row-contiguous view of memory owned by `keep_alive` (e.g. a file mapping), which the tensor
  // and its copies hold until the last one is gone.
  static Tensor view_owned(void* data, const Shape& shape, DType dtype, Device device,
                           std::shared_ptr<void> keep_alive);

  bool defined() const { return data_ != nullptr || (dtype_set_ && numel() == 0); }
  void* data() const { return data_; }
  template <class T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int dim) const;    // negative dims count from the back
  int64_t stride(int dim) const;  // negative dims count from the back
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;
  // Last two dims row-contiguous (what the kernels need of x and w); batch dims may be strided.
  bool rows_contiguous() const;

  // Copies to `device` (a contiguous owning tensor); same device gives a contiguous copy.
  Tensor to(Device device) const;
  // This tensor if contiguous, else a contiguous copy on the same device.
  Tensor contiguous() const;
  // View with a new shape; requires a contiguous tensor and the same numel.
  Tensor reshape(const Shape& shape) const;
  // mx.swapaxes: a view (same storage) with dims a and b exchanged; negative dims count from the back.
  Tensor swapaxes(int a, int b) const;
  // Host copy of the elements in row-major order (any device, any strides).
  std::vector<uint8_t> to_host_bytes() const;
  // Describes dtype, shape, strides and device, for error messages.
  std::string describe() const;

 private:
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  bool dtype_set_ = false;
  Device device_ = Device::cpu;
  Shape shape_;
  Shape strides_;
};

}  // namespace expertqmm

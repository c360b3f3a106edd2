// The bridge between Python arrays and expertqmm tensors: zero-copy views of anything that speaks
// DLPack or the buffer protocol (numpy, torch, jax, cupy ...), results handed back through DLPack,
// and the device/stream in force while an op runs on CUDA.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "expertqmm/backend.h"
#include "expertqmm/tensor.h"

namespace expertqmm::python {

namespace nb = nanobind;

// A tensor seen from Python: an expertqmm::Tensor and what keeps its memory alive (the source
// array's DLPack handle for a view; nothing for a tensor the library allocated, which owns itself).
struct PyTensor {
  Tensor tensor;
  nb::ndarray<nb::ro> source;  // empty for owning tensors
  int device_id = 0;     // the CUDA device ordinal (0 on the CPU)

  // Wraps `obj` (a DLPack producer, a DLPack capsule or a buffer) without copying. `dtype`, when
  // given, reinterprets elements of the same size ("bfloat16" for uint16 bits, "uint32"/"int32" for each other).
  static PyTensor wrap(nb::handle obj, const std::optional<std::string>& dtype, bool writable);
  static PyTensor owning(Tensor t, int device_id) { return PyTensor{std::move(t), {}, device_id}; }
};

// A DLPack-exportable array over `self`'s memory, which `self` (the Python object) keeps alive.
// bits_only: bf16 is exported as uint16 (for numpy, which has no bfloat16).
nb::ndarray<nb::array_api> to_ndarray(nb::handle self, bool bits_only);

DType parse_dtype(const std::string& name, const char* op);

// While alive: the CUDA device `device_id` is current and the library's stream is `stream` (the
// caller's cudaStream_t as an integer; 0 is the legacy default stream); both restored after. Does
// nothing for the CPU. Never synchronizes.
class CudaScope {
 public:
  CudaScope(Device device, int device_id, uintptr_t stream) {
    if (device == Device::cuda) scope_.emplace(device_id, reinterpret_cast<void*>(stream));
  }
  CudaScope(const PyTensor& like, uintptr_t stream) : CudaScope(like.tensor.device(), like.device_id, stream) {}

 private:
  std::optional<CudaStreamScope> scope_;  // the library's scope (expertqmm/backend.h)
};

// Optional tensor arguments arrive as None or a PyTensor.
inline Tensor tensor_or_undefined(const PyTensor* t) { return t ? t->tensor : Tensor(); }

}  // namespace expertqmm::python

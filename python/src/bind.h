// The binding units of expertqmm._core and the weight holders they share.
#pragma once
#include <nanobind/nanobind.h>

#include <vector>

#include "bridge.h"
#include "expertqmm/gemma4.h"
#include "expertqmm/moe.h"

namespace expertqmm::python {

// MLX's (w, scales, biases) triple with its group size and bits; holds the source arrays.
struct PyQuantized {
  PyTensor w, scales, biases;
  int group_size = 64;
  int bits = 4;
  QuantizedWeight get() const { return QuantizedWeight{w.tensor, scales.tensor, biases.tensor, bits, group_size}; }
};

// MoeWeights and the arrays its views point into (empty when the library owns the memory, e.g. a
// checkpoint's mapping or a copy on the GPU).
struct PyMoeWeights {
  MoeWeights weights;
  std::vector<PyTensor> keep;
  Device device = Device::cpu;
  int device_id = 0;
};

// One Gemma 4 layer's feed-forward weights (views of a checkpoint mapping, or owned).
struct PyGemma4Layer {
  Gemma4FfnWeights weights;
  Device device = Device::cpu;
  int device_id = 0;
};

void bind_ops(nanobind::module_& m);
void bind_gemma4(nanobind::module_& m);
void bind_settings(nanobind::module_& m);

}  // namespace expertqmm::python

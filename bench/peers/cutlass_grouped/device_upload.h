// Host vectors to owning device buffers (timing::DeviceBuffer: cudaMalloc, freed on destruction).
#pragma once
#include <vector>

#include "replay_timing.h"

namespace expertqmm::peer {

using timing::DeviceBuffer;

template <class T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer b(host.size() * sizeof(T));
  if (!host.empty()) EXPERTQMM_CUDA_CHECK(cudaMemcpy(b.ptr, host.data(), b.bytes, cudaMemcpyHostToDevice));
  return b;
}

}  // namespace expertqmm::peer

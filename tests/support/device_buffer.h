// One device allocation from the library's allocator, for the GPU tests that drive device-side
// builders directly (the tile plan, the row grouping), and the library's stream as a cudaStream_t.
#pragma once
#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/device_memory.h"
#include "expertqmm/backend.h"

namespace expertqmm::test {

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) : ptr(detail::device_alloc(std::max<size_t>(bytes, 16))) {}
  ~DeviceBuffer() { detail::device_free(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  int32_t* i32() const { return static_cast<int32_t*>(ptr); }
};

// The library's current stream (cuda/runtime.cuh has device code, so a .cpp cannot include it).
inline cudaStream_t library_stream() { return static_cast<cudaStream_t>(cuda_stream()); }

}  // namespace expertqmm::test
#endif

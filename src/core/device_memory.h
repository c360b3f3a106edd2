// Device memory hooks used by backend-neutral code (Tensor). Implemented by the CUDA backend;
// without it every function throws expertqmm::Error naming the missing backend.
#pragma once
#include <cstddef>

namespace expertqmm::detail {

void* device_alloc(size_t bytes);
void device_free(void* p);
void copy_host_to_device(void* dst, const void* src, size_t bytes);
void copy_device_to_host(void* dst, const void* src, size_t bytes);
void copy_device_to_device(void* dst, const void* src, size_t bytes);
void device_zero(void* dst, size_t bytes);  // stream-ordered on the calling thread's stream

}  // namespace expertqmm::detail

namespace expertqmm::detail {

bool device_usable();             // a CUDA device can be used now
const char* device_description();  // name of device 0, or ""
void device_check();               // sync the stream, throw recorded device faults
// Makes `device` the calling thread's current CUDA device and returns the one it replaced (without
// CUDA: returns `device`, nothing to switch).
int device_exchange(int device);

}  // namespace expertqmm::detail

// Which backends exist in this build and on this machine, and the CUDA execution settings.
#pragma once
#include "expertqmm/dtype.h"
#include "expertqmm/settings.h"

namespace expertqmm {

bool cuda_built();      // compiled with the CUDA backend
bool cuda_available();  // built, and a CUDA device is usable now
Device best_device();    // cuda when available, else cpu
const char* cuda_device_name();  // "" when unavailable

// All CUDA work of expertqmm that a thread issues goes on that thread's stream (a cudaStream_t;
// nullptr, the default of every thread, is the legacy default stream). Per thread, so that threads
// with their own Workspace and stream run layers side by side.
void set_cuda_stream(void* stream);
void* cuda_stream();

// For its lifetime, this thread's expertqmm CUDA work goes to `stream` on CUDA device `device_id`
// (a framework's current stream and device: torch's, MLX's); both are restored on exit. The device
// is set in the library's own CUDA runtime, which a static build does not share with the caller's.
// In a build without CUDA only the stream is set.
class CudaStreamScope {
 public:
  CudaStreamScope(int device_id, void* stream);
  ~CudaStreamScope();
  CudaStreamScope(const CudaStreamScope&) = delete;
  CudaStreamScope& operator=(const CudaStreamScope&) = delete;

 private:
  int previous_device_;
  void* previous_stream_;
};

// Synchronizes the stream and throws expertqmm::Error for faults the kernels recorded on the
// device (expert ids out of range). Every call that copies a result to the host also checks.
void cuda_check();

}  // namespace expertqmm

// The settings (product mode, deterministic mode, route switches) live in settings.h.

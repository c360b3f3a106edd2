#include "expertqmm/backend.h"

#include "core/device_memory.h"
#include "expertqmm/error.h"

namespace expertqmm {

namespace {
thread_local void* t_stream = nullptr;  // per thread: see backend.h
}  // namespace

bool cuda_built() {
#ifdef EXPERTQMM_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_available() { return cuda_built() && detail::device_usable(); }
Device best_device() { return cuda_available() ? Device::cuda : Device::cpu; }
const char* cuda_device_name() { return cuda_available() ? detail::device_description() : ""; }
void set_cuda_stream(void* stream) { t_stream = stream; }
void* cuda_stream() { return t_stream; }
void cuda_check() { detail::device_check(); }

CudaStreamScope::CudaStreamScope(int device_id, void* stream)
    : previous_device_(detail::device_exchange(device_id)), previous_stream_(cuda_stream()) {
  set_cuda_stream(stream);
}

CudaStreamScope::~CudaStreamScope() {
  set_cuda_stream(previous_stream_);
  try {
    detail::device_exchange(previous_device_);
  } catch (const Error&) {  // a destructor must not throw; the device it restores existed at entry
  }
}

}  // namespace expertqmm

#include "expertqmm/backend.h"

#include "core/device_memory.h"

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

}  // namespace expertqmm

#include "expertqmm/backend.h"

#include <atomic>

#include "core/device_memory.h"

namespace expertqmm {

namespace {
std::atomic<void*> g_stream{nullptr};
std::atomic<ProductMode> g_product_mode{ProductMode::fused};
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
void set_cuda_stream(void* stream) { g_stream.store(stream); }
void* cuda_stream() { return g_stream.load(); }
void cuda_check() { detail::device_check(); }
void set_product_mode(ProductMode mode) { g_product_mode.store(mode); }
ProductMode product_mode() { return g_product_mode.load(); }

}  // namespace expertqmm

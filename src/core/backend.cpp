#include "expertqmm/backend.h"

#include <atomic>
#include <cstdlib>

#include "core/device_memory.h"
#include "core/route_counters.h"

namespace expertqmm {

namespace {
std::atomic<void*> g_stream{nullptr};
std::atomic<ProductMode> g_product_mode{ProductMode::fused};
bool deterministic_from_env() {  // unset or 0: off
  return detail::parse_switch_env("EXPERTQMM_DETERMINISTIC", "deterministic",
                                  std::getenv("EXPERTQMM_DETERMINISTIC")) == RouteSwitch::on;
}
std::atomic<int> g_deterministic{-1};  // -1: not set through the API; the environment decides
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
void set_deterministic(bool on) { g_deterministic.store(on ? 1 : 0); }
bool deterministic() {
  const int v = g_deterministic.load();
  if (v >= 0) return v == 1;
  static const bool from_env = deterministic_from_env();  // throws once on a bad value
  return from_env;
}

}  // namespace expertqmm

// Built only without the CUDA backend: no CUDA op table, and device memory requests fail with a
// clear error.
#include "core/backend_ops.h"
#include "core/device_memory.h"
#include "expertqmm/error.h"

namespace expertqmm::detail {

namespace {
[[noreturn]] void missing(const char* what) {
  throw Error(what, "this build of expertqmm has no CUDA backend (configure with EXPERTQMM_CUDA=ON)");
}
}  // namespace

void* device_alloc(size_t) { missing("device_alloc"); }
void device_free(void*) {}
void copy_host_to_device(void*, const void*, size_t) { missing("copy_host_to_device"); }
void copy_device_to_host(void*, const void*, size_t) { missing("copy_device_to_host"); }
void copy_device_to_device(void*, const void*, size_t) { missing("copy_device_to_device"); }
void device_zero(void*, size_t) { missing("device_zero"); }
bool device_usable() { return false; }
const char* device_description() { return ""; }
void device_check() {}
int device_exchange(int device) { return device; }
const BackendOps* cuda_backend_ops() { return nullptr; }

}  // namespace expertqmm::detail

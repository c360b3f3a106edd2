// The CUDA backend's table of core/backend_ops.h: every op of the list, the fused layer paths
// included (so it is filled from the list itself).
#include "cuda/cuda_backend.h"

namespace expertqmm::detail {

const BackendOps* cuda_backend_ops() {
  static const BackendOps table = [] {
    BackendOps t;
    t.name = "cuda";
#define EXPERTQMM_CUDA_TABLE_ENTRY(ret, name, params) t.name = cuda::name;
    EXPERTQMM_BACKEND_OPS(EXPERTQMM_CUDA_TABLE_ENTRY)
#undef EXPERTQMM_CUDA_TABLE_ENTRY
    return t;
  }();
  return &table;
}

}  // namespace expertqmm::detail

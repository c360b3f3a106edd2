// The CUDA backend as seen from host C++ (no CUDA header here). Its ops are the list of
// core/backend_ops.h (it implements all of them, the fused layer paths included); inputs arrive
// validated by the op front (src/ops), on the device. Everything is issued on the calling thread's
// expertqmm::cuda_stream().
#pragma once
#include "core/backend_ops.h"

namespace expertqmm::cuda {

EXPERTQMM_DECLARE_BACKEND_OPS()

}  // namespace expertqmm::cuda

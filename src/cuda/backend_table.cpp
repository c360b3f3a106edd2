// The CUDA backend's table of core/backend_ops.h: every op, the fused layer paths included.
#include "cuda/cuda_backend.h"

namespace expertqmm::detail {

const BackendOps* cuda_backend_ops() {
  static const BackendOps table = [] {
    BackendOps t;
    t.name = "cuda";
    t.quantize = cuda::quantize;
    t.dequantize = cuda::dequantize;
    t.gather_qmm = cuda::gather_qmm;
    t.gather_mm = cuda::gather_mm;
    t.gather_sort = cuda::gather_sort;
    t.scatter_unsort = cuda::scatter_unsort;
    t.glu_product = cuda::glu_product;
    t.route = cuda::route;
    t.weighted_combine = cuda::weighted_combine;
    t.rms_norm = cuda::rms_norm;
    t.add = cuda::add;
    t.add_scaled = cuda::add_scaled;
    t.dense_linear = cuda::dense_linear;
    t.switch_glu = cuda::switch_glu;
    t.moe_layer_into = cuda::moe_layer_into;
    t.gemma4_ffn_into = cuda::gemma4_ffn_into;
    return t;
  }();
  return &table;
}

}  // namespace expertqmm::detail

// The CPU backend's table of core/backend_ops.h.
#include "cpu/cpu_backend.h"

namespace expertqmm::detail {

const BackendOps& cpu_backend_ops() {
  static const BackendOps table = [] {
    BackendOps t;
    t.name = "cpu";
    t.quantize = cpu::quantize;
    t.dequantize = cpu::dequantize;
    t.tile_weight = cpu::tile_weight;
    t.untile_weight = cpu::untile_weight;
    t.gather_qmm = cpu::gather_qmm;
    t.gather_mm = cpu::gather_mm;
    t.gather_sort = cpu::gather_sort;
    t.scatter_unsort = cpu::scatter_unsort;
    t.glu_product = cpu::glu_product;
    t.route = cpu::route;
    t.weighted_combine = cpu::weighted_combine;
    t.rms_norm = cpu::rms_norm;
    t.add = cpu::add;
    t.add_scaled = cpu::add_scaled;
    t.dense_linear = cpu::dense_linear;
    return t;  // gather_qmm_into, switch_glu(_into), moe_layer_into, gemma4_ffn_into, qwen3_moe_ffn_into: composed by the front
  }();
  return table;
}

}  // namespace expertqmm::detail

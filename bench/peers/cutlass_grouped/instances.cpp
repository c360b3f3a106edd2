// The instance table: one row per CUTLASS kernel compiled into the peer. The rows come from
// EXPERTQMM_CUTLASS_PEER_INSTANCES (CMakeLists.txt writes instances.inc, one
// EXPERTQMM_PEER_INSTANCE(form, token_tile) line per kernel).
#include <memory>
#include <vector>

#include "peer_gemm.h"

namespace expertqmm::peer {

#define EXPERTQMM_PEER_INSTANCE(form, tile) std::unique_ptr<PeerGemm> make_##form##_t##tile();
#include "instances.inc"
#undef EXPERTQMM_PEER_INSTANCE

const std::vector<Instance>& instances() {
  static const std::vector<Instance> table = {
#define EXPERTQMM_PEER_INSTANCE(form, tile) {#form "-t" #tile, QuantForm::form, tile, &make_##form##_t##tile},
#include "instances.inc"
#undef EXPERTQMM_PEER_INSTANCE
  };
  return table;
}

}  // namespace expertqmm::peer

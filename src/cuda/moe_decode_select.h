// Host selection inside the decode layer (moe_decode_layer.cu), in a header without device code so
// host tests can call it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace expertqmm::cuda {

// Who ranks a one-token call's experts: the gate/up CTAs themselves, the router ending at its logits
// (T == 1, either router kind, 4-bit experts, E <= 256, k <= kDecodeMaxTopK), where
// EXPERTQMM_DECODE_ROUTE_IN_GATE_UP is on, or automatic and the router is not chained behind the
// kernel ahead of it: the layer alone gained 3.1 us at T = 1, while the block, whose chained router
// ranks while the entry norms run, lost 2.5 (bench/NOTES.md step 33). Else the router's last CTA.
bool decode_routes_in_gate_up(int64_t T, int gate_bits, int64_t E, int64_t k, bool router_chained);

// Whether a plan-reading 4-bit gate/up call of T tokens runs as the ring of work items
// (moe_decode_gate_up_ring.cuh): EXPERTQMM_DECODE_GATE_UP_RING on (automatic: off, not yet measured),
// T >= 2 (at one token the one-item grid's 352 Gemma CTAs are one wave at 3 per SM, more slots than
// the ring's 2 per SM), and the ring's two buffers (ring_smem bytes) within the decode kernels' shared
// memory; else one CTA per item.
bool decode_gate_up_ring(int64_t T, size_t ring_smem);

}  // namespace expertqmm::cuda

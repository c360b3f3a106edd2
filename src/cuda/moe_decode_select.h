// Host selection inside the decode layer (moe_decode_layer.cu), in a header without device code so
// host tests can call it.
#pragma once

#include <cstdint>

namespace expertqmm::cuda {

// Who ranks a one-token call's experts: the gate/up CTAs themselves, the router ending at its logits
// (T == 1, either router kind, 4-bit experts, E <= 256, k <= kDecodeMaxTopK), where
// EXPERTQMM_DECODE_ROUTE_IN_GATE_UP is on, or automatic and the router is not chained behind the
// kernel ahead of it: the layer alone gained 3.1 us at T = 1, while the block, whose chained router
// ranks while the entry norms run, lost 2.5 (bench/NOTES.md step 33). Else the router's last CTA.
bool decode_routes_in_gate_up(int64_t T, int gate_bits, int64_t E, int64_t k, bool router_chained);

// Output columns of a 4-bit gate/up CTA (16 or 32) for a grid of group_rows = min(T*k, E) expert
// groups on the current device (H, G and fp as the layer's gate/up; fp: an fp4 mode): 32 from 32
// groups (T = 4 at top-8), where two such CTAs fit an SM's shared memory: the wide CTA shares a
// group's activation loads and sum-of-x steps over twice the tiles and pays the plan's and the
// codes' first round trips once for twice the columns (bench/NOTES.md step 40); below 32 groups the
// narrow grid is at most ~2 waves (a dense MLP's, one group, is one) and a wide one would idle SMs.
// EXPERTQMM_DECODE_GATE_UP_COLS pins either (a pinned 32 that does not fit gives 16). Not for a call
// whose gate/up CTAs rank their own routing (always 16).
int decode_gate_up_cta_cols(int64_t group_rows, int64_t H, int G, bool fp);

}  // namespace expertqmm::cuda

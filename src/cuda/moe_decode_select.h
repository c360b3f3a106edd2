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

// Rows of the decode gate/up grid (expert groups: the router's plan gives an expert's rows in groups
// of at most 8, the mma's n): at most one group per (token, slot) row, and at most the experts hit
// (<= min(T*k, E)) plus one more per 8 rows, which only T > 8 can need. CTAs of rows past the
// plan's group count exit at once.
int decode_group_rows(int64_t T, int64_t k, int64_t E);

// Whether a decode call of T tokens runs its down product as the down groups (per expert group and
// 128 columns, then a slot-order combine kernel: four kernels) instead of per token:
// EXPERTQMM_DECODE_DOWN_GROUPS on and T >= 2 (at one token every group is one row, the same work as
// per token), or automatic and T >= kDecodeDownGroupsMinTokens; 4-bit down weights (the tensor-core tile), and its
// smem bytes of shared memory within decode_max_smem (about 89 I + 4 KB at group 64, Gemma's 65 KB;
// the per-token kernel needs about 11 k I).
// Measured (H100, bench/NOTES.md step 45): against the per-token down, Gemma 4 +0.3 / -2.6 / -5.1% and
// Qwen3 +1.8 / -0.7 / -3.5% at T = 8 / 12 / 16.
constexpr int64_t kDecodeDownGroupsMinTokens = 12;
bool decode_down_groups(int64_t T, int down_bits, size_t smem);

// Whether the decode router's staged rows for T tokens of width H fit this device's shared memory
// (decode_max_smem: on sm_80 Gemma's H = 2816 fits up to T = 11, on sm_90 up to 16); a call past it
// takes the general path (supports_decode_layer).
bool decode_router_fits(int64_t T, int64_t H);

}  // namespace expertqmm::cuda

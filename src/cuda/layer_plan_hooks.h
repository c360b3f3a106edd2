// Host-only handles on the MoE layer plan (layer_plan.cu) for tests: layer_plan.h itself pulls in
// device headers, which a host compiler cannot read.
#pragma once
#include <cstddef>
#include <cstdint>

#include "expertqmm/moe.h"

namespace expertqmm::cuda {

// The most bytes of down output moe_layer_into holds before it runs down and the combine per
// column window (0: kDownWindowBytes in layer_plan.cu, 24 MiB). Tests shrink it to reach the
// windows at small shapes; process-wide, read when a call is planned.
void set_down_window_bytes(size_t bytes);

// The output columns per down window that moe_layer_into's plan makes for this call (0: none), as
// plan_moe_layer decides them (the selector counts the plan's routes, as a call would).
int64_t planned_down_window_cols(const Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& w);

// Whether moe_layer_into's plan groups this call's rows with group_rows.cu (the sorted path's one
// kernel) rather than CUB's sort and the plan builder, as plan_moe_layer decides it.
bool planned_group_rows(const Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& w);

}  // namespace expertqmm::cuda

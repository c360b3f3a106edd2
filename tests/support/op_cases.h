// The elementwise and layout ops on CUDA against the CPU backend: quantize/dequantize and
// gather_sort/scatter_unsort bit for bit, glu_product and weighted_combine within an ulp or two
// (docs/numerics.md). The checks of the backend-ops table's QuantizeCase, SortCase, GluCase and
// CombineCase rows.
#pragma once
#include "support/backend_cases.h"

namespace expertqmm::test {

void check(const QuantizeCase& c);
void check(const SortCase& c);
void check(const GluCase& c);
void check(const CombineCase& c);

}  // namespace expertqmm::test

// Which backends exist in this build and on this machine, and the CUDA execution settings.
#pragma once
#include "expertqmm/dtype.h"

namespace expertqmm {

bool cuda_built();      // compiled with the CUDA backend
bool cuda_available();  // built, and a CUDA device is usable now
Device best_device();    // cuda when available, else cpu
const char* cuda_device_name();  // "" when unavailable

// All CUDA work of expertqmm is issued on this stream (a cudaStream_t; nullptr = legacy default).
void set_cuda_stream(void* stream);
void* cuda_stream();

// Synchronizes the stream and throws expertqmm::Error for faults the kernels recorded on the
// device (expert ids out of range). Every call that copies a result to the host also checks.
void cuda_check();

}  // namespace expertqmm

namespace expertqmm {

// How the GLU product is computed on CUDA (the fusion ladder, DESIGN.md): one kernel (fused) or
// gelu/silu then multiply as two kernels (separate), kept for comparison.
enum class ProductMode : uint8_t { fused, separate };
void set_product_mode(ProductMode mode);
ProductMode product_mode();

// Deterministic mode: the same output bits on every run. Off (the default, or
// EXPERTQMM_DETERMINISTIC=0), the CUDA MoE layer may add each expert's down output into its
// token's fp32 output row with atomics inside the down GEMM (no [T*k, H] buffer, no combine pass),
// so the order of the k additions varies between runs. On (EXPERTQMM_DETERMINISTIC=1), it writes
// the down outputs and sums them in slot order in a separate kernel. The CPU backend is always
// deterministic.
void set_deterministic(bool on);
bool deterministic();

}  // namespace expertqmm

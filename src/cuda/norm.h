// The launches of norm.cu that gemma4_ffn.cu strings together (no CUDA header here). Everything is
// issued on the calling thread's expertqmm::cuda_stream(); none allocates or synchronizes.
#pragma once
#include "cuda/cuda_backend.h"

namespace expertqmm::cuda {

// norm.cu launches, all pointers device memory, all arrays contiguous.
// x, out: [rows, D] in `dtype`; weight [D] in w_dtype.
void launch_rms_norm(DType dtype, const void* x, int64_t rows, int64_t D, DType w_dtype, const void* weight,
                     float eps, void* out);
// out = a + b over n values in `dtype`.
void launch_add(DType dtype, const void* a, const void* b, int64_t n, void* out);
// out = round(a + b) * scalar[0] over n values in `dtype`; scalar is one value in s_dtype.
void launch_add_scaled(DType dtype, const void* a, const void* b, int64_t n, DType s_dtype, const void* scalar,
                       void* out);

// The Gemma 4 block's fused norms (gemma4_ffn_norms.cu). Activations (T, H) in the launch's dtype,
// contiguous; each weight (H) and the scalar (1) in its own float dtype.
struct Gemma4NormArgs {
  int64_t T = 0, H = 0;
  float eps = 0.f;
  const void* h = nullptr;  // the block's input (residual)
  // entry: x1 = rms_norm(h, pre_ff), x2 = rms_norm(h, pre_ff_2)
  const void *pre_ff = nullptr, *pre_ff_2 = nullptr;
  DType pre_ff_dtype = DType::bf16, pre_ff_2_dtype = DType::bf16;
  void *x1 = nullptr, *x2 = nullptr;
  // exit: out = (h + rms_norm(rms_norm(d, post_ff_1) + rms_norm(m, post_ff_2), post_ff)) * layer_scalar
  const void *d = nullptr, *m = nullptr;  // the dense MLP's and the experts' outputs
  const void *post_ff_1 = nullptr, *post_ff_2 = nullptr, *post_ff = nullptr, *layer_scalar = nullptr;
  DType post_ff_1_dtype = DType::bf16, post_ff_2_dtype = DType::bf16, post_ff_dtype = DType::bf16,
        layer_scalar_dtype = DType::bf16;
  void* out = nullptr;
};
void launch_gemma4_entry_norms(DType dtype, const Gemma4NormArgs& a);
// chained: a programmatic dependent launch (EXPERTQMM_CHAINED_LAUNCH): it may start before the
// kernel ahead of it on the stream ends and reads m only after that kernel has (d and h must be
// complete before this launch).
void launch_gemma4_exit(DType dtype, const Gemma4NormArgs& a, bool chained = false);

}  // namespace expertqmm::cuda

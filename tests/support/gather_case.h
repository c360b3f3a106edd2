// gather_qmm on the CUDA backend, call by call: the operands of one call in the forms mlx-lm produces
// (weights, x, ids), a run of one route through the test hook into a poisoned output (so every
// element must be written), and the float64 reference. Shared by the backend-ops table (check(const
// GatherQmmCase&)) and the route tests (gpu_gather_qmm_test.cpp, gpu_expert_tiles_test.cpp).
#pragma once
#ifdef EXPERTQMM_HAVE_CUDA
#include <cstdint>
#include <string>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/moe.h"
#include "expertqmm/settings.h"
#include "support/backend_cases.h"
#include "support/moe_case.h"  // SettingGuard

namespace expertqmm::test {

// An MLX weight [E, rows, cols * bits / 32] on the host: uniformly random codes (every bit pattern
// is a valid code stream, so every code value is equally likely at any width) and scales/biases in
// `params` that centre the codes on 0 (|w| <~ 0.08). Seconds even at Gemma's 500M weights, where the
// CPU quantizer would take minutes.
// An fp mode: random codes and uint8 scales (detail::finish_synthetic_fp), no biases.
QuantizedWeight random_codes(int64_t E, int64_t rows, int64_t cols, int bits, int group_size,
                             DType params = DType::bf16, QuantMode mode = QuantMode::affine);

// One gather_qmm call: host operands for the references, device operands for the routes.
struct GatherCall {
  QuantizedWeight q_host, q_dev;
  Tensor x_host, x_dev;
  Tensor lhs_host, rhs_host;       // undefined: absent (MLX None); *_dev their device copies
  Tensor lhs_dev, rhs_dev;
  std::vector<int32_t> lhs, rhs;   // per batch element, broadcast and flat: the reference's view
  int64_t M = 1;
  bool transpose = true;
  bool sorted = false;             // the sorted_indices promise
  Tensor keepalive;                // storage behind a strided x_dev or an offset q_dev.w

  detail::GatherQmmProblem problem() const;
  int64_t K() const { return x_host.size(-1); }
  int64_t N() const { return transpose ? q_host.w.size(-2) : q_host.w.size(-1) * 32 / q_host.bits; }
  int64_t B() const { return static_cast<int64_t>(rhs.size()); }
  std::string describe(const std::string& route) const;  // route, problem and seed, for failures
};

// x [R, 1, K], rhs [R], no lhs: mlx-lm's SwitchGLU after gather_sort (x random in `dtype`).
GatherCall rows_call(const QuantizedWeight& q, DType dtype, const std::vector<int32_t>& ids, bool sorted);
// x [T, 1, 1, K], rhs [T, k] of k distinct experts per token, lhs absent (broadcast from x's batch).
GatherCall topk_call(const QuantizedWeight& q, DType dtype, int64_t T, int64_t k);
// x [x_batch, M, K]; lhs and rhs int32 [B].
GatherCall batched_call(const QuantizedWeight& q, DType dtype, int64_t x_batch, int64_t M,
                        const std::vector<int32_t>& lhs, const std::vector<int32_t>& rhs, bool transpose = true);

// Runs `route` through the test hook ("" or "auto": the selector) into a poisoned output.
std::vector<float> run_route(const GatherCall& c, const std::string& route = "");
// ||out - ref|| / ||ref|| against the float64 reference over every batch element, or over an even
// spread of them (first and last included) where the whole reference would cost too much.
double reference_error(const GatherCall& c, const std::vector<float>& out);

// The gather_qmm row of diagnostics::snapshot() (a test failure when absent).
RouteCounters gather_counters();

// The warp-specialized wgmma build (EXPERTQMM_WGMMA_WS) switched and its grid capped (0: one CTA per
// SM) for one scope; both restored on exit, also when a launch throws.
class WsBuildGuard {
 public:
  WsBuildGuard(RouteSwitch build, int max_ctas);
  ~WsBuildGuard();
  WsBuildGuard(const WsBuildGuard&) = delete;
  WsBuildGuard& operator=(const WsBuildGuard&) = delete;

 private:
  SettingGuard<RouteSwitch, wgmma_ws_setting, set_wgmma_ws> build_;
};

// The row's call on CUDA against float64 and against a second implementation (the CPU backend where
// it is cheap, else another route), its selector choice or its refusal.
void check(const GatherQmmCase& c);

}  // namespace expertqmm::test
#endif

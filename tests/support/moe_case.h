// The MoE layer on CUDA, case by case: a layer's weights on both backends, the router, random
// routings, and the checks of switch_glu, moe_layer_into and route against the float64 reference
// or the CPU router. Shared by the backend-ops table and the layer tests (gpu_moe_test.cpp,
// gpu_moe_decode_test.cpp, gpu_ops_test.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "expertqmm/backend.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/moe.h"
#include "support/backend_cases.h"

namespace expertqmm::test {

// A process-wide setting changed for one scope and restored after it.
template <class T, T (*Get)(), void (*Set)(T)>
class SettingGuard {
 public:
  explicit SettingGuard(T value) : saved_(Get()) { Set(value); }
  ~SettingGuard() { Set(saved_); }
  SettingGuard(const SettingGuard&) = delete;
  SettingGuard& operator=(const SettingGuard&) = delete;

 private:
  T saved_;
};
using ProductModeGuard = SettingGuard<ProductMode, product_mode, set_product_mode>;
using DecodeSwitchGuard = SettingGuard<RouteSwitch, decode_layer_setting, set_decode_layer>;
using ChainedLaunchGuard = SettingGuard<RouteSwitch, chained_launch_setting, set_chained_launch>;

// A router over E experts choosing k, on the host, in `dtype`: a proj_bits-bit projection (CPU-
// quantized, logits ~ N(0, 1); 0: a dense [E, H] one); a gemma4 router also gets RMSNorm scale
// ~ 1 + 0.1 N(0, 1) and per-expert scale ~ 1 + 0.2 N(0, 1). A softmax_topk one reads un-normalised
// h, so its projection is scaled by H^-1/2 to keep the logits ~ N(0, 1).
// mode: the projection's quantization mode (an fp mode: proj_bits and group must be its own).
RouterWeights random_router(int64_t E, int64_t H, int k, DType dtype, int proj_bits = 8, int group = 64,
                            RouterKind kind = RouterKind::gemma4, bool norm_topk_prob = true,
                            QuantMode mode = QuantMode::affine);
RouterWeights router_to(const RouterWeights& r, Device device);
SwitchGLUWeights experts_to(const SwitchGLUWeights& w, Device device);

// One layer of geometry g (CPU-quantized experts, weights ~ N(0, 0.05)), the same values on both.
struct Layer {
  MoeWeights cpu, gpu;
};
Layer make_layer(const MoeGeometry& g);

// k distinct random experts per token, and weights in [0.05, 1).
void random_routing(int64_t T, int64_t k, int64_t E, std::vector<int32_t>& ids, std::vector<float>& weights);

// switch_glu of x [T, H] (host) by ids [T, k] on CUDA against float64, every (token, slot) row.
void expect_switch_glu_matches(const Tensor& x, const std::vector<int32_t>& ids, int64_t k, const Layer& l,
                               const std::string& what);

// moe_layer_into on CUDA into a poisoned output.
Tensor run_layer(const Tensor& h, const Tensor& x, const MoeWeights& w, Workspace& ws);

// A feed-forward output on CUDA (got) against the CPU's (expected), both [T, H], where the two
// backends' routers may disagree at near-ties of their bf16 scores: a token the CPU router (on
// router_input, host) sends to other experts than gpu_idx ([T, k], as sets) is left out where the
// experts they disagree on sit at a near-tie of the CPU's scores (cpu_router_logits; else a
// failure); at most half the tokens (one at T = 1) may be; the rest must agree within 1e-2
// (docs/numerics.md: bf16 across backends). gpu_idx: route() on the GPU, which at decode sizes is
// not the decode layer's router kernel: a token that kernel routes otherwise at a near-tie stays
// among the kept rows, its error inside their aggregate.
void expect_close_where_routed_alike(const Tensor& expected, const Tensor& got, const Tensor& router_input,
                                     const RouterWeights& cpu_router, const std::vector<int32_t>& gpu_idx,
                                     const std::string& what);

// Hits of the decode layer so far (diagnostics).
uint64_t decode_hits();

void check(const SwitchGluCase& c);
void check(const MoeLayerCase& c);
void check(const RouteCase& c);

}  // namespace expertqmm::test

// The CUDA MoE layer with 16-bit (MLX gather_mm) expert projections, in every mix with quantized
// ones, against the CPU reference on the same weights and routing: switch_glu at decode (unsorted,
// GEMV route) and prefill (sorted, tile route) sizes, and moe_layer_into (whose decode path must
// decline 16-bit experts and leave them to the experts path). Tolerance: docs/numerics.md.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "expertqmm/diagnostics.h"
#include "expertqmm/moe.h"
#include "support/moe_case.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

constexpr double kTolerance = 1e-2;  // docs/numerics.md: bf16 layer, CUDA vs the CPU reference

enum class Mix { down_16bit, gate_up_16bit, all_16bit, fused_gate_up_16bit, fused_all_quantized_down_16bit };
const char* mix_name(Mix m) {
  switch (m) {
    case Mix::down_16bit: return "down bf16";
    case Mix::gate_up_16bit: return "gate/up bf16";
    case Mix::all_16bit: return "all bf16";
    case Mix::fused_gate_up_16bit: return "fused gate_up bf16";
    case Mix::fused_all_quantized_down_16bit: return "fused gate_up 4-bit, down bf16";
  }
  return "?";
}

// Experts [E, I, D] / [E, D, I] in the mix, 4-bit group 64 where quantized (host).
SwitchGLUWeights mixed_experts(Mix m, int64_t E, int64_t D, int64_t I) {
  SwitchGLUWeights w;
  w.activation = Activation::geglu;
  auto quantized = [&](int64_t N, int64_t K) { return test::random_quantized({E, N, K}, 4, 64); };
  auto dense = [&](int64_t N, int64_t K) { return test::random_tensor({E, N, K}, DType::bf16, 0.05f); };
  const bool fused = m == Mix::fused_gate_up_16bit || m == Mix::fused_all_quantized_down_16bit;
  const bool gate_up_dense = m == Mix::gate_up_16bit || m == Mix::all_16bit || m == Mix::fused_gate_up_16bit;
  const bool down_dense = m != Mix::gate_up_16bit && m != Mix::fused_gate_up_16bit;
  if (fused) {
    if (gate_up_dense) w.gate_up_dense = dense(2 * I, D);
    else w.gate_up = quantized(2 * I, D);
  } else if (gate_up_dense) {
    w.gate_dense = dense(I, D);
    w.up_dense = dense(I, D);
  } else {
    w.gate = quantized(I, D);
    w.up = quantized(I, D);
  }
  if (down_dense) w.down_dense = dense(D, I);
  else w.down = quantized(D, I);
  return w;
}

const Mix kMixes[] = {Mix::down_16bit, Mix::gate_up_16bit, Mix::all_16bit, Mix::fused_gate_up_16bit,
                      Mix::fused_all_quantized_down_16bit};

TEST(GpuMoe16Bit, SwitchGluEveryMixMatchesTheCpu) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t E = 16, D = 256, I = 320, k = 8;  // I = 320: mlx-lm's case (not a multiple of 128)
  for (Mix m : kMixes) {
    const SwitchGLUWeights host = mixed_experts(m, E, D, I);
    const SwitchGLUWeights dev = test::experts_to(host, Device::cuda);
    for (int64_t T : {1, 3, 24}) {  // 8 and 24 rows: unsorted (GEMV); 192 rows: sorted (tile route)
      std::vector<int32_t> ids;
      std::vector<float> weights;
      test::random_routing(T, k, E, ids, weights);
      const Tensor x = test::random_tensor({T, D}, DType::bf16), idx = test::ids_tensor(ids, {T, k});
      const Tensor cpu = switch_glu(x, idx, host);
      const Tensor gpu = switch_glu(x.to(Device::cuda), idx.to(Device::cuda), dev);
      ASSERT_EQ(gpu.shape(), cpu.shape()) << mix_name(m);
      EXPECT_LE(test::rel_error(test::to_float(gpu), test::to_float(cpu)), kTolerance) << mix_name(m) << " T=" << T;
    }
  }
}

// moe_layer_into on CUDA against the CPU's switch_glu + weighted_combine on the routing the CUDA
// router produced (so a near-tie routed differently cannot hide or fake a GEMM difference).
TEST(GpuMoe16Bit, MoeLayerIntoEveryMixMatchesTheCpuAndSkipsTheDecodeLayer) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t E = 16, D = 256, I = 320, k = 8;
  for (Mix m : kMixes) {
    MoeWeights host;
    host.router = test::random_router(E, D, static_cast<int>(k), DType::bf16);
    host.experts = mixed_experts(m, E, D, I);
    MoeWeights dev;
    dev.router = test::router_to(host.router, Device::cuda);
    dev.experts = test::experts_to(host.experts, Device::cuda);
    for (int64_t T : {1, 2, 24}) {
      const Tensor h = test::random_tensor({T, D}, DType::bf16), x = test::random_tensor({T, D}, DType::bf16);
      const Tensor hd = h.to(Device::cuda), xd = x.to(Device::cuda);
      const uint64_t decode_before = test::decode_hits();
      Workspace ws;
      const Tensor gpu = test::run_layer(hd, xd, dev, ws);
      EXPECT_EQ(test::decode_hits(), decode_before) << mix_name(m) << ": the decode layer took 16-bit experts";
      const Routing r = route(hd, dev.router);
      const Tensor idx = r.indices.to(Device::cpu), rw = r.weights.to(Device::cpu);
      const Tensor cpu = weighted_combine(switch_glu(x, idx, host.experts), rw);
      EXPECT_LE(test::rel_error(test::to_float(gpu), test::to_float(cpu)), kTolerance) << mix_name(m) << " T=" << T;
    }
  }
}

// The layer counts each 16-bit GEMM once under gather_mm, tile-route hits at prefill sizes.
TEST(GpuMoe16Bit, LayerGemmsAreCountedUnderGatherMm) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t E = 16, D = 256, I = 320, T = 24, k = 8;
  const SwitchGLUWeights dev = test::experts_to(mixed_experts(Mix::down_16bit, E, D, I), Device::cuda);
  std::vector<int32_t> ids;
  std::vector<float> weights;
  test::random_routing(T, k, E, ids, weights);
  const Tensor x = test::random_tensor({T, D}, DType::bf16).to(Device::cuda);
  const Tensor idx = test::ids_tensor(ids, {T, k}).to(Device::cuda);
  diagnostics::reset();
  switch_glu(x, idx, dev);
  uint64_t mm_attempts = 0, mm_hits = 0, qmm_attempts = 0;
  for (const RouteCounters& r : diagnostics::snapshot()) {
    if (r.primitive == "gather_mm") mm_attempts = r.attempts, mm_hits = r.hits;
    if (r.primitive == "gather_qmm") qmm_attempts = r.attempts;
  }
  EXPECT_EQ(mm_attempts, 1u);  // down
  EXPECT_EQ(mm_hits, expert_tiles_setting() == RouteSwitch::off ? 0u : 1u);
  EXPECT_EQ(qmm_attempts, 2u);  // up, gate
}

}  // namespace
}  // namespace expertqmm

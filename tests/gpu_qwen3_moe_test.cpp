// The Qwen3-MoE feed-forward part on CUDA against the CPU reference: a small synthetic layer in both
// GLU product modes across decode / unsorted / sorted / prefill sizes, mlx-lm's golden checkpoint,
// one layer captured in a CUDA graph, and the routes the layer takes at Qwen3-30B-A3B's geometry
// (the decode layer up to 16 tokens, the expert tile route at prefill).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "expertqmm/checkpoint.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "support/golden.h"
#include "support/graph_capture.h"
#include "support/moe_case.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

// H=256, 16 experts x 128, top-4; experts 4-bit g64, router 8-bit g64.
Gemma4Config small_config() {
  Gemma4Config c = Gemma4Config::qwen3_30b_a3b(1);
  c.hidden_size = 256;
  c.moe_intermediate_size = 128;
  c.num_experts = 16;
  c.top_k_experts = 4;
  return c;
}

// The block's router reads the normalised x (router_input); the routing it makes of it.
Tensor router_input(const Tensor& h, const Qwen3MoeFfnWeights& w) { return rms_norm(h, w.post_attention_layernorm, w.eps); }
std::vector<int32_t> block_routing(const Tensor& h, const Qwen3MoeFfnWeights& w) {
  return test::to_i32(route(router_input(h, w), w.moe.router).indices);
}

TEST(GpuQwen3MoeFfn, MatchesTheCpuReferenceInBothProductModes) {
  EXPERTQMM_REQUIRE_GPU();
  for (bool renorm : {true, false}) {
    Gemma4Config c = small_config();
    c.norm_topk_prob = renorm;
    const Qwen3MoeFfnWeights cpu_w = synthetic_qwen3_moe_layer(c, 0, 11);
    const Qwen3MoeFfnWeights gpu_w = cpu_w.to(Device::cuda);
    for (ProductMode mode : {ProductMode::fused, ProductMode::separate}) {
      test::ProductModeGuard guard(mode);
      for (int64_t T : {1, 3, 8, 40, 300}) {
        const std::string what = detail::cat("T=", T, " renorm=", renorm, " mode=",
                                             mode == ProductMode::fused ? "fused" : "separate");
        const Tensor h = test::random_tensor({T, 256}, DType::bf16, 1.0f);
        const Tensor hd = h.to(Device::cuda);
        test::expect_close_where_routed_alike(qwen3_moe_ffn(h, cpu_w), qwen3_moe_ffn(hd, gpu_w),
                                              router_input(h, cpu_w), cpu_w.moe.router, block_routing(hd, gpu_w),
                                              what);
      }
    }
  }
}

// mlx-lm's tiny qwen3_moe checkpoint (tests/golden/make_qwen3_goldens.py): CUDA against the CPU and
// against mlx-lm's float32 twin. The generator kept tokens whose k-th and (k+1)-th logits are 6%
// apart, so both backends route them alike.
TEST(GpuQwen3MoeFfn, GoldenCheckpointMatchesTheCpuAndMlxLm) {
  EXPERTQMM_REQUIRE_GPU();
  const Gemma4Checkpoint ck = Gemma4Checkpoint::open(test::golden_dir() + "/qwen3_tiny_ckpt");
  SafetensorsFile g;
  ASSERT_NO_FATAL_FAILURE(test::open_golden("qwen3_layer_ffn.safetensors", &g));
  const std::vector<test::GoldenCase> cases = test::golden_cases(g);
  ASSERT_EQ(cases.size(), 4u);
  for (const test::GoldenCase& c : cases) {
    const int layer = c.int_param("layer");
    const std::string key = "l" + std::to_string(layer) + ".t" + std::to_string(c.int_param("T"));
    Tensor h, f32_out;
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, key + ".h", &h));
    ASSERT_NO_FATAL_FAILURE(test::golden_tensor(g, key + ".f32_out", &f32_out));
    const Qwen3MoeFfnWeights w = ck.qwen3_moe_layer(layer);
    const std::vector<float> gpu = test::to_float(qwen3_moe_ffn(h.to(Device::cuda), w.to(Device::cuda)));
    EXPECT_LE(test::rel_error(gpu, test::to_float(qwen3_moe_ffn(h, w))), 1e-2) << key << " vs the CPU";
    EXPECT_LE(test::rel_error(gpu, test::to_float(f32_out)), 1e-2) << key << " vs mlx-lm's float32 twin";
  }
}

TEST(GpuQwen3MoeFfn, OneLayerCapturedInACudaGraphReplaysTheSameOutput) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  const Qwen3MoeFfnWeights w = synthetic_qwen3_moe_layer(small_config(), 0, 5).to(Device::cuda);
  // warm at the larger size; the smaller one must not grow anything
  test::expect_block_capture_replays(
      [&](Tensor& out, const Tensor& h, Workspace& ws) { qwen3_moe_ffn_into(out, h, w, ws); }, 256, {100, 6}, 3);
#endif
}

// Which routes Qwen3-30B-A3B's layer takes (synthetic weights at the real geometry): the decode layer
// serves T = 1 and 8 (its router computes the softmax_topk kind), and at T = 512 the expert GEMMs
// run on the expert tile route. The CPU reference checks the decode sizes here (at 512 tokens it
// would take minutes; the table's Qwen3 rows check the tile route against float64 at T = 96).
TEST(GpuQwen3MoeFfn, RoutesAtTheRealGeometry) {
  EXPERTQMM_REQUIRE_GPU();
  const Gemma4Config c = Gemma4Config::qwen3_30b_a3b(1);
  const Qwen3MoeFfnWeights cpu_w = synthetic_qwen3_moe_layer(c, 0, 3);
  const Qwen3MoeFfnWeights gpu_w = cpu_w.to(Device::cuda);
  auto counters = [](const char* primitive) {
    for (const RouteCounters& r : diagnostics::snapshot())
      if (r.primitive == primitive) return r;
    ADD_FAILURE() << "no " << primitive << " row in snapshot()";
    return RouteCounters();
  };
  for (int64_t T : {1, 8, 512}) {
    const std::string what = detail::cat("T=", T);
    const Tensor h = test::random_tensor({T, 2048}, DType::bf16, 1.0f);
    const Tensor hd = h.to(Device::cuda);
    diagnostics::reset();
    const Tensor got = qwen3_moe_ffn(hd, gpu_w);
    cuda_check();
    const RouteCounters decode = counters("moe_decode_layer"), qmm = counters("gather_qmm");
    if (T <= 16) {
      EXPECT_EQ(decode.hits, 1u) << what << ": the decode layer did not serve the call\n"
                                 << diagnostics::format(diagnostics::snapshot());
    } else {
      EXPECT_EQ(decode.hits, 0u) << what;
      EXPECT_GE(qmm.hits, 1u) << what << ": the expert tile route did not serve the experts\n"
                              << diagnostics::format(diagnostics::snapshot());
    }
    std::printf("%s\n%s", what.c_str(), diagnostics::format(diagnostics::snapshot()).c_str());
    int64_t finite = 0;
    for (float v : test::to_float(got)) finite += std::isfinite(v);
    EXPECT_EQ(finite, T * 2048) << what << ": every output element written and finite";
    if (T <= 16)
      test::expect_close_where_routed_alike(qwen3_moe_ffn(h, cpu_w), got, router_input(h, cpu_w), cpu_w.moe.router,
                                            block_routing(hd, gpu_w), what);
  }
}

TEST(GpuQwen3MoeFfn, MixedDevicesAreAnError) {
  EXPERTQMM_REQUIRE_GPU();
  const Qwen3MoeFfnWeights cpu_w = synthetic_qwen3_moe_layer(small_config(), 0, 3);
  const Tensor h = test::random_tensor({2, 256}, DType::bf16, 1.0f, Device::cuda);
  try {
    (void)qwen3_moe_ffn(h, cpu_w);
    ADD_FAILURE() << "no error for cuda h with cpu weights";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qwen3_moe_ffn"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace expertqmm

// MLX's fp quantization modes on CUDA against the CPU: nvfp4 with a global scale bit for bit, and a
// whole Gemma 4 feed-forward block whose every quantized module is in an fp mode (qmv / simt GEMMs,
// the router on uint8 scales), allocating and _into alike, plus one layer captured in a CUDA graph.
// The per-op rows (gather_qmm routes and refusals, quantize, switch_glu, moe_layer) are in the
// backend table.
#include <gtest/gtest.h>

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"
#include "expertqmm/quant.h"
#include "support/checkpoint_files.h"
#include "support/graph_capture.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

TEST(GpuQuantModes, Nvfp4GlobalScaleMatchesTheCpuBitForBit) {
  EXPERTQMM_REQUIRE_GPU();
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    const Tensor w = test::random_tensor({6, 96}, dtype, 3.0f);
    QuantSpec spec = default_quant_spec(QuantMode::nvfp4);
    const float g = 0.0123f;
    spec.global_scale = Tensor::from_host(&g, {}, DType::f32, Device::cpu);
    const QuantizedWeight c = quantize(w, spec), d = quantize(w.to(Device::cuda), spec);
    EXPECT_EQ(d.w.to_host_bytes(), c.w.to_host_bytes()) << dtype_name(dtype);
    EXPECT_EQ(d.scales.to_host_bytes(), c.scales.to_host_bytes()) << dtype_name(dtype);
    const Tensor dc = dequantize(c, dtype), dd = dequantize(d, dtype);
    EXPECT_EQ(dd.dtype(), DType::f32);  // MLX promotes with the float32 global scale
    EXPECT_EQ(dd.to_host_bytes(), dc.to_host_bytes()) << dtype_name(dtype);
  }
}

// Experts mxfp4, dense MLP mxfp8, router nvfp4.
Gemma4Config fp_modes_config() {
  Gemma4Config c = test::gemma4_config(256, 384, 128, 16, 4, 1);
  c.default_quant = {4, 32, QuantMode::mxfp4};
  for (const char* m : {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
    c.overrides[std::string("model.layers.0.") + m] = {8, 32, QuantMode::mxfp8};
  c.overrides["model.layers.0.router.proj"] = {4, 16, QuantMode::nvfp4};
  return c;
}

// float32 activations, so the two backends' routers agree but for fp32 summation order.
TEST(GpuQuantModes, Gemma4FfnInFpModesMatchesTheCpu) {
  EXPERTQMM_REQUIRE_GPU();
  const Gemma4FfnWeights cpu_w = synthetic_gemma4_layer(fp_modes_config(), 0, 21);
  const Gemma4FfnWeights gpu_w = cpu_w.to(Device::cuda);
  for (int64_t T : {1, 5, 70}) {
    const Tensor h = test::random_tensor({T, 256}, DType::f32, 1.0f);
    const Tensor expected = gemma4_ffn(h, cpu_w);
    const Tensor hd = h.to(Device::cuda);
    const Tensor got = gemma4_ffn(hd, gpu_w);
    ASSERT_EQ(got.device(), Device::cuda);
    EXPECT_LE(test::rel_error(test::to_float(got), test::to_float(expected)), 1e-4) << "T=" << T << test::seed_note();
    Tensor into = Tensor::empty({T, 256}, DType::f32, Device::cuda);
    Workspace ws;
    gemma4_ffn_into(into, hd, gpu_w, ws);
    EXPECT_EQ(into.to_host_bytes(), got.to_host_bytes()) << "T=" << T;
  }
}

// What `bench --quant` needs: the fp-mode layer captured in a CUDA graph (no allocation, no host
// sync) replays the output of the direct call, at decode (qmv) and prefill (simt) sizes.
TEST(GpuQuantModes, FpModeLayerCapturedInACudaGraphReplaysTheSameOutput) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  const Gemma4FfnWeights w = synthetic_gemma4_layer(fp_modes_config(), 0, 5).to(Device::cuda);
  const test::CaptureStream stream;
  Workspace ws;
  for (int64_t T : {100, 6}) {
    const std::string what = detail::cat("T=", T);
    const Tensor h = test::random_tensor({T, 256}, DType::bf16, 1.0f, Device::cuda);
    Tensor expected = Tensor::empty({T, 256}, DType::bf16, Device::cuda);
    gemma4_ffn_into(expected, h, w, ws);
    cuda_check();
    Tensor replayed = Tensor::empty({T, 256}, DType::bf16, Device::cuda);
    cudaGraph_t graph = test::capture_graph(stream.get(), [&] { gemma4_ffn_into(replayed, h, w, ws); }, what);
    ASSERT_NE(graph, nullptr) << what;
    test::expect_replays_match(graph, stream.get(), replayed, expected, 2, what);
  }
#endif
}

}  // namespace
}  // namespace expertqmm

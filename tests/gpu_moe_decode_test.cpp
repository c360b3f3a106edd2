// The decode layer (src/cuda/moe_decode.cu: moe_layer_into in three kernels when T*k <= 64) beyond
// the backend-ops table (gpu_backend_ops_test.cpp checks it against float64 and the general path at
// Gemma 4's geometry and at small odd ones, with its hits counted and runs bit-identical): calls it
// does not take, and CUDA graph capture + replay as three kernel nodes.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "support/graph_capture.h"
#include "support/moe_case.h"
#include "support/test_util.h"

using namespace expertqmm;

// Calls the decode layer does not take go to the general path.
TEST(GpuMoeDecode, UnsupportedCallsFallBack) {
  EXPERTQMM_REQUIRE_GPU();
  test::DecodeSwitchGuard on(RouteSwitch::on);
  const test::Layer l = test::make_layer({320, 96, 16, 4, 4, 32, 8, false, Activation::geglu, DType::bf16});
  Workspace ws;
  const uint64_t before = test::decode_hits();
  // T = 9 > 8 tokens; T*k = 36 is still under the row bound.
  const Tensor h = test::random_tensor({9, 320}, DType::bf16, 1.0f, Device::cuda);
  const Tensor out = test::run_layer(h, h, l.gpu, ws);
  cuda_check();
  EXPECT_EQ(test::decode_hits(), before);
  // And the result is still right (general path): compare with the switch forced off.
  test::DecodeSwitchGuard off(RouteSwitch::off);
  Workspace ws2;
  EXPECT_EQ(out.to_host_bytes(), test::run_layer(h, h, l.gpu, ws2).to_host_bytes());
}

// A warmed-up decode call captured in a CUDA graph (global mode: any host sync or allocation fails
// the capture) holds exactly three kernel nodes and replays to the uncaptured bytes, twice.
TEST(GpuMoeDecode, CapturedInACudaGraphAsThreeKernels) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  test::DecodeSwitchGuard on(RouteSwitch::on);
  const test::MoeGeometry g{2816, 704, 16, 8, 4, 64, 8, false, Activation::geglu, DType::bf16};
  const test::Layer l = test::make_layer(g);
  const test::CaptureStream stream;
  Workspace ws;
  for (int64_t T : {8, 1, 3}) {
    const std::string what = detail::cat("T=", T);
    const Tensor h = test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda);
    const Tensor x = test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda);
    const Tensor expected = test::run_layer(h, x, l.gpu, ws);
    cuda_check();
    const size_t held = ws.bytes_held();
    Tensor replayed = Tensor::empty({T, g.H}, g.dtype, Device::cuda);
    cudaGraph_t graph = test::capture_graph(stream.get(), [&] { moe_layer_into(replayed, h, x, l.gpu, ws); }, what);
    ASSERT_NE(graph, nullptr) << what;
    EXPECT_EQ(ws.bytes_held(), held) << what << ": the workspace grew during the captured call";
    EXPECT_EQ(test::kernel_nodes(graph), 3) << what << ": the decode layer should be three kernels";
    test::expect_replays_match(graph, stream.get(), replayed, expected, 3, what);
  }
#endif
}


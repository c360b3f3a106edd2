// The device MoE path (switch_glu, moe_layer, moe_layer_into) against the float64 reference of
// tests/support/reference.h, plus the properties the benchmark relies on: a warmed-up call is
// capturable in a CUDA graph (no host sync, no allocation) and replays to the same output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "core/gather_qmm_problem.h"
#include "expertqmm/backend.h"
#include "expertqmm/error.h"
#include "support/graph_capture.h"
#include "support/reference.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

constexpr int64_t kD = 256;  // hidden size of the test experts
constexpr int64_t kI = 128;  // expert width

class ProductModeGuard {
 public:
  explicit ProductModeGuard(ProductMode m) : saved_(product_mode()) { set_product_mode(m); }
  ~ProductModeGuard() { set_product_mode(saved_); }

 private:
  ProductMode saved_;
};

// Random 4-bit gs64 experts (CPU-quantized), separate gate/up or one fused gate_up.
SwitchGLUWeights make_experts(int64_t E, bool fused, Activation act, Device device) {
  SwitchGLUWeights w;
  w.activation = act;
  if (fused) {
    w.gate_up = test::random_quantized({E, 2 * kI, kD}, 4, 64, 0.05f, device);
  } else {
    w.gate = test::random_quantized({E, kI, kD}, 4, 64, 0.05f, device);
    w.up = test::random_quantized({E, kI, kD}, 4, 64, 0.05f, device);
  }
  w.down = test::random_quantized({E, kD, kI}, 4, 64, 0.05f, device);
  return w;
}

RouterWeights make_router(int64_t E, int k, Device device) {
  RouterWeights r;
  r.top_k = k;
  r.proj = test::random_quantized({E, kD}, 8, 64, 1.0f, device);
  std::vector<float> scale(kD, 1.0f), pes(E);
  for (int64_t e = 0; e < E; ++e) pes[e] = 0.5f + static_cast<float>(e % 7) / 7.0f;
  r.scale = test::from_float(scale, {kD}, DType::bf16, device);
  r.per_expert_scale = test::from_float(pes, {E}, DType::bf16, device);
  return r;
}

// w_cpu's quantized weights copied to the device (gate and up, or the fused gate_up, and down).
SwitchGLUWeights device_experts(const SwitchGLUWeights& w_cpu) {
  SwitchGLUWeights w = w_cpu;
  if (w_cpu.fused()) {
    w.gate_up = test::to_device(w_cpu.gate_up, Device::cuda);
  } else {
    w.gate = test::to_device(w_cpu.gate, Device::cuda);
    w.up = test::to_device(w_cpu.up, Device::cuda);
  }
  w.down = test::to_device(w_cpu.down, Device::cuda);
  return w;
}

// The device layer over CPU-side experts w_cpu: a random router over E experts choosing k.
MoeWeights device_moe(const SwitchGLUWeights& w_cpu, int64_t E, int k) {
  MoeWeights moe;
  moe.router = make_router(E, k, Device::cuda);
  moe.experts = device_experts(w_cpu);
  return moe;
}

// k distinct random experts per token, and positive weights.
void random_routing(int64_t T, int64_t k, int64_t E, std::vector<int32_t>& ids, std::vector<float>& weights) {
  ids.clear();
  weights.clear();
  std::vector<int32_t> all(E);
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(all.begin(), all.end(), test::rng());
    ids.insert(ids.end(), all.begin(), all.begin() + k);
    for (int64_t j = 0; j < k; ++j) weights.push_back(uw(test::rng()));
  }
}

// Per-row relative error (each D-wide row against its float64 reference); the worst row.
double worst_row_error(const std::vector<float>& out, const std::vector<double>& ref, int64_t D) {
  double worst = 0;
  for (size_t r = 0; r * D < ref.size(); ++r) {
    std::vector<float> a(out.begin() + r * D, out.begin() + (r + 1) * D);
    std::vector<double> b(ref.begin() + r * D, ref.begin() + (r + 1) * D);
    worst = std::max(worst, test::rel_error(a, b));
  }
  return worst;
}

// switch_glu on the device vs the float64 reference, slot by slot: the reference is run on T*k
// one-slot "tokens" (x repeated, weight 1), which gives every [t, j] row on its own.
void check_switch_glu(const Tensor& x, const std::vector<int32_t>& ids, int64_t k, const SwitchGLUWeights& w_cpu,
                      const SwitchGLUWeights& w_gpu, const std::string& what) {
  const int64_t T = x.size(0);
  const Tensor idx = test::ids_tensor(ids, {T, k}, Device::cuda);
  const Tensor y = switch_glu(x.to(Device::cuda), idx, w_gpu);
  ASSERT_EQ(y.shape(), (Shape{T, k, kD})) << what;
  ASSERT_EQ(y.device(), Device::cuda) << what;
  const std::vector<float> xs = test::to_float(x);
  std::vector<float> x_rep;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) x_rep.insert(x_rep.end(), xs.begin() + t * kD, xs.begin() + (t + 1) * kD);
  const std::vector<float> ones(static_cast<size_t>(T * k), 1.0f);
  const std::vector<double> ref = test::reference_switch_glu_combine(x_rep, T * k, kD, ids, ones, 1, w_cpu);
  const std::vector<float> out = test::to_float(y);
  EXPECT_LE(test::rel_error(out, ref), 1e-2) << what << " " << test::seed_note();
  EXPECT_LE(worst_row_error(out, ref, kD), 3e-2) << what << " " << test::seed_note();
  cuda_check();
}

// moe_layer on the device vs the float64 reference fed with the device's own routing (routing
// itself is compared with the CPU router in gpu_ops_test.cpp).
void check_moe_layer(const Tensor& h, const Tensor& x, const MoeWeights& w_gpu, const SwitchGLUWeights& experts_cpu,
                     const std::string& what) {
  const int64_t T = x.size(0);
  const int k = w_gpu.router.top_k;
  const Tensor hd = h.to(Device::cuda), xd = x.to(Device::cuda);
  const Tensor out = moe_layer(hd, xd, w_gpu);
  ASSERT_EQ(out.shape(), (Shape{T, kD})) << what;
  const Routing r = route(hd, w_gpu.router);
  const std::vector<double> ref = test::reference_switch_glu_combine(test::to_float(x), T, kD, test::to_i32(r.indices),
                                                                     test::to_float(r.weights), k, experts_cpu);
  const std::vector<float> got = test::to_float(out);
  EXPECT_LE(test::rel_error(got, ref), 1e-2) << what << " " << test::seed_note();
  EXPECT_LE(worst_row_error(got, ref, kD), 3e-2) << what << " " << test::seed_note();
  cuda_check();
}

struct Variant {
  bool fused;
  Activation act;
};

void run_matrix(int64_t E, Variant v) {
  const SwitchGLUWeights w_cpu = make_experts(E, v.fused, v.act, Device::cpu);
  const SwitchGLUWeights w_gpu = device_experts(w_cpu);
  for (int64_t k : {1, 2, 8}) {
    MoeWeights moe;
    moe.router = make_router(E, static_cast<int>(k), Device::cuda);
    moe.experts = w_gpu;
    for (int64_t T : {1, 7, 8, 64, 300}) {
      const std::string what = detail::cat("E=", E, " k=", k, " T=", T, v.fused ? " fused gate_up" : " gate+up", " ",
                                           activation_name(v.act), T * k >= 64 ? " (sorted)" : " (unsorted)");
      const Tensor x = test::random_tensor({T, kD}, DType::bf16);
      std::vector<int32_t> ids;
      std::vector<float> weights;
      random_routing(T, k, E, ids, weights);
      check_switch_glu(x, ids, k, w_cpu, w_gpu, "switch_glu " + what);
      const Tensor h = test::random_tensor({T, kD}, DType::bf16);
      check_moe_layer(h, x, moe, w_cpu, "moe_layer " + what);
    }
  }
}

}  // namespace

TEST(GpuMoe, E8SeparateGateUpGeglu) {
  EXPERTQMM_REQUIRE_GPU();
  run_matrix(8, {false, Activation::geglu});
}
TEST(GpuMoe, E8FusedGateUpSwiglu) {
  EXPERTQMM_REQUIRE_GPU();
  run_matrix(8, {true, Activation::swiglu});
}
TEST(GpuMoe, E128SeparateGateUpSwiglu) {
  EXPERTQMM_REQUIRE_GPU();
  run_matrix(128, {false, Activation::swiglu});
}
TEST(GpuMoe, E128FusedGateUpGeglu) {
  EXPERTQMM_REQUIRE_GPU();
  run_matrix(128, {true, Activation::geglu});
}

TEST(GpuMoe, SwitchGluSmall) {
  EXPERTQMM_REQUIRE_GPU();
  // Both paths (unsorted 3*2 rows, sorted 9*8 rows) with uint32 ids, kept small for the sanitizer.
  for (bool fused : {false, true}) {
    const SwitchGLUWeights w_cpu = make_experts(4, fused, Activation::geglu, Device::cpu);
    const SwitchGLUWeights w_gpu = device_experts(w_cpu);
    for (int64_t T : {3, 9}) {
      const int64_t k = T == 3 ? 2 : 8;
      std::vector<int32_t> ids;
      if (k == 8) {
        ids = test::to_i32(test::random_ids({T, k}, 4));  // 4 experts, 8 slots: repeats within a token
      } else {
        std::vector<float> weights;
        random_routing(T, k, 4, ids, weights);
      }
      check_switch_glu(test::random_tensor({T, kD}, DType::bf16), ids, k, w_cpu, w_gpu,
                       detail::cat("small switch_glu T=", T, " k=", k, fused ? " fused" : ""));
    }
  }
}

TEST(GpuMoe, MoeLayerSmall) {
  EXPERTQMM_REQUIRE_GPU();
  const SwitchGLUWeights w_cpu = make_experts(8, false, Activation::geglu, Device::cpu);
  MoeWeights moe = device_moe(w_cpu, 8, 2);
  for (int64_t T : {2, 40})
    check_moe_layer(test::random_tensor({T, kD}, DType::bf16), test::random_tensor({T, kD}, DType::bf16), moe, w_cpu,
                    detail::cat("small moe_layer T=", T));
}

TEST(GpuMoe, ProductModesAgree) {
  EXPERTQMM_REQUIRE_GPU();
  const SwitchGLUWeights w_cpu = make_experts(16, true, Activation::geglu, Device::cpu);
  MoeWeights moe = device_moe(w_cpu, 16, 4);
  const Tensor h = test::random_tensor({50, kD}, DType::bf16, 1.0f, Device::cuda);
  const Tensor x = test::random_tensor({50, kD}, DType::bf16, 1.0f, Device::cuda);
  Tensor fused, separate;
  {
    ProductModeGuard g(ProductMode::fused);
    fused = moe_layer(h, x, moe);
  }
  {
    ProductModeGuard g(ProductMode::separate);
    separate = moe_layer(h, x, moe);
  }
  // The separate form rounds act(gate) to bf16 once more; everything else is the same launches.
  EXPECT_LE(test::rel_error(test::to_float(separate), test::to_float(fused)), 1e-2) << test::seed_note();
  const Routing r = route(h, moe.router);
  const std::vector<double> ref = test::reference_switch_glu_combine(test::to_float(x), 50, kD, test::to_i32(r.indices),
                                                                     test::to_float(r.weights), 4, w_cpu);
  EXPECT_LE(test::rel_error(test::to_float(separate), ref), 1e-2) << test::seed_note();
  cuda_check();
}

// The combine inside the down GEMM (atomics, the default where the wgmma route takes the layer)
// against the deterministic path (down outputs, then a slot-order combine kernel): the same
// answer within rounding, bit-identical repeats in deterministic mode, and less scratch.
TEST(GpuMoe, FusedCombineMatchesTheDeterministicPath) {
  EXPERTQMM_REQUIRE_GPU();
  const SwitchGLUWeights w_cpu = make_experts(16, false, Activation::geglu, Device::cpu);
  MoeWeights moe = device_moe(w_cpu, 16, 4);
  const int64_t T = 300;
  const Tensor h = test::random_tensor({T, kD}, DType::bf16, 1.0f, Device::cuda);
  auto run_layer = [&](bool deterministic_mode, size_t* scratch) {
    const bool before = deterministic();
    set_deterministic(deterministic_mode);
    Workspace ws;
    Tensor out = Tensor::empty({T, kD}, DType::bf16, Device::cuda);
    moe_layer_into(out, h, h, moe, ws);
    cuda_check();
    set_deterministic(before);
    if (scratch) *scratch = ws.bytes_held();
    return test::to_float(out);
  };
  size_t det_bytes = 0, fused_bytes = 0;
  const std::vector<float> det = run_layer(true, &det_bytes);
  const std::vector<float> det_again = run_layer(true, nullptr);
  const std::vector<float> fused = run_layer(false, &fused_bytes);
  EXPECT_EQ(std::memcmp(det.data(), det_again.data(), det.size() * sizeof(float)), 0)
      << "deterministic mode gave different bits";
  EXPECT_LE(test::rel_error(fused, det), 5e-3) << test::seed_note();
  const Routing r = route(h, moe.router);
  const std::vector<double> ref = test::reference_switch_glu_combine(test::to_float(h), T, kD, test::to_i32(r.indices),
                                                                     test::to_float(r.weights), 4, w_cpu);
  EXPECT_LE(test::rel_error(fused, ref), 1e-2) << test::seed_note();
  EXPECT_LE(fused_bytes, det_bytes) << "the fused combine should not need more scratch";
}

// A warmed-up moe_layer_into, captured in a CUDA graph on a non-default stream and replayed, writes
// the same bytes as the uncaptured call. Global capture mode rejects any synchronizing or
// allocating CUDA call made during the capture, so a successful capture proves the path has none;
// the workspace must not grow either.
TEST(GpuMoe, MoeLayerIntoCapturedInACudaGraphReplaysTheSameOutput) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  const int64_t E = 128;
  const int k = 8;
  const SwitchGLUWeights w_cpu = make_experts(E, false, Activation::geglu, Device::cpu);
  MoeWeights moe = device_moe(w_cpu, E, k);

  const test::CaptureStream stream;
  Workspace ws;
  // Warm up at the largest size; then the smaller (unsorted) size must not grow the workspace.
  for (int64_t T : {64, 5}) {
    const std::string what = detail::cat("T=", T);
    const Tensor h = test::random_tensor({T, kD}, DType::bf16, 1.0f, Device::cuda);
    const Tensor x = test::random_tensor({T, kD}, DType::bf16, 1.0f, Device::cuda);
    Tensor expected = Tensor::empty({T, kD}, DType::bf16, Device::cuda);
    moe_layer_into(expected, h, x, moe, ws);
    cuda_check();
    const size_t held = ws.bytes_held();
    ASSERT_GT(held, 0u) << what;

    Tensor replayed = Tensor::empty({T, kD}, DType::bf16, Device::cuda);
    cudaGraph_t graph = test::capture_graph(stream.get(), [&] { moe_layer_into(replayed, h, x, moe, ws); }, what);
    ASSERT_NE(graph, nullptr) << what;
    EXPECT_EQ(ws.bytes_held(), held) << what << ": the workspace grew during the captured call";
    size_t nodes = 0;
    ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
    // T=5 (T*k = 40) is served by the three-kernel decode layer (moe_decode.cu), T=64 by the
    // general path.
    EXPECT_GE(nodes, 3u) << what << ": the graph should hold the whole layer";
    test::expect_replays_match(graph, stream.get(), replayed, expected, 2, what);
  }
#endif
}

TEST(GpuMoe, WarmWorkspaceDoesNotGrowAtEqualOrSmallerSizes) {
  EXPERTQMM_REQUIRE_GPU();
  const SwitchGLUWeights w_cpu = make_experts(8, true, Activation::swiglu, Device::cpu);
  MoeWeights moe = device_moe(w_cpu, 8, 2);
  Workspace ws;
  size_t held = 0;
  for (int64_t T : {100, 100, 64, 31, 1}) {
    const Tensor h = test::random_tensor({T, kD}, DType::bf16, 1.0f, Device::cuda);
    Tensor out = Tensor::empty({T, kD}, DType::bf16, Device::cuda);
    moe_layer_into(out, h, h, moe, ws);
    if (held == 0) held = ws.bytes_held();
    EXPECT_EQ(ws.bytes_held(), held) << "T=" << T;
    // And the result is the allocating path's.
    EXPECT_EQ(out.to_host_bytes(), moe_layer(h, h, moe).to_host_bytes()) << "T=" << T;
  }
  cuda_check();
}

TEST(GpuMoe, ZeroTokensIsANoOpSmall) {
  EXPERTQMM_REQUIRE_GPU();
  const SwitchGLUWeights w_cpu = make_experts(4, false, Activation::geglu, Device::cpu);
  MoeWeights moe = device_moe(w_cpu, 4, 2);
  const Tensor empty = Tensor::empty({0, kD}, DType::bf16, Device::cuda);
  Workspace ws;
  Tensor out = Tensor::empty({0, kD}, DType::bf16, Device::cuda);
  EXPECT_NO_THROW(moe_layer_into(out, empty, empty, moe, ws));
  EXPECT_EQ(ws.bytes_held(), 0u);
  EXPECT_EQ(moe_layer(empty, empty, moe).shape(), (Shape{0, kD}));
  const Tensor no_ids = Tensor::empty({0, 2}, DType::i32, Device::cuda);
  EXPECT_EQ(switch_glu(empty, no_ids, moe.experts).shape(), (Shape{0, 2, kD}));
  const Routing r = route(empty, moe.router);
  EXPECT_EQ(r.indices.shape(), (Shape{0, 2}));
  cuda_check();
}

// An expert id out of range on the device is recorded and reported by cuda_check(), never read out
// of bounds (run under compute-sanitizer), and leaves nothing behind: the next call is clean and
// right. Sorted path: the bad id also aliases a valid id in the sort's key bits, so the GEMMs get
// unsorted ids.
TEST(GpuMoe, OutOfRangeExpertIdIsReportedSmall) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t E = 8;
  const SwitchGLUWeights w_cpu = make_experts(E, false, Activation::geglu, Device::cpu);
  const SwitchGLUWeights w_gpu = device_experts(w_cpu);
  for (int64_t T : {2, 16}) {
    const int64_t k = T == 2 ? 2 : 4;
    const std::string what = detail::cat("T=", T, " k=", k, T * k >= 64 ? " (sorted)" : " (unsorted)");
    std::vector<int32_t> ids;
    std::vector<float> weights;
    random_routing(T, k, E, ids, weights);
    std::vector<int32_t> bad = ids;
    bad[1] = static_cast<int32_t>(E + 8);  // low bits alias a valid id
    const Tensor x = test::random_tensor({T, kD}, DType::bf16);
    Tensor y = switch_glu(x.to(Device::cuda), test::ids_tensor(bad, {T, k}, Device::cuda), w_gpu);
    EXPECT_THROW(cuda_check(), Error) << what;
    EXPECT_NO_THROW(cuda_check()) << what << ": the fault must be reported once and cleared";
    bad[1] = -3;
    y = switch_glu(x.to(Device::cuda), test::ids_tensor(bad, {T, k}, Device::cuda), w_gpu);
    EXPECT_THROW(cuda_check(), Error) << what << " negative id";
    check_switch_glu(x, ids, k, w_cpu, w_gpu, "valid call after a fault, " + what);
  }
}

// The decode layer (src/cuda/moe_decode.cu: moe_layer_into in three kernels when T*k <= 64) against
// the float64 reference of tests/support/reference.h and against the general CUDA path (decode
// layer switched off), at Gemma 4's geometry and at small odd ones, bf16 and f16, 4- and 8-bit;
// plus CUDA graph capture + replay (three kernel nodes), determinism and the diagnostics counters.
//
// Router near-ties: the decode router sums in another order than route_into, so a token whose k-th
// and (k+1)-th logits sit within rounding of each other may pick another expert. A token whose
// output misses the bound is excused only when its CPU logits (recomputed as in gpu_ops_test.cpp)
// have such a near-tie at the k-th place, and at most one token per case may be excused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "core/gather_qmm_problem.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "support/graph_capture.h"
#include "support/reference.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

struct Geometry {
  int64_t H, I, E;
  int k;
  int bits;        // expert bits
  int group;       // expert group size
  int router_bits;  // 0: dense router
  bool fused;
  Activation act;
  DType dtype;
  std::string name() const {
    return detail::cat("H=", H, " I=", I, " E=", E, " k=", k, " bits=", bits, " gs=", group,
                       router_bits ? detail::cat(" router ", router_bits, "-bit") : std::string(" dense router"),
                       fused ? " fused" : "", " ", activation_name(act), " ", dtype_name(dtype));
  }
};

class DecodeSwitchGuard {
 public:
  explicit DecodeSwitchGuard(RouteSwitch s) : saved_(decode_layer_setting()) { set_decode_layer(s); }
  ~DecodeSwitchGuard() { set_decode_layer(saved_); }

 private:
  RouteSwitch saved_;
};

QuantizedWeight quantized(const Shape& shape, int bits, int group, float scale, DType dtype) {
  QuantizedWeight q = test::random_quantized(shape, bits, group, scale, Device::cpu);
  if (dtype != q.scales.dtype()) {
    q.scales = detail::cast_floating(q.scales, dtype);
    q.biases = detail::cast_floating(q.biases, dtype);
  }
  return q;
}

struct Layer {
  MoeWeights cpu, gpu;
};

Layer make_layer(const Geometry& g) {
  Layer l;
  SwitchGLUWeights& w = l.cpu.experts;
  w.activation = g.act;
  if (g.fused) {
    w.gate_up = quantized({g.E, 2 * g.I, g.H}, g.bits, g.group, 0.05f, g.dtype);
  } else {
    w.gate = quantized({g.E, g.I, g.H}, g.bits, g.group, 0.05f, g.dtype);
    w.up = quantized({g.E, g.I, g.H}, g.bits, g.group, 0.05f, g.dtype);
  }
  w.down = quantized({g.E, g.H, g.I}, g.bits, g.group, 0.05f, g.dtype);
  RouterWeights& r = l.cpu.router;
  r.top_k = g.k;
  if (g.router_bits) r.proj = quantized({g.E, g.H}, g.router_bits, 64, 1.0f, g.dtype);
  else r.proj_dense = test::random_tensor({g.E, g.H}, g.dtype, 1.0f);
  std::vector<float> scale = test::to_float(test::random_tensor({g.H}, DType::f32, 0.1f));
  for (float& s : scale) s += 1.0f;
  r.scale = test::from_float(scale, {g.H}, g.dtype);
  std::vector<float> pes(g.E);
  for (int64_t e = 0; e < g.E; ++e) pes[e] = 0.5f + static_cast<float>(e % 7) / 7.0f;
  r.per_expert_scale = test::from_float(pes, {g.E}, g.dtype);

  l.gpu = l.cpu;
  SwitchGLUWeights& d = l.gpu.experts;
  if (g.fused) d.gate_up = test::to_device(w.gate_up, Device::cuda);
  else {
    d.gate = test::to_device(w.gate, Device::cuda);
    d.up = test::to_device(w.up, Device::cuda);
  }
  d.down = test::to_device(w.down, Device::cuda);
  if (r.proj.defined()) l.gpu.router.proj = test::to_device(r.proj, Device::cuda);
  else l.gpu.router.proj_dense = r.proj_dense.to(Device::cuda);
  l.gpu.router.scale = r.scale.to(Device::cuda);
  l.gpu.router.per_expert_scale = r.per_expert_scale.to(Device::cuda);
  return l;
}

// True when token t's k-th and (k+1)-th logits are within 1/64 (relative) of each other.
bool near_tie(const std::vector<float>& logits, int64_t t, int64_t E, int k) {
  if (k >= E) return false;
  std::vector<float> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
  std::sort(row.begin(), row.end(), std::greater<float>());
  const float kth = row[k - 1], next = row[k];
  return kth - next <= std::fabs(kth) * (1.0f / 64) + 1e-6f;
}

double row_error(const std::vector<float>& out, const std::vector<double>& ref, int64_t t, int64_t H) {
  return test::rel_error(std::vector<float>(out.begin() + t * H, out.begin() + (t + 1) * H),
                         std::vector<double>(ref.begin() + t * H, ref.begin() + (t + 1) * H));
}
double row_error(const std::vector<float>& out, const std::vector<float>& ref, int64_t t, int64_t H) {
  return test::rel_error(std::vector<float>(out.begin() + t * H, out.begin() + (t + 1) * H),
                         std::vector<float>(ref.begin() + t * H, ref.begin() + (t + 1) * H));
}

uint64_t decode_hits() {
  for (const RouteCounters& c : diagnostics::snapshot())
    if (c.primitive == "moe_decode_layer") return c.hits;
  ADD_FAILURE() << "no moe_decode_layer row in snapshot()";
  return 0;
}

Tensor run_layer(const Tensor& h, const Tensor& x, const MoeWeights& w, Workspace& ws) {
  Tensor out = Tensor::empty({x.size(0), x.size(1)}, x.dtype(), Device::cuda);
  test::poison(out);  // every element must be written
  moe_layer_into(out, h, x, w, ws);
  return out;
}

// Decode path vs the float64 reference (routed by route_into) and vs the general path, for each T.
void check_geometry(const Geometry& g, const std::vector<int64_t>& tokens) {
  const Layer l = make_layer(g);
  const double tol = g.dtype == DType::bf16 ? 1e-2 : 5e-3;
  const double row_tol = 3 * tol;
  Workspace ws, ws_old;
  for (int64_t T : tokens) {
    const std::string what = detail::cat(g.name(), " T=", T);
    const Tensor h = test::random_tensor({T, g.H}, g.dtype);
    const Tensor x = test::random_tensor({T, g.H}, g.dtype);
    const Tensor hd = h.to(Device::cuda), xd = x.to(Device::cuda);

    Tensor dec, dec2, old;
    {
      DecodeSwitchGuard on(RouteSwitch::on);
      const uint64_t before = decode_hits();
      dec = run_layer(hd, xd, l.gpu, ws);
      dec2 = run_layer(hd, xd, l.gpu, ws);
      cuda_check();
      EXPECT_EQ(decode_hits(), before + 2) << what << ": the decode layer did not serve the calls";
    }
    {
      DecodeSwitchGuard off(RouteSwitch::off);
      const uint64_t before = decode_hits();
      old = run_layer(hd, xd, l.gpu, ws_old);
      cuda_check();
      EXPECT_EQ(decode_hits(), before) << what;
    }
    EXPECT_EQ(dec.to_host_bytes(), dec2.to_host_bytes()) << what << ": two runs differ";

    const Routing r = route(hd, l.gpu.router);
    const std::vector<double> ref = test::reference_switch_glu_combine(
        test::to_float(x), T, g.H, test::to_i32(r.indices), test::to_float(r.weights), g.k, l.cpu.experts);
    const std::vector<float> got = test::to_float(dec), general = test::to_float(old);
    std::vector<float> logits;
    int excused = 0;
    std::vector<float> got_kept, general_kept;
    std::vector<double> ref_kept;
    for (int64_t t = 0; t < T; ++t) {
      const double e_ref = row_error(got, ref, t, g.H), e_old = row_error(got, general, t, g.H);
      if (e_ref > row_tol || e_old > row_tol) {
        if (logits.empty()) logits = test::cpu_router_logits(h, l.cpu.router);
        EXPECT_TRUE(near_tie(logits, t, g.E, g.k))
            << what << ": token " << t << " error " << e_ref << " vs the reference, " << e_old
            << " vs the general path, without a router near-tie " << test::seed_note();
        ++excused;
        continue;
      }
      got_kept.insert(got_kept.end(), got.begin() + t * g.H, got.begin() + (t + 1) * g.H);
      general_kept.insert(general_kept.end(), general.begin() + t * g.H, general.begin() + (t + 1) * g.H);
      ref_kept.insert(ref_kept.end(), ref.begin() + t * g.H, ref.begin() + (t + 1) * g.H);
    }
    EXPECT_LE(excused, 1) << what << ": too many rerouted tokens " << test::seed_note();
    if (!got_kept.empty()) {
      EXPECT_LE(test::rel_error(got_kept, ref_kept), tol) << what << " " << test::seed_note();
      EXPECT_LE(test::rel_error(got_kept, general_kept), tol) << what << " vs general " << test::seed_note();
    }
  }
}

const std::vector<int64_t> kTokens = {1, 2, 3, 7, 8};

}  // namespace

TEST(GpuMoeDecode, GemmaGeometryBf16FourBit) {
  EXPERTQMM_REQUIRE_GPU();
  check_geometry({2816, 704, 16, 8, 4, 64, 8, false, Activation::geglu, DType::bf16}, kTokens);
}

TEST(GpuMoeDecode, GemmaGeometryF16FourBitFusedGateUp) {
  EXPERTQMM_REQUIRE_GPU();
  check_geometry({2816, 704, 16, 8, 4, 64, 8, true, Activation::geglu, DType::f16}, kTokens);
}

TEST(GpuMoeDecode, SmallOddGeometries) {
  EXPERTQMM_REQUIRE_GPU();
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (int bits : {4, 8}) {
      check_geometry({320, 96, 16, 4, bits, 32, 8, false, Activation::geglu, dtype}, kTokens);
      check_geometry({320, 96, 16, 4, bits, 32, 4, true, Activation::swiglu, dtype}, kTokens);
    }
    check_geometry({320, 96, 16, 4, 8, 32, 0, false, Activation::swiglu, dtype}, kTokens);
  }
  // Group 128 and k = 1 / 2 (T*k well under the bound), E = k (every expert chosen).
  check_geometry({256, 128, 8, 2, 4, 128, 8, false, Activation::geglu, DType::bf16}, kTokens);
  check_geometry({256, 128, 8, 2, 4, 128, 8, true, Activation::swiglu, DType::f16}, kTokens);
  check_geometry({256, 128, 8, 8, 4, 64, 8, false, Activation::swiglu, DType::bf16}, {1, 3, 8});
  check_geometry({256, 128, 4, 1, 8, 64, 8, true, Activation::geglu, DType::bf16}, kTokens);
}

// Calls the decode layer does not take go to the general path, counted by class.
TEST(GpuMoeDecode, UnsupportedCallsFallBack) {
  EXPERTQMM_REQUIRE_GPU();
  DecodeSwitchGuard on(RouteSwitch::on);
  const Layer l = make_layer({320, 96, 16, 4, 4, 32, 8, false, Activation::geglu, DType::bf16});
  Workspace ws;
  const uint64_t before = decode_hits();
  // T = 9 > 8 tokens; T*k = 36 is still under the row bound.
  const Tensor h = test::random_tensor({9, 320}, DType::bf16, 1.0f, Device::cuda);
  const Tensor out = run_layer(h, h, l.gpu, ws);
  cuda_check();
  EXPECT_EQ(decode_hits(), before);
  // And the result is still right (general path): compare with the switch forced off.
  DecodeSwitchGuard off(RouteSwitch::off);
  Workspace ws2;
  EXPECT_EQ(out.to_host_bytes(), run_layer(h, h, l.gpu, ws2).to_host_bytes());
}

// A warmed-up decode call captured in a CUDA graph (global mode: any host sync or allocation fails
// the capture) holds exactly three kernel nodes and replays to the uncaptured bytes, twice.
TEST(GpuMoeDecode, CapturedInACudaGraphAsThreeKernels) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  DecodeSwitchGuard on(RouteSwitch::on);
  const Geometry g{2816, 704, 16, 8, 4, 64, 8, false, Activation::geglu, DType::bf16};
  const Layer l = make_layer(g);
  const test::CaptureStream stream;
  Workspace ws;
  for (int64_t T : {8, 1, 3}) {
    const std::string what = detail::cat("T=", T);
    const Tensor h = test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda);
    const Tensor x = test::random_tensor({T, g.H}, g.dtype, 1.0f, Device::cuda);
    const Tensor expected = run_layer(h, x, l.gpu, ws);
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

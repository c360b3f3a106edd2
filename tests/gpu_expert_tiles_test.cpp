// The expert tile route (gather_qmm route 1): exact Gemma 4 shapes against the float64 reference and
// against the generic route, one-field selector misses with their named fallback classes, the
// sortedness fail-safe decided on the device (inside a CUDA graph capture, which fails on any host
// synchronization), and the diagnostics invariant. Fresh random inputs every run.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/float16.h"
#include "core/gather_qmm_problem.h"
#include "cuda/gather_qmm.h"
#include "cuda/gather_qmm_routes.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "expertqmm/ops.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

// A 4-bit (or 8-bit) MLX weight [E, N, K] with random codes and plausible bf16 scales/biases,
// generated directly (the CPU quantizer over 500M values would take minutes), on the host.
QuantizedWeight random_codes_weight(int64_t E, int64_t N, int64_t K, int bits, int group_size,
                                    DType param_dtype = DType::bf16) {
  std::mt19937_64& g = test::rng();
  const int64_t words = K * bits / 32, groups = K / group_size;
  std::vector<uint32_t> w(E * N * words);
  for (uint32_t& v : w) v = static_cast<uint32_t>(g());
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> s(E * N * groups), b(E * N * groups);
  const float levels = static_cast<float>((1 << bits) - 1);
  for (size_t i = 0; i < s.size(); ++i) {
    const float scale = (0.01f + 0.002f * nd(g)) * (g() & 1 ? 1.f : -1.f) * 15.f / levels;
    const float bias = -scale * levels * 0.5f + 0.001f * nd(g);
    s[i] = param_dtype == DType::f16 ? float_to_f16(scale) : float_to_bf16(scale);
    b[i] = param_dtype == DType::f16 ? float_to_f16(bias) : float_to_bf16(bias);
  }
  QuantizedWeight q;
  q.bits = bits;
  q.group_size = group_size;
  q.w = Tensor::from_host(w.data(), {E, N, words}, DType::u32);
  q.scales = Tensor::from_host(s.data(), {E, N, groups}, param_dtype);
  q.biases = Tensor::from_host(b.data(), {E, N, groups}, param_dtype);
  return q;
}

// Dequantized row n of expert e, in float64 from the host weight (any bits 4/8).
std::vector<double> weight_row(const QuantizedWeight& q, int64_t e, int64_t n) {
  const int64_t N = q.w.size(-2), words = q.w.size(-1), K = words * 32 / q.bits, groups = K / q.group_size;
  const uint32_t* w = q.w.data_as<uint32_t>() + (e * N + n) * words;
  const uint16_t* s = q.scales.data_as<uint16_t>() + (e * N + n) * groups;
  const uint16_t* b = q.biases.data_as<uint16_t>() + (e * N + n) * groups;
  std::vector<double> row(K);
  const int per_word = 32 / q.bits;
  for (int64_t k = 0; k < K; ++k) {
    const uint32_t code = (w[k / per_word] >> (q.bits * (k % per_word))) & ((1u << q.bits) - 1u);
    const int64_t gi = k / q.group_size;
    const bool f16 = q.scales.dtype() == DType::f16;
    const float sv = f16 ? f16_to_float(s[gi]) : bf16_to_float(s[gi]), bv = f16 ? f16_to_float(b[gi]) : bf16_to_float(b[gi]);
    row[k] = static_cast<double>(sv) * code + bv;
  }
  return row;
}

// Sorted expert ids: `rows` assignments of top-k routing over E experts (uniform).
std::vector<int32_t> sorted_ids(int64_t rows, int E) {
  std::uniform_int_distribution<int> ud(0, E - 1);
  std::vector<int32_t> ids(rows);
  for (int32_t& v : ids) v = ud(test::rng());
  std::sort(ids.begin(), ids.end());
  return ids;
}

// The SwitchGLU form of gather_qmm: x [B, 1, K], rhs [B] sorted, identity lhs.
struct RowsCase {
  QuantizedWeight q_host, q_dev;
  Tensor x_host, x_dev, rhs_dev;
  std::vector<int32_t> ids;
  bool promise_sorted = true;
  detail::GatherQmmProblem problem() const {
    return detail::make_gather_qmm_problem(x_dev, q_dev.w, q_dev.scales, q_dev.biases, Tensor(), rhs_dev, true,
                                           q_dev.group_size, q_dev.bits, promise_sorted);
  }
  int64_t B() const { return static_cast<int64_t>(ids.size()); }
  int64_t N() const { return q_host.w.size(-2); }
  int64_t K() const { return x_host.size(-1); }
};

RowsCase make_rows_case(const QuantizedWeight& q, std::vector<int32_t> ids, DType dtype = DType::bf16) {
  RowsCase c;
  c.q_host = q;
  c.q_dev = test::to_device(q, Device::cuda);
  c.ids = std::move(ids);
  const int64_t K = q.w.size(-1) * 32 / q.bits;
  c.x_host = test::random_tensor({c.B(), 1, K}, dtype, 1.0f);
  c.x_dev = c.x_host.to(Device::cuda);
  c.rhs_dev = test::ids_tensor(c.ids, {c.B()}, Device::cuda);
  return c;
}

// Runs `route` (or the selector when empty) into a poisoned output; returns it as floats.
std::vector<float> run(const RowsCase& c, const std::string& route = "") {
  Tensor out = Tensor::empty({c.B(), 1, c.N()}, c.x_dev.dtype(), Device::cuda);
  test::poison(out);
  detail::GatherQmmProblem p = c.problem();
  if (route.empty()) cuda::gather_qmm_into(p, out.data(), nullptr);
  else cuda::gather_qmm_into_route(route, p, out.data(), nullptr);
  cuda_check();
  return test::to_float(out);
}

// ||out - ref|| / ||ref|| over `samples` rows against float64.
double sampled_error(const RowsCase& c, const std::vector<float>& out, int samples) {
  std::vector<float> x = test::to_float(c.x_host);
  std::vector<float> got;
  std::vector<double> ref;
  std::uniform_int_distribution<int64_t> pick(0, c.B() - 1);
  const int64_t N = c.N(), K = c.K();
  for (int s = 0; s < samples; ++s) {
    const int64_t b = s == 0 ? 0 : s == 1 ? c.B() - 1 : pick(test::rng());
    for (int64_t n = 0; n < N; n += (s % 7) + 1) {  // a strided subset of columns per row
      const std::vector<double> w = weight_row(c.q_host, c.ids[b], n);
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(x[b * K + k]) * w[k];
      ref.push_back(acc);
      got.push_back(out[b * N + n]);
    }
  }
  return test::rel_error(got, ref);
}

struct CountersGuard {  // every test starts from zero counters and the automatic setting
  CountersGuard() {
    set_expert_tiles(RouteSwitch::automatic);
    diagnostics::reset();
  }
  ~CountersGuard() { set_expert_tiles(RouteSwitch::automatic); }
};

RouteCounters gather_counters() {
  for (const RouteCounters& c : diagnostics::snapshot())
    if (c.primitive == "gather_qmm") return c;
  ADD_FAILURE() << "no gather_qmm counters";
  return {};
}

void expect_invariant(const RouteCounters& c) {
  EXPECT_EQ(c.attempts, c.hits + c.fallback_total()) << diagnostics::format({c});
}

}  // namespace

// Exact Gemma 4 shapes at 4096, 8192 and 16384 assignments: gate/up fused [128, 1408, 2816] and down
// [128, 2816, 704], 4-bit gs64, against float64 (sampled) and the generic route (every element).
TEST(GpuExpertTiles, GemmaShapesMatchReferenceAndGenericRoute) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  const QuantizedWeight gate_up = random_codes_weight(128, 1408, 2816, 4, 64);
  const QuantizedWeight down = random_codes_weight(128, 2816, 704, 4, 64);
  for (int64_t rows : {4096, 8192, 16384})
    for (const QuantizedWeight* q : {&gate_up, &down}) {
      const RowsCase c = make_rows_case(*q, sorted_ids(rows, 128));
      ASSERT_EQ(cuda::gather_qmm_selected_route(c.problem()), "expert_tiles");
      const std::vector<float> tiles = run(c);
      const std::vector<float> generic = run(c, "rhs_tiles");
      const std::string what = "rows " + std::to_string(rows) + " N " + std::to_string(c.N()) + " " + test::seed_note();
      EXPECT_LE(sampled_error(c, tiles, 6), 1e-2) << what;
      EXPECT_LE(test::rel_error(tiles, generic), 1e-2) << what;
    }
  const RouteCounters counters = gather_counters();
  EXPECT_EQ(counters.hits, 6u);
  expect_invariant(counters);
}

// Plan edge cases through the route: tail tiles, one expert owning every row, empty experts, odd N.
TEST(GpuExpertTiles, OccupancyEdgeCasesSmall) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  const QuantizedWeight q = random_codes_weight(8, 200, 192, 4, 64);
  std::vector<std::vector<int32_t>> cases;
  cases.push_back(std::vector<int32_t>(300, 5));  // one expert, 9 full tiles + a 12-row tail
  std::vector<int32_t> tails;
  for (int e = 0; e < 8; ++e) tails.insert(tails.end(), 1 + 5 * e, e);  // 1..36 rows: bm 16 and 32 tails
  cases.push_back(tails);
  std::vector<int32_t> sparse(64, 2);
  sparse.insert(sparse.end(), 33, 7);  // experts 0, 1, 3..6 empty
  cases.push_back(sparse);
  for (const auto& ids : cases) {
    const RowsCase c = make_rows_case(q, ids);
    const std::vector<float> tiles = run(c, "expert_tiles");
    EXPECT_LE(sampled_error(c, tiles, 8), 1e-2) << test::seed_note();
    EXPECT_LE(test::rel_error(tiles, run(c, "simt")), 1e-2) << test::seed_note();
  }
}

// Both kernels of the route, pinned, on shapes that hit their edges: N not a multiple of the CTA's
// 128 (wgmma) or 128 (mma.sync) columns, one k tile, group size 128 (one group spans two k tiles),
// tails of every class, one expert owning every row, empty experts, bf16 and f16; the wgmma kernel
// in each of its builds (n32, n64, n128 with its n96 width for 65-96 rows, pinned by
// set_wgmma_width, the API side of EXPERTQMM_WGMMA_WIDTH). The wgmma kernel must
// be available on a compute capability 9.0 device (this build carries sm_90a code).
TEST(GpuExpertTiles, MmaSyncAndWgmmaKernelsMatchOnEdgeShapesSmall) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  int major = 0, minor = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  const bool hopper = major == 9 && minor == 0;
  struct Shape3 {
    int64_t E, N, K;
    int group_size;
  };
  const Shape3 shapes[] = {{8, 200, 192, 64}, {16, 136, 256, 128}, {4, 8, 64, 64}, {6, 712, 640, 64}};
  for (const Shape3& sh : shapes) {
    const QuantizedWeight q_bf16 = random_codes_weight(sh.E, sh.N, sh.K, 4, sh.group_size);
    const QuantizedWeight q_f16 = random_codes_weight(sh.E, sh.N, sh.K, 4, sh.group_size, DType::f16);
    std::vector<std::vector<int32_t>> cases;
    cases.push_back(std::vector<int32_t>(300, static_cast<int32_t>(sh.E - 1)));  // one expert, 4 full + 44-row tail
    std::vector<int32_t> tails;
    for (int e = 0; e < sh.E; ++e) tails.insert(tails.end(), 1 + 13 * e, e);  // 1, 14, 27, 40, 53, ...
    cases.push_back(tails);
    std::vector<int32_t> sparse(65, 1);
    sparse.insert(sparse.end(), 17, static_cast<int32_t>(sh.E - 1));  // the experts between are empty
    cases.push_back(sparse);
    std::vector<int32_t> n96(96, 0);  // the n128 build's n96 width: 96 rows, then 97 (n128)
    n96.insert(n96.end(), 97, static_cast<int32_t>(sh.E - 1));
    cases.push_back(n96);
    for (const auto& ids : cases)
      for (DType dtype : {DType::bf16, DType::f16}) {
        const RowsCase c = make_rows_case(dtype == DType::f16 ? q_f16 : q_bf16, ids, dtype);
        const std::string what = "E " + std::to_string(sh.E) + " N " + std::to_string(sh.N) + " K " +
                                 std::to_string(sh.K) + " gs " + std::to_string(sh.group_size) + " rows " +
                                 std::to_string(c.B()) + " " + dtype_name(dtype) + " " + test::seed_note();
        const std::vector<float> simt = run(c, "simt");
        const std::vector<float> mma = run(c, "expert_tiles_mma_sync");
        EXPECT_LE(sampled_error(c, mma, 8), 1e-2) << what;
        EXPECT_LE(test::rel_error(mma, simt), 1e-2) << what;
        const bool fits = cuda::supports_expert_tiles_wgmma(c.problem()).ok;
        EXPECT_EQ(fits, hopper) << what;
        if (!fits) continue;
        // Each build of the wgmma kernel (widest wgmma n32, n64, n128; taller tiles in pieces),
        // then the automatic choice (unset).
        for (int width : {32, 64, 128, 0}) {
          set_wgmma_width(width);  // 0: the measured table
          const std::vector<float> wg = run(c, "expert_tiles_wgmma");
          set_wgmma_width(0);
          const std::string with = what + " width " + std::to_string(width);
          EXPECT_LE(sampled_error(c, wg, 8), 1e-2) << with;
          EXPECT_LE(test::rel_error(wg, simt), 1e-2) << with;
          EXPECT_LE(test::rel_error(wg, mma), 1e-2) << with;
        }
      }
  }
}

// Every field changed alone sends the call to the generic routes with the named fallback class,
// and the answer stays right.
TEST(GpuExpertTiles, OneFieldSelectorMissesSmall) {
  EXPERTQMM_REQUIRE_GPU();
  const QuantizedWeight q4 = random_codes_weight(8, 128, 256, 4, 64);
  const std::vector<int32_t> ids = sorted_ids(128, 8);
  struct Miss {
    std::string name;
    Fallback expected;
    RowsCase c;
  };
  std::vector<Miss> misses;
  {
    RowsCase c = make_rows_case(q4, ids);
    c.promise_sorted = false;  // no promise: the rows may be in any order
    misses.push_back({"no sorted promise", Fallback::topology, c});
  }
  misses.push_back({"f32 activations", Fallback::dtype, make_rows_case(test::random_quantized({8, 128, 256}, 4, 64),
                                                                        ids, DType::f32)});
  misses.push_back({"3-bit", Fallback::quantization, make_rows_case(test::random_quantized({8, 128, 256}, 3, 64), ids)});
  misses.push_back({"K % 64", Fallback::alignment, make_rows_case(test::random_quantized({8, 128, 96}, 4, 32), ids)});
  misses.push_back({"too few rows", Fallback::shape, make_rows_case(q4, sorted_ids(cuda::kExpertTilesMinRows - 1, 8))});
  misses.push_back({"E > 4096", Fallback::shape, make_rows_case(random_codes_weight(4097, 8, 64, 4, 64), sorted_ids(128, 4097))});
  for (Miss& m : misses) {
    CountersGuard guard;
    // f32 activations need f32 scales for promotion to keep them f32: the quantized weight is bf16,
    // so the problem promotes to f32 and the route sees f32.
    const detail::GatherQmmProblem p = m.c.problem();
    const cuda::RouteSupport s = cuda::supports_expert_tiles(p);
    ASSERT_FALSE(s.ok) << m.name;
    EXPECT_EQ(s.reason, m.expected) << m.name << ": got " << fallback_name(s.reason);
    Tensor out = Tensor::empty({m.c.B(), 1, m.c.N()}, p.dtype, Device::cuda);
    test::poison(out);
    cuda::gather_qmm_into(p, out.data(), nullptr);
    cuda_check();
    const std::vector<float> got = test::to_float(out);
    EXPECT_LE(test::rel_error(got, run(m.c, "simt")), p.dtype == DType::f32 ? 1e-4 : 1e-2) << m.name;
    const RouteCounters c = gather_counters();
    EXPECT_EQ(c.attempts, 1u) << m.name;
    EXPECT_EQ(c.hits, 0u) << m.name;
    EXPECT_EQ(c.fallbacks[static_cast<int>(m.expected)], 1u) << m.name;
    expect_invariant(c);
  }
}

// The switch: off -> disabled (generic route, same answer); on/automatic -> hit.
TEST(GpuExpertTiles, SwitchOffCountsDisabledSmall) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  const RowsCase c = make_rows_case(random_codes_weight(8, 128, 256, 4, 64), sorted_ids(256, 8));
  const std::vector<float> hit = run(c);
  set_expert_tiles(RouteSwitch::off);
  EXPECT_EQ(cuda::gather_qmm_selected_route(c.problem()), "rhs_tiles");
  const std::vector<float> off = run(c);
  EXPECT_LE(test::rel_error(off, hit), 1e-2);
  set_expert_tiles(RouteSwitch::on);
  run(c);
  const RouteCounters counters = gather_counters();
  EXPECT_EQ(counters.attempts, 3u);
  EXPECT_EQ(counters.hits, 2u);
  EXPECT_EQ(counters.requested, 2u);
  EXPECT_EQ(counters.fallbacks[static_cast<int>(Fallback::disabled)], 1u);
  expect_invariant(counters);
}

// Unsorted ids under a sorted promise: the plan is retracted on the device, the same launch runs the
// generic algorithm, the answer is right, and the retraction is counted. The whole call is captured
// in a CUDA graph in global capture mode, so any host synchronization would fail the capture.
TEST(GpuExpertTiles, MisSortedInputIsRetractedOnTheDeviceWithoutHostSyncSmall) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  const QuantizedWeight q = random_codes_weight(16, 136, 256, 4, 64);
  std::vector<int32_t> ids = sorted_ids(200, 16);
  std::swap(ids[10], ids[150]);
  if (ids[10] == ids[150]) ids[10] = (ids[150] + 1) % 16;  // make sure the order is broken
  RowsCase c = make_rows_case(q, ids);
  const detail::GatherQmmProblem p = c.problem();
  ASSERT_EQ(cuda::gather_qmm_selected_route(p), "expert_tiles");

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  set_cuda_stream(stream);
  Workspace ws;
  Tensor out = Tensor::empty({c.B(), 1, c.N()}, DType::bf16, Device::cuda);
  cuda::gather_qmm_into(p, out.data(), &ws);  // warm-up sizes the workspace
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  test::poison(out);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cuda::gather_qmm_into(p, out.data(), &ws);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cuda_check();
  const std::vector<float> got = test::to_float(out);
  set_cuda_stream(nullptr);
  EXPECT_LE(sampled_error(c, got, 12), 1e-2) << test::seed_note();
  EXPECT_LE(test::rel_error(got, run(c, "simt")), 1e-2) << test::seed_note();

  const RouteCounters counters = gather_counters();
  // The warm-up and the captured call were selected as hits; both plans that ran (warm-up, one
  // replay) were retracted on the device. run(c, "simt") bypasses the selector.
  EXPECT_EQ(counters.attempts, 2u);
  EXPECT_EQ(counters.fallbacks[static_cast<int>(Fallback::sortedness_retracted)], 2u);
  EXPECT_EQ(counters.hits, 0u);
  expect_invariant(counters);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Calls that never reach the selector count nothing; reset() zeroes; the invariant holds throughout.
TEST(GpuExpertTiles, CountersInvariantAndResetSmall) {
  EXPERTQMM_REQUIRE_GPU();
  CountersGuard guard;
  const QuantizedWeight q = test::to_device(random_codes_weight(8, 64, 128, 4, 64), Device::cuda);
  Tensor x = test::random_tensor({4, 1, 100}, DType::bf16, 1.f, Device::cuda);  // K mismatch: rejected
  EXPECT_THROW(gather_qmm(x, q, Tensor(), test::ids_tensor({0, 1, 2, 3}, {4}, Device::cuda), true, true), Error);
  Tensor empty_x = Tensor::empty({0, 1, 128}, DType::bf16, Device::cuda);  // zero rows: a no-op
  gather_qmm(empty_x, q, Tensor(), Tensor::empty({0}, DType::i32, Device::cuda), true, true);
  RouteCounters c = gather_counters();
  EXPECT_EQ(c.attempts, 0u);
  const RowsCase rc = make_rows_case(random_codes_weight(8, 64, 128, 4, 64), sorted_ids(cuda::kExpertTilesMinRows + 31, 8));
  run(rc);
  run(rc, "");
  c = gather_counters();
  EXPECT_EQ(c.attempts, 2u);
  expect_invariant(c);
  diagnostics::reset();
  c = gather_counters();
  EXPECT_EQ(c.attempts, 0u);
  EXPECT_EQ(c.hits, 0u);
}

// CUDA gather_qmm: every route (forced through the test hook) against the float64 reference, route
// against route on the same inputs, the selector's choices, device-side id checks, and the public
// op against the CPU backend. Outputs are poisoned (NaN) first, so every element must be written.
// Fresh random inputs every run; EXPERTQMM_TEST_SEED replays a failure.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "core/gather_qmm_problem.h"
#include "cuda/gather_qmm.h"
#include "cuda/gather_qmm_routes.h"
#include "expertqmm/error.h"
#include "expertqmm/ops.h"
#include "support/reference.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

// docs/numerics.md: bf16 1e-2, f16 5e-3, f32 1e-4; route vs route 1e-2.
double tolerance(DType t) { return t == DType::bf16 ? 1e-2 : t == DType::f16 ? 5e-3 : 1e-4; }
constexpr double kRouteAgreement = 1e-2;

// Random weight [E, rows, cols] in `dtype`, quantized by the CPU backend (scales in `dtype`).
QuantizedWeight make_weight(int64_t E, int64_t rows, int64_t cols, int bits, int group_size, DType dtype) {
  Tensor w = test::random_tensor({E, rows, cols}, dtype, 0.05f);
  return quantize(w, QuantSpec{bits, group_size, Rounding::cpu});
}
DType weight_dtype_for(DType act) { return act == DType::f16 ? DType::f16 : DType::bf16; }

// One gather_qmm call: host operands for the reference, device operands for the routes.
struct Case {
  QuantizedWeight q_host, q_dev;
  Tensor x_host, x_dev;
  Tensor lhs_dev, rhs_dev;         // undefined: absent (MLX None)
  std::vector<int32_t> lhs, rhs;   // per batch element, broadcast and flat: the reference's view
  int64_t M = 1;
  bool transpose = true;
  bool sorted = false;
  Tensor x_keepalive;              // storage behind a strided x_dev view

  detail::GatherQmmProblem problem() const {
    return detail::make_gather_qmm_problem(x_dev, q_dev.w, q_dev.scales, q_dev.biases, lhs_dev, rhs_dev, transpose,
                                           q_dev.group_size, q_dev.bits, sorted);
  }
  int64_t K() const { return x_host.size(-1); }
  int64_t N() const { return transpose ? q_host.w.size(-2) : q_host.w.size(-1) * 32 / q_host.bits; }
  int64_t B() const { return static_cast<int64_t>(rhs.size()); }
};

Case make_case(const QuantizedWeight& q, const Tensor& x_host) {
  Case c;
  c.q_host = q;
  c.q_dev = test::to_device(q, Device::cuda);
  c.x_host = x_host;
  c.x_dev = x_host.to(Device::cuda);
  c.M = x_host.size(-2);
  return c;
}

// x [x_batch, M, K]; lhs and rhs given as device int32 [B] (ids checked on the device only).
Case batched_case(const QuantizedWeight& q, DType dtype, int64_t x_batch, int64_t M, const std::vector<int32_t>& lhs,
                  const std::vector<int32_t>& rhs, bool transpose = true) {
  const int64_t K = transpose ? q.w.size(-1) * 32 / q.bits : q.w.size(-2);
  Case c = make_case(q, test::random_tensor({x_batch, M, K}, dtype));
  c.transpose = transpose;
  c.lhs = lhs;
  c.rhs = rhs;
  c.lhs_dev = test::ids_tensor(lhs, {static_cast<int64_t>(lhs.size())}, Device::cuda);
  c.rhs_dev = test::ids_tensor(rhs, {static_cast<int64_t>(rhs.size())}, Device::cuda);
  return c;
}

// mlx-lm SwitchGLU after gather_sort: x [R, 1, K] (one row per (token, slot)), rhs [R], no lhs.
Case rows_case(const QuantizedWeight& q, DType dtype, const std::vector<int32_t>& ids, bool sorted) {
  const int64_t R = static_cast<int64_t>(ids.size());
  Case c = make_case(q, test::random_tensor({R, 1, q.w.size(-1) * 32 / q.bits}, dtype));
  c.rhs = ids;
  c.lhs.resize(R);
  std::iota(c.lhs.begin(), c.lhs.end(), 0);
  c.rhs_dev = test::ids_tensor(ids, {R}, Device::cuda);
  c.sorted = sorted;
  return c;
}

// mlx-lm SwitchGLU without sorting: x [T, 1, 1, K], rhs [T, k] distinct experts per token; lhs is
// absent and broadcasts from x's batch [T, 1].
Case topk_case(const QuantizedWeight& q, DType dtype, int64_t T, int64_t k) {
  const int64_t E = q.w.size(0);
  Case c = make_case(q, test::random_tensor({T, 1, 1, q.w.size(-1) * 32 / q.bits}, dtype));
  std::vector<int32_t> all(E);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(all.begin(), all.end(), test::rng());
    for (int64_t j = 0; j < k; ++j) {
      c.rhs.push_back(all[j % E]);
      c.lhs.push_back(static_cast<int32_t>(t));
    }
  }
  c.rhs_dev = test::ids_tensor(c.rhs, {T, k}, Device::cuda);
  return c;
}

std::vector<int32_t> random_ids(int64_t n, int64_t E, bool sorted) {
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(E - 1));
  std::vector<int32_t> ids(n);
  for (int32_t& i : ids) i = d(test::rng());
  if (sorted) std::sort(ids.begin(), ids.end());
  return ids;
}

// Runs one named route (or the selector when route is empty) into a poisoned output.
std::vector<float> run(const Case& c, const std::string& route = "") {
  const detail::GatherQmmProblem p = c.problem();
  Tensor out = Tensor::empty({p.B, p.M, p.N}, p.dtype, Device::cuda);
  test::poison(out);
  if (route.empty()) cuda::gather_qmm_into(p, out.data(), nullptr);
  else cuda::gather_qmm_into_route(route, p, out.data(), nullptr);
  cuda_check();
  return test::to_float(out);
}

std::vector<double> reference(const Case& c) {
  return test::reference_gather_qmm(test::to_float(c.x_host), c.M, c.K(), c.q_host, c.lhs, c.rhs, c.transpose);
}

// Relative error of the output rows of up to `count` batch elements (evenly spread, first and
// last included) against the float64 reference; for problems too large to reference whole.
double sampled_error(const Case& c, const std::vector<float>& out, int64_t count) {
  const int64_t B = c.B(), MN = c.M * c.N();
  std::vector<int64_t> picks;
  for (int64_t i = 0; i < std::min(count, B); ++i) picks.push_back(count >= B ? i : i * (B - 1) / (count - 1));
  std::vector<int32_t> lhs, rhs;
  std::vector<float> got;
  for (int64_t b : picks) {
    lhs.push_back(c.lhs[b]);
    rhs.push_back(c.rhs[b]);
    got.insert(got.end(), out.begin() + b * MN, out.begin() + (b + 1) * MN);
  }
  return test::rel_error(got, test::reference_gather_qmm(test::to_float(c.x_host), c.M, c.K(), c.q_host, lhs, rhs,
                                                         c.transpose));
}

std::string describe(const Case& c, const std::string& route) {
  return detail::cat("route=", route.empty() ? "(selector)" : route, " ", c.problem().describe(), " ",
                     test::seed_note());
}

// Every listed route against the float64 reference, and every route against the first.
void expect_routes_match_reference(const Case& c, const std::vector<std::string>& routes) {
  const std::vector<double> ref = reference(c);
  const double tol = tolerance(c.problem().dtype);
  std::vector<float> first;
  for (const std::string& route : routes) {
    const std::vector<float> out = run(c, route);
    EXPECT_LE(test::rel_error(out, ref), tol) << describe(c, route);
    if (first.empty()) first = out;
    else EXPECT_LE(test::rel_error(out, first), kRouteAgreement) << describe(c, route) << " vs " << routes[0];
  }
}

const std::vector<std::string> kAllRoutes = {"qmv", "rhs_tiles_bm16", "rhs_tiles_bm32", "rhs_tiles_bm64", "simt"};
const std::vector<std::string> kManyRowRoutes = {"rhs_tiles", "rhs_tiles_bm16", "rhs_tiles_bm32", "rhs_tiles_bm64",
                                                 "simt"};

}  // namespace

TEST(GpuGatherQmm, EveryRouteOnOddShapesSmall) {
  EXPERTQMM_REQUIRE_GPU();
  // N = 200 and K = 192 are multiples of no tile (K has 3 groups of 64: odd groups per row).
  const QuantizedWeight q = make_weight(8, 200, 192, 4, 64, DType::bf16);
  expect_routes_match_reference(batched_case(q, DType::bf16, 5, 1, {4, 0, 2, 2, 1, 3, 0, 4, 1, 1, 2, 3, 0},
                                             {7, 0, 3, 3, 3, 6, 1, 0, 5, 2, 2, 7, 4}),
                                kAllRoutes);
  // M = 3 rows per batch element: tiles cut through batch elements.
  expect_routes_match_reference(batched_case(q, DType::bf16, 4, 3, {3, 1, 0, 2, 2, 1, 0}, {5, 5, 1, 7, 0, 2, 2}),
                                kAllRoutes);
}

TEST(GpuGatherQmm, EveryBitsAndGroupSizeOnEveryRoute) {
  EXPERTQMM_REQUIRE_GPU();
  for (int bits : {4, 8})
    for (int gs : {32, 64, 128})
      for (int64_t K : {384, 448}) {  // 448: 7 groups of 64, an odd group count with a 64-wide k tile
        if (K % gs != 0) continue;
        const QuantizedWeight q = make_weight(8, 136, K, bits, gs, DType::bf16);
        expect_routes_match_reference(rows_case(q, DType::bf16, random_ids(24, 8, false), false), kAllRoutes);
        expect_routes_match_reference(rows_case(q, DType::bf16, random_ids(300, 8, true), true), kManyRowRoutes);
      }
}

TEST(GpuGatherQmm, Float16OnEveryRoute) {
  EXPERTQMM_REQUIRE_GPU();
  for (int bits : {4, 8}) {
    const QuantizedWeight q = make_weight(8, 200, 256, bits, 64, DType::f16);
    expect_routes_match_reference(rows_case(q, DType::f16, random_ids(24, 8, false), false), kAllRoutes);
    expect_routes_match_reference(topk_case(q, DType::f16, 40, 2), kManyRowRoutes);
  }
}

TEST(GpuGatherQmm, OtherBitWidthsGoThroughSimtSmall) {
  EXPERTQMM_REQUIRE_GPU();
  for (int bits : {2, 3, 5, 6})
    for (int gs : {32, 64, 128}) {
      const QuantizedWeight q = make_weight(4, 40, 256, bits, gs, DType::bf16);
      const Case c = rows_case(q, DType::bf16, random_ids(20, 4, false), false);
      EXPECT_EQ(cuda::gather_qmm_selected_route(c.problem()), "simt") << describe(c, "");
      EXPECT_THROW(run(c, "qmv"), Error);
      EXPECT_THROW(run(c, "rhs_tiles"), Error);
      EXPECT_LE(test::rel_error(run(c), reference(c)), tolerance(DType::bf16)) << describe(c, "");
    }
}

TEST(GpuGatherQmm, TransposeFalseGoesThroughSimtSmall) {
  EXPERTQMM_REQUIRE_GPU();
  // w [E, K, N*bits/32]: groups run along N, and K may be anything (here 100).
  for (int bits : {3, 4, 8}) {
    const QuantizedWeight q = make_weight(6, 100, 128, bits, 32, DType::bf16);
    const Case c = batched_case(q, DType::bf16, 3, 2, {0, 2, 1, 1, 2}, {5, 0, 3, 3, 1}, false);
    EXPECT_EQ(cuda::gather_qmm_selected_route(c.problem()), "simt") << describe(c, "");
    EXPECT_LE(test::rel_error(run(c), reference(c)), tolerance(DType::bf16)) << describe(c, "");
  }
}

TEST(GpuGatherQmm, Float32ActivationsGoThroughSimtSmall) {
  EXPERTQMM_REQUIRE_GPU();
  // f32 x with bf16 scales promotes to f32: fp32 dequantize and accumulation.
  const QuantizedWeight q = make_weight(4, 72, 160, 4, 32, DType::bf16);
  const Case c = rows_case(q, DType::f32, random_ids(50, 4, true), true);
  EXPECT_EQ(c.problem().dtype, DType::f32);
  EXPECT_EQ(cuda::gather_qmm_selected_route(c.problem()), "simt") << describe(c, "");
  EXPECT_LE(test::rel_error(run(c), reference(c)), tolerance(DType::f32)) << describe(c, "");
}

TEST(GpuGatherQmm, RowCountsFromDecodeToLongPrefill) {
  EXPERTQMM_REQUIRE_GPU();
  struct Shape3 { int64_t tokens, top_k, E; };
  for (const Shape3& s : {Shape3{1, 1, 8}, Shape3{1, 8, 128}, Shape3{3, 2, 8}, Shape3{64, 8, 128},
                          Shape3{700, 1, 256}, Shape3{2048, 8, 128}}) {
    const QuantizedWeight q = make_weight(s.E, 200, 192, 4, 64, DType::bf16);
    const int64_t rows = s.tokens * s.top_k;
    for (bool sorted : {false, true}) {
      const Case c = sorted ? rows_case(q, DType::bf16, random_ids(rows, s.E, true), true)
                            : topk_case(q, DType::bf16, s.tokens, s.top_k);
      const std::vector<float> selected = run(c);
      const std::vector<float> simt = run(c, "simt");
      EXPECT_LE(sampled_error(c, selected, 256), tolerance(DType::bf16)) << describe(c, "");
      EXPECT_LE(sampled_error(c, simt, 256), tolerance(DType::bf16)) << describe(c, "simt");
      EXPECT_LE(test::rel_error(selected, simt), kRouteAgreement) << describe(c, "") << " vs simt";
      if (rows <= cuda::kQmvMaxRows) {
        EXPECT_LE(test::rel_error(run(c, "rhs_tiles"), simt), kRouteAgreement) << describe(c, "rhs_tiles");
      } else {
        EXPECT_THROW(run(c, "qmv"), Error) << describe(c, "qmv");
      }
    }
  }
}

TEST(GpuGatherQmm, ExpertOccupancyEdgeCases) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t E = 128;
  const QuantizedWeight q = make_weight(E, 200, 192, 4, 64, DType::bf16);
  std::vector<std::vector<int32_t>> id_sets;
  // Most experts get no rows: ids from {1, 5, 127} only.
  std::vector<int32_t> few = random_ids(500, 3, true);
  for (int32_t& i : few) i = i == 0 ? 1 : i == 1 ? 5 : 127;
  id_sets.push_back(few);
  id_sets.push_back(std::vector<int32_t>(1000, 77));  // one expert takes every row
  std::vector<int32_t> alternating(100);              // a new run at every row
  for (size_t i = 0; i < alternating.size(); ++i) alternating[i] = static_cast<int32_t>(i % 2 ? 0 : E - 1);
  id_sets.push_back(alternating);
  std::vector<int32_t> descending = random_ids(333, E, true);  // sorted the wrong way
  std::reverse(descending.begin(), descending.end());
  id_sets.push_back(descending);
  id_sets.push_back(random_ids(333, E, false));
  for (const std::vector<int32_t>& ids : id_sets) {
    const Case c = rows_case(q, DType::bf16, ids, std::is_sorted(ids.begin(), ids.end()));
    const std::vector<float> simt = run(c, "simt");
    EXPECT_LE(sampled_error(c, simt, 128), tolerance(DType::bf16)) << describe(c, "simt");
    for (const std::string& route : {"", "rhs_tiles_bm16", "rhs_tiles_bm32"}) {
      const std::vector<float> out = run(c, route);
      EXPECT_LE(sampled_error(c, out, 128), tolerance(DType::bf16)) << describe(c, route);
      EXPECT_LE(test::rel_error(out, simt), kRouteAgreement) << describe(c, route) << " vs simt";
    }
  }
}

TEST(GpuGatherQmm, SeveralRowsPerBatchElement) {
  EXPERTQMM_REQUIRE_GPU();
  const QuantizedWeight q = make_weight(8, 136, 256, 8, 128, DType::bf16);
  // M = 5: runs of 5 rows cross 16-row tiles; 30 rows still fit qmv.
  expect_routes_match_reference(batched_case(q, DType::bf16, 4, 5, {0, 3, 3, 1, 2, 0}, {6, 6, 2, 0, 7, 3}),
                                kAllRoutes);
  // M = 40: rhs_tiles picks 32-row tiles; rows of a batch element share an expert.
  expect_routes_match_reference(batched_case(q, DType::bf16, 3, 40, {2, 0, 1, 1}, {4, 4, 0, 7}), kManyRowRoutes);
}

// Few columns, many rows, long K (the router's projection: N = 128, K = 2816): the selector's BM=16
// tiles split K into fp32 slices summed by a second kernel. Every case must take the split (checked)
// and match the reference and the unsplit BM=16 route; slices of unequal k-tile counts (K = 576: 9
// tiles in 2 slices), N off the 128-column grid, rows off the 16-row grid, unsorted ids (several
// expert runs per tile), 4 and 8 bits, group sizes 32 / 64 / 128, bf16 and f16.
TEST(GpuGatherQmm, SplitKOnFewColumnsManyRowsSmall) {
  EXPERTQMM_REQUIRE_GPU();
  struct Shape {
    int64_t E, N, K;
    int bits, group_size;
    DType dtype;
    int64_t rows;
    bool sorted;
  };
  const Shape shapes[] = {{4, 128, 2816, 8, 64, DType::bf16, 300, false}, {4, 100, 576, 4, 32, DType::f16, 130, true},
                          {3, 128, 768, 4, 128, DType::bf16, 77, false}, {5, 36, 1024, 8, 64, DType::bf16, 200, true}};
  for (const Shape& sh : shapes) {
    const QuantizedWeight q = make_weight(sh.E, sh.N, sh.K, sh.bits, sh.group_size, sh.dtype);
    const Case c = rows_case(q, sh.dtype, random_ids(sh.rows, sh.E, sh.sorted), sh.sorted);
    ASSERT_GT(cuda::rhs_tiles_split_slices(c.problem()), 1) << describe(c, "rhs_tiles");
    expect_routes_match_reference(c, {"rhs_tiles", "rhs_tiles_bm16"});
  }
  // The router's own form: one weight matrix, x [1, T, K] as M = T rows of one batch element.
  const QuantizedWeight router = make_weight(1, 128, 2816, 8, 64, DType::bf16);
  const Case r = batched_case(router, DType::bf16, 1, 300, {0}, {0});
  ASSERT_GT(cuda::rhs_tiles_split_slices(r.problem()), 1) << describe(r, "rhs_tiles");
  expect_routes_match_reference(r, {"rhs_tiles", "rhs_tiles_bm16"});
}

TEST(GpuGatherQmm, GemmaShapesGateUpAndDown) {
  EXPERTQMM_REQUIRE_GPU();
  // Gemma 4 26B-A4B: gate/up [E, 704, 2816] (fused gate_up: 1408), down [E, 2816, 704]; 4-bit gs64.
  // E = 8 keeps the float64 reference affordable; E = 128/256 run at smaller N, K above.
  struct Proj { int64_t N, K; };
  for (const Proj& pr : {Proj{704, 2816}, Proj{1408, 2816}, Proj{2816, 704}}) {
    const QuantizedWeight q = make_weight(8, pr.N, pr.K, 4, 64, DType::bf16);
    // Decode: one token, top-8, unsorted. The selector takes qmv; all routes agree.
    const Case decode = topk_case(q, DType::bf16, 1, 8);
    EXPECT_EQ(cuda::gather_qmm_selected_route(decode.problem()), "qmv") << describe(decode, "");
    expect_routes_match_reference(decode, kAllRoutes);
    // Prefill: 64 tokens x top-8 sorted (rhs_tiles), sampled against the reference, and simt.
    const Case prefill = rows_case(q, DType::bf16, random_ids(512, 8, true), true);
    const std::vector<float> tiles = run(prefill, "rhs_tiles");
    EXPECT_LE(sampled_error(prefill, tiles, 24), tolerance(DType::bf16)) << describe(prefill, "rhs_tiles");
    EXPECT_LE(test::rel_error(tiles, run(prefill, "simt")), kRouteAgreement) << describe(prefill, "rhs_tiles");
  }
}

TEST(GpuGatherQmm, StridedAndMisalignedOperands) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t B = 20, M = 1, K = 256, N = 136, E = 8;
  const QuantizedWeight q = make_weight(E, N, K, 4, 64, DType::bf16);
  const std::vector<int32_t> ids = random_ids(B, E, false);
  for (int64_t pad : {64, 4}) {  // x batch stride K + pad: 16-byte aligned rows, then 8-byte aligned
    Case c = rows_case(q, DType::bf16, ids, false);
    const std::vector<float> xv = test::to_float(c.x_host);
    std::vector<float> padded(B * (K + pad), 0.f);
    for (int64_t b = 0; b < B; ++b) std::copy(xv.begin() + b * K, xv.begin() + (b + 1) * K, padded.begin() + b * (K + pad));
    c.x_keepalive = test::from_float(padded, {B * (K + pad)}, DType::bf16, Device::cuda);
    c.x_dev = Tensor::view(c.x_keepalive.data(), {B, M, K}, DType::bf16, Device::cuda, {K + pad, K, 1});
    ASSERT_EQ(c.problem().x_batch_stride, K + pad);
    if (pad % 8 == 0) {
      expect_routes_match_reference(c, kAllRoutes);
    } else {
      EXPECT_THROW(run(c, "rhs_tiles"), Error) << describe(c, "rhs_tiles");  // needs 16-byte rows
      expect_routes_match_reference(c, {"qmv", "simt"});
    }
  }
  // Weights one word past a 16-byte boundary: qmv falls back to single-word loads, rhs_tiles is out.
  Case c = rows_case(q, DType::bf16, ids, false);
  Tensor w_buf = Tensor::empty({q.w.numel() + 1}, DType::u32, Device::cuda);
  const std::vector<uint8_t> w_bytes = q.w.to_host_bytes();
  detail::copy_host_to_device(static_cast<uint32_t*>(w_buf.data()) + 1, w_bytes.data(), w_bytes.size());
  c.q_dev.w = Tensor::view(static_cast<uint32_t*>(w_buf.data()) + 1, q.w.shape(), DType::u32, Device::cuda);
  EXPECT_THROW(run(c, "rhs_tiles"), Error) << describe(c, "rhs_tiles");
  expect_routes_match_reference(c, {"qmv", "simt"});
}

TEST(GpuGatherQmm, SelectorOrderAndChoicesSmall) {
  EXPERTQMM_REQUIRE_GPU();
  const std::vector<std::string> names = cuda::gather_qmm_route_names();
  auto pos = [&](const char* n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  ASSERT_LT(pos("qmv"), static_cast<long>(names.size()));
  EXPECT_LT(pos("qmv"), pos("rhs_tiles"));
  EXPECT_LT(pos("rhs_tiles"), pos("simt"));
  EXPECT_EQ(names.back(), "simt");

  // Unsorted problems (sorted_indices=false), which the sorted tile route does not take.
  const QuantizedWeight q = make_weight(8, 64, 256, 4, 64, DType::bf16);
  const int64_t qmv_rows = cuda::kQmvMaxRows;
  EXPECT_EQ(cuda::gather_qmm_selected_route(rows_case(q, DType::bf16, random_ids(qmv_rows, 8, false), false).problem()),
            "qmv");
  EXPECT_EQ(cuda::gather_qmm_selected_route(rows_case(q, DType::bf16, random_ids(qmv_rows + 1, 8, false), false).problem()),
            "rhs_tiles");
  // K = 224 is a multiple of 32 but not of 64: qmv for decode, simt beyond.
  const QuantizedWeight q224 = make_weight(8, 64, 224, 4, 32, DType::bf16);
  const Case odd_k = rows_case(q224, DType::bf16, random_ids(100, 8, false), false);
  EXPECT_EQ(cuda::gather_qmm_selected_route(odd_k.problem()), "simt");
  EXPECT_EQ(cuda::gather_qmm_selected_route(rows_case(q224, DType::bf16, random_ids(8, 8, false), false).problem()),
            "qmv");
  try {
    run(odd_k, "rhs_tiles");
    ADD_FAILURE() << "rhs_tiles accepted K=224";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("alignment"), std::string::npos) << e.what();
  }
  EXPECT_THROW(run(odd_k, "no_such_route"), Error);
  expect_routes_match_reference(odd_k, {"", "simt"});
}

TEST(GpuGatherQmm, EmptyProblemsAndZeroKSmall) {
  EXPERTQMM_REQUIRE_GPU();
  const QuantizedWeight q = make_weight(4, 40, 128, 4, 64, DType::bf16);
  // Zero rows: nothing is launched and nothing fails.
  const Case none = rows_case(q, DType::bf16, {}, true);
  const detail::GatherQmmProblem p = none.problem();
  cuda::gather_qmm_into(p, nullptr, nullptr);
  cuda_check();
  // K = 0: every output is an empty sum, written as 0 (simt takes it; the others refuse it).
  QuantizedWeight q0;
  q0.bits = 4;
  q0.group_size = 64;
  q0.w = Tensor::empty({4, 40, 0}, DType::u32, Device::cuda);
  q0.scales = Tensor::empty({4, 40, 0}, DType::bf16, Device::cuda);
  q0.biases = Tensor::empty({4, 40, 0}, DType::bf16, Device::cuda);
  const Tensor x0 = Tensor::empty({6, 1, 0}, DType::bf16, Device::cuda);
  const Tensor ids = test::ids_tensor({0, 1, 2, 3, 3, 0}, {6}, Device::cuda);
  const detail::GatherQmmProblem pk =
      detail::make_gather_qmm_problem(x0, q0.w, q0.scales, q0.biases, Tensor(), ids, true, 64, 4, false);
  EXPECT_EQ(cuda::gather_qmm_selected_route(pk), "simt");
  Tensor out = Tensor::empty({6, 1, 40}, DType::bf16, Device::cuda);
  test::poison(out);
  cuda::gather_qmm_into(pk, out.data(), nullptr);
  cuda_check();
  for (float v : test::to_float(out)) ASSERT_EQ(v, 0.0f);
}

TEST(GpuGatherQmm, OutOfRangeIdsAreReportedSmall) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t E = 8;
  const QuantizedWeight q = make_weight(E, 136, 256, 4, 64, DType::bf16);
  cuda_check();  // start from a clean fault record
  for (const std::string& route : kAllRoutes) {
    for (int32_t bad : {static_cast<int32_t>(E), -1, 1 << 30}) {
      std::vector<int32_t> ids = random_ids(20, E, true);
      ids[7] = bad;
      const Case c = rows_case(q, DType::bf16, ids, true);
      const detail::GatherQmmProblem p = c.problem();
      Tensor out = Tensor::empty({p.B, p.M, p.N}, p.dtype, Device::cuda);
      cuda::gather_qmm_into_route(route, p, out.data(), nullptr);
      try {
        cuda_check();
        ADD_FAILURE() << "expert id " << bad << " was not reported by " << route;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("expert id"), std::string::npos) << e.what();
      }
    }
    // A bad lhs (x matrix) id is reported too.
    const Case lc = batched_case(q, DType::bf16, 4, 1, {0, 1, 9, 3}, {1, 1, 2, 2});
    const detail::GatherQmmProblem lp = lc.problem();
    Tensor out = Tensor::empty({lp.B, lp.M, lp.N}, lp.dtype, Device::cuda);
    cuda::gather_qmm_into_route(route, lp, out.data(), nullptr);
    EXPECT_THROW(cuda_check(), Error) << route;
    // The fault record is cleared: a good call afterwards succeeds and is right.
    const Case good = rows_case(q, DType::bf16, random_ids(20, E, true), true);
    EXPECT_LE(test::rel_error(run(good, route), reference(good)), tolerance(DType::bf16)) << describe(good, route);
  }
}

TEST(GpuGatherQmm, PublicOpOnCudaMatchesCpuBackend) {
  EXPERTQMM_REQUIRE_GPU();
  // Unsorted decode form with broadcast indices, sorted rows, and a 3-bit transpose=false weight.
  const QuantizedWeight q = make_weight(16, 200, 256, 4, 64, DType::bf16);
  const QuantizedWeight qd = test::to_device(q, Device::cuda);
  {
    const Tensor x = test::random_tensor({5, 1, 1, 256}, DType::bf16);
    const Tensor idx = test::random_ids({5, 4}, 16);
    const Tensor want = gather_qmm(x, q, Tensor(), idx);
    const Tensor got = gather_qmm(x.to(Device::cuda), qd, Tensor(), idx.to(Device::cuda));
    EXPECT_EQ(got.device(), Device::cuda);
    EXPECT_EQ(got.shape(), want.shape());
    EXPECT_EQ(got.dtype(), DType::bf16);
    EXPECT_LE(test::rel_error(test::to_float(got), test::to_float(want)), tolerance(DType::bf16)) << test::seed_note();
  }
  {
    const Tensor x = test::random_tensor({300, 1, 256}, DType::bf16);
    const Tensor idx = test::ids_tensor(random_ids(300, 16, true), {300});
    const Tensor want = gather_qmm(x, q, Tensor(), idx, true, true);
    const Tensor got = gather_qmm(x.to(Device::cuda), qd, Tensor(), idx.to(Device::cuda), true, true);
    EXPECT_EQ(got.shape(), want.shape());
    EXPECT_LE(test::rel_error(test::to_float(got), test::to_float(want)), tolerance(DType::bf16)) << test::seed_note();
  }
  {
    const QuantizedWeight q3 = make_weight(3, 64, 128, 3, 64, DType::bf16);  // [E, K=64, N=128]
    const Tensor x = test::random_tensor({2, 7, 64}, DType::bf16);
    const Tensor lhs = test::ids_tensor({1, 0, 1}, {3});
    const Tensor rhs = test::ids_tensor({2, 2, 0}, {3});
    const Tensor want = gather_qmm(x, q3, lhs, rhs, false);
    const Tensor got = gather_qmm(x.to(Device::cuda), test::to_device(q3, Device::cuda), lhs.to(Device::cuda),
                                  rhs.to(Device::cuda), false);
    EXPECT_EQ(got.shape(), want.shape());
    EXPECT_LE(test::rel_error(test::to_float(got), test::to_float(want)), tolerance(DType::bf16)) << test::seed_note();
  }
}

// CUDA gather_qmm beyond the backend-ops table (gpu_backend_ops_test.cpp, which runs every route on
// every shape against float64): the selector's route list, empty problems, and expert ids out of
// range, which every route must report through cuda_check() without reading out of bounds (run under
// compute-sanitizer) and without leaving a fault behind; and the public gather_qmm_into.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/gather_qmm_problem.h"
#include "cuda/gather_qmm.h"
#include "expertqmm/error.h"
#include "expertqmm/moe.h"
#include "expertqmm/ops.h"
#include "support/gather_case.h"
#include "support/test_util.h"

using namespace expertqmm;

TEST(SanitizeGpuGatherQmm, RoutesInSelectorOrder) {
  EXPERTQMM_REQUIRE_GPU();
  const std::vector<std::string> names = cuda::gather_qmm_route_names();
  auto pos = [&](const char* n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  ASSERT_LT(pos("qmv"), static_cast<long>(names.size()));
  EXPECT_LT(pos("qmv"), pos("rhs_tiles"));
  EXPECT_LT(pos("rhs_tiles"), pos("simt"));
  EXPECT_EQ(names.back(), "simt");  // it takes every valid problem
  const test::GatherCall c = test::rows_call(test::random_codes(8, 64, 256, 4, 64), DType::bf16, {0, 3, 3, 7}, true);
  EXPECT_THROW(test::run_route(c, "no_such_route"), Error);
}

TEST(SanitizeGpuGatherQmm, EmptyProblemsAndZeroK) {
  EXPERTQMM_REQUIRE_GPU();
  // Zero rows: nothing is launched and nothing fails.
  const test::GatherCall none = test::rows_call(test::random_codes(4, 40, 128, 4, 64), DType::bf16, {}, true);
  cuda::gather_qmm_into(none.problem(), nullptr, nullptr);
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

TEST(SanitizeGpuGatherQmm, OutOfRangeIdsAreReported) {
  EXPERTQMM_REQUIRE_GPU();
  const int64_t E = 8;
  const QuantizedWeight q = test::random_codes(E, 136, 256, 4, 64);
  cuda_check();  // start from a clean fault record
  for (const std::string route : {"qmv", "rhs_tiles_bm16", "rhs_tiles_bm32", "rhs_tiles_bm64", "simt"}) {
    for (int32_t bad : {static_cast<int32_t>(E), -1, 1 << 30}) {
      std::vector<int32_t> ids = test::make_ids(test::sorted(20), E);
      ids[7] = bad;
      const test::GatherCall c = test::rows_call(q, DType::bf16, ids, true);
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
    const test::GatherCall lc = test::batched_call(q, DType::bf16, 4, 1, {0, 1, 9, 3}, {1, 1, 2, 2});
    const detail::GatherQmmProblem lp = lc.problem();
    Tensor out = Tensor::empty({lp.B, lp.M, lp.N}, lp.dtype, Device::cuda);
    cuda::gather_qmm_into_route(route, lp, out.data(), nullptr);
    EXPECT_THROW(cuda_check(), Error) << route;
    // The fault record is cleared: a good call afterwards succeeds and is right.
    const test::GatherCall good = test::rows_call(q, DType::bf16, test::make_ids(test::sorted(20), E), true);
    EXPECT_LE(test::reference_error(good, test::run_route(good, route)), test::gemm_tolerance(DType::bf16))
        << good.describe(route);
  }
}

// The public gather_qmm_into on CUDA (the MLX extension's path): bit for bit gather_qmm's output, in
// the caller's memory, with and without a workspace; a second call on the warmed workspace
// allocates no scratch.
TEST(GpuGatherQmm, IntoWritesTheCallersOutput) {
  EXPERTQMM_REQUIRE_GPU();
  const QuantizedWeight q = test::random_quantized({8, 136, 256}, 4, 64, 0.05f, Device::cuda);
  for (const Shape& x_shape : {Shape{5, 1, 1, 256}, Shape{40, 1, 1, 256}}) {
    const Tensor x = test::random_tensor(x_shape, DType::bf16, 1.0f, Device::cuda);
    const Tensor rhs = test::random_ids({x_shape[0], 4}, 8, Device::cuda);
    const Tensor want = gather_qmm(x, q, Tensor(), rhs, true, false);
    Workspace ws;
    for (Workspace* w : {static_cast<Workspace*>(nullptr), &ws, &ws}) {
      Tensor out = Tensor::empty(want.shape(), want.dtype(), Device::cuda);
      test::poison(out);
      const size_t held = ws.bytes_held();
      gather_qmm_into(out, x, q.w, q.scales, q.biases, Tensor(), rhs, true, q.group_size, q.bits, false,
                      QuantMode::affine, w);
      cuda_check();
      EXPECT_EQ(test::to_float(out), test::to_float(want)) << shape_str(x_shape);
      if (w && held > 0) EXPECT_EQ(ws.bytes_held(), held) << "a warmed workspace grew";
    }
  }
}

// qmv with the GeGLU epilogue (the Gemma 4 block's 8-bit dense MLP at one token) writes the bits of
// the two one-row qmv launches it replaces followed by the GLU product: the same sums in the same
// order at the same K split. Gemma 4's gate/up shape at one and two rows (from three rows qmv leaves a
// matrix that wide to rhs_tiles) and a narrow one (N = 200: a partial column set; 64 chunks: no K
// split) at one and three rows, bf16 and f16; and the calls it refuses.
TEST(GpuGatherQmm, QmvGluIsTwoQmvsAndTheGluProduct) {
  EXPERTQMM_REQUIRE_GPU();
  for (DType dtype : {DType::bf16, DType::f16})
    for (const std::pair<int64_t, int64_t>& nk : {std::pair<int64_t, int64_t>{2112, 2816}, {200, 256}})
      for (int64_t T : {int64_t{1}, nk.first > 256 ? int64_t{2} : int64_t{3}}) {
        const std::string what = detail::cat(dtype_name(dtype), " N=", nk.first, " K=", nk.second, " T=", T);
        auto codes = [&] { return test::to_device(test::random_codes(1, nk.first, nk.second, 8, 64, dtype), Device::cuda); };
        const QuantizedWeight gate = codes(), up = codes();
        const Tensor x = test::random_tensor({T, nk.second}, dtype, 1.0f, Device::cuda);
        const detail::GatherQmmProblem pg = cuda::single_matrix_problem(x.data(), T, nk.second, dtype, gate);
        const detail::GatherQmmProblem pu = cuda::single_matrix_problem(x.data(), T, nk.second, dtype, up);
        ASSERT_TRUE(cuda::supports_qmv_glu(pg, pu, Activation::geglu).ok) << what;
        Tensor g = Tensor::empty({T, nk.first}, dtype, Device::cuda);
        Tensor u = Tensor::empty({T, nk.first}, dtype, Device::cuda);
        cuda::gather_qmm_into_route("qmv_one_row", pg, g.data(), nullptr);
        cuda::gather_qmm_into_route("qmv_one_row", pu, u.data(), nullptr);
        const Tensor want = glu_product(Activation::geglu, g, u);
        Tensor got = Tensor::empty({T, nk.first}, dtype, Device::cuda);
        test::poison(got);
        cuda::call_qmv_glu(pg, pu, Activation::geglu, got.data());
        cuda_check();
        EXPECT_EQ(got.to_host_bytes(), want.to_host_bytes()) << what;
      }
  // Refused: swiglu (no such epilogue in the table), 4-bit codes (no kernel), two different x, an
  // expert batch, three rows of Gemma 4's gate/up (rhs_tiles' rows).
  const QuantizedWeight q8 = test::to_device(test::random_codes(1, 200, 256, 8, 64), Device::cuda);
  const QuantizedWeight q4 = test::to_device(test::random_codes(1, 200, 256, 4, 64), Device::cuda);
  const Tensor x = test::random_tensor({2, 256}, DType::bf16, 1.0f, Device::cuda);
  const detail::GatherQmmProblem p8 = cuda::single_matrix_problem(x.data(), 1, 256, DType::bf16, q8);
  const detail::GatherQmmProblem p4 = cuda::single_matrix_problem(x.data(), 1, 256, DType::bf16, q4);
  const detail::GatherQmmProblem other_x =
      cuda::single_matrix_problem(static_cast<const uint16_t*>(x.data()) + 256, 1, 256, DType::bf16, q8);
  EXPECT_EQ(cuda::supports_qmv_glu(p8, p8, Activation::swiglu).reason, Fallback::topology);
  EXPECT_EQ(cuda::supports_qmv_glu(p4, p4, Activation::geglu).reason, Fallback::quantization);
  EXPECT_EQ(cuda::supports_qmv_glu(p8, other_x, Activation::geglu).reason, Fallback::shape);
  detail::GatherQmmProblem batched = p8;
  batched.B = 2;
  batched.batch = {2};
  EXPECT_FALSE(cuda::supports_qmv_glu(batched, p8, Activation::geglu).ok);
  {
    const QuantizedWeight wide = test::to_device(test::random_codes(1, 2112, 2816, 8, 64), Device::cuda);
    const Tensor x3 = test::random_tensor({3, 2816}, DType::bf16, 1.0f, Device::cuda);
    const detail::GatherQmmProblem p3 = cuda::single_matrix_problem(x3.data(), 3, 2816, DType::bf16, wide);
    ASSERT_TRUE(cuda::supports_rhs_tiles(p3).ok);
    EXPECT_EQ(cuda::supports_qmv_glu(p3, p3, Activation::geglu).reason, Fallback::shape);
  }
  Tensor out = Tensor::empty({1, 200}, DType::bf16, Device::cuda);
  EXPECT_THROW(cuda::call_qmv_glu(p4, p4, Activation::geglu, out.data()), Error);
}

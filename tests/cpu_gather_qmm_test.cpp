// The CPU gather_qmm against a float64 reference (tests/support/reference.h) on every MLX shape
// rule: batch dims, broadcast lhs/rhs, transpose false, lhs given, unsorted ids under the
// sorted_indices promise, every bits x group pair, dtype promotion and strided x; plus a
// hand-packed bit stream that pins the unpacking of every width independently of quantize().
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "expertqmm/error.h"
#include "expertqmm/ops.h"
#include "support/reference.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

// The CPU reference differs from the float64 reference only by fp32 accumulation (~1e-6
// relative) and by the single rounding of each output: at most 2^-9 relative per element for bf16,
// 2^-12 for f16. The bounds sit a little above those, far below the O(1) error of a wrong row,
// expert, group or transpose.
double bound_for(DType out) {
  switch (out) {
    case DType::bf16: return 4e-3;
    case DType::f16: return 6e-4;
    default: return 1e-5;
  }
}

// Flat index values broadcast from `src` to `dst` (numpy rules), written independently of the
// library's own broadcasting.
std::vector<int32_t> broadcast_to(const std::vector<int32_t>& v, const Shape& src, const Shape& dst) {
  std::vector<int32_t> out(static_cast<size_t>(shape_numel(dst)));
  for (int64_t flat = 0; flat < static_cast<int64_t>(out.size()); ++flat) {
    int64_t rem = flat, src_flat = 0, src_stride = 1;
    for (int i = static_cast<int>(dst.size()) - 1; i >= 0; --i) {
      const int64_t coord = rem % dst[i];
      rem /= dst[i];
      const int si = i - static_cast<int>(dst.size() - src.size());
      if (si < 0) continue;
      if (src[si] != 1) src_flat += coord * src_stride;
      src_stride *= src[si];
    }
    out[flat] = v[src_flat];
  }
  return out;
}

std::vector<int32_t> arange(int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(i);
  return v;
}

Shape batch_of(const Shape& s) { return Shape(s.begin(), s.end() - 2); }

// Runs gather_qmm and checks shape, dtype and error against the float64 reference. `lhs`/`rhs`
// may be undefined (MLX's None).
void check_against_reference(const Tensor& x, const QuantizedWeight& q, const Tensor& lhs, const Tensor& rhs,
                             bool transpose, bool sorted_indices, const Shape& expect_batch) {
  const Tensor out = gather_qmm(x, q, lhs, rhs, transpose, sorted_indices);
  const int64_t M = x.size(-2), K = x.size(-1);
  const int64_t N = transpose ? q.w.size(-2) : q.w.size(-1) * 32 / q.bits;
  Shape expect_shape = expect_batch;
  expect_shape.push_back(M);
  expect_shape.push_back(N);
  ASSERT_EQ(out.shape(), expect_shape);
  ASSERT_EQ(out.dtype(), promote_floating(x.dtype(), q.scales.dtype()));

  const Shape xb = batch_of(x.shape()), wb = batch_of(q.w.shape());
  const std::vector<int32_t> lhs_flat =
      broadcast_to(lhs.defined() ? test::to_i32(lhs) : arange(shape_numel(xb)), lhs.defined() ? lhs.shape() : xb,
                   expect_batch);
  const std::vector<int32_t> rhs_flat =
      broadcast_to(rhs.defined() ? test::to_i32(rhs) : arange(shape_numel(wb)), rhs.defined() ? rhs.shape() : wb,
                   expect_batch);
  const std::vector<double> ref =
      test::reference_gather_qmm(test::to_float(x), M, K, q, lhs_flat, rhs_flat, transpose);
  const double err = test::rel_error(test::to_float(out), ref);
  EXPECT_LE(err, bound_for(out.dtype())) << "bits=" << q.bits << " gs=" << q.group_size << " " << test::seed_note();
}

// Packs codes into the LSB-first little-endian bit stream of MLX (spec 1.2), one row.
std::vector<uint32_t> pack_row(const std::vector<uint32_t>& codes, int bits) {
  std::vector<uint32_t> words(codes.size() * bits / 32, 0u);
  for (size_t i = 0; i < codes.size(); ++i)
    for (int b = 0; b < bits; ++b)
      if ((codes[i] >> b) & 1u) {
        const size_t bit = i * bits + b;
        words[bit / 32] |= 1u << (bit % 32);
      }
  return words;
}

}  // namespace

TEST(CpuGatherQmm, BatchDimsOnBothSidesWithoutIndices) {
  const QuantizedWeight q = test::random_quantized({2, 3, 16, 64}, 4, 32);
  const Tensor x = test::random_tensor({2, 3, 4, 64}, DType::bf16);
  check_against_reference(x, q, Tensor(), Tensor(), true, false, {2, 3});
}

TEST(CpuGatherQmm, LhsAndRhsBroadcastTogether) {
  const QuantizedWeight q = test::random_quantized({5, 32, 128}, 4, 64);
  const Tensor x = test::random_tensor({3, 2, 128}, DType::bf16);
  const Tensor lhs = test::ids_tensor({2, 0, 1, 2}, {4, 1});
  const Tensor rhs = test::ids_tensor({4, 0, 3, 1, 2}, {1, 5});
  check_against_reference(x, q, lhs, rhs, true, false, {4, 5});
}

TEST(CpuGatherQmm, RhsOnlyImpliesBroadcastLhs) {
  // SwitchGLU's unsorted form: x [T, 1, 1, K], rhs [T, k]; lhs = arange(T).reshape(T, 1).
  const QuantizedWeight q = test::random_quantized({6, 40, 128}, 4, 64);
  const Tensor x = test::random_tensor({7, 1, 1, 128}, DType::bf16);
  const Tensor rhs = test::random_ids({7, 3}, 6);
  check_against_reference(x, q, Tensor(), rhs, true, false, {7, 3});
}

TEST(CpuGatherQmm, LhsGivenRhsDefaultsToArange) {
  const QuantizedWeight q = test::random_quantized({3, 24, 64}, 4, 64);
  const Tensor x = test::random_tensor({5, 3, 64}, DType::bf16);
  const Tensor lhs = test::ids_tensor({4, 0, 4}, {3});
  check_against_reference(x, q, lhs, Tensor(), true, false, {3});
}

TEST(CpuGatherQmm, TransposeFalseGroupsAlongN) {
  // w logical [E, K, N]: quantized along N, product x @ W.
  for (int bits : {4, 8}) {
    const QuantizedWeight q = test::random_quantized({3, 64, 128}, bits, 64);
    const Tensor x = test::random_tensor({4, 3, 64}, DType::bf16);
    const Tensor rhs = test::ids_tensor({2, 0, 2, 1}, {4});
    check_against_reference(x, q, Tensor(), rhs, false, false, {4});
  }
}

TEST(CpuGatherQmm, UnsortedIdsUnderSortedPromiseStayCorrect) {
  const QuantizedWeight q = test::random_quantized({4, 40, 128}, 4, 64);
  const Tensor x = test::random_tensor({16, 1, 128}, DType::bf16);
  const Tensor rhs = test::ids_tensor({3, 0, 2, 2, 1, 0, 3, 1, 0, 0, 2, 3, 1, 1, 3, 2}, {16});
  check_against_reference(x, q, Tensor(), rhs, true, /*sorted_indices=*/true, {16});
  const Tensor promised = gather_qmm(x, q, Tensor(), rhs, true, true);
  const Tensor plain = gather_qmm(x, q, Tensor(), rhs, true, false);
  EXPECT_EQ(promised.to_host_bytes(), plain.to_host_bytes());
}

TEST(CpuGatherQmm, EveryBitsAndGroupSize) {
  for (int bits : {2, 3, 4, 5, 6, 8})
    for (int gs : {32, 64, 128}) {
      SCOPED_TRACE(testing::Message() << "bits=" << bits << " group_size=" << gs);
      const QuantizedWeight q = test::random_quantized({3, 24, 256}, bits, gs);
      const Tensor x = test::random_tensor({5, 1, 1, 256}, DType::bf16);
      const Tensor rhs = test::random_ids({5, 2}, 3);
      check_against_reference(x, q, Tensor(), rhs, true, false, {5, 2});
      const QuantizedWeight qn = test::random_quantized({3, 32, 128}, bits, gs);  // transpose=false
      check_against_reference(test::random_tensor({2, 2, 32}, DType::bf16), qn, Tensor(),
                              test::ids_tensor({2, 1}, {2}), false, false, {2});
    }
}

TEST(CpuGatherQmm, PromotesToFloat32AndFloat16) {
  const QuantizedWeight q = test::random_quantized({3, 16, 128}, 4, 64);  // bf16 scales
  const Tensor rhs = test::ids_tensor({1, 2, 0}, {3});
  // f32 x with bf16 scales -> f32 (MLX promotion); f16 x with bf16 scales -> f32 too.
  check_against_reference(test::random_tensor({3, 2, 128}, DType::f32), q, Tensor(), rhs, true, false, {3});
  check_against_reference(test::random_tensor({3, 2, 128}, DType::f16), q, Tensor(), rhs, true, false, {3});
  // f16 scales with f16 x stay f16.
  QuantizedWeight q16 = q;
  q16.scales = test::from_float(test::to_float(q.scales), q.scales.shape(), DType::f16);
  q16.biases = test::from_float(test::to_float(q.biases), q.biases.shape(), DType::f16);
  check_against_reference(test::random_tensor({3, 2, 128}, DType::f16), q16, Tensor(), rhs, true, false, {3});
}

TEST(CpuGatherQmm, StridedBatchOfXIsRead) {
  // x = every other [M, K] matrix of a larger buffer: a batch stride of 2*M*K.
  const QuantizedWeight q = test::random_quantized({2, 16, 64}, 4, 64);
  const Tensor base = test::random_tensor({6, 3, 64}, DType::bf16);
  const Tensor x = Tensor::view(base.data(), {3, 3, 64}, DType::bf16, Device::cpu, {2 * 3 * 64, 64, 1});
  const Tensor lhs = test::ids_tensor({2, 0, 1, 1}, {4});
  const Tensor rhs = test::ids_tensor({0, 1, 1, 0}, {4});
  check_against_reference(x, q, lhs, rhs, true, false, {4});
  check_against_reference(x.contiguous(), q, lhs, rhs, true, false, {4});
  EXPECT_EQ(gather_qmm(x, q, lhs, rhs).to_host_bytes(), gather_qmm(x.contiguous(), q, lhs, rhs).to_host_bytes());
}

TEST(CpuGatherQmm, FourBitWordPacksLsbFirst) {
  // Spec 1.2: q = [1..8] packs to 0x87654321. One row of K = 32 (one group), scale 1, bias 0.
  std::vector<uint32_t> words = {0x87654321u, 0u, 0u, 0u};
  const Tensor w = Tensor::from_host(words.data(), {1, 1, 4}, DType::u32);
  const Tensor s = test::from_float({1.f}, {1, 1, 1}, DType::f32);
  const Tensor b = test::from_float({0.f}, {1, 1, 1}, DType::f32);
  std::vector<float> eye(32 * 32, 0.f);
  for (int i = 0; i < 32; ++i) eye[i * 32 + i] = 1.f;
  const Tensor x = test::from_float(eye, {1, 32, 32}, DType::f32);
  const std::vector<float> out = test::to_float(gather_qmm(x, w, s, b, Tensor(), Tensor(), true, 32, 4));
  for (int i = 0; i < 32; ++i) EXPECT_EQ(out[i], i < 8 ? static_cast<float>(i + 1) : 0.f) << i;
}

TEST(CpuGatherQmm, UnpacksEveryWidthFromAHandPackedStream) {
  // x = identity, so out[m][n] = dequant(w[n])[m] exactly: each code (and each straddling code of
  // the 3-, 5- and 6-bit streams) must come back at its position, times its group's scale plus bias.
  for (int bits : {2, 3, 4, 5, 6, 8}) {
    SCOPED_TRACE(testing::Message() << "bits=" << bits);
    const int K = 64, gs = 32, N = 2;
    std::vector<uint32_t> all_words;
    std::vector<std::vector<uint32_t>> codes(N);
    for (int n = 0; n < N; ++n) {
      for (int i = 0; i < K; ++i) codes[n].push_back(static_cast<uint32_t>((i * 7 + n * 3 + 1) % (1 << bits)));
      const std::vector<uint32_t> row = pack_row(codes[n], bits);
      all_words.insert(all_words.end(), row.begin(), row.end());
    }
    const int64_t row_words = K * bits / 32;
    const Tensor w = Tensor::from_host(all_words.data(), {1, N, row_words}, DType::u32);
    const std::vector<float> scale = {0.5f, 2.f, -1.f, 0.25f}, bias = {1.f, -3.f, 0.f, 8.f};  // [N, K/gs]
    const Tensor s = test::from_float(scale, {1, N, K / gs}, DType::f32);
    const Tensor b = test::from_float(bias, {1, N, K / gs}, DType::f32);
    std::vector<float> eye(K * K, 0.f);
    for (int i = 0; i < K; ++i) eye[i * K + i] = 1.f;
    const Tensor x = test::from_float(eye, {1, K, K}, DType::f32);
    const std::vector<float> out = test::to_float(gather_qmm(x, w, s, b, Tensor(), Tensor(), true, gs, bits));
    for (int m = 0; m < K; ++m)
      for (int n = 0; n < N; ++n) {
        const int g = n * (K / gs) + m / gs;
        ASSERT_EQ(out[m * N + n], scale[g] * static_cast<float>(codes[n][m]) + bias[g]) << "m=" << m << " n=" << n;
      }
  }
}

TEST(CpuGatherQmm, EmptyBatchAndRowsAreValidNoOps) {
  const QuantizedWeight q = test::random_quantized({3, 16, 64}, 4, 64);
  const Tensor no_ids = Tensor::empty({0}, DType::i32);
  Tensor out = gather_qmm(test::random_tensor({0, 1, 64}, DType::bf16), q, Tensor(), no_ids);
  EXPECT_EQ(out.shape(), (Shape{0, 1, 16}));
  out = gather_qmm(test::random_tensor({2, 0, 64}, DType::bf16), q, Tensor(), test::ids_tensor({0, 2}, {2}));
  EXPECT_EQ(out.shape(), (Shape{2, 0, 16}));
  EXPECT_EQ(out.dtype(), DType::bf16);
}

// gather_qmm_into (a caller-owned output): the same values as gather_qmm, bit for bit, and an
// output of the wrong shape, dtype or layout is refused with the shape it needs.
TEST(CpuGatherQmm, IntoWritesTheCallersOutput) {
  const QuantizedWeight q = test::random_quantized({6, 40, 128}, 4, 64);
  const Tensor x = test::random_tensor({7, 1, 1, 128}, DType::bf16);
  const Tensor rhs = test::random_ids({7, 3}, 6);
  const Tensor want = gather_qmm(x, q, Tensor(), rhs, true, false);
  Tensor out = Tensor::empty(want.shape(), want.dtype());
  std::memset(out.data(), 0xFF, out.nbytes());  // NaN bits: an unwritten element cannot pass
  gather_qmm_into(out, x, q.w, q.scales, q.biases, Tensor(), rhs, true, q.group_size, q.bits);
  ASSERT_EQ(std::memcmp(out.data(), want.data(), want.nbytes()), 0);

  Tensor wrong_shape = Tensor::empty({7, 3, 1, 41}, DType::bf16);
  test::expect_error([&] { gather_qmm_into(wrong_shape, x, q.w, q.scales, q.biases, Tensor(), rhs, true, 64, 4); },
                     "gather_qmm_into", "out must be bfloat16[7, 3, 1, 40]");
  Tensor wrong_dtype = Tensor::empty(want.shape(), DType::f32);
  test::expect_error([&] { gather_qmm_into(wrong_dtype, x, q.w, q.scales, q.biases, Tensor(), rhs, true, 64, 4); },
                     "gather_qmm_into", "out must be bfloat16");
  Tensor wide = Tensor::empty({7, 3, 1, 80}, DType::bf16);
  Tensor strided = Tensor::view(wide.data(), want.shape(), DType::bf16, Device::cpu, {240, 80, 80, 1});
  test::expect_error([&] { gather_qmm_into(strided, x, q.w, q.scales, q.biases, Tensor(), rhs, true, 64, 4); },
                     "gather_qmm_into", "out must be contiguous");
}

// The dense MLP's cuBLAS pieces (src/cuda/dense_cublas.h) from first principles: the dequantization
// for the GEMM bit for bit against one rounding of q * s + b computed exactly on the host, every
// bits x group x dtype it takes; the GEMM against a float64 product of the same 16-bit values within
// the bf16 / f16 bound (docs/numerics.md), with row strides; what dense_cublas_fits refuses, by name.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/float16.h"
#include "expertqmm/backend.h"
#include "expertqmm/error.h"
#include "expertqmm/quant.h"
#include "support/test_util.h"

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/check.cuh"
#include "cuda/dense_cublas.h"
#endif

using namespace expertqmm;

namespace {

// Round a double once to a 16-bit float's precision (nearest, ties to even), as its bits.
uint16_t round_once(double v, DType dt) {
  if (v == 0.0) return dt == DType::bf16 ? float_to_bf16(static_cast<float>(v)) : float_to_f16(static_cast<float>(v));
  const int mantissa_bits = dt == DType::bf16 ? 8 : 11;  // significant bits, the implicit one included
  int e = 0;
  std::frexp(v, &e);  // v = f * 2^e, 0.5 <= |f| < 1
  if (dt == DType::f16 && e < -13) e = -13;  // f16 subnormals: a fixed quantum of 2^-24
  const double quantum = std::ldexp(1.0, e - mantissa_bits);
  const double r = std::nearbyint(v / quantum) * quantum;  // exact: the quotient has few bits
  const float f = static_cast<float>(r);                   // exact: r has <= 11 significant bits
  return dt == DType::bf16 ? float_to_bf16(f) : float_to_f16(f);
}

double load16(uint16_t b, DType dt) { return dt == DType::bf16 ? bf16_to_float(b) : f16_to_float(b); }

std::vector<uint16_t> host_u16(const Tensor& t) {
  const Tensor c = t.to(Device::cpu).contiguous();
  const uint16_t* p = c.data_as<const uint16_t>();
  return std::vector<uint16_t>(p, p + c.numel());
}

#ifdef EXPERTQMM_HAVE_CUDA

TEST(GpuDenseCublas, DequantizeForGemmRoundsOnce) {
  EXPERTQMM_REQUIRE_GPU();
  for (DType dt : {DType::bf16, DType::f16})
    for (int bits : {4, 8})
      for (int group : {32, 64, 128})
        // 24 rows: one CTA's 1024 units and a partial second; 344 rows: 16 whole CTAs and a tail.
        for (int64_t N : {24, 344}) {
          const std::string what = detail::cat(dtype_name(dt), " ", bits, "-bit group ", group, ", ", N, " rows");
          const int64_t K = 384;
          const QuantizedWeight q = quantize(test::random_tensor({N, K}, dt, 0.05f), QuantSpec(bits, group));
          const QuantizedWeight d{q.w.to(Device::cuda), q.scales.to(Device::cuda), q.biases.to(Device::cuda), bits, group};
          const char* why = "";
          ASSERT_TRUE(cuda::dense_cublas_fits(d, dt, &why)) << what << ": " << why;
          Tensor out = Tensor::empty({N, K}, dt, Device::cuda);
          cuda::dequantize_for_gemm(d, out.data(), /*stream=*/nullptr);
          EXPERTQMM_CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<uint16_t> got = host_u16(out);
          const Tensor codes = q.w.contiguous();
          const uint32_t* w = codes.data_as<const uint32_t>();
          const std::vector<uint16_t> s = host_u16(q.scales), b = host_u16(q.biases);
          int64_t wrong = 0;
          for (int64_t n = 0; n < N; ++n)
            for (int64_t k = 0; k < K; ++k) {
              const int64_t bit = k * bits, word = n * (K * bits / 32) + bit / 32;
              const uint32_t code = (w[word] >> (bit % 32)) & ((1u << bits) - 1);
              const int64_t g = n * (K / group) + k / group;
              const uint16_t want = round_once(double(code) * load16(s[g], dt) + load16(b[g], dt), dt);
              if (got[n * K + k] != want && wrong++ < 3)
                ADD_FAILURE() << what << " [" << n << ", " << k << "]: got " << got[n * K + k] << " want " << want;
            }
          EXPECT_EQ(wrong, 0) << what;
        }
}

TEST(GpuDenseCublas, LinearMatchesTheFloat64ProductWithStrides) {
  EXPERTQMM_REQUIRE_GPU();
  for (DType dt : {DType::bf16, DType::f16})
    for (int64_t T : {1, 7, 130}) {
      const int64_t N = 96, K = 320, ldx = K + 8, ldo = N + 24;
      const std::string what = detail::cat(dtype_name(dt), " T=", T);
      const Tensor w = test::random_tensor({N, K}, dt, 0.05f);
      const Tensor x = test::random_tensor({T, ldx}, dt, 1.0f);
      Tensor out = Tensor::empty({T, ldo}, dt, Device::cuda);
      EXPERTQMM_CUDA_CHECK(cudaMemset(out.data(), 0xff, out.nbytes()));  // NaN where nothing is written
      const Tensor wd = w.to(Device::cuda), xd = x.to(Device::cuda);
      Workspace ws;
      cuda::cublas_linear(dt, wd.data(), xd.data(), ldx, out.data(), ldo, T, N, K, ws, /*stream=*/nullptr);
      EXPERTQMM_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint16_t> got = host_u16(out), wh = host_u16(w), xh = host_u16(x);
      double num = 0, den = 0;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = 0; n < N; ++n) {
          double ref = 0;
          for (int64_t k = 0; k < K; ++k) ref += load16(xh[t * ldx + k], dt) * load16(wh[n * K + k], dt);
          const double d = load16(got[t * ldo + n], dt) - ref;
          num += d * d;
          den += ref * ref;
        }
      EXPECT_LE(std::sqrt(num / den), 1e-2) << what;
      for (int64_t t = 0; t < T; ++t)  // the padding columns of each output row are untouched
        EXPECT_EQ(got[t * ldo + N], 0xffff) << what << " row " << t;
    }
}

TEST(GpuDenseCublas, FitsRefusesWhatItCannotReadByName) {
  EXPERTQMM_REQUIRE_GPU();
  const Tensor w = test::random_tensor({16, 128}, DType::bf16, 0.05f);
  auto refusal = [](const QuantizedWeight& q, DType x_dtype) {
    const char* why = "";
    EXPECT_FALSE(cuda::dense_cublas_fits(q, x_dtype, &why));
    return std::string(why);
  };
  const QuantizedWeight q4 = quantize(w, QuantSpec(4, 64));
  const char* why = "";
  EXPECT_TRUE(cuda::dense_cublas_fits(q4, DType::bf16, &why)) << why;
  EXPECT_EQ(refusal(quantize(w, QuantSpec(3, 64)), DType::bf16), "codes of other than 4 or 8 bits");
  EXPECT_EQ(refusal(quantize(w, QuantSpec(4, 64)), DType::f16), "scales or biases of another dtype");
  EXPECT_EQ(refusal(quantize(test::random_tensor({16, 128}, DType::f32, 0.05f), QuantSpec(4, 64)), DType::f32),
            "activations other than bf16 or f16");
  EXPECT_EQ(refusal(quantize(w, QuantSpec(4, 32, Rounding::cpu, QuantMode::mxfp4)), DType::bf16),
            "not affine codes");
  test::expect_error([&] { cuda::dequantize_for_gemm(quantize(w, QuantSpec(3, 64)), nullptr, nullptr); },
                     "dense_cublas", "3-bit");
}

#endif  // EXPERTQMM_HAVE_CUDA

}  // namespace

// MLX's fp quantization modes (mxfp4, mxfp8, nvfp4) on the GPU, bit for bit with the CPU reference
// (src/cpu/quantize_fp.cpp, itself bit-exact with MLX's CPU stream): the same fp32 operations as
// round-to-nearest intrinsics (no contraction) and the same roundings to the weight's dtype; the
// codecs are core/fp_codes.h, shared with the host.
#include <cstring>

#include "core/fp_codes.h"
#include "cuda/cuda_backend.h"
#include "cuda/moe_internal.h"
#include "cuda/quantize_fp.h"

namespace expertqmm::cuda {

namespace {

// argmin over the E2M1 codes of |R(x - v_c)| (R: round to dtype S), first strict minimum wins.
template <DType S>
__device__ __forceinline__ uint32_t nearest_e2m1(float x) {
  uint32_t best = 0;
  float best_d = fabsf(round_to<S>(__fsub_rn(x, e2m1_value(0))));
  for (uint32_t c = 1; c < 16; ++c) {
    const float d = fabsf(round_to<S>(__fsub_rn(x, e2m1_value(c))));
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

// One thread per group of gs values (a group owns gs * bits / 32 >= 2 whole words).
//   mx modes: scale = D(amax / maxval); e = ceil(log2 scale) (0 for 0) in [-127, 127]; values
//   D(w / 2^e); code byte e + 127.  nvfp4: scale = D(amax / 6) * enc in fp32, its E4M3 code; values
//   D(w / D(decoded)) * enc in fp32, nearest E2M1 in fp32.
template <DType D>
__global__ void quantize_fp_kernel(const typename Elem<D>::storage* __restrict__ w, int64_t groups, int gs, int bits,
                                   int mode, float enc, uint32_t* __restrict__ codes, uint8_t* __restrict__ scales) {
  const bool nv = mode == static_cast<int>(QuantMode::nvfp4);
  const int words = gs * bits / 32;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const typename Elem<D>::storage* v = w + g * gs;
    float amax = 0.0f;
    for (int j = 0; j < gs; ++j) amax = fmaxf(amax, fabsf(Elem<D>::load(v[j])));
    float divisor;
    uint8_t code;
    if (nv) {
      code = e4m3_code(__fmul_rn(round_to<D>(__fdiv_rn(amax, 6.0f)), enc));
      divisor = round_to<D>(e4m3_value(code));
    } else {
      const float scale = round_to<D>(__fdiv_rn(amax, bits == 4 ? 6.0f : 448.0f));
      int e = 0;
      if (scale != 0.0f) {
        int p;
        const float m = frexpf(scale, &p);
        e = m == 0.5f ? p - 1 : p;
      }
      e = e < -127 ? -127 : (e > 127 ? 127 : e);
      divisor = ldexpf(1.0f, e);
      code = static_cast<uint8_t>(e + 127);
    }
    for (int wi = 0; wi < words; ++wi) {
      uint32_t word = 0;
      for (int j = 0; j < 32 / bits; ++j) {
        const float x = round_to<D>(__fdiv_rn(Elem<D>::load(v[wi * (32 / bits) + j]), divisor));
        const uint32_t c = nv ? nearest_e2m1<DType::f32>(__fmul_rn(x, enc))
                              : bits == 4 ? nearest_e2m1<D>(x) : e4m3_code(x);
        word |= c << (j * bits);
      }
      codes[g * words + wi] = word;
    }
    scales[g] = code;
  }
}

// One thread per output value: R(v) * scale rounded to O, with v the E2M1 / E4M3 value and scale
// D(2^(s - 127)) (mx) or O(D(E4M3(s)) * inv_enc) (nvfp4); O is D, or f32 with a global scale.
template <DType D, DType O>
__global__ void dequantize_fp_kernel(const uint32_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                     int64_t rows, int64_t K, int gs, int bits, int mode, float inv_enc,
                                     typename Elem<O>::storage* __restrict__ out) {
  const int64_t total = rows * K;
  const int64_t words_per_row = K * bits / 32, groups_per_row = K / gs;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / K, i = idx - row * K;
    const uint8_t s = scales[row * groups_per_row + i / gs];
    const float scale = mode == static_cast<int>(QuantMode::nvfp4)
                            ? round_to<O>(__fmul_rn(round_to<D>(e4m3_value(s)), inv_enc))
                            : round_to<D>(ldexpf(1.0f, static_cast<int>(s) - 127));
    const uint32_t word = codes[row * words_per_row + (i * bits >> 5)];
    const uint32_t c = (word >> ((i * bits) & 31)) & ((1u << bits) - 1u);
    const float v = round_to<D>(bits == 4 ? e2m1_value(c) : e4m3_value(static_cast<uint8_t>(c)));
    out[idx] = Elem<O>::store(__fmul_rn(v, scale));
  }
}

unsigned blocks_for(int64_t items, int threads) {
  const int64_t b = (items + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

float host_scalar(const Tensor& g) {
  float v;
  std::memcpy(&v, g.contiguous().to_host_bytes().data(), 4);
  return v;
}

}  // namespace

QuantizedWeight quantize_fp(const Tensor& w_in, const QuantSpec& spec) {
  EXPERTQMM_CHECK(w_in.device() == Device::cuda, "quantize", "cuda::quantize_fp needs a device tensor, got ",
                  w_in.describe());
  const Tensor w = w_in.contiguous();
  const int64_t K = w.size(-1);
  Shape packed_shape = w.shape(), group_shape = w.shape();
  packed_shape.back() = K * spec.bits / 32;
  group_shape.back() = K / spec.group_size;
  QuantizedWeight q;
  q.bits = spec.bits;
  q.group_size = spec.group_size;
  q.mode = spec.mode;
  q.global_scale = spec.global_scale;
  q.w = Tensor::empty(packed_shape, DType::u32, Device::cuda);
  q.scales = Tensor::empty(group_shape, DType::u8, Device::cuda);
  const int64_t groups = w.numel() / spec.group_size;
  if (groups == 0) return q;
  // 448 * 6 / global in fp32 on the host, as the CPU reference (MLX: divide(2688, global_scale)).
  const float enc = spec.global_scale.defined() ? 2688.0f / host_scalar(spec.global_scale) : 1.0f;
  dispatch_float(w.dtype(), "quantize", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    constexpr int kThreads = 128;
    quantize_fp_kernel<D><<<blocks_for(groups, kThreads), kThreads, 0, current_stream()>>>(
        w.data_as<const typename Elem<D>::storage>(), groups, spec.group_size, spec.bits, static_cast<int>(spec.mode),
        enc, q.w.data_as<uint32_t>(), q.scales.data_as<uint8_t>());
    EXPERTQMM_CUDA_CHECK_LAUNCH(quantize_fp_kernel);
  });
  return q;
}

Tensor dequantize_fp(const QuantizedWeight& q, DType dtype) {
  const Tensor w = q.w.contiguous(), scales = q.scales.contiguous();
  const bool global = q.global_scale.defined();
  const float inv_enc = global ? host_scalar(q.global_scale) / 2688.0f : 1.0f;
  const int64_t K = w.size(-1) * 32 / q.bits;
  Shape out_shape = w.shape();
  out_shape.back() = K;
  Tensor out = Tensor::empty(out_shape, global ? DType::f32 : dtype, Device::cuda);
  const int64_t rows = w.size(-1) == 0 ? 0 : w.numel() / w.size(-1);
  if (rows == 0 || K == 0) return out;
  dispatch_float(dtype, "dequantize", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    constexpr int kThreads = 256;
    auto launch = [&](auto otag) {
      constexpr DType O = decltype(otag)::value;
      dequantize_fp_kernel<D, O><<<blocks_for(rows * K, kThreads), kThreads, 0, current_stream()>>>(
          w.data_as<const uint32_t>(), scales.data_as<const uint8_t>(), rows, K, q.group_size, q.bits,
          static_cast<int>(q.mode), inv_enc, out.data_as<typename Elem<O>::storage>());
      EXPERTQMM_CUDA_CHECK_LAUNCH(dequantize_fp_kernel);
    };
    if (global) launch(DTypeTag<DType::f32>{});
    else launch(DTypeTag<D>{});
  });
  return out;
}

}  // namespace expertqmm::cuda

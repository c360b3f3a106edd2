// MLX affine quantize / dequantize on the GPU (spec mlx-semantics.md 1.2-1.4; the fp modes:
// quantize_fp.cu), bit-exact with the
// CPU backend of the same Rounding flavour: every fp32 operation of spec 1.3 is an explicit
// round-to-nearest intrinsic (no FMA contraction, no fast-math), and bf16/f16 conversions are the
// shared ones of core/float16.h.
#include <cfloat>

#include "core/gather_qmm_problem.h"
#include "cuda/cuda_backend.h"
#include "cuda/moe_internal.h"
#include "cuda/quantize_fp.h"

namespace expertqmm::cuda {

namespace {

constexpr int kQuantizeWarps = 8;   // warps per CTA of the quantize kernel
constexpr int kMaxGroupSize = 128;  // largest MLX group

// Unsigned code of value i in an LSB-first bit stream of `bits`-wide values (spec 1.2).
__device__ __forceinline__ uint32_t extract_code(const uint32_t* row_words, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const int64_t word = bit >> 5;
  const int shift = static_cast<int>(bit & 31);
  uint64_t window = row_words[word] >> shift;
  if (shift + bits > 32) window |= static_cast<uint64_t>(row_words[word + 1]) << (32 - shift);
  return static_cast<uint32_t>(window) & ((1u << bits) - 1u);
}

// Quantizes groups of `group_size` consecutive values (spec 1.3), one warp per group.
//   w      (groups * group_size) values of D, row-major [..., N, K]; a group never crosses a row
//   codes  (groups * group_size * bits / 32) uint32: each group owns group_size*bits/32 whole words
//          (group_size >= 32), LSB-first bit stream, so group g's words start at g*words_per_group
//   scales, biases (groups) of D
// Work split: a CTA holds kQuantizeWarps warps; warp w of CTA c takes groups c*8+w, then strides by
// the whole grid. Lane l loads values [l*v, (l+1)*v) of the group (v = group_size/32), the warp
// reduces min/max by shuffles (exact, so order-free), every lane then derives the same scale and
// bias, writes its codes to shared memory, and lanes < words_per_group each pack one output word.
template <DType D, bool kGpuRounding>
__global__ void quantize_groups_kernel(const typename Elem<D>::storage* __restrict__ w, int64_t groups,
                                       int group_size, int bits, uint32_t* __restrict__ codes,
                                       typename Elem<D>::storage* __restrict__ scales,
                                       typename Elem<D>::storage* __restrict__ biases) {
  __shared__ uint8_t group_codes[kQuantizeWarps][kMaxGroupSize];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int per_lane = group_size / 32;
  const int words_per_group = group_size * bits / 32;
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const float eps = 1e-7f;

  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kQuantizeWarps + warp; g < groups;
       g += static_cast<int64_t>(gridDim.x) * kQuantizeWarps) {
    const typename Elem<D>::storage* src = w + g * group_size + lane * per_lane;
    float v[4];
    // MLX CUDA/Metal start w_max at 0 (and w_min at the largest float); the CPU at -inf/+inf.
    float w_min = kGpuRounding ? FLT_MAX : INFINITY;
    float w_max = kGpuRounding ? 0.0f : -INFINITY;
    for (int i = 0; i < per_lane; ++i) {
      v[i] = Elem<D>::load(src[i]);
      w_min = fminf(w_min, v[i]);
      w_max = fmaxf(w_max, v[i]);
    }
    for (int off = 16; off > 0; off >>= 1) {
      w_min = fminf(w_min, __shfl_xor_sync(0xffffffffu, w_min, off));
      w_max = fmaxf(w_max, __shfl_xor_sync(0xffffffffu, w_max, off));
    }
    // cpu: std::max(x, eps) keeps a NaN x; gpu: fmaxf drops it (only reachable with inf inputs).
    const float range_scale = __fdiv_rn(__fsub_rn(w_max, w_min), n_bins);
    float scale = kGpuRounding ? fmaxf(range_scale, eps) : (range_scale < eps ? eps : range_scale);
    const bool side = fabsf(w_min) > fabsf(w_max);
    scale = side ? scale : -scale;
    const float edge = side ? w_min : w_max;
    const float q0 = kGpuRounding ? roundf(__fdiv_rn(edge, scale)) : rintf(__fdiv_rn(edge, scale));
    float bias = 0.0f;
    if (q0 != 0.0f) {
      scale = __fdiv_rn(edge, q0);
      bias = edge;
    }
    for (int i = 0; i < per_lane; ++i) {
      const float x = __fdiv_rn(__fsub_rn(v[i], bias), scale);
      uint32_t code;
      if (kGpuRounding) {
        // MLX CUDA: min(round(x), n) then a saturating conversion (NaN -> n, negative -> 0).
        const float c = fminf(roundf(x), n_bins);
        code = c > 0.0f ? static_cast<uint32_t>(c) : 0u;
      } else {
        // MLX CPU: clamp(rint(x), 0, n); a NaN code reads as 0.
        const float r = rintf(x);
        const float lo = r < 0.0f ? 0.0f : r;  // std::max(r, 0) keeps a NaN r
        const float c = n_bins < lo ? n_bins : lo;
        code = isnan(c) ? 0u : static_cast<uint32_t>(c);
      }
      group_codes[warp][lane * per_lane + i] = static_cast<uint8_t>(code);
    }
    if (lane == 0) {
      scales[g] = Elem<D>::store(scale);
      biases[g] = Elem<D>::store(bias);
    }
    __syncwarp();
    if (lane < words_per_group) {
      // Word `lane` holds stream bits [32*lane, 32*lane + 32): values first..last overlap it.
      const int first_bit = 32 * lane;
      uint32_t word = 0;
      for (int i = first_bit / bits; i * bits < first_bit + 32; ++i) {
        const int shift = i * bits - first_bit;  // negative: value started in the previous word
        const uint32_t c = group_codes[warp][i];
        word |= shift >= 0 ? c << shift : c >> -shift;
      }
      codes[g * words_per_group + lane] = word;
    }
    __syncwarp();  // group_codes is rewritten by the next group
  }
}

// out = T(T(q * s) + b): MLX dequantize on a CPU stream (multiply, round, add, round).
//   codes  (rows, K*bits/32) uint32, LSB-first bit stream per row
//   scales, biases (rows, K/group_size) of D;  out (rows, K) of D
// Work split: one thread per output element, grid-stride; consecutive threads write consecutive
// elements of a row (coalesced stores; code words are re-read from L1 by neighbouring threads).
template <DType D>
__global__ void dequantize_kernel(const uint32_t* __restrict__ codes, const typename Elem<D>::storage* __restrict__ scales,
                                  const typename Elem<D>::storage* __restrict__ biases, int64_t rows, int64_t K,
                                  int group_size, int bits, typename Elem<D>::storage* __restrict__ out) {
  const int64_t total = rows * K;
  const int64_t words_per_row = K * bits / 32;
  const int64_t groups_per_row = K / group_size;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / K;
    const int64_t i = idx - row * K;
    const uint32_t q = extract_code(codes + row * words_per_row, i, bits);
    const int64_t g = row * groups_per_row + i / group_size;
    const float s = Elem<D>::load(scales[g]);
    const float b = Elem<D>::load(biases[g]);
    const float scaled = round_to<D>(__fmul_rn(static_cast<float>(q), s));
    out[idx] = Elem<D>::store(__fadd_rn(scaled, b));
  }
}

unsigned grid_for(int64_t work_items, int per_block) {
  const int64_t blocks = (work_items + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 * 8 ? 65535 * 8 : blocks));
}

}  // namespace

QuantizedWeight quantize(const Tensor& w_in, QuantSpec spec) {
  if (spec.mode != QuantMode::affine) return quantize_fp(w_in, spec);
  detail::check_bits_group("quantize", spec.bits, spec.group_size);
  EXPERTQMM_CHECK(w_in.device() == Device::cuda, "quantize", "cuda::quantize needs a device tensor, got ",
                  w_in.describe());
  EXPERTQMM_CHECK(w_in.ndim() >= 2 && w_in.size(-1) % spec.group_size == 0, "quantize", "w ",
                  w_in.describe(), " must be [..., N, K] with K a multiple of group_size=", spec.group_size);
  const Tensor w = w_in.contiguous();
  const int64_t K = w.size(-1);
  Shape packed_shape = w.shape();
  packed_shape.back() = K * spec.bits / 32;
  Shape group_shape = w.shape();
  group_shape.back() = K / spec.group_size;

  QuantizedWeight q;
  q.bits = spec.bits;
  q.group_size = spec.group_size;
  q.w = Tensor::empty(packed_shape, DType::u32, Device::cuda);
  q.scales = Tensor::empty(group_shape, w.dtype(), Device::cuda);
  q.biases = Tensor::empty(group_shape, w.dtype(), Device::cuda);
  const int64_t groups = w.numel() / spec.group_size;
  if (groups == 0) return q;

  cudaStream_t stream = current_stream();
  dispatch_float(w.dtype(), "quantize", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using S = typename Elem<D>::storage;
    const unsigned grid = grid_for(groups, kQuantizeWarps);
    if (spec.rounding == Rounding::gpu)
      quantize_groups_kernel<D, true><<<grid, kQuantizeWarps * 32, 0, stream>>>(
          w.data_as<const S>(), groups, spec.group_size, spec.bits, q.w.data_as<uint32_t>(), q.scales.data_as<S>(),
          q.biases.data_as<S>());
    else
      quantize_groups_kernel<D, false><<<grid, kQuantizeWarps * 32, 0, stream>>>(
          w.data_as<const S>(), groups, spec.group_size, spec.bits, q.w.data_as<uint32_t>(), q.scales.data_as<S>(),
          q.biases.data_as<S>());
    EXPERTQMM_CUDA_CHECK_LAUNCH(quantize_groups_kernel);
  });
  return q;
}

// The fp modes: dequantize_fp (quantize_fp.cu). Affine ignores `dtype` (the front casts).
Tensor dequantize(const QuantizedWeight& q, DType dtype) {
  detail::check_quantized_weight("dequantize", q);
  EXPERTQMM_CHECK(q.w.device() == Device::cuda, "dequantize", "cuda::dequantize needs device tensors, got ",
                  q.w.describe());
  if (q.mode != QuantMode::affine) return dequantize_fp(q, dtype);
  const int group_size = q.group_size, bits = q.bits;
  const Tensor w = q.w.contiguous();
  const Tensor scales = q.scales.contiguous();
  const Tensor biases = q.biases.contiguous();
  const int64_t K = w.size(-1) * 32 / bits;
  Shape out_shape = w.shape();
  out_shape.back() = K;
  Tensor out = Tensor::empty(out_shape, scales.dtype(), Device::cuda);
  const int64_t rows = w.numel() / w.size(-1);
  if (rows == 0 || K == 0) return out;

  cudaStream_t stream = current_stream();
  dispatch_float(scales.dtype(), "dequantize", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using S = typename Elem<D>::storage;
    constexpr int kThreads = 256;
    dequantize_kernel<D><<<grid_for(rows * K, kThreads), kThreads, 0, stream>>>(
        w.data_as<const uint32_t>(), scales.data_as<const S>(), biases.data_as<const S>(), rows, K, group_size, bits,
        out.data_as<S>());
    EXPERTQMM_CUDA_CHECK_LAUNCH(dequantize_kernel);
  });
  return out;
}

}  // namespace expertqmm::cuda

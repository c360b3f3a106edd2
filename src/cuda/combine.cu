// Weighted combine on the GPU (mlx-lm Experts: (expand_dims(w, -1) * y).sum(-2)):
//   out[t, d] = sum_j w[t, j] * y[row(t, j), d]
// fp32 products and sums in slot order j = 0..k-1 (explicit round-to-nearest, no FMA: the same
// sequence of fp32 operations as the CPU backend), one rounding to the output dtype. In the MoE
// path row(t, j) = inv_order[t*k + j] reads the down GEMM's output in sorted order, so no unsort.
#include "cuda/cuda_backend.h"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

namespace {

constexpr int kMaxThreads = 256;

template <DType D, int VEC>
struct alignas(sizeof(typename Elem<D>::storage) * VEC) Pack {
  typename Elem<D>::storage v[VEC];
};

__device__ __forceinline__ float load_weight(const void* w, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(w)[i]);
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(w)[i]);
    default: return static_cast<const float*>(w)[i];
  }
}

constexpr int kSlotBatch = 8;  // slots whose row ids, weights and y loads are all issued before any math

// Weighted sum of k rows per token over D columns.
//   y        (y_rows, D) of Y, rows y_ld apart; slot (t, j) reads row slot_row[t*k + j] (identity
//            t*k + j when slot_row is null)
//   w        (T, k) of w_dtype (uniform branch on the dtype: one scalar per slot)
//   out      (T, D) of O, rows out_ld apart
// Work split: blockIdx.x = token t, blockIdx.y * blockDim.x + threadIdx.x = a VEC-wide column chunk
// (16 bytes of y): 2816 bf16 values make 2 CTAs of 192 threads per token, a 768-column window of
// them 1 CTA of 96 (launch_weighted_combine sizes the CTAs to the columns). A thread takes the slots
// 8 at a time: it loads the 8 row ids and weights, then the 8 rows' chunks (8 x 16 bytes in flight,
// so one token costs two dependent memory latencies, not 2k), then accumulates in slot order and
// writes its chunk of out[t] once.
template <DType Y, DType O, int VEC>
__global__ void weighted_combine_kernel(const typename Elem<Y>::storage* __restrict__ y, int64_t y_rows,
                                        int64_t y_ld, const int32_t* __restrict__ slot_row,
                                        const void* __restrict__ w, DType w_dtype, int64_t k, int64_t D,
                                        typename Elem<O>::storage* __restrict__ out, int64_t out_ld, uint32_t* faults) {
  const int64_t t = blockIdx.x;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * VEC;
  if (c >= D) return;
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
  for (int64_t j0 = 0; j0 < k; j0 += kSlotBatch) {
    int64_t row[kSlotBatch];
    float wj[kSlotBatch];
#pragma unroll
    for (int s = 0; s < kSlotBatch; ++s) {
      const int64_t slot = t * k + j0 + s;
      const bool live = j0 + s < k;
      row[s] = !live ? -1 : slot_row ? slot_row[slot] : slot;
      wj[s] = live ? load_weight(w, w_dtype, slot) : 0.0f;
    }
    Pack<Y, VEC> yv[kSlotBatch];
#pragma unroll
    for (int s = 0; s < kSlotBatch; ++s)
      if (row[s] >= 0 && row[s] < y_rows) yv[s] = *reinterpret_cast<const Pack<Y, VEC>*>(y + row[s] * y_ld + c);
#pragma unroll
    for (int s = 0; s < kSlotBatch; ++s) {
      if (j0 + s >= k) break;
      if (row[s] < 0 || row[s] >= y_rows) {
        if (c == 0)
          record_fault(faults, kFaultRowOutOfRange, static_cast<uint32_t>(row[s]), static_cast<uint32_t>(y_rows));
        continue;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wj[s], Elem<Y>::load(yv[s].v[i])));
    }
  }
  Pack<O, VEC> o;
#pragma unroll
  for (int i = 0; i < VEC; ++i) o.v[i] = Elem<O>::store(acc[i]);
  *reinterpret_cast<Pack<O, VEC>*>(out + t * out_ld + c) = o;
}

template <DType Y, DType O, int VEC>
void launch_combine_variant(const void* y, int64_t y_rows, int64_t y_ld, const int32_t* slot_row, DType w_dtype,
                            const void* w, void* out, int64_t out_ld, int64_t T, int64_t k, int64_t D,
                            cudaStream_t stream) {
  // The fewest CTAs of at most 256 threads per token, then the fewest whole warps that cover them.
  const int64_t chunks = (D + VEC - 1) / VEC;
  const int64_t ctas = (chunks + kMaxThreads - 1) / kMaxThreads;
  const int64_t threads = ((chunks + ctas - 1) / ctas + 31) / 32 * 32;
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(ctas));
  weighted_combine_kernel<Y, O, VEC><<<grid, static_cast<unsigned>(threads), 0, stream>>>(
      static_cast<const typename Elem<Y>::storage*>(y), y_rows, y_ld, slot_row, w, w_dtype, k, D,
      static_cast<typename Elem<O>::storage*>(out), out_ld, device_faults());
  EXPERTQMM_CUDA_CHECK_LAUNCH(weighted_combine_kernel);
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

void launch_weighted_combine(DType y_dtype, const void* y, int64_t y_rows, int64_t y_ld, const int32_t* slot_row,
                             DType w_dtype, const void* w, DType out_dtype, void* out, int64_t out_ld, int64_t T,
                             int64_t k, int64_t D, cudaStream_t stream) {
  if (T == 0 || D == 0) return;
  EXPERTQMM_CHECK(T <= INT32_MAX, "weighted_combine", "too many tokens: ", T);
  EXPERTQMM_CHECK(is_floating(w_dtype), "weighted_combine", "weights must be a float type, got ", dtype_name(w_dtype));
  dispatch_float(y_dtype, "weighted_combine", [&](auto ytag) {
    constexpr DType Y = decltype(ytag)::value;
    dispatch_float(out_dtype, "weighted_combine", [&](auto otag) {
      constexpr DType O = decltype(otag)::value;
      constexpr int V = kVec16<Y>;
      const bool vectorized = D % V == 0 && y_ld % V == 0 && out_ld % V == 0 && aligned(y, 16) &&
                              aligned(out, sizeof(typename Elem<O>::storage) * V);
      if (vectorized)
        launch_combine_variant<Y, O, V>(y, y_rows, y_ld, slot_row, w_dtype, w, out, out_ld, T, k, D, stream);
      else
        launch_combine_variant<Y, O, 1>(y, y_rows, y_ld, slot_row, w_dtype, w, out, out_ld, T, k, D, stream);
    });
  });
}

Tensor weighted_combine(const Tensor& y_in, const Tensor& weights_in) {
  EXPERTQMM_CHECK(y_in.device() == Device::cuda && weights_in.device() == Device::cuda, "weighted_combine",
                  "cuda::weighted_combine needs device tensors, got y ", y_in.describe(), " and weights ",
                  weights_in.describe());
  EXPERTQMM_CHECK(y_in.ndim() == 3 && weights_in.ndim() == 2 && y_in.size(0) == weights_in.size(0) &&
                      y_in.size(1) == weights_in.size(1),
                  "weighted_combine", "expected y [T, k, D] and weights [T, k], got y ", y_in.describe(),
                  " and weights ", weights_in.describe());
  const Tensor y = y_in.contiguous();
  const Tensor weights = weights_in.contiguous();
  const int64_t T = y.size(0), k = y.size(1), D = y.size(2);
  Tensor out = Tensor::empty({T, D}, y.dtype(), Device::cuda);
  launch_weighted_combine(y.dtype(), y.data(), T * k, D, nullptr, weights.dtype(), weights.data(), y.dtype(),
                          out.data(), D, T, k, D, current_stream());
  return out;
}

}  // namespace expertqmm::cuda

// GLU products on the GPU: geglu = gelu_tanh(gate) * up, swiglu = silu(gate) * up (spec 4.3).
// fp32 math on the widened inputs with the CPU backend's constants and operation order (explicit
// round-to-nearest intrinsics, no FMA contraction), one rounding to the activation dtype.
// Two forms (fusion ladder step 1, DESIGN.md): one fused kernel, or act then multiply as two
// kernels through an intermediate in the activation dtype (what an uncompiled MLX graph does).
#include "cuda/cuda_backend.h"
#include "cuda/device/glu.cuh"
#include "cuda/moe_internal.h"

namespace expertqmm::cuda {

namespace {

constexpr int kThreads = 256;
using device::activate;

// VEC consecutive elements, loaded and stored as one access (16 bytes when VEC = kVec16<D>).
template <DType D, int VEC>
struct alignas(sizeof(typename Elem<D>::storage) * VEC) Pack {
  typename Elem<D>::storage v[VEC];
};

unsigned grid_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 1048576 ? 1048576 : blocks));
}

// out[r, c] = act(gate[r, c]) * up[r, c].
//   gate, up  rows of `width` values, row r at r * in_row_stride (gate and up may be the two halves
//             of one fused [rows, 2*width] GEMM output: up = gate + width, in_row_stride = 2*width)
//   out       (rows, width) contiguous
// Work split: one thread per VEC-element chunk (16 bytes: 8 bf16/f16 or 4 f32), grid-stride over
// rows * width / VEC chunks; consecutive threads take consecutive chunks of a row, so each warp
// reads and writes 512 contiguous bytes per operand.
template <DType D, Activation A, int VEC>
__global__ void glu_fused_kernel(const typename Elem<D>::storage* __restrict__ gate,
                                 const typename Elem<D>::storage* __restrict__ up, int64_t rows, int64_t width,
                                 int64_t in_row_stride, typename Elem<D>::storage* __restrict__ out) {
  using P = Pack<D, VEC>;
  const int64_t chunks_per_row = width / VEC;
  const int64_t total = rows * chunks_per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / chunks_per_row;
    const int64_t c = (idx - r * chunks_per_row) * VEC;
    const P g = *reinterpret_cast<const P*>(gate + r * in_row_stride + c);
    const P u = *reinterpret_cast<const P*>(up + r * in_row_stride + c);
    P o;
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      o.v[i] = Elem<D>::store(__fmul_rn(activate<A>(Elem<D>::load(g.v[i])), Elem<D>::load(u.v[i])));
    *reinterpret_cast<P*>(out + r * width + c) = o;
  }
}

// Separate form, first kernel: act_out[r, c] = T(act(gate[r, c])). Layouts and work split as
// glu_fused_kernel (act_out is contiguous (rows, width)).
template <DType D, Activation A, int VEC>
__global__ void glu_act_kernel(const typename Elem<D>::storage* __restrict__ gate, int64_t rows, int64_t width,
                               int64_t in_row_stride, typename Elem<D>::storage* __restrict__ act_out) {
  using P = Pack<D, VEC>;
  const int64_t chunks_per_row = width / VEC;
  const int64_t total = rows * chunks_per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / chunks_per_row;
    const int64_t c = (idx - r * chunks_per_row) * VEC;
    const P g = *reinterpret_cast<const P*>(gate + r * in_row_stride + c);
    P o;
#pragma unroll
    for (int i = 0; i < VEC; ++i) o.v[i] = Elem<D>::store(activate<A>(Elem<D>::load(g.v[i])));
    *reinterpret_cast<P*>(act_out + r * width + c) = o;
  }
}

// Separate form, second kernel: out[r, c] = T(act[r, c] * up[r, c]); act and out contiguous
// (rows, width), up rows in_row_stride apart. Work split as glu_fused_kernel.
template <DType D, int VEC>
__global__ void glu_multiply_kernel(const typename Elem<D>::storage* __restrict__ act,
                                    const typename Elem<D>::storage* __restrict__ up, int64_t rows, int64_t width,
                                    int64_t in_row_stride, typename Elem<D>::storage* __restrict__ out) {
  using P = Pack<D, VEC>;
  const int64_t chunks_per_row = width / VEC;
  const int64_t total = rows * chunks_per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / chunks_per_row;
    const int64_t c = (idx - r * chunks_per_row) * VEC;
    const P a = *reinterpret_cast<const P*>(act + r * width + c);
    const P u = *reinterpret_cast<const P*>(up + r * in_row_stride + c);
    P o;
#pragma unroll
    for (int i = 0; i < VEC; ++i) o.v[i] = Elem<D>::store(__fmul_rn(Elem<D>::load(a.v[i]), Elem<D>::load(u.v[i])));
    *reinterpret_cast<P*>(out + r * width + c) = o;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <DType D, Activation A, int VEC>
void launch_glu_variant(ProductMode mode, const void* gate, const void* up, int64_t rows, int64_t width,
                        int64_t in_row_stride, void* out, void* intermediate, cudaStream_t stream) {
  using S = typename Elem<D>::storage;
  const unsigned grid = grid_for(rows * (width / VEC));
  if (mode == ProductMode::fused) {
    glu_fused_kernel<D, A, VEC><<<grid, kThreads, 0, stream>>>(static_cast<const S*>(gate), static_cast<const S*>(up),
                                                               rows, width, in_row_stride, static_cast<S*>(out));
    EXPERTQMM_CUDA_CHECK_LAUNCH(glu_fused_kernel);
    return;
  }
  glu_act_kernel<D, A, VEC><<<grid, kThreads, 0, stream>>>(static_cast<const S*>(gate), rows, width, in_row_stride,
                                                           static_cast<S*>(intermediate));
  EXPERTQMM_CUDA_CHECK_LAUNCH(glu_act_kernel);
  glu_multiply_kernel<D, VEC><<<grid, kThreads, 0, stream>>>(static_cast<const S*>(intermediate),
                                                             static_cast<const S*>(up), rows, width, in_row_stride,
                                                             static_cast<S*>(out));
  EXPERTQMM_CUDA_CHECK_LAUNCH(glu_multiply_kernel);
}

}  // namespace

void launch_glu_product(Activation act, ProductMode mode, DType dtype, const void* gate, const void* up, int64_t rows,
                        int64_t width, int64_t in_row_stride, void* out, void* intermediate, cudaStream_t stream) {
  if (rows == 0 || width == 0) return;
  EXPERTQMM_CHECK(mode == ProductMode::fused || intermediate != nullptr, "glu_product",
                  "the separate product needs an intermediate buffer");
  dispatch_float(dtype, "glu_product", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    constexpr int V = kVec16<D>;
    const bool vectorized = width % V == 0 && in_row_stride % V == 0 && aligned16(gate) && aligned16(up) &&
                            aligned16(out) && (mode == ProductMode::fused || aligned16(intermediate));
    const bool geglu = act == Activation::geglu;
    if (vectorized && geglu)
      launch_glu_variant<D, Activation::geglu, V>(mode, gate, up, rows, width, in_row_stride, out, intermediate, stream);
    else if (vectorized)
      launch_glu_variant<D, Activation::swiglu, V>(mode, gate, up, rows, width, in_row_stride, out, intermediate, stream);
    else if (geglu)
      launch_glu_variant<D, Activation::geglu, 1>(mode, gate, up, rows, width, in_row_stride, out, intermediate, stream);
    else
      launch_glu_variant<D, Activation::swiglu, 1>(mode, gate, up, rows, width, in_row_stride, out, intermediate, stream);
  });
}

Tensor glu_product(Activation act, const Tensor& gate_in, const Tensor& up_in) {
  EXPERTQMM_CHECK(gate_in.device() == Device::cuda && up_in.device() == Device::cuda, "glu_product",
                  "cuda::glu_product needs device tensors, got gate ", gate_in.describe(), " and up ", up_in.describe());
  EXPERTQMM_CHECK(gate_in.shape() == up_in.shape() && gate_in.dtype() == up_in.dtype(), "glu_product", "gate ",
                  gate_in.describe(), " and up ", up_in.describe(), " must have one shape and dtype");
  const Tensor gate = gate_in.contiguous();
  const Tensor up = up_in.contiguous();
  Tensor out = Tensor::empty(gate.shape(), gate.dtype(), Device::cuda);
  const int64_t n = gate.numel();
  if (n == 0) return out;
  const ProductMode mode = product_mode();
  Tensor intermediate;
  if (mode == ProductMode::separate) intermediate = Tensor::empty(gate.shape(), gate.dtype(), Device::cuda);
  // One row of n values: the flat tensors are elementwise partners.
  launch_glu_product(act, mode, gate.dtype(), gate.data(), up.data(), 1, n, n, out.data(),
                     mode == ProductMode::separate ? intermediate.data() : nullptr, current_stream());
  return out;
}

}  // namespace expertqmm::cuda

// The CUTLASS types every instance shares: operand layouts, the offline shuffle of the 4-bit codes
// and the grouped kernel built from them (Hopper TMA warp-specialized cooperative, mixed input).
// The weights are the register-sourced operand, so each GEMM is run transposed: the kernel's M is
// the weight rows (output features), its N the tokens of the group, and D^T column-major is the
// output [tokens, features] row-major.
#pragma once
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/mixed_dtype_utils.hpp"
#include "cutlass/util/packed_stride.hpp"

// The grouped kernel rewrites its TMA descriptors per group on the device (tensormap.replace).
#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the CUTLASS peer needs nvcc 12.3 or newer (CUTLASS's grouped Hopper kernels modify TMA descriptors)"
#endif

namespace expertqmm::peer::cutlass_types {

using namespace cute;

using Bf16 = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group

// Activations [tokens, k] row-major; weights [n, k] k-contiguous (a column-major k x n operand).
using LayoutX = cutlass::layout::RowMajor;
using LayoutW = cutlass::layout::ColumnMajor;
using LayoutXT = cutlass::layout::LayoutTranspose<LayoutX>::type;
using LayoutWT = cutlass::layout::LayoutTranspose<LayoutW>::type;
using StrideX = cute::remove_pointer_t<cutlass::detail::TagToStrideA_t<LayoutX*>>;
using StrideW = cute::remove_pointer_t<cutlass::detail::TagToStrideB_t<LayoutW*>>;

// Offline shuffle: the 8 values a thread converts at once are stored contiguously, in the order
// [0,2,4,6,1,3,5,7] that the int4/uint4 -> bf16 converters expect (mixed_input_utils.hpp).
using ValueShuffle = Layout<Shape<_2, _4>, Stride<_4, _1>>;
using ShuffleAtoms = Layout<Shape<_1, _1>>;
using LayoutAtomQuant = decltype(cutlass::compute_memory_reordering_atom<Bf16, ShuffleAtoms, ValueShuffle>());
using LayoutWReordered = decltype(cute::tile_to_shape(LayoutAtomQuant{}, Layout<Shape<int, int, Int<1>>, StrideW>{}));

constexpr int kAlignX = 128 / cutlass::sizeof_bits<Bf16>::value;
constexpr int kAlignD = 128 / cutlass::sizeof_bits<Bf16>::value;
constexpr int kTileK = 128 * 8 / cutlass::sizeof_bits<Bf16>::value;  // 64: one quant group per k tile

template <class Quant, int TokenTile>
struct GroupedKernel {
  static constexpr int kAlignW = 128 / cutlass::sizeof_bits<Quant>::value;
  using TileShape = Shape<_128, Int<TokenTile>, Int<kTileK>>;
  using ClusterShape = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      Bf16, cutlass::layout::LayoutTranspose<LayoutX>::type*, kAlignD,
      Bf16, cutlass::layout::LayoutTranspose<LayoutX>::type*, kAlignD,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  // The scale rides with the quantized operand as a tuple; no zero point (see NOTES.md: the grouped
  // collective's scale-with-zero mode does not set up the scale's TMA descriptor in 4.2.0).
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cute::tuple<Quant, Bf16>, LayoutWReordered*, kAlignW,
      Bf16, LayoutXT*, kAlignX,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using StrideS = typename Mainloop::StrideScale;
};

}  // namespace expertqmm::peer::cutlass_types

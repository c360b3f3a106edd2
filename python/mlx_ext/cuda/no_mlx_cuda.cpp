// eval_gpu where MLX's CUDA backend (or expertqmm's) is not part of the build: MLX only calls it
// for arrays on a GPU stream, which then cannot run here; the error says what to rebuild.
#include "eval.h"
#include "expertqmm/error.h"

namespace expertqmm::mlx_ext {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(what, "this expertqmm._mlx was built without CUDA (an MLX without its CUDA backend, or expertqmm "
                    "without nvcc): reinstall expertqmm (--no-build-isolation) next to mlx[cuda] with nvcc on PATH");
}
}  // namespace

void eval_on_cuda(const mx::Stream&, const std::vector<mx::array>&, mx::array&, Body) { no_cuda("mlx eval_gpu"); }

}  // namespace expertqmm::mlx_ext

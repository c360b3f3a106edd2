// The CUTLASS grouped-GEMM peer's interface between the harness (peer.cu, no CUTLASS headers) and the
// CUTLASS instances (instance_*.cu, one kernel each, compiled in parallel).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace expertqmm::peer {

// How the 4-bit codes become bf16 weights inside the GEMM.
enum class QuantForm {
  scale,   // (a) example 69's form: signed int4 codes c, w = c * s (our codes: c = q - 8)
  affine,  // (b) MLX's form w = q * s + b: unsigned codes, q * s in the GEMM, the bias term
           //     sum_g b_g * sum(x_g) added through the epilogue's C (beta = 1)
};

// One grouped GEMM D_g = X_g * W_g^T (+ C_g) over the experts hit; rows of a group are consecutive.
// Pointers are device pointers; one entry per group.
struct GroupedProblem {
  int n = 0, k = 0, group_size = 64;  // weight rows (output features), reduction length, quant group
  std::vector<int> rows;              // tokens of each group (> 0)
  std::vector<const void*> x;         // bf16 [rows, k], row-major
  std::vector<const void*> w;         // 4-bit codes [n, k] in the reordered layout (reorder_codes)
  std::vector<const void*> scales;    // bf16 [k / group_size, n] (n contiguous)
  std::vector<const void*> c;         // bf16 [rows, n]: the affine form's bias term (read when add_c)
  std::vector<void*> d;               // bf16 [rows, n], row-major
};

class PeerGemm {
 public:
  virtual ~PeerGemm() = default;
  // Builds the device argument arrays and the workspace for `p` and runs CUTLASS's can_implement and
  // initialize; throws expertqmm::Error with the status and the problem on any failure.
  virtual void prepare(const GroupedProblem& p, bool add_c, cudaStream_t stream) = 0;
  // One kernel launch on `stream` (capturable into a CUDA graph).
  virtual void run(cudaStream_t stream) = 0;
};

struct Instance {
  const char* name;  // e.g. "affine-t64"
  QuantForm form;
  int token_tile;    // the CTA tile's N (tokens); M is 128 weight rows, K 64
  std::unique_ptr<PeerGemm> (*make)();
};

// Every instance compiled into this binary (instances.cpp: the table).
const std::vector<Instance>& instances();

// Rewrites one expert's codes [n, k] (4-bit, k contiguous, MLX nibble order) into the layout the
// instances read (example 69's offline shuffle: each thread's values contiguous). Synchronizes.
void reorder_codes(const void* src, void* dst, int n, int k);

// The CUTLASS headers' version, "major.minor.patch".
std::string cutlass_version();

}  // namespace expertqmm::peer

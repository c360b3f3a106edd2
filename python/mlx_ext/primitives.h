// MLX custom primitives over expertqmm (MLX's "Custom Extensions"): each is an mx::Primitive whose
// eval_cpu runs expertqmm's CPU backend (the bit-exact reference) on the arrays' memory and whose
// eval_gpu runs expertqmm's CUDA kernels on MLX's CUDA stream, inside MLX's graph (cuda/mlx_stream.cpp).
#pragma once
#include <mlx/mlx.h>
#include <mlx/primitives.h>

#include <optional>
#include <string>
#include <vector>

#include "expertqmm/moe.h"

namespace expertqmm::mlx_ext {

namespace mx = mlx::core;

// A projection's storage: MLX affine quantized (w, scales, biases arrays, in that order) or one
// dense float weight array.
struct ProjectionSpec {
  bool quantized = true;
  int group_size = 64;
  int bits = 4;
  int arrays() const { return quantized ? 3 : 1; }
  bool operator==(const ProjectionSpec&) const = default;
};

// The SwitchGLU experts: gate, up, down projections (their arrays follow each other) and the GLU.
struct ExpertsSpec {
  ProjectionSpec gate, up, down;
  Activation activation = Activation::swiglu;
  bool operator==(const ExpertsSpec&) const = default;
};

// A router (moe.h RouterKind): its projection's arrays, then for gemma4 scale [H] and
// per_expert_scale [E].
struct RouterSpec {
  RouterKind kind = RouterKind::gemma4;
  ProjectionSpec proj;
  int top_k = 8;
  float eps = 1e-6f;
  bool norm_topk_prob = true;
  int arrays() const { return proj.arrays() + (kind == RouterKind::gemma4 ? 2 : 0); }
  bool operator==(const RouterSpec&) const = default;
};

// mx.gather_qmm (affine, transpose=True) on expertqmm. Every index array is given (the Python side
// fills MLX's defaults) and broadcast to one shape.
class GatherQmm : public mx::UnaryPrimitive {
 public:
  GatherQmm(mx::Stream s, int group_size, int bits, bool sorted_indices)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits), sorted_(sorted_indices) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "ExpertqmmGatherQMM"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_, bits_;
  bool sorted_;
};

// mlx-lm's SwitchGLU: x [T, D], indices [T, k], then the experts' arrays -> [T, k, D].
class SwitchGlu : public mx::UnaryPrimitive {
 public:
  SwitchGlu(mx::Stream s, ExpertsSpec spec) : mx::UnaryPrimitive(s), spec_(spec) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "ExpertqmmSwitchGLU"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  ExpertsSpec spec_;
};

// The MoE block (moe.h moe_layer): h [T, H] (the router's input), x [T, H] (the experts'), then the
// router's arrays, then the experts' -> [T, H].
class MoeBlock : public mx::UnaryPrimitive {
 public:
  MoeBlock(mx::Stream s, RouterSpec router, ExpertsSpec experts)
      : mx::UnaryPrimitive(s), router_(router), experts_(experts) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "ExpertqmmMoeBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  RouterSpec router_;
  ExpertsSpec experts_;
};

// The ops that build graph nodes; inputs are made row-contiguous on `s` first.
mx::array gather_qmm(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     const mx::array& lhs_indices, const mx::array& rhs_indices, int group_size, int bits,
                     bool sorted_indices, mx::StreamOrDevice s = {});
mx::array switch_glu(const mx::array& x, const mx::array& indices, const std::vector<mx::array>& experts,
                     const ExpertsSpec& spec, mx::StreamOrDevice s = {});
mx::array moe_block(const mx::array& h, const mx::array& x, const std::vector<mx::array>& router,
                    const RouterSpec& router_spec, const std::vector<mx::array>& experts,
                    const ExpertsSpec& experts_spec, mx::StreamOrDevice s = {});

}  // namespace expertqmm::mlx_ext

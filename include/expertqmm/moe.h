// SwitchGLU, the routers (Gemma 4, Qwen3-MoE), the weighted combine and the MoE layer built from them.
#pragma once
#include <memory>
#include "expertqmm/ops.h"

namespace expertqmm {

// Expert weights of a SwitchGLU. Either gate and up separately (mlx-lm checkpoints:
// [E, I, K/..]) or one fused gate_up [E, 2I, K/..] with gate rows first (HF gate_up_proj).
// Each projection is quantized or 16-bit on its own: mlx-lm leaves a SwitchLinear unquantized
// (e.g. down_proj when I is not a multiple of the group size), stored as a float [E, N, K] weight
// and applied with MLX's gather_mm. Give exactly one of `gate` / `gate_dense` (and so on); mixes
// such as gate/up quantized and down bf16 are valid, on both backends.
struct SwitchGLUWeights {
  QuantizedWeight gate;
  QuantizedWeight up;
  QuantizedWeight gate_up;  // used when defined (or gate_up_dense); then gate and up are ignored
  QuantizedWeight down;     // [E, D, I/..]
  Tensor gate_dense;        // [E, I, D] float
  Tensor up_dense;          // [E, I, D]
  Tensor gate_up_dense;     // [E, 2I, D], gate rows first
  Tensor down_dense;        // [E, D, I]
  Activation activation = Activation::geglu;
  bool fused() const { return gate_up.defined() || gate_up_dense.defined(); }
  // True when any projection is 16-bit.
  bool has_dense() const {
    return gate_dense.defined() || up_dense.defined() || gate_up_dense.defined() || down_dense.defined();
  }
};

// mlx-lm SwitchGLU: x [T, D], indices [T, k] -> [T, k, D]. Sorts when T*k >= 64.
Tensor switch_glu(const Tensor& x, const Tensor& indices, const SwitchGLUWeights& weights);

// How a router turns h into (experts, weights): data of the layer, one value per model family.
enum class RouterKind : uint8_t {
  // Gemma 4 (spec gemma4-moe.md section 5, mlx-semantics.md 4.2):
  //   r = rms_norm(h) * (scale * H^-0.5); logits = r @ proj^T; top-k by logit; softmax over the k;
  //   weights *= per_expert_scale[idx].
  gemma4,
  // Qwen3-MoE (mlx-lm qwen3_moe.Qwen3MoeSparseMoeBlock): logits = h @ proj^T; p = softmax over all
  //   E experts (fp32, rounded to the logits' dtype); top-k by p; weights = p[idx], divided by
  //   their sum when norm_topk_prob. No norm, no scale, no per_expert_scale.
  softmax_topk,
};
const char* router_kind_name(RouterKind kind);

// Router weights. proj is quantized (proj.defined()) or dense (proj_dense). scale and
// per_expert_scale belong to RouterKind::gemma4 and must be undefined for softmax_topk.
struct RouterWeights {
  RouterKind kind = RouterKind::gemma4;
  QuantizedWeight proj;    // [E, H/..] quantized, or
  Tensor proj_dense;       // [E, H] float
  Tensor scale;            // [H]  (gemma4)
  Tensor per_expert_scale; // [E]  (gemma4)
  int top_k = 8;
  float eps = 1e-6f;            // of the rms norm (gemma4)
  bool norm_topk_prob = true;   // renormalize the k probabilities (softmax_topk)
};
struct Routing {
  Tensor indices;  // [T, k] int32
  Tensor weights;  // [T, k] in h's dtype
};
Routing route(const Tensor& h, const RouterWeights& router);

// out[t] = sum_j weights[t, j] * y[t, j] : y [T, k, D], weights [T, k] -> [T, D].
Tensor weighted_combine(const Tensor& y, const Tensor& weights);

struct MoeWeights {
  RouterWeights router;
  SwitchGLUWeights experts;
  // A copy with every tensor on `device` (undefined members stay undefined).
  MoeWeights to(Device device) const;
  // Adds the tile layout (quant.h TiledWeight) to each tileable expert projection among gate, up and
  // down that lacks one, on its device; returns how many it added. The layer's wgmma expert kernels
  // then read those instead of the MLX tensors (a fused gate_up is left as it is). Costs the
  // projections' bytes once more.
  int tile_experts();
  // Bytes of every tensor held (codes, scales, biases, tile layouts, router vectors).
  size_t nbytes() const;
};

// The expert half of an MoE block: route(h), switch_glu(x, idx), weighted_combine. Gemma 4: h is
// the router input (the un-normalised residual), x the expert input; Qwen3-MoE routes and runs the
// experts on the same normalised x (moe_layer(x, weights)). Both [T, H].
Tensor moe_layer(const Tensor& h, const Tensor& x, const MoeWeights& weights);
inline Tensor moe_layer(const Tensor& x, const MoeWeights& weights) { return moe_layer(x, x, weights); }

}  // namespace expertqmm

namespace expertqmm {

// Scratch memory of the device MoE path. Grows on first use at a size, then is reused: calls at
// or below a size already seen allocate nothing, so they can be captured in a CUDA graph.
class Workspace {
 public:
  Workspace();
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  // Returns a device buffer of at least `bytes` for slot `slot` (grow-only). Slot owners:
  // src/core/workspace_slots.h.
  void* get(int slot, size_t bytes);
  // get(), and every byte is zero when the buffer is (re)allocated: for device counters that the
  // kernels using them leave at zero when they finish.
  void* get_zeroed(int slot, size_t bytes);
  // Scratch for work that runs beside this workspace's on another stream (the Gemma 4 block's dense
  // MLP beside its experts): a second set of slots, made on first use and freed with this one.
  Workspace& branch();
  // Bytes of every slot, the branch's included.
  size_t bytes_held() const;

 private:
  struct Slot { void* ptr = nullptr; size_t bytes = 0; };
  Slot slots_[16];
  std::unique_ptr<Workspace> branch_;
  Slot& slot_at(int slot);           // range-checked
  bool grow(Slot& s, size_t bytes);  // true when it (re)allocated
};

// switch_glu writing into a caller-owned contiguous `out` [T, k, D] (its output dtype, x's device),
// with the scratch from `ws`: on CUDA, after a call at that size or larger, no allocation and no
// host synchronization. On the CPU it computes switch_glu and copies the result in.
void switch_glu_into(Tensor& out, const Tensor& x, const Tensor& indices, const SwitchGLUWeights& weights,
                     Workspace& ws);

// moe_layer writing into a caller-owned `out` [T, H] on the device of h, with scratch from `ws`.
// With a warmed-up workspace this path performs no allocation and no host synchronization.
void moe_layer_into(Tensor& out, const Tensor& h, const Tensor& x, const MoeWeights& weights,
                    Workspace& ws);

}  // namespace expertqmm

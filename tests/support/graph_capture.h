// Capturing one library call into a CUDA graph and replaying it: the GPU tests that check a path is
// graph-safe (no allocation, no host sync under capture, the replay writes every output element).
#pragma once
#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>

#include <functional>
#include <string>
#include <vector>

#include "expertqmm/moe.h"
#include "expertqmm/tensor.h"

namespace expertqmm::test {

// A new non-blocking stream, the library's current stream while the object lives.
class CaptureStream {
 public:
  CaptureStream();
  ~CaptureStream();
  CaptureStream(const CaptureStream&) = delete;
  CaptureStream& operator=(const CaptureStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
  void* saved_ = nullptr;
};

// Captures call() on `stream` (global capture mode) into a new graph. A throw or a capture error is a
// test failure (naming `what`) and gives nullptr.
cudaGraph_t capture_graph(cudaStream_t stream, const std::function<void()>& call, const std::string& what);

// Kernel nodes of `graph`.
int kernel_nodes(cudaGraph_t graph);
// The grid of every kernel node of `graph` (in the graph's node order).
std::vector<dim3> kernel_grids(cudaGraph_t graph);

// How a replay must match the uncaptured call: its bytes, or (where the call may add the k expert
// outputs with fp32 atomics in a varying order) within that reordering's rounding: every element
// finite and |replayed - expected| <= |expected| / 32 + max|expected| / 4096 (a few bf16 ulps, and
// a floor for sums that cancel).
enum class ReplayMatch { bytes, within_rounding };
// The match a MoE call (a layer or a block) of T tokens routed to k experts each can promise: its
// bytes in deterministic mode or where its T * k rows are not sorted (below mlx-lm's threshold of
// 64: only sorted rows are combined with atomics, and the decode layer sums each token's k slots in
// one CTA), else within rounding.
ReplayMatch replay_match_for(int64_t T, int64_t k);

// Instantiates `graph`, replays it `replays` times, each into a freshly poisoned `replayed`, and
// expects `expected` each time (`match`); then destroys the graph.
void expect_replays_match(cudaGraph_t graph, cudaStream_t stream, Tensor& replayed, const Tensor& expected,
                          int replays, const std::string& what, ReplayMatch match = ReplayMatch::bytes);

// A block's into-call (out [T, H] from bf16 h [T, H] with scratch from ws: gemma4_ffn_into,
// qwen3_moe_ffn_into) at each T of `tokens`, the first the largest (it grows the workspace; no later
// call may): the call captured in a graph holds more than min_nodes nodes, `inspect` (when given)
// passes on the graph's shape, and every replay writes the uncaptured call's output
// (replay_match_for(T, top_k)).
using BlockInto = std::function<void(Tensor& out, const Tensor& h, Workspace& ws)>;
void expect_block_capture_replays(const BlockInto& call, int64_t H, int64_t top_k, const std::vector<int64_t>& tokens,
                                  size_t min_nodes,
                                  const std::function<void(cudaGraph_t, const std::string&)>& inspect = {});

}  // namespace expertqmm::test
#endif

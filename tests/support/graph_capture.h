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

// Instantiates `graph`, replays it `replays` times, each into a freshly poisoned `replayed`, and
// expects the bytes of `expected` each time (every MoE path sums a token's k slots in slot order);
// then destroys the graph.
void expect_replays_match(cudaGraph_t graph, cudaStream_t stream, Tensor& replayed, const Tensor& expected,
                          int replays, const std::string& what);

// A block's into-call (out [T, H] from bf16 h [T, H] with scratch from ws: gemma4_ffn_into,
// qwen3_moe_ffn_into) at each T of `tokens`, the first the largest (it grows the workspace; no later
// call may): the call captured in a graph holds more than min_nodes nodes, `inspect` (when given)
// passes on the graph's shape, and every replay writes the uncaptured call's output bytes.
using BlockInto = std::function<void(Tensor& out, const Tensor& h, Workspace& ws)>;
void expect_block_capture_replays(const BlockInto& call, int64_t H, const std::vector<int64_t>& tokens,
                                  size_t min_nodes,
                                  const std::function<void(cudaGraph_t, const std::string&)>& inspect = {});

}  // namespace expertqmm::test
#endif

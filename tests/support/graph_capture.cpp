#include "support/graph_capture.h"

#ifdef EXPERTQMM_HAVE_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <exception>
#include <vector>

#include "expertqmm/backend.h"
#include "support/test_util.h"

namespace expertqmm::test {

CaptureStream::CaptureStream() {
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  saved_ = cuda_stream();
  set_cuda_stream(stream_);
}

CaptureStream::~CaptureStream() {
  set_cuda_stream(saved_);
  EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
}

cudaGraph_t capture_graph(cudaStream_t stream, const std::function<void()>& call, const std::string& what) {
  cudaGraph_t graph = nullptr;
  const cudaError_t begin = cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
  EXPECT_EQ(begin, cudaSuccess) << what << ": " << cudaGetErrorString(begin);
  if (begin != cudaSuccess) return nullptr;
  std::string error;
  try {
    call();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  EXPECT_TRUE(error.empty()) << what << ": the call failed under capture: " << error;
  EXPECT_EQ(end, cudaSuccess) << what << ": " << cudaGetErrorString(end);
  if (error.empty() && end == cudaSuccess) return graph;
  if (graph != nullptr) cudaGraphDestroy(graph);
  return nullptr;
}

namespace {
// The kernel nodes of `graph`, in the graph's node order.
std::vector<cudaGraphNode_t> kernel_node_list(cudaGraph_t graph) {
  size_t nodes = 0;
  EXPECT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  std::vector<cudaGraphNode_t> all(nodes);
  EXPECT_EQ(cudaGraphGetNodes(graph, all.data(), &nodes), cudaSuccess);
  std::vector<cudaGraphNode_t> kernels;
  for (cudaGraphNode_t node : all) {
    cudaGraphNodeType type;
    EXPECT_EQ(cudaGraphNodeGetType(node, &type), cudaSuccess);
    if (type == cudaGraphNodeTypeKernel) kernels.push_back(node);
  }
  return kernels;
}
}  // namespace

int kernel_nodes(cudaGraph_t graph) { return static_cast<int>(kernel_node_list(graph).size()); }

std::vector<dim3> kernel_grids(cudaGraph_t graph) {
  std::vector<dim3> grids;
  for (cudaGraphNode_t node : kernel_node_list(graph)) {
    cudaKernelNodeParams params{};
    EXPECT_EQ(cudaGraphKernelNodeGetParams(node, &params), cudaSuccess);
    grids.push_back(params.gridDim);
  }
  return grids;
}

void expect_replays_match(cudaGraph_t graph, cudaStream_t stream, Tensor& replayed, const Tensor& expected,
                          int replays, const std::string& what) {
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  EXPECT_EQ(made, cudaSuccess) << what << ": " << cudaGetErrorString(made);
  for (int replay = 0; made == cudaSuccess && replay < replays; ++replay) {
    poison(replayed);  // the replay, not the capture, must write every element
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess) << what;
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess) << what;
    EXPECT_EQ(replayed.to_host_bytes(), expected.to_host_bytes()) << what << " replay " << replay;
  }
  cuda_check();
  if (made == cudaSuccess) {
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  }
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

void expect_block_capture_replays(const BlockInto& call, int64_t H, const std::vector<int64_t>& tokens,
                                  size_t min_nodes, const std::function<void(cudaGraph_t, const std::string&)>& inspect) {
  const CaptureStream stream;
  Workspace ws;
  for (int64_t T : tokens) {
    const std::string what = "T=" + std::to_string(T);
    const Tensor h = random_tensor({T, H}, DType::bf16, 1.0f, Device::cuda);
    Tensor expected = Tensor::empty({T, H}, DType::bf16, Device::cuda);
    call(expected, h, ws);
    cuda_check();
    const size_t held = ws.bytes_held();
    Tensor replayed = Tensor::empty({T, H}, DType::bf16, Device::cuda);
    cudaGraph_t graph = capture_graph(stream.get(), [&] { call(replayed, h, ws); }, what);
    ASSERT_NE(graph, nullptr) << what;
    EXPECT_EQ(ws.bytes_held(), held) << what << ": the workspace grew during the captured call";
    size_t nodes = 0;
    ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
    EXPECT_GT(nodes, min_nodes) << what << ": the graph should hold the whole block";
    if (inspect) inspect(graph, what);
    expect_replays_match(graph, stream.get(), replayed, expected, 2, what);
  }
}

}  // namespace expertqmm::test
#endif

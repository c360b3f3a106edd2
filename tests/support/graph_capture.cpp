#include "support/graph_capture.h"

#ifdef EXPERTQMM_HAVE_CUDA
#include <gtest/gtest.h>

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

int kernel_nodes(cudaGraph_t graph) {
  size_t nodes = 0;
  EXPECT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  std::vector<cudaGraphNode_t> all(nodes);
  EXPECT_EQ(cudaGraphGetNodes(graph, all.data(), &nodes), cudaSuccess);
  int kernels = 0;
  for (cudaGraphNode_t node : all) {
    cudaGraphNodeType type;
    EXPECT_EQ(cudaGraphNodeGetType(node, &type), cudaSuccess);
    kernels += type == cudaGraphNodeTypeKernel;
  }
  return kernels;
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
  if (made == cudaSuccess) EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

}  // namespace expertqmm::test
#endif

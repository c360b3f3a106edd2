// eval_gpu of the primitives: expertqmm's CUDA ops on MLX's CUDA stream, captured into MLX's graph.
//
// MLX's CUDA backend records each primitive as a node of a CUDA graph (its command encoder) and
// orders nodes by the arrays they register as inputs and outputs. Our kernels are launched with
// <<<>>> on expertqmm's stream, so we point that stream at the encoder's and launch inside the
// encoder's capture context: the launches become a child graph of MLX's, after the nodes that
// produce our inputs. Nothing waits on the host and no array is copied: Tensors view the arrays'
// device memory, and the output is allocated by MLX's allocator (stream ordered).
#include <cuda_runtime_api.h>
#include <mlx/backend/cuda/device.h>
#include <mlx/backend/cuda/utils.h>

#include <memory>
#include <mutex>
#include <unordered_map>

#include "eval.h"
#include "expertqmm/backend.h"
#include "expertqmm/error.h"
#include "expertqmm/settings.h"

namespace expertqmm::mlx_ext {

namespace {

constexpr const char* kOp = "mlx eval_gpu";

// What lives with an MLX stream: the workspace every primitive on it shares (it grows to the
// largest call and is then reused; the library's device pool backs it, so after warm-up nothing is
// allocated), and an array whose only job is to be registered as an input and output of each of
// our nodes, which chains them in MLX's graph: they share the workspace, so they must not run
// concurrently (MLX runs independent graph nodes in parallel).
struct StreamState {
  Workspace workspace;
  mx::array order;
  StreamState() : order(mx::allocator::malloc(4), {1}, mx::uint8) {}
};

StreamState& stream_state(const mx::Stream& s) {
  static std::mutex mu;
  // Leaked on purpose: the workspace must not be freed after CUDA has shut down at exit.
  static auto* states = new std::unordered_map<int, std::unique_ptr<StreamState>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& st = (*states)[s.index];
  if (!st) st = std::make_unique<StreamState>();
  return *st;
}

Shape shape_of(const mx::array& a) { return Shape(a.shape().begin(), a.shape().end()); }

Tensor device_view(const mx::array& a) {
  EXPERTQMM_CHECK(a.flags().row_contiguous, kOp, "expects row-contiguous inputs");
  return Tensor::view(mx::gpu_ptr<void>(a), shape_of(a), expertqmm_dtype(a.dtype(), kOp), Device::cuda);
}

// Lets cudaMalloc (a workspace or pool growth, first calls only) happen during MLX's capture, which
// MLX begins in thread-local mode (that mode refuses it); restored on scope exit.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace

void eval_on_cuda(const mx::Stream& s, const std::vector<mx::array>& inputs, mx::array& out, Body body) {
  auto& encoder = mx::cu::get_command_encoder(s);
  StreamState& state = stream_state(s);
  // MLX's allocator (cu::malloc_async, the stream-ordered one, is not exported by libmlx.so).
  out.set_data(mx::allocator::malloc(out.nbytes()));
  for (const mx::array& a : inputs) encoder.set_input_array(a);
  encoder.set_input_array(state.order);
  encoder.set_output_array(out);
  encoder.set_output_array(state.order);

  std::vector<Tensor> views;
  views.reserve(inputs.size());
  for (const mx::array& a : inputs) views.push_back(device_view(a));
  Tensor o = Tensor::view(mx::gpu_ptr<void>(out), shape_of(out), expertqmm_dtype(out.dtype(), kOp), Device::cuda);

  auto capture = encoder.capture_context();
  try {
    RelaxedCapture relaxed;
    CudaStreamScope stream(encoder.device().cuda_device(), encoder.stream());  // expertqmm/backend.h
    // Plain launches inside MLX's graph: our captured launches become a child graph of MLX's, and
    // programmatic edges there are not verified (the GPU tests of this extension ran without them).
    ChainedLaunchScope plain(RouteSwitch::off);  // expertqmm/settings.h
    body(views, o, &state.workspace);
  } catch (...) {
    capture.discard = true;  // a half-recorded graph must not run
    throw;
  }
}

}  // namespace expertqmm::mlx_ext

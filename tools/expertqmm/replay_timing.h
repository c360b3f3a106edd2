// The benchmark protocol's timing pieces (bench/README.md), shared by `expertqmm bench` and the peer
// programs under bench/peers: device buffers outside the library's allocator, one event pair per
// replay, host gates that keep launch latency out of timed regions, the replay loop with the L2
// flush, and the median / p10 / p90. CUDA only.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/check.cuh"
#include "expertqmm/error.h"

namespace expertqmm::timing {

// Owning device buffer outside the library's caching allocator, so that big buffers are really
// returned when they go (move-only).
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (n) EXPERTQMM_CUDA_CHECK(cudaMalloc(&ptr, n));
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(std::exchange(o.ptr, nullptr)), bytes(std::exchange(o.bytes, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(bytes, o.bytes);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(ptr); }
};

struct EventPairs {
  std::vector<cudaEvent_t> start, stop;
  explicit EventPairs(int n) : start(n, nullptr), stop(n, nullptr) {
    for (int i = 0; i < n; ++i) {
      EXPERTQMM_CUDA_CHECK(cudaEventCreate(&start[i]));
      EXPERTQMM_CUDA_CHECK(cudaEventCreate(&stop[i]));
    }
  }
  ~EventPairs() {
    for (size_t i = 0; i < start.size(); ++i) {
      if (start[i]) cudaEventDestroy(start[i]);
      if (stop[i]) cudaEventDestroy(stop[i]);
    }
  }
  EventPairs(const EventPairs&) = delete;
  EventPairs& operator=(const EventPairs&) = delete;
  // Elapsed microseconds of every pair (the stream must be synchronized).
  std::vector<double> elapsed_us() const {
    std::vector<double> us(start.size());
    for (size_t i = 0; i < start.size(); ++i) {
      float ms = 0;
      EXPERTQMM_CUDA_CHECK(cudaEventElapsedTime(&ms, start[i], stop[i]));
      us[i] = double(ms) * 1e3;
    }
    return us;
  }
};

struct Stats {
  double median = 0, p10 = 0, p90 = 0;
};

inline Stats stats_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  Stats s;
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  s.p10 = v[size_t(0.1 * double(n - 1) + 0.5)];
  s.p90 = v[size_t(0.9 * double(n - 1) + 0.5)];
  return s;
}

// Host gates: each holds the stream behind a host function until it is opened, so that a batch of
// replays is fully enqueued before the device starts it and no timed region includes host launch
// latency. The flags live until the stream has drained (a host function may still read its flag
// after the batch loop moved on); the destructor opens every gate first, also after an error.
class HostGates {
 public:
  explicit HostGates(cudaStream_t s) : stream_(s) {}
  ~HostGates() {
    open_all();
    cudaStreamSynchronize(stream_);
  }
  HostGates(const HostGates&) = delete;
  HostGates& operator=(const HostGates&) = delete;
  // Enqueues a closed gate; returns its index for open().
  size_t close() {
    flags_.push_back(std::make_unique<std::atomic<bool>>(false));
    EXPERTQMM_CUDA_CHECK(cudaLaunchHostFunc(stream_, &HostGates::wait, flags_.back().get()));
    return flags_.size() - 1;
  }
  void open(size_t i) { flags_[i]->store(true); }
  void open_all() {
    for (auto& f : flags_) f->store(true);
  }

 private:
  static void CUDART_CB wait(void* flag) {
    while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
  }
  cudaStream_t stream_;
  std::vector<std::unique_ptr<std::atomic<bool>>> flags_;
};

// Captured graphs (one per weight copy) and their instantiations; destroys what it holds.
struct Graphs {
  std::vector<cudaGraph_t> graphs;
  std::vector<cudaGraphExec_t> execs;
  Graphs() = default;
  Graphs(const Graphs&) = delete;
  Graphs& operator=(const Graphs&) = delete;
  ~Graphs() {
    for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
    for (cudaGraph_t g : graphs) cudaGraphDestroy(g);
  }
};

// Captures body() on `stream` (global capture mode) and appends the graph and its instantiation to
// g; `what` names the captured work in the error: a path that allocates or synchronizes fails.
template <class Body>
void capture_into(Graphs& g, cudaStream_t stream, const char* what, Body&& body) {
  EXPERTQMM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  cudaGraph_t graph = nullptr;
  try {
    body();
  } catch (const std::exception& e) {
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw Error("bench", detail::cat(what, " failed under CUDA graph capture: ", e.what()));
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  if (end != cudaSuccess) {
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw Error("bench", detail::cat("capturing ", what, " failed (", cudaGetErrorString(end),
                                     "): the warmed-up path must not allocate or synchronize"));
  }
  g.graphs.push_back(graph);
  cudaGraphExec_t exec = nullptr;
  EXPERTQMM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  g.execs.push_back(exec);
}

constexpr int kReplaysPerGate = 8;  // replays enqueued behind one host gate

// The bytes the L2 flush writes before each replay: 2 x the L2, at least 64 MiB.
inline size_t l2_flush_bytes() {
  int device = 0, l2_bytes = 0;
  EXPERTQMM_CUDA_CHECK(cudaGetDevice(&device));
  EXPERTQMM_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  return std::max<size_t>(size_t(2) * size_t(l2_bytes), size_t(64) << 20);
}

// `replays` timed replays round robin over `execs`, each after a cudaMemsetAsync of the flush buffer
// (outside its event pair, so that no data of the previous replay stays in L2); returns the
// microseconds of each replay. The stream is drained on return. gated = false enqueues the replays
// without host gates, for profilers that serialize every launch (ncu waits for the stream inside the
// launch call, so a closed gate ahead of it would never open: scripts/profile-layer).
inline std::vector<double> timed_replays(const std::vector<cudaGraphExec_t>& execs, int replays, cudaStream_t stream,
                                         const DeviceBuffer& flush, bool gated = true) {
  EventPairs ev(replays);
  {
    HostGates gates(stream);
    for (int first = 0; first < replays; first += kReplaysPerGate) {
      const size_t gate = gated ? gates.close() : 0;
      for (int r = first; r < std::min(replays, first + kReplaysPerGate); ++r) {
        EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(flush.ptr, r & 0xff, flush.bytes, stream));
        EXPERTQMM_CUDA_CHECK(cudaEventRecord(ev.start[r], stream));
        EXPERTQMM_CUDA_CHECK(cudaGraphLaunch(execs[r % execs.size()], stream));
        EXPERTQMM_CUDA_CHECK(cudaEventRecord(ev.stop[r], stream));
      }
      if (gated) gates.open(gate);
    }
  }  // drains the stream
  return ev.elapsed_us();
}

}  // namespace expertqmm::timing

#include "cuda/stream_branch.h"

#include <map>

#include "cuda/runtime.cuh"

namespace expertqmm::cuda {

namespace {

// The side stream and the fork/join events of one device, per thread (threads with their own
// streams and workspaces run blocks side by side, so they must not share a side stream).
struct BranchResources {
  cudaStream_t side = nullptr;
  cudaEvent_t forked = nullptr, joined = nullptr;
  ~BranchResources() {  // at thread exit; errors (e.g. the runtime already unloaded) are moot then
    if (side) cudaStreamDestroy(side);
    if (forked) cudaEventDestroy(forked);
    if (joined) cudaEventDestroy(joined);
  }
};

BranchResources& resources_for_current_device() {
  thread_local std::map<int, BranchResources> per_device;
  int device = 0;
  EXPERTQMM_CUDA_CHECK(cudaGetDevice(&device));
  BranchResources& r = per_device[device];
  if (!r.side) {
    EXPERTQMM_CUDA_CHECK(cudaStreamCreateWithFlags(&r.side, cudaStreamNonBlocking));
    EXPERTQMM_CUDA_CHECK(cudaEventCreateWithFlags(&r.forked, cudaEventDisableTiming));
    EXPERTQMM_CUDA_CHECK(cudaEventCreateWithFlags(&r.joined, cudaEventDisableTiming));
  }
  return r;
}

}  // namespace

StreamBranch::StreamBranch() : origin_(current_stream()) {
  BranchResources& r = resources_for_current_device();
  side_ = r.side;
  joined_ = r.joined;
  EXPERTQMM_CUDA_CHECK(cudaEventRecord(r.forked, origin_));
  EXPERTQMM_CUDA_CHECK(cudaStreamWaitEvent(side_, r.forked, 0));
}

void StreamBranch::enter() {
  set_cuda_stream(side_);
  entered_ = true;
}

void StreamBranch::leave() {
  set_cuda_stream(origin_);
  entered_ = false;
}

void StreamBranch::join() {
  leave();
  EXPERTQMM_CUDA_CHECK(cudaEventRecord(joined_, side_));
  EXPERTQMM_CUDA_CHECK(cudaStreamWaitEvent(origin_, joined_, 0));
}

StreamBranch::~StreamBranch() {
  if (entered_) set_cuda_stream(origin_);
}

}  // namespace expertqmm::cuda

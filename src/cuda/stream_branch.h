// A branch of work beside the thread's stream: the Gemma 4 block runs its dense MLP on a second
// stream while the experts run on the thread's (cuda_stream()). Both edges are events, so a CUDA
// graph captured on the thread's stream takes the branch in as a parallel path; without capture the
// two streams simply overlap. Per thread and device: one side stream and two events, made on first
// use and kept (a branch allocates nothing after that).
#pragma once
#include <cuda_runtime.h>

namespace expertqmm::cuda {

class StreamBranch {
 public:
  // Fork: the side stream waits for everything issued so far on the thread's stream.
  StreamBranch();
  // The side stream becomes the thread's stream (expertqmm::set_cuda_stream): what is launched
  // now runs on the branch. leave() makes the original stream the thread's again (the branch's work
  // goes on beside it).
  void enter();
  void leave();
  // Join: the original stream waits for everything issued on the side stream (and is the thread's
  // stream). Call once, when both paths have been issued.
  void join();
  // Leaves the branch if an exception skipped leave() or join() (the branch's work is then not
  // waited for, as with any failed launch sequence).
  ~StreamBranch();
  StreamBranch(const StreamBranch&) = delete;
  StreamBranch& operator=(const StreamBranch&) = delete;

 private:
  cudaStream_t origin_;
  cudaStream_t side_;
  cudaEvent_t joined_;
  bool entered_ = false;
};

}  // namespace expertqmm::cuda

// Under load: two host threads, each with its own CUDA stream (set_cuda_stream applies to the
// calling thread only) and its own Workspace, calling moe_layer_into again and again on the same
// weights and inputs, get the bits that one call at a time gets (every path sums a token's k slots in
// slot order; deterministic mode on as well, as a caller who needs the bits would set it). Token counts cover the decode layer and the sorted prefill path, and the two threads
// walk them in opposite orders so that different paths run side by side.
#include <gtest/gtest.h>

#include <atomic>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "expertqmm/backend.h"
#include "expertqmm/error.h"
#include "expertqmm/moe.h"
#include "support/graph_capture.h"
#include "support/test_util.h"

using namespace expertqmm;

namespace {

constexpr int64_t kD = 256;  // hidden size
constexpr int64_t kI = 128;  // expert width
constexpr int64_t kE = 64;   // experts
constexpr int kTopK = 8;
constexpr int kRounds = 20;  // calls per token count per thread

MoeWeights device_layer() {
  MoeWeights w;
  w.experts.activation = Activation::geglu;
  w.experts.gate = test::random_quantized({kE, kI, kD}, 4, 64, 0.05f, Device::cuda);
  w.experts.up = test::random_quantized({kE, kI, kD}, 4, 64, 0.05f, Device::cuda);
  w.experts.down = test::random_quantized({kE, kD, kI}, 4, 64, 0.05f, Device::cuda);
  w.router.top_k = kTopK;
  w.router.proj = test::random_quantized({kE, kD}, 8, 64, 1.0f, Device::cuda);
  w.router.scale = test::from_float(std::vector<float>(kD, 1.0f), {kD}, DType::bf16, Device::cuda);
  std::vector<float> per_expert(kE);
  for (int64_t e = 0; e < kE; ++e) per_expert[e] = 0.5f + float(e % 5) / 5.0f;
  w.router.per_expert_scale = test::from_float(per_expert, {kE}, DType::bf16, Device::cuda);
  return w;
}

struct Case {
  Tensor h, x;                   // on the device, shared read-only by both threads
  std::vector<uint8_t> expected;  // the one-at-a-time output
};

// One call on the calling thread's stream; cuda_check() waits for it and reports device faults.
std::vector<uint8_t> layer_bytes(const Case& c, const MoeWeights& w, Workspace& ws) {
  Tensor out = Tensor::empty({c.h.size(0), kD}, DType::bf16, Device::cuda);
  moe_layer_into(out, c.h, c.x, w, ws);
  cuda_check();
  return out.to_host_bytes();
}

}  // namespace

TEST(GpuConcurrency, TwoThreadsTwoStreamsGiveTheBitsOfOneAtATime) {
  EXPERTQMM_REQUIRE_GPU();
#ifdef EXPERTQMM_HAVE_CUDA
  struct Restore {
    bool on;
    ~Restore() { set_deterministic(on); }
  } restore{deterministic()};
  set_deterministic(true);
  const MoeWeights w = device_layer();
  std::vector<Case> cases;
  for (int64_t T : {1, 5, 64, 300}) {  // T*k 8 and 40: decode layer; 512 and 2400: sorted path
    Case c;
    c.h = test::random_tensor({T, kD}, DType::bf16, 1.0f, Device::cuda);
    c.x = test::random_tensor({T, kD}, DType::bf16, 1.0f, Device::cuda);
    cases.push_back(std::move(c));
  }
  {
    Workspace ws;
    for (Case& c : cases) c.expected = layer_bytes(c, w, ws);
    for (const Case& c : cases)
      ASSERT_EQ(layer_bytes(c, w, ws), c.expected) << "T=" << c.h.size(0) << ": not deterministic on one thread";
  }

  std::atomic<int> streams_set{0};
  std::vector<std::string> failures[2];
  auto worker = [&](int id) {
    try {
      const test::CaptureStream stream;  // this thread's stream, set with set_cuda_stream
      ++streams_set;
      while (streams_set.load() < 2) std::this_thread::yield();  // both threads have set theirs
      if (cuda_stream() != static_cast<void*>(stream.get()))
        failures[id].push_back("the other thread's set_cuda_stream changed this thread's stream");
      Workspace ws;
      for (int r = 0; r < kRounds; ++r)
        for (size_t i = 0; i < cases.size(); ++i) {
          const Case& c = cases[id == 0 ? i : cases.size() - 1 - i];
          if (layer_bytes(c, w, ws) != c.expected)
            failures[id].push_back(detail::cat("round ", r, ", T=", c.h.size(0), ": different bits"));
        }
    } catch (const std::exception& e) {
      failures[id].push_back(e.what());
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  EXPECT_EQ(cuda_stream(), nullptr) << "the threads' streams leaked into the main thread";
  for (int id = 0; id < 2; ++id) {
    std::string all;
    for (size_t i = 0; i < failures[id].size() && i < 10; ++i) all += "\n  " + failures[id][i];
    EXPECT_TRUE(failures[id].empty()) << "thread " << id << ": " << failures[id].size() << " failure(s):" << all;
  }
  cuda_check();
#endif
}

// Probe: the Gemma 4 block's dense linears alone (bench/NOTES.md step 21 and the issue-15 dense
// plan). The block runs its dense MLP as gather_qmm on one weight matrix (x [T, K] @ W^T); this
// times that call by itself, so that a route's cost is not hidden behind the experts it runs beside:
//   T <= 64: the selector (qmv where it takes the rows, several per CTA: kQmvMaxSharedRows and the
//            narrow router's kQmvMaxSharedRowsNarrow; rhs_tiles above) against the one-row kernel (the
//            test hook's qmv_one_row, where qmv takes them): step 21's change in isolation; from T = 2
//            also the tensor-core rhs_tiles pinned, which set those limits (T = 2-8 one by one);
//   T > 64:  the single-matrix form (the selector: rhs_tiles) against the same linear as T rows of
//            one expert (x [T, 1, K], ids all 0, sorted: the expert tile route, wgmma), and pinned
//            to the mma.sync kernel (8-bit: the kernel below kWgmma8BitMinRowsPerExpert).
// Shapes: gate / up [2112, 2816], down [2816, 2112] and the router's projection [128, 2816] (x [1, T, K]
// through gather_qmm in the MoE layer beyond the decode sizes), 8-bit (the QAT upload) and 4-bit (mlx-community's)
// g64, bf16. The bench's protocol pieces (tools/expertqmm/replay_timing.h): one call captured as a graph
// after a warm-up call (so the workspace has grown), a flush of 2 x the L2 before each replay, median
// of 50 replays. Also the 8-bit gate/up/GeGLU at one token as one qmv launch (step 27) against the
// three launches it replaces. Prints JSON. Built as dense_linear_probe with the CUDA build; gpu-check's bench-extra
// runs it (probe-dense-linear.json).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/float16.h"
#include "core/gather_qmm_problem.h"
#include "cuda/gather_qmm.h"
#include "cuda/moe_internal.h"  // launch_glu_product
#include "expertqmm/backend.h"
#include "expertqmm/moe.h"
#include "expertqmm/quant.h"
#include "probe_check.cuh"
#include "probe_weights.h"
#include "replay_timing.h"

namespace timing = expertqmm::timing;
using namespace expertqmm;

namespace {

using probe::device_weight;
using probe::random_bf16;

// Median µs of `call` as a graph replay after an L2 flush.
template <class Call>
double median_us(const timing::DeviceBuffer& flush, Call call) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double us = 0;
  {
    CudaStreamScope scope(0, s);
    call();  // warm-up: the workspace grows here, not under capture
    CHECK(cudaStreamSynchronize(s));
    timing::Graphs g;
    timing::capture_into(g, s, "the dense linear", call);
    CHECK(cudaGraphLaunch(g.execs[0], s));
    us = timing::stats_of(timing::timed_replays(g.execs, 50, s, flush)).median;
  }
  CHECK(cudaStreamDestroy(s));
  return us;
}

}  // namespace

int main() {
  struct LinearShape {
    const char* name;
    int64_t N, K;
  };
  const LinearShape linears[] = {{"gate_up", 2112, 2816}, {"down", 2816, 2112}, {"router", 128, 2816}};
  const int64_t tokens[] = {1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256, 512, 1024, 2048};
  const timing::DeviceBuffer flush(timing::l2_flush_bytes());
  const int64_t max_T = 2048;
  std::vector<int32_t> zeros(max_T, 0);
  const Tensor zero_ids = Tensor::from_host(zeros.data(), {max_T}, DType::i32, Device::cuda);
  std::printf("{\"probe\": \"dense_linear\", \"rows\": [\n");
  bool first = true;
  uint32_t seed = 1;
  for (int bits : {8, 4})
    for (const LinearShape& l : linears) {
      const QuantizedWeight q = device_weight(l.N, l.K, bits, seed++);
      const double weight_mb = double(q.w.nbytes() + q.scales.nbytes() + q.biases.nbytes()) / 1e6;
      const Tensor x = random_bf16({max_T, l.K}, 1.0f, seed++, Device::cuda);
      Tensor out = Tensor::empty({max_T, l.N}, DType::bf16, Device::cuda);
      for (int64_t T : tokens) {
        const detail::GatherQmmProblem single = cuda::single_matrix_problem(x.data(), T, l.K, DType::bf16, q);
        struct Variant {
          const char* form;
          detail::GatherQmmProblem p;
          std::string route;  // empty: the selector
        };
        std::vector<Variant> variants;
        if (T <= 64) {
          variants = {{"single", single, ""}};
          if (cuda::supports_qmv(single).ok) variants.push_back({"single", single, "qmv_one_row"});  // qmv's rows
          if (T >= 2) variants.push_back({"single", single, "rhs_tiles"});
        } else {
          const detail::GatherQmmProblem rows = cuda::one_expert_rows_problem(single, zero_ids.data_as<int32_t>());
          variants = {{"single", single, ""}, {"one_expert_rows", rows, ""}};
          variants.push_back({"one_expert_rows", rows, "expert_tiles_mma_sync"});
        }
        for (const Variant& v : variants) {
          Workspace ws;
          const std::string route = v.route.empty() ? cuda::gather_qmm_selected_route(v.p) : v.route;
          const double us = median_us(flush, [&] {
            if (v.route.empty()) cuda::gather_qmm_into(v.p, out.data(), &ws);
            else cuda::gather_qmm_into_route(v.route, v.p, out.data(), &ws);
          });
          std::printf("%s  {\"linear\": \"%s\", \"bits\": %d, \"N\": %lld, \"K\": %lld, \"tokens\": %lld, "
                      "\"form\": \"%s\", \"route\": \"%s\", \"us_median\": %.2f, \"weight_MB\": %.2f, "
                      "\"weight_GBps\": %.0f, \"tflops\": %.1f}",
                      first ? "" : ",\n", l.name, bits, (long long)l.N, (long long)l.K, (long long)T, v.form,
                      route.c_str(), us, weight_mb, weight_mb * 1e3 / us, 2.0 * T * l.N * l.K / us / 1e6);
          first = false;
        }
      }
    }
  // Gate, up and the GeGLU at one token, 8-bit (the block's dense branch, step 27): one qmv launch with
  // the GeGLU epilogue against the two qmv launches and the GLU product it replaces.
  {
    const QuantizedWeight gate = device_weight(2112, 2816, 8, seed++), up = device_weight(2112, 2816, 8, seed++);
    const Tensor x = random_bf16({1, 2816}, 1.0f, seed++, Device::cuda);
    Tensor g = Tensor::empty({1, 2112}, DType::bf16, Device::cuda);
    Tensor u = Tensor::empty({1, 2112}, DType::bf16, Device::cuda);
    Tensor act = Tensor::empty({1, 2112}, DType::bf16, Device::cuda);
    const detail::GatherQmmProblem pg = cuda::single_matrix_problem(x.data(), 1, 2816, DType::bf16, gate);
    const detail::GatherQmmProblem pu = cuda::single_matrix_problem(x.data(), 1, 2816, DType::bf16, up);
    Workspace ws;
    const double fused = median_us(flush, [&] { cuda::call_qmv_glu(pg, pu, Activation::geglu, act.data()); });
    const double three = median_us(flush, [&] {
      cuda::gather_qmm_into(pg, g.data(), &ws);
      cuda::gather_qmm_into(pu, u.data(), &ws);
      cuda::launch_glu_product(Activation::geglu, ProductMode::fused, DType::bf16, g.data(), u.data(), 1, 2112, 2112,
                               act.data(), nullptr, cuda::current_stream());
    });
    std::printf(",\n  {\"linear\": \"gate_up_glu\", \"bits\": 8, \"N\": 2112, \"K\": 2816, \"tokens\": 1, "
                "\"qmv_glu_us\": %.2f, \"two_qmv_and_glu_us\": %.2f}", fused, three);
  }
  std::printf("\n]}\n");
  return 0;
}

// Probe (issue 15, the block's dense MLP at prefill): the best dense GEMM that exists on this GPU,
// cuBLAS bf16 x bf16 -> bf16 with fp32 accumulation, against our route on the same quantized linears
// (8-bit g64 in the QAT upload, 4-bit in mlx-community's). The block runs its dense MLP on cuBLAS from
// 512 tokens and, where that does not fit, as T rows of one expert on the wgmma tile kernel
// (dense_linear_probe times those). On the same shapes this times (a) the block's cuBLAS call
// (cuda::cublas_linear) on weights already dequantized (the GEMM alone: the limit of a
// dequantize-then-GEMM design), (b) the block's dequantization (cuda::dequantize_for_gemm: one fma
// rounded to bf16 per value, docs/numerics.md) plus that GEMM, in one graph, and (c) the selector's
// route (one_expert_rows) in the same process. Protocol: tools/expertqmm/replay_timing.h (graph
// replay, L2 flushed before each, median of 50). Prints JSON.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/float16.h"
#include "core/gather_qmm_problem.h"
#include "cuda/dense_cublas.h"
#include "cuda/gather_qmm.h"
#include "expertqmm/backend.h"
#include "expertqmm/quant.h"
#include "probe_check.cuh"
#include "probe_weights.h"
#include "replay_timing.h"

namespace timing = expertqmm::timing;
using namespace expertqmm;

namespace {

using probe::device_weight;
using probe::random_bf16;

template <class Call>
double median_us(const timing::DeviceBuffer& flush, cudaStream_t s, Call call) {
  call();  // warm-up (workspaces grow here, not under capture)
  CHECK(cudaStreamSynchronize(s));
  timing::Graphs g;
  timing::capture_into(g, s, "the dense GEMM", call);
  CHECK(cudaGraphLaunch(g.execs[0], s));
  return timing::stats_of(timing::timed_replays(g.execs, 50, s, flush)).median;
}

}  // namespace

int main() {
  struct LinearShape {
    const char* name;
    int64_t N, K;
  };
  const LinearShape linears[] = {{"gate_up", 2112, 2816}, {"gate_and_up", 4224, 2816}, {"down", 2816, 2112}};
  const int64_t tokens[] = {128, 256, 512, 1024, 2048};
  const timing::DeviceBuffer flush(timing::l2_flush_bytes());
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int64_t max_T = 2048;
  std::vector<int32_t> zeros(max_T, 0);
  const Tensor zero_ids = Tensor::from_host(zeros.data(), {max_T}, DType::i32, Device::cuda);
  std::printf("{\"probe\": \"dense_cublas\", \"rows\": [\n");
  bool first = true;
  uint32_t seed = 7;
  for (int bits : {8, 4})
    for (const LinearShape& l : linears) {
      const QuantizedWeight q = device_weight(l.N, l.K, bits, seed++);
      const Tensor x = random_bf16({max_T, l.K}, 1.0f, seed++, Device::cuda);
      Tensor out = Tensor::empty({max_T, l.N}, DType::bf16, Device::cuda);
      Tensor out_ref = Tensor::empty({max_T, l.N}, DType::bf16, Device::cuda);
      Tensor wb = Tensor::empty({l.N, l.K}, DType::bf16, Device::cuda);
      // The block's own dequantization (src/cuda/dense_cublas.cu), so that this row is what the block runs.
      auto dequant = [&] { cuda::dequantize_for_gemm(q, wb.data(), s); };
      dequant();
      CHECK(cudaStreamSynchronize(s));
      for (int64_t T : tokens) {
        double gemm = 0, both = 0, dq = 0, route_us = 0;
        {
          CudaStreamScope scope(0, s);
          // The block's own cuBLAS call (its handle and its workspace slot), as the dequantization above.
          Workspace gemm_ws;
          auto gemm_call = [&] {
            cuda::cublas_linear(DType::bf16, wb.data(), x.data(), l.K, out.data(), l.N, T, l.N, l.K, gemm_ws, s);
          };
          gemm = median_us(flush, s, gemm_call);
          both = median_us(flush, s, [&] {
            dequant();
            gemm_call();
          });
          dq = median_us(flush, s, dequant);
          const detail::GatherQmmProblem single = cuda::single_matrix_problem(x.data(), T, l.K, DType::bf16, q);
          const detail::GatherQmmProblem rows = cuda::one_expert_rows_problem(single, zero_ids.data_as<int32_t>());
          Workspace ws;
          route_us = median_us(flush, s, [&] { cuda::gather_qmm_into(rows, out_ref.data(), &ws); });
        }
        // Agreement of the two outputs (both bf16; differences: summation order, one rounding).
        std::vector<uint16_t> a(size_t(T * l.N)), b(size_t(T * l.N));
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaMemcpy(a.data(), out.data(), a.size() * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(b.data(), out_ref.data(), b.size() * 2, cudaMemcpyDeviceToHost));
        double num = 0, den = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          const double d = double(bf16_to_float(a[i])) - bf16_to_float(b[i]);
          num += d * d;
          den += double(bf16_to_float(b[i])) * bf16_to_float(b[i]);
        }
        std::printf("%s  {\"linear\": \"%s\", \"bits\": %d, \"N\": %lld, \"K\": %lld, \"tokens\": %lld, "
                    "\"cublas_gemm_us\": %.2f, \"dequant_us\": %.2f, \"dequant_and_cublas_us\": %.2f, "
                    "\"one_expert_rows_us\": %.2f, \"route\": \"%s\", \"cublas_tflops\": %.1f, "
                    "\"rel_diff\": %.2e}",
                    first ? "" : ",\n", l.name, bits, (long long)l.N, (long long)l.K, (long long)T, gemm, dq, both,
                    route_us,
                    cuda::gather_qmm_selected_route(cuda::one_expert_rows_problem(
                        cuda::single_matrix_problem(x.data(), T, l.K, DType::bf16, q), zero_ids.data_as<int32_t>()))
                        .c_str(),
                    2.0 * T * l.N * l.K / gemm / 1e6, std::sqrt(num / (den > 0 ? den : 1)));
        first = false;
      }
    }
  std::printf("\n]}\n");
  CHECK(cudaStreamDestroy(s));
  return 0;
}

// Probe: what a kernel's own code costs when it is fetched cold (bench/NOTES.md steps 17-18). The
// decode-size kernels run one CTA per row (the block's norms) or one wave of CTAs (the router), and
// their SASS was 70-105 KB; between two calls of the same layer kernel the weights stream 45 MB
// through the L2, so their code comes from HBM every time. This probe separates fetching from
// executing: the same number of executed FFMA instructions (N, in 8 independent chains, no memory
// access) either as straight-line code (N * 16 bytes of SASS) or as a loop over a 64-instruction body
// (~1 KB), launched as one CTA of 192 threads (the exit kernel's shape at Gemma 4's H) and as 128 CTAs
// of 256 threads (the router's), each cold (a memset of 2 x the L2 before each replay: the L2 holds none of
// the code) and warm (no memset). If fetching the code is what those kernels pay, the straight-line
// cold time grows with N * 16 bytes far above the loop's.
//
// Measured with the bench's own protocol pieces (tools/expertqmm/replay_timing.h: graph capture, timed
// replays behind host gates, a flush of 2 x the L2 before each cold replay); median of 60 replays.
// Prints JSON. Built as code_fetch_probe with the CUDA build.
#include <cuda_runtime.h>

#include <cstdio>

#include "probe_check.cuh"
#include "replay_timing.h"

namespace timing = expertqmm::timing;

constexpr int kBody = 64;  // FFMA per loop trip (8 chains x 8)

// 8 independent FFMA chains, kBody instructions, kept by asm volatile (no folding, no reordering).
__device__ __forceinline__ void body(float (&a)[8], float c) {
#pragma unroll
  for (int i = 0; i < kBody; ++i) asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(a[i % 8]) : "f"(c));
}

// kStraight: N / kBody bodies unrolled (N * 16 bytes of code); else a loop of N / kBody trips.
template <int N, bool kStraight>
__global__ void fma_kernel(float* out, float c) {
  float a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = static_cast<float>(threadIdx.x + i);
  if constexpr (kStraight) {
#pragma unroll
    for (int r = 0; r < N / kBody; ++r) body(a, c);
  } else {
#pragma unroll 1
    for (int r = 0; r < N / kBody; ++r) body(a, c);
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += a[i];
  if (s == 12345.f) out[threadIdx.x] = s;  // keeps the chains live; never true for these inputs
}

// Median µs of 60 replays of launch(stream) as a graph, each after a memset of `flush` (cold: 2 x the
// L2; warm: 16 bytes, so both rows carry the same memset node).
template <class Launch>
double median_us(const timing::DeviceBuffer& flush, Launch launch) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double us = 0;
  {
    timing::Graphs g;
    timing::capture_into(g, s, "the code-fetch kernel", [&] { launch(s); });
    CHECK(cudaGraphLaunch(g.execs[0], s));  // warm-up replay
    us = timing::stats_of(timing::timed_replays(g.execs, 60, s, flush)).median;
  }
  CHECK(cudaStreamDestroy(s));
  return us;
}

template <int N>
void row(float* out, const timing::DeviceBuffer (&flush)[2], bool& first) {
  struct Shape {
    const char* name;
    int ctas, threads;
  };
  const Shape shapes[] = {{"1x192", 1, 192}, {"128x256", 128, 256}};
  for (const Shape& sh : shapes) {
    double us[2][2];  // [straight?][cold?]
    for (int straight = 0; straight < 2; ++straight)
      for (int cold = 0; cold < 2; ++cold)
        us[straight][cold] = median_us(flush[cold], [&](cudaStream_t s) {
          if (straight) fma_kernel<N, true><<<sh.ctas, sh.threads, 0, s>>>(out, 1.0001f);
          else fma_kernel<N, false><<<sh.ctas, sh.threads, 0, s>>>(out, 1.0001f);
          CHECK(cudaGetLastError());
        });
    std::printf("%s  {\"ffma\": %d, \"straight_code_KB\": %.0f, \"shape\": \"%s\", \"straight_cold_us\": %.2f, "
                "\"straight_warm_us\": %.2f, \"loop_cold_us\": %.2f, \"loop_warm_us\": %.2f}",
                first ? "" : ",\n", N, N * 16 / 1024.0, sh.name, us[1][1], us[1][0], us[0][1], us[0][0]);
    first = false;
  }
}

int main() {
  float* out;
  CHECK(cudaMalloc(&out, 1024 * sizeof(float)));
  const timing::DeviceBuffer flush[2] = {timing::DeviceBuffer(16), timing::DeviceBuffer(timing::l2_flush_bytes())};
  std::printf("{\"probe\": \"code_fetch\", \"rows\": [\n");
  bool first = true;
  row<1024>(out, flush, first);
  row<2048>(out, flush, first);
  row<4096>(out, flush, first);
  row<8192>(out, flush, first);
  std::printf("\n]}\n");
  return 0;
}

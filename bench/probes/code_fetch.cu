// Probe: what a kernel's own code costs when it is fetched cold (bench/NOTES.md steps 17-18). The
// decode-size kernels run one CTA per row (the block's norms) or one wave of CTAs (the router), and
// their SASS was 70-105 KB; between two calls of the same layer kernel the weights stream 45 MB
// through the L2, so their code comes from HBM every time. This probe separates fetching from
// executing: the same number of executed FFMA instructions (N, in 8 independent chains, no memory
// access) either as straight-line code (N * 16 bytes of SASS) or as a loop over a 64-instruction body
// (~1 KB), launched as one CTA of 192 threads (the exit kernel's shape at Gemma 4's H) and as 128 CTAs
// of 256 threads (the router's), each cold (a 256 MB memset before each replay: the L2 holds none of
// the code) and warm (no memset). If fetching the code is what those kernels pay, the straight-line
// cold time grows with N * 16 bytes far above the loop's.
//
// Measured like decode_chain (bench/README.md): CUDA graph replays, the time between events around
// the graph launch only; median of 60 replays. Prints JSON. Built as code_fetch_probe with the CUDA build.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "probe_check.cuh"

constexpr size_t kFlushBytes = size_t{256} << 20;
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

template <class Launch>
double time_graph(float* flush, bool cold, Launch launch, int replays) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  launch(s);
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < replays + 3; ++r) {
    if (cold) CHECK(cudaMemsetAsync(flush, r & 0xff, kFlushBytes, s));
    CHECK(cudaEventRecord(e0, s));
    CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (r >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  CHECK(cudaStreamDestroy(s));
  return ms[ms.size() / 2] * 1e3;
}

template <int N>
void row(float* out, float* flush, bool& first) {
  struct Shape {
    const char* name;
    int ctas, threads;
  };
  const Shape shapes[] = {{"1x192", 1, 192}, {"128x256", 128, 256}};
  for (const Shape& sh : shapes) {
    double us[2][2];  // [straight?][cold?]
    for (int straight = 0; straight < 2; ++straight)
      for (int cold = 0; cold < 2; ++cold)
        us[straight][cold] = time_graph(flush, cold, [&](cudaStream_t s) {
          if (straight) fma_kernel<N, true><<<sh.ctas, sh.threads, 0, s>>>(out, 1.0001f);
          else fma_kernel<N, false><<<sh.ctas, sh.threads, 0, s>>>(out, 1.0001f);
          CHECK(cudaGetLastError());
        }, 60);
    std::printf("%s  {\"ffma\": %d, \"straight_code_KB\": %.0f, \"shape\": \"%s\", \"straight_cold_us\": %.2f, "
                "\"straight_warm_us\": %.2f, \"loop_cold_us\": %.2f, \"loop_warm_us\": %.2f}",
                first ? "" : ",\n", N, N * 16 / 1024.0, sh.name, us[1][1], us[1][0], us[0][1], us[0][0]);
    first = false;
  }
}

int main() {
  float *out, *flush;
  CHECK(cudaMalloc(&out, 1024 * sizeof(float)));
  CHECK(cudaMalloc(&flush, kFlushBytes));
  std::printf("{\"probe\": \"code_fetch\", \"rows\": [\n");
  bool first = true;
  row<1024>(out, flush, first);
  row<2048>(out, flush, first);
  row<4096>(out, flush, first);
  row<8192>(out, flush, first);
  std::printf("\n]}\n");
  return 0;
}

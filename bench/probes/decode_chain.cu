// Probe: the least a one-token (T=1) Gemma 4 26B-A4B expert layer can take on this GPU when it is
// built as the dependent chain every implementation has: route (read the router weights, pick the
// top 8 experts) -> gate/up (stream the 8 chosen experts' gate and up weights) -> down (stream
// their down weights). Each kernel here does only that: 16-byte loads of exactly the bytes the real
// layer must read (4-bit codes plus a bf16 scale and bias per 64 weights; the 8-bit router), all
// issued before any is used, a token amount of math, and the dependent reads of the previous step's
// output (expert ids, hidden row). No dequantization, no mma. A real layer cannot be faster than
// this chain unless it overlaps the phases, which the dependency (ids before weights) forbids.
//
// Measured like the bench (bench/README.md): CUDA graph replays, a 256 MB memset before each replay
// so the weights come from HBM, the time between events around the graph launch only; median of
// 60 replays. Prints JSON. Built as decode_chain_probe with the CUDA build.
//
// Shapes: H = 2816, I = 704, E = 128, top-8. Buffers (bytes):
//   router_w (E, H) int8 codes + (E, H/64) scale/bias pairs;  x (H,) bf16
//   gate_up  (E, 2I, H/2) codes, then (E, 2I, H/64) 4-byte scale/bias pairs
//   down     (E, H, I/2) codes, then (E, H, I/64) pairs
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.cuh"

constexpr int kH = 2816, kI = 704, kE = 128, kTopK = 8;
constexpr int kThreads = 128;
constexpr int kRowsGateUp = 16;  // rows per CTA: 16 x 1408 B of codes = 22 KB
constexpr int kRowsDown = 64;    // rows per CTA: 64 x 352 B = 22 KB
constexpr size_t kGateUpCodes = size_t{kE} * 2 * kI * kH / 2, kGateUpParams = size_t{kE} * 2 * kI * (kH / 64) * 4;
constexpr size_t kDownCodes = size_t{kE} * kH * kI / 2, kDownParams = size_t{kE} * kH * (kI / 64) * 4;

// Sums 16 bytes so the loads cannot be dropped (the "math").
__device__ __forceinline__ uint32_t fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// Grid E, 256 threads: CTA e reads x and router row e (plus its 44 scale/bias pairs), writes a
// logit; the last CTA to finish picks the top 8 (8 rounds of a warp argmax) and resets the counter.
__global__ void route(const uint4* __restrict__ x, const uint4* __restrict__ w, const uint32_t* __restrict__ params,
                      float* __restrict__ logits, unsigned* __restrict__ done, int* __restrict__ ids) {
  __shared__ float warp_sum[8];
  __shared__ bool last;
  const int e = blockIdx.x, t = threadIdx.x;
  float acc = 0.f;
  if (t < kH / 16) {  // 176 threads: 16 codes and 16 activations each
    const uint4 c = w[e * (kH / 16) + t];
    const uint4 a = x[2 * t], b = x[2 * t + 1];
    acc = static_cast<float>(fold(c) & 0xff) * __uint_as_float((fold(a) ^ fold(b)) & 0x3f800000u);
  }
  if (t < kH / 64) acc += __uint_as_float(params[e * (kH / 64) + t] & 0x3f800000u);
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((t & 31) == 0) warp_sum[t >> 5] = acc;
  __syncthreads();
  if (t == 0) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += warp_sum[i];
    logits[e] = s + static_cast<float>((e * 2654435761u) >> 8);  // distinct, pseudo-random order
    __threadfence();
    last = atomicAdd(done, 1u) == kE - 1;
  }
  __syncthreads();
  if (!last || t >= 32) return;
  __threadfence();
  float v[kE / 32];
  for (int i = 0; i < kE / 32; ++i) v[i] = logits[t + 32 * i];
  for (int k = 0; k < kTopK; ++k) {
    float best = -1e30f;
    int arg = 0;
    for (int i = 0; i < kE / 32; ++i)
      if (v[i] > best) best = v[i], arg = t + 32 * i;
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
      if (ob > best || (ob == best && oa < arg)) best = ob, arg = oa;
    }
    if (t == 0) ids[k] = arg;
    if ((arg & 31) == t) v[arg >> 5] = -1e30f;
  }
  if (t == 0) *done = 0;
}

// Grid (rows / kRows, 8): CTA (b, j) streams rows b*kRows .. +kRows of expert ids[j] (row_bytes
// of codes each, then their scale/bias pairs), reads its slice of `in` (the previous output), and
// writes one value per row. All of a thread's loads are issued before any is used.
template <int kRows, int kRowBytes, int kTotalRows>
__global__ void __launch_bounds__(kThreads) stream_expert(const uint8_t* __restrict__ codes, const uint32_t* __restrict__ params,
                                                          const int* __restrict__ ids, const float* __restrict__ in,
                                                          float* __restrict__ out) {
  constexpr int kChunks = kRows * kRowBytes / 16, kPer = (kChunks + kThreads - 1) / kThreads;
  constexpr int kGroups = kRowBytes * 2 / 64;  // scale/bias pairs per row
  const int j = blockIdx.y, t = threadIdx.x;
  const int e = ids[j];
  const size_t row0 = static_cast<size_t>(e) * kTotalRows + static_cast<size_t>(blockIdx.x) * kRows;
  const uint4* src = reinterpret_cast<const uint4*>(codes + row0 * kRowBytes);
  uint4 v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = t + i * kThreads;
    v[i] = c < kChunks ? src[c] : make_uint4(0, 0, 0, 0);
  }
  uint32_t p = 0;
  for (int c = t; c < kRows * kGroups; c += kThreads) p ^= params[row0 * kGroups + c];
  const float a = in[(t * 16) % 1408 + j];
  uint32_t s = p;
#pragma unroll
  for (int i = 0; i < kPer; ++i) s ^= fold(v[i]);
  const float r = __uint_as_float(s & 0x3f800000u) * a;
  if (t < kRows) out[j * kTotalRows + blockIdx.x * kRows + t] = r;
}

__global__ void empty_kernel() {}

struct Buffers {
  uint4 *x, *router_w;
  uint32_t* router_params;
  float *logits, *hidden, *y, *in0;
  unsigned* done;
  int* ids;
  uint8_t *gate_up, *down;
  void* flush;
};
constexpr size_t kFlushBytes = size_t{256} << 20;

void launch_route(const Buffers& b, cudaStream_t s) {
  route<<<kE, 256, 0, s>>>(b.x, b.router_w, b.router_params, b.logits, b.done, b.ids);
}
void launch_gate_up(const Buffers& b, cudaStream_t s) {
  stream_expert<kRowsGateUp, kH / 2, 2 * kI><<<dim3(2 * kI / kRowsGateUp, kTopK), kThreads, 0, s>>>(
      b.gate_up, reinterpret_cast<const uint32_t*>(b.gate_up + kGateUpCodes), b.ids, b.in0, b.hidden);
}
void launch_down(const Buffers& b, cudaStream_t s) {
  stream_expert<kRowsDown, kI / 2, kH><<<dim3(kH / kRowsDown, kTopK), kThreads, 0, s>>>(
      b.down, reinterpret_cast<const uint32_t*>(b.down + kDownCodes), b.ids, b.hidden, b.y);
}

// Median µs of `replays` graph replays of `record`, each after a 256 MB memset (cold L2).
template <class Record>
double time_graph(const Buffers& b, Record record, int replays) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  record(s);
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < replays + 3; ++r) {
    CHECK(cudaMemsetAsync(b.flush, r & 0xff, kFlushBytes, s));
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
  CHECK(cudaStreamDestroy(s));
  return ms[ms.size() / 2] * 1e3;
}

int main() {
  Buffers b{};
  CHECK(cudaMalloc(&b.x, kH * 2));
  CHECK(cudaMalloc(&b.router_w, size_t{kE} * kH));
  CHECK(cudaMalloc(&b.router_params, size_t{kE} * (kH / 64) * 4));
  CHECK(cudaMalloc(&b.logits, kE * 4));
  CHECK(cudaMalloc(&b.hidden, kTopK * 2 * kI * 4));
  CHECK(cudaMalloc(&b.y, kTopK * kH * 4));
  CHECK(cudaMalloc(&b.in0, 2 * kI * 4 + 64));
  CHECK(cudaMalloc(&b.done, 4));
  CHECK(cudaMalloc(&b.ids, kTopK * 4));
  CHECK(cudaMalloc(&b.gate_up, kGateUpCodes + kGateUpParams));
  CHECK(cudaMalloc(&b.down, kDownCodes + kDownParams));
  CHECK(cudaMalloc(&b.flush, kFlushBytes));
  CHECK(cudaMemset(b.x, 0x3c, kH * 2));
  CHECK(cudaMemset(b.router_w, 0x11, size_t{kE} * kH));
  CHECK(cudaMemset(b.router_params, 0x3f, size_t{kE} * (kH / 64) * 4));
  CHECK(cudaMemset(b.gate_up, 0x5a, kGateUpCodes + kGateUpParams));
  CHECK(cudaMemset(b.down, 0xa5, kDownCodes + kDownParams));
  CHECK(cudaMemset(b.in0, 0, 2 * kI * 4 + 64));
  CHECK(cudaMemset(b.hidden, 0, kTopK * 2 * kI * 4));
  CHECK(cudaMemset(b.done, 0, 4));
  CHECK(cudaMemset(b.ids, 0, kTopK * 4));
  const int replays = 60;
  const double chain = time_graph(b, [&](cudaStream_t s) { launch_route(b, s); launch_gate_up(b, s); launch_down(b, s); }, replays);
  const double experts = time_graph(b, [&](cudaStream_t s) { launch_gate_up(b, s); launch_down(b, s); }, replays);
  const double route_only = time_graph(b, [&](cudaStream_t s) { launch_route(b, s); }, replays);
  const double gate_up_only = time_graph(b, [&](cudaStream_t s) { launch_gate_up(b, s); }, replays);
  const double down_only = time_graph(b, [&](cudaStream_t s) { launch_down(b, s); }, replays);
  // Both weight streams at once (no dependency between them): the best a layer could do if down
  // did not need gate/up's output; a fork-join in the captured graph.
  cudaStream_t side;
  cudaEvent_t fork, join;
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  const double parallel = time_graph(b, [&](cudaStream_t s) {
    CHECK(cudaEventRecord(fork, s));
    CHECK(cudaStreamWaitEvent(side, fork, 0));
    launch_gate_up(b, s);
    launch_down(b, side);
    CHECK(cudaEventRecord(join, side));
    CHECK(cudaStreamWaitEvent(s, join, 0));
  }, replays);
  // What the measurement itself costs: a graph of one, and of three, empty kernels.
  const double empty1 = time_graph(b, [&](cudaStream_t s) { empty_kernel<<<1, 32, 0, s>>>(); }, replays);
  const double empty3 = time_graph(b, [&](cudaStream_t s) {
    for (int i = 0; i < 3; ++i) empty_kernel<<<1, 32, 0, s>>>();
  }, replays);
  int ids[kTopK];
  CHECK(cudaMemcpy(ids, b.ids, sizeof(ids), cudaMemcpyDeviceToHost));
  const double expert_bytes = kTopK * (double(kGateUpCodes + kGateUpParams) + double(kDownCodes + kDownParams)) / kE;
  std::printf("{\"probe\": \"decode_chain\", \"tokens\": 1, \"expert_MB\": %.2f, \"router_MB\": %.2f,\n", expert_bytes / 1e6,
              (double(kE) * kH + kE * (kH / 64) * 4) / 1e6);
  std::printf(" \"median_us\": {\"route+gate_up+down\": %.2f, \"gate_up+down\": %.2f, \"route\": %.2f, \"gate_up\": %.2f, "
              "\"down\": %.2f, \"gate_up || down\": %.2f, \"one empty kernel\": %.2f, \"three empty kernels\": %.2f},\n", chain, experts,
              route_only, gate_up_only, down_only, parallel, empty1, empty3);
  std::printf(" \"ids\": [%d, %d, %d, %d, %d, %d, %d, %d]}\n", ids[0], ids[1], ids[2], ids[3], ids[4], ids[5], ids[6], ids[7]);
  return 0;
}

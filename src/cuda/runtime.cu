// Device memory (a caching allocator: freed blocks return to per-size free lists, so steady-state
// calls never reach cudaMalloc/cudaFree), device queries and the fault record.
#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <string>
#include <unordered_map>

#include "core/device_memory.h"
#include "cuda/runtime.cuh"

namespace expertqmm::detail {

namespace {
struct Pool {
  std::mutex mu;
  std::multimap<size_t, void*> free_blocks;      // size -> block
  std::unordered_map<void*, size_t> live;        // block -> size
};
Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: tensors may outlive static destruction
  return *p;
}
size_t round_size(size_t n) {
  if (n <= 512) return 512;
  size_t r = 512;
  while (r < n && r < (size_t(1) << 24)) r <<= 1;
  if (r >= n) return r;
  return (n + (size_t(1) << 21) - 1) & ~((size_t(1) << 21) - 1);  // 2 MiB steps above 16 MiB
}
}  // namespace

void* device_alloc(size_t bytes) {
  Pool& p = pool();
  size_t want = round_size(bytes);
  std::lock_guard<std::mutex> lock(p.mu);
  auto it = p.free_blocks.find(want);
  if (it != p.free_blocks.end()) {
    void* ptr = it->second;
    p.free_blocks.erase(it);
    p.live[ptr] = want;
    return ptr;
  }
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, want);
  if (err != cudaSuccess) {
    cudaGetLastError();
    // Give cached blocks back and try once more before failing.
    for (auto& kv : p.free_blocks) cudaFree(kv.second);
    p.free_blocks.clear();
    err = cudaMalloc(&ptr, want);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw Error("device_alloc", cat("cudaMalloc of ", want, " bytes failed: ", cudaGetErrorString(err)));
    }
  }
  p.live[ptr] = want;
  return ptr;
}

void device_free(void* ptr) {
  if (!ptr) return;
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  auto it = p.live.find(ptr);
  if (it == p.live.end()) return;
  p.free_blocks.emplace(it->second, ptr);
  p.live.erase(it);
}

void copy_host_to_device(void* dst, const void* src, size_t bytes) {
  cudaStream_t s = cuda::current_stream();
  EXPERTQMM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(s));  // src is pageable and may die after return
}

void copy_device_to_host(void* dst, const void* src, size_t bytes) {
  cudaStream_t s = cuda::current_stream();
  EXPERTQMM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(s));
  device_check();
}

void copy_device_to_device(void* dst, const void* src, size_t bytes) {
  EXPERTQMM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda::current_stream()));
}

void device_zero(void* dst, size_t bytes) {
  EXPERTQMM_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, cuda::current_stream()));
}

bool device_usable() {
  static const bool usable = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return n > 0;
  }();
  return usable;
}

int device_exchange(int device) {
  int previous = 0;
  EXPERTQMM_CUDA_CHECK(cudaGetDevice(&previous));
  if (previous != device) {
    const cudaError_t e = cudaSetDevice(device);
    EXPERTQMM_CHECK(e == cudaSuccess, "cuda", "cudaSetDevice(", device, "): ", cudaGetErrorString(e));
  }
  return previous;
}

const char* device_description() {
  static const std::string name = [] {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
      cudaGetLastError();
      return std::string();
    }
    return std::string(prop.name);
  }();
  return name.c_str();
}

void device_check() {
  cudaStream_t s = cuda::current_stream();
  EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(s));
  uint32_t host[3];
  uint32_t* dev = cuda::device_faults();
  EXPERTQMM_CUDA_CHECK(cudaMemcpy(host, dev, sizeof(host), cudaMemcpyDeviceToHost));
  if (host[0] == cuda::kFaultNone) return;
  EXPERTQMM_CUDA_CHECK(cudaMemset(dev, 0, sizeof(host)));
  if (host[0] == cuda::kFaultExpertOutOfRange)
    throw Error("cuda_check", cat("a kernel saw expert id ", static_cast<int32_t>(host[1]),
                                  " out of range [0, ", host[2], "); the affected rows were not computed"));
  throw Error("cuda_check", cat("a kernel saw index ", static_cast<int32_t>(host[1]), " out of range [0, ",
                                host[2], ")"));
}

}  // namespace expertqmm::detail

namespace expertqmm::cuda {

uint32_t* device_faults() {
  static uint32_t* faults = [] {
    uint32_t* p = nullptr;
    EXPERTQMM_CUDA_CHECK(cudaMalloc(&p, 4 * sizeof(uint32_t)));
    EXPERTQMM_CUDA_CHECK(cudaMemset(p, 0, 4 * sizeof(uint32_t)));
    return p;
  }();
  return faults;
}

bool chained_launch_available() {
  // Asked at every chained launch: the compute capability is read once per device.
  constexpr int kDevices = 64;
  static std::atomic<int8_t> known[kDevices] = {};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  EXPERTQMM_CUDA_CHECK(cudaGetDevice(&device));
  if (device < kDevices && known[device].load(std::memory_order_relaxed) != 0) return known[device].load() == 2;
  int major = 0;
  EXPERTQMM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (device < kDevices) known[device].store(major >= 9 ? 2 : 1, std::memory_order_relaxed);
  return major >= 9;
}

}  // namespace expertqmm::cuda

namespace expertqmm::cuda {

namespace {

unsigned long long* retraction_counters() {  // one per primitive, zeroed once
  static unsigned long long* counters = [] {
    unsigned long long* p = nullptr;
    EXPERTQMM_CUDA_CHECK(cudaMalloc(&p, detail::kPrimitiveCount * sizeof(unsigned long long)));
    EXPERTQMM_CUDA_CHECK(cudaMemset(p, 0, detail::kPrimitiveCount * sizeof(unsigned long long)));
    return p;
  }();
  return counters;
}

uint64_t read_retractions(int primitive, bool reset) {
  unsigned long long v = 0;
  unsigned long long* counter = retraction_counters() + primitive;
  EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
  EXPERTQMM_CUDA_CHECK(cudaMemcpy(&v, counter, sizeof(v), cudaMemcpyDeviceToHost));
  if (reset) EXPERTQMM_CUDA_CHECK(cudaMemset(counter, 0, sizeof(v)));
  return v;
}
template <int P>
uint64_t read_retractions(bool reset) {
  return read_retractions(P, reset);
}

// One reader per primitive, read_retractions<0> .. <kPrimitiveCount - 1>.
template <int... P>
constexpr std::array<detail::DeviceRetractionReader, sizeof...(P)> readers_of(std::integer_sequence<int, P...>) {
  return {read_retractions<P>...};
}
constexpr auto kReaders = readers_of(std::make_integer_sequence<int, detail::kPrimitiveCount>{});

}  // namespace

unsigned long long* retraction_counter(detail::Primitive p) {
  static std::once_flag registered[detail::kPrimitiveCount];
  const int i = static_cast<int>(p);
  std::call_once(registered[i], [&] { detail::set_device_retraction_reader(kReaders[i], p); });
  return retraction_counters() + i;
}

uint64_t device_retractions(detail::Primitive p) {
  retraction_counter(p);  // registers the reader, so that diagnostics::reset() zeroes the count
  return read_retractions(static_cast<int>(p), false);
}

}  // namespace expertqmm::cuda

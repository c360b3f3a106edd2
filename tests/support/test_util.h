// Helpers shared by the CPU and GPU tests: random tensors, float views, error norms, GPU skip.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "expertqmm/backend.h"
#include "expertqmm/error.h"
#include "expertqmm/moe.h"

namespace expertqmm::test {

// Fresh seed per process unless EXPERTQMM_TEST_SEED is set; printed on failure via seed_note().
uint64_t test_seed();
std::string seed_note();
std::mt19937_64& rng();

// Random normal values * scale, stored in dtype (bf16/f16/f32), on `device`.
Tensor random_tensor(const Shape& shape, DType dtype, float scale = 1.0f, Device device = Device::cpu);
// Random integer ids in [0, limit) as int32.
Tensor random_ids(const Shape& shape, int64_t limit, Device device = Device::cpu);
// Tensor of the given int32 values.
Tensor ids_tensor(const std::vector<int32_t>& v, const Shape& shape, Device device = Device::cpu);
// All elements as float (any float dtype, any device).
std::vector<float> to_float(const Tensor& t);
std::vector<int32_t> to_i32(const Tensor& t);
// Float values into a new tensor of dtype on device.
Tensor from_float(const std::vector<float>& v, const Shape& shape, DType dtype, Device device = Device::cpu);
// Fills a device or host tensor with a poison pattern (0xFF bytes: NaN for every float dtype).
void poison(Tensor& t);

// ||a - b|| / ||b|| in float64; +inf if any element of a is NaN or Inf while b's is finite.
double rel_error(const std::vector<float>& a, const std::vector<float>& b);
double rel_error(const std::vector<float>& a, const std::vector<double>& b);

// A quantized random weight [E..., N, K] (bf16 scales; uint8 for an fp mode, whose own bits and
// group size then apply) built by the CPU quantizer.
QuantizedWeight random_quantized(const Shape& shape, int bits, int group_size, float scale = 0.05f,
                                 Device device = Device::cpu, QuantMode mode = QuantMode::affine);
QuantizedWeight to_device(const QuantizedWeight& q, Device device);

// make(), drawn from rng() seeded by the test seed and `key` (rng()'s own state is restored after):
// the same values for every caller of the same key, alone or after others. The last value of each
// call site is kept for its next call with that key, so consecutive table rows on one weight build
// it once. Never freed: a static destructor would free device memory after CUDA has shut down.
template <class Make>
const auto& built_once(const std::string& key, Make make) {
  using T = decltype(make());
  static std::string last_key;
  static T* last = nullptr;
  if (last == nullptr || key != last_key) {
    delete last;
    last = nullptr;
    const std::mt19937_64 saved = rng();
    rng().seed(test_seed() ^ std::hash<std::string>{}(key));
    last = new T(make());
    rng() = saved;
    last_key = key;
  }
  return *last;
}

// Runs f, expecting an Error raised by `op` whose message holds `part`.
template <class F>
void expect_error(F&& f, const std::string& op, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected " << op << " error mentioning '" << part << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), op) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

}  // namespace expertqmm::test

// In GPU tests: skip (never pass) when no CUDA device is usable.
#define EXPERTQMM_REQUIRE_GPU()                                              \
  do {                                                                       \
    if (!::expertqmm::cuda_available()) GTEST_SKIP() << "SKIP: no CUDA device"; \
  } while (0)

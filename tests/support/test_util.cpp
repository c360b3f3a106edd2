#include "support/test_util.h"

#include "core/settings.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/device_memory.h"
#include "core/float16.h"

namespace expertqmm::test {

uint64_t test_seed() {
  static const uint64_t seed = []() -> uint64_t {
    if (const auto s = detail::environment_variable("EXPERTQMM_TEST_SEED")) return std::strtoull(s->c_str(), nullptr, 10);
    return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  return seed;
}

std::string seed_note() { return "EXPERTQMM_TEST_SEED=" + std::to_string(test_seed()); }

std::mt19937_64& rng() {
  static std::mt19937_64 g(test_seed());
  return g;
}

static uint16_t to_half_bits(float f, DType t) { return t == DType::bf16 ? float_to_bf16(f) : float_to_f16(f); }

Tensor from_float(const std::vector<float>& v, const Shape& shape, DType dtype, Device device) {
  std::vector<uint8_t> bytes(v.size() * dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::f32) {
      std::memcpy(bytes.data() + 4 * i, &v[i], 4);
    } else {
      uint16_t h = to_half_bits(v[i], dtype);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return Tensor::from_host(bytes.data(), shape, dtype, device);
}

Tensor random_tensor(const Shape& shape, DType dtype, float scale, Device device) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(shape_numel(shape));
  for (float& f : v) f = nd(rng()) * scale;
  return from_float(v, shape, dtype, device);
}

Tensor random_ids(const Shape& shape, int64_t limit, Device device) {
  std::uniform_int_distribution<int64_t> ud(0, limit - 1);
  std::vector<int32_t> v(shape_numel(shape));
  for (int32_t& i : v) i = static_cast<int32_t>(ud(rng()));
  return ids_tensor(v, shape, device);
}

Tensor ids_tensor(const std::vector<int32_t>& v, const Shape& shape, Device device) {
  return Tensor::from_host(v.data(), shape, DType::i32, device);
}

std::vector<float> to_float(const Tensor& t) {
  std::vector<uint8_t> b = t.to_host_bytes();
  std::vector<float> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint16_t h;
    switch (t.dtype()) {
      case DType::f32: std::memcpy(&out[i], b.data() + 4 * i, 4); break;
      case DType::bf16: std::memcpy(&h, b.data() + 2 * i, 2); out[i] = bf16_to_float(h); break;
      case DType::f16: std::memcpy(&h, b.data() + 2 * i, 2); out[i] = f16_to_float(h); break;
      default: {
        int32_t v;
        std::memcpy(&v, b.data() + 4 * i, 4);
        out[i] = static_cast<float>(v);
      }
    }
  }
  return out;
}

std::vector<int32_t> to_i32(const Tensor& t) {
  std::vector<uint8_t> b = t.to_host_bytes();
  std::vector<int32_t> out(t.numel());
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}

void poison(Tensor& t) {
  std::vector<uint8_t> bytes(t.nbytes(), 0xFF);
  if (bytes.empty()) return;
  if (t.device() == Device::cpu) std::memcpy(t.data(), bytes.data(), bytes.size());
  else detail::copy_host_to_device(t.data(), bytes.data(), bytes.size());
}

template <class Ref>
static double rel_error_impl(const std::vector<float>& a, const std::vector<Ref>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double r = static_cast<double>(b[i]);
    double x = static_cast<double>(a[i]);
    if (std::isfinite(r) && !std::isfinite(x)) return INFINITY;
    if (std::isnan(x) != std::isnan(r)) return INFINITY;
    if (!std::isfinite(r)) continue;
    num += (x - r) * (x - r);
    den += r * r;
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) { return rel_error_impl(a, b); }
double rel_error(const std::vector<float>& a, const std::vector<double>& b) { return rel_error_impl(a, b); }

QuantizedWeight random_quantized(const Shape& shape, int bits, int group_size, float scale, Device device,
                                 QuantMode mode) {
  Tensor w = random_tensor(shape, DType::bf16, scale, Device::cpu);
  QuantizedWeight q = quantize(w, mode == QuantMode::affine ? QuantSpec{bits, group_size, Rounding::cpu}
                                                            : default_quant_spec(mode));
  return to_device(q, device);
}

QuantizedWeight to_device(const QuantizedWeight& q, Device device) {
  QuantizedWeight r = q;
  r.w = q.w.to(device);
  r.scales = q.scales.to(device);
  if (q.biases.defined()) r.biases = q.biases.to(device);  // affine only
  return r;
}

}  // namespace expertqmm::test

// Under ASan (EXPERTQMM_SANITIZE) a failed allocation must come back as nullptr, as it does without
// ASan, so that the tests of "cannot allocate" errors see the library's error, not ASan's report.
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }

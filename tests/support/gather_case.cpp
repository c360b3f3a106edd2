#include "support/gather_case.h"

#ifdef EXPERTQMM_HAVE_CUDA
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "core/device_memory.h"
#include "core/synthetic_fp.h"
#include "cuda/gather_qmm.h"
#include "cuda/gather_qmm_ws_hooks.h"
#include "expertqmm/diagnostics.h"
#include "expertqmm/error.h"
#include "expertqmm/ops.h"
#include "support/reference.h"
#include "support/test_util.h"

namespace expertqmm::test {

namespace {

// Multiply-adds the float64 reference may spend on one call (~0.1 s): beyond it, a sample of rows.
constexpr double kReferenceWork = 5e7;
// Up to this many multiply-adds the CPU backend is the second opinion; beyond, another CUDA route.
constexpr double kCpuBackendWork = 3e7;

GatherCall make_call(const QuantizedWeight& q, const Tensor& x_host) {
  GatherCall c;
  c.q_host = q;
  c.q_dev = to_device(q, Device::cuda);
  c.x_host = x_host;
  c.x_dev = x_host.to(Device::cuda);
  c.M = x_host.size(-2);
  return c;
}

void set_ids(GatherCall& c, const Tensor& lhs, const Tensor& rhs) {
  c.lhs_host = lhs;
  c.rhs_host = rhs;
  if (lhs.defined()) c.lhs_dev = lhs.to(Device::cuda);
  if (rhs.defined()) c.rhs_dev = rhs.to(Device::cuda);
}

// The row's operands laid out as its Operands column says (x_host and q_host stay contiguous).
void apply_operands(GatherCall& c, Operands o) {
  if (o == Operands::x_stride_pad64 || o == Operands::x_stride_pad4) {
    const int64_t pad = o == Operands::x_stride_pad64 ? 64 : 4, B = c.x_host.size(0), M = c.M, K = c.K();
    const std::vector<float> x = to_float(c.x_host);
    std::vector<float> padded(B * (M * K + pad), 0.f);
    for (int64_t b = 0; b < B; ++b) std::copy(x.begin() + b * M * K, x.begin() + (b + 1) * M * K, padded.begin() + b * (M * K + pad));
    c.keepalive = from_float(padded, {static_cast<int64_t>(padded.size())}, c.x_host.dtype(), Device::cuda);
    c.x_dev = Tensor::view(c.keepalive.data(), {B, M, K}, c.x_host.dtype(), Device::cuda, {M * K + pad, K, 1});
  } else if (o == Operands::w_word_offset) {
    c.keepalive = Tensor::empty({c.q_host.w.numel() + 1}, DType::u32, Device::cuda);
    const std::vector<uint8_t> bytes = c.q_host.w.to_host_bytes();
    uint32_t* shifted = static_cast<uint32_t*>(c.keepalive.data()) + 1;
    detail::copy_host_to_device(shifted, bytes.data(), bytes.size());
    c.q_dev.w = Tensor::view(shifted, c.q_host.w.shape(), DType::u32, Device::cuda);
  }
}

GatherCall build_call(const GatherQmmCase& c) {
  const DType params = c.dtype == DType::f32 ? DType::bf16 : c.dtype;
  const int64_t rows = c.transpose ? c.N : c.K, cols = c.transpose ? c.K : c.N;  // transpose=false: groups along N
  const QuantizedWeight& q =
      built_once(detail::cat("codes ", c.E, "x", rows, "x", cols, " ", c.bits, "/", c.group, " ", dtype_name(params),
                             " ", quant_mode_name(c.mode)),
                 [&] { return random_codes(c.E, rows, cols, c.bits, c.group, params, c.mode); });
  GatherCall call;
  switch (c.form) {
    case Form::rows: call = rows_call(q, c.dtype, make_ids(c.ids, c.E), c.ids.sorted()); break;
    case Form::topk: call = topk_call(q, c.dtype, c.T, c.k); break;
    case Form::batched: {
      std::uniform_int_distribution<int32_t> x_pick(0, static_cast<int32_t>(c.x_batch - 1));
      std::uniform_int_distribution<int32_t> w_pick(0, static_cast<int32_t>(c.E - 1));
      std::vector<int32_t> lhs(c.B), rhs(c.B);
      for (int32_t& i : lhs) i = x_pick(rng());
      for (int32_t& i : rhs) i = w_pick(rng());
      call = batched_call(q, c.dtype, c.x_batch, c.M, lhs, rhs, c.transpose);
      break;
    }
  }
  apply_operands(call, c.operands);
  return call;
}

// Compute capability 9.0: where this build's sm_90a wgmma kernels must run.
bool hopper() {
  int device = 0, major = 0, minor = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), cudaSuccess);
  return major == 9 && minor == 0;
}

// The selector's run: it must pick c.expect and count one attempt (a hit when it took expert_tiles).
std::vector<float> run_selector(const GatherQmmCase& c, const GatherCall& call, const std::string& what) {
  EXPECT_EQ(cuda::gather_qmm_selected_route(call.problem()), c.expect) << what;
  // From zero: a retraction left by an earlier named-route launch (no hit of its own) would take this hit.
  diagnostics::reset();
  const RouteCounters before = gather_counters();
  std::vector<float> out = run_route(call);
  const RouteCounters after = gather_counters();
  EXPECT_EQ(after.attempts - before.attempts, 1u) << what;
  EXPECT_EQ(after.hits - before.hits, c.expect == "expert_tiles" ? 1u : 0u) << what;
  EXPECT_EQ(after.attempts, after.hits + after.fallback_total()) << diagnostics::format({after});
  return out;
}

// The public op on the CPU backend.
Tensor cpu_backend(const GatherCall& call) {
  return gather_qmm(call.x_host, call.q_host, call.lhs_host, call.rhs_host, call.transpose, call.sorted);
}

// The public op on CUDA: the result on the device, in the CPU backend's shape and dtype.
std::vector<float> run_public_op(const GatherCall& call, const Tensor& want, const std::string& what) {
  const Tensor got = gather_qmm(call.x_dev, call.q_dev, call.lhs_dev, call.rhs_dev, call.transpose, call.sorted);
  EXPECT_EQ(got.device(), Device::cuda) << what;
  EXPECT_EQ(got.shape(), want.shape()) << what;
  EXPECT_EQ(got.dtype(), want.dtype()) << what;
  return to_float(got);
}

}  // namespace

WsBuildGuard::WsBuildGuard(RouteSwitch build, int max_ctas) : build_(build) { cuda::set_wgmma_ws_max_ctas(max_ctas); }
WsBuildGuard::~WsBuildGuard() { cuda::set_wgmma_ws_max_ctas(0); }

RouteCounters gather_counters() {
  for (const RouteCounters& r : diagnostics::snapshot())
    if (r.primitive == "gather_qmm") return r;
  ADD_FAILURE() << "no gather_qmm counters";
  return {};
}

QuantizedWeight random_codes(int64_t E, int64_t rows, int64_t cols, int bits, int group_size, DType params,
                             QuantMode mode) {
  std::mt19937_64& g = rng();
  const int64_t words = cols * bits / 32, groups = cols / group_size;
  std::vector<uint32_t> w(E * rows * words);
  for (uint32_t& v : w) v = static_cast<uint32_t>(g());
  if (mode != QuantMode::affine) {
    QuantizedWeight q;
    q.bits = bits;
    q.group_size = group_size;
    q.mode = mode;
    std::vector<uint8_t> s(E * rows * groups);
    detail::finish_synthetic_fp(mode, w.data(), static_cast<int64_t>(w.size()), s.data(),
                                static_cast<int64_t>(s.size()), g());
    q.w = Tensor::from_host(w.data(), {E, rows, words}, DType::u32);
    q.scales = Tensor::from_host(s.data(), {E, rows, groups}, DType::u8);
    return q;
  }
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> s(E * rows * groups), b(s.size());
  const float levels = static_cast<float>((1 << bits) - 1);
  for (size_t i = 0; i < s.size(); ++i) {
    s[i] = (0.01f + 0.002f * nd(g)) * (g() & 1 ? 1.f : -1.f) * 15.f / levels;
    b[i] = -s[i] * levels * 0.5f + 0.001f * nd(g);
  }
  QuantizedWeight q;
  q.bits = bits;
  q.group_size = group_size;
  q.w = Tensor::from_host(w.data(), {E, rows, words}, DType::u32);
  q.scales = from_float(s, {E, rows, groups}, params);
  q.biases = from_float(b, {E, rows, groups}, params);
  return q;
}

detail::GatherQmmProblem GatherCall::problem() const {
  detail::GatherQmmProblem p = detail::make_gather_qmm_problem(x_dev, q_dev.w, q_dev.scales, q_dev.biases, lhs_dev,
                                                               rhs_dev, transpose, q_dev.group_size, q_dev.bits, sorted,
                                                               q_dev.mode);
  p.tiled = q_dev.tiled;  // the layer passes a projection's tile layout the same way
  return p;
}

std::string GatherCall::describe(const std::string& route) const {
  return detail::cat("route=", route.empty() ? "(selector)" : route, " ", problem().describe(), " ", seed_note());
}

GatherCall rows_call(const QuantizedWeight& q, DType dtype, const std::vector<int32_t>& ids, bool sorted) {
  const int64_t R = static_cast<int64_t>(ids.size());
  GatherCall c = make_call(q, random_tensor({R, 1, q.w.size(-1) * 32 / q.bits}, dtype));
  c.rhs = ids;
  c.lhs.resize(R);
  std::iota(c.lhs.begin(), c.lhs.end(), 0);
  set_ids(c, Tensor(), ids_tensor(ids, {R}));
  c.sorted = sorted;
  return c;
}

GatherCall topk_call(const QuantizedWeight& q, DType dtype, int64_t T, int64_t k) {
  const int64_t E = q.w.size(0);
  GatherCall c = make_call(q, random_tensor({T, 1, 1, q.w.size(-1) * 32 / q.bits}, dtype));
  std::vector<int32_t> all(E);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(all.begin(), all.end(), rng());
    for (int64_t j = 0; j < k; ++j) {
      c.rhs.push_back(all[j % E]);
      c.lhs.push_back(static_cast<int32_t>(t));
    }
  }
  set_ids(c, Tensor(), ids_tensor(c.rhs, {T, k}));
  return c;
}

GatherCall batched_call(const QuantizedWeight& q, DType dtype, int64_t x_batch, int64_t M,
                        const std::vector<int32_t>& lhs, const std::vector<int32_t>& rhs, bool transpose) {
  const int64_t K = transpose ? q.w.size(-1) * 32 / q.bits : q.w.size(-2);
  GatherCall c = make_call(q, random_tensor({x_batch, M, K}, dtype));
  c.transpose = transpose;
  c.lhs = lhs;
  c.rhs = rhs;
  set_ids(c, ids_tensor(lhs, {static_cast<int64_t>(lhs.size())}), ids_tensor(rhs, {static_cast<int64_t>(rhs.size())}));
  return c;
}

std::vector<float> run_route(const GatherCall& c, const std::string& route) {
  const detail::GatherQmmProblem p = c.problem();
  Tensor out = Tensor::empty({p.B, p.M, p.N}, p.dtype, Device::cuda);
  poison(out);
  if (route.empty() || route == "auto") cuda::gather_qmm_into(p, out.data(), nullptr);
  else cuda::gather_qmm_into_route(route, p, out.data(), nullptr);
  cuda_check();
  return to_float(out);
}

double reference_error(const GatherCall& c, const std::vector<float>& out) {
  const int64_t B = c.B(), MN = c.M * c.N(), per_element = std::max<int64_t>(1, MN * c.K());
  const int64_t count = std::min(B, std::max<int64_t>(8, static_cast<int64_t>(kReferenceWork / per_element)));
  std::vector<int64_t> picks;
  for (int64_t i = 0; i < std::min(count, B); ++i) picks.push_back(count >= B ? i : i * (B - 1) / (count - 1));
  // One expert dequantized at a time (Gemma's are 4M values each): picks grouped by expert.
  std::stable_sort(picks.begin(), picks.end(), [&](int64_t a, int64_t b) { return c.rhs[a] < c.rhs[b]; });
  const std::vector<float> x = to_float(c.x_host);
  const int64_t E = c.q_host.w.size(0);
  auto expert = [&](const Tensor& t, int32_t e) {
    Shape shape = t.shape();
    shape[0] = 1;
    return Tensor::view(static_cast<uint8_t*>(t.data()) + e * (t.nbytes() / E), shape, t.dtype());
  };
  std::vector<float> got;
  std::vector<double> ref;
  for (size_t i = 0; i < picks.size();) {
    const int32_t e = c.rhs[picks[i]];
    QuantizedWeight one = c.q_host;
    one.w = expert(c.q_host.w, e);
    one.scales = expert(c.q_host.scales, e);
    if (c.q_host.biases.defined()) one.biases = expert(c.q_host.biases, e);
    std::vector<int32_t> lhs;
    for (; i < picks.size() && c.rhs[picks[i]] == e; ++i) {
      lhs.push_back(c.lhs[picks[i]]);
      got.insert(got.end(), out.begin() + picks[i] * MN, out.begin() + (picks[i] + 1) * MN);
    }
    const std::vector<double> r =
        reference_gather_qmm(x, c.M, c.K(), one, lhs, std::vector<int32_t>(lhs.size(), 0), c.transpose);
    ref.insert(ref.end(), r.begin(), r.end());
  }
  return rel_error(got, ref);
}

void check(const GatherQmmCase& c) {
  const GatherCall call = build_call(c);
  const detail::GatherQmmProblem p = call.problem();
  const std::string what = c.name() + ": " + call.describe(c.route);
  ASSERT_EQ(p.dtype, c.dtype) << what;  // f32 activations over bf16 scales promote to f32
  if (c.refuses) {
    try {
      (void)run_route(call, c.route);
      ADD_FAILURE() << what << ": the route ran";
    } catch (const Error& e) {
      // The hook names the Fallback class in parentheses after the problem.
      EXPECT_NE(std::string(e.what()).find("(" + c.expect + ")"), std::string::npos) << what << ": " << e.what();
    }
    return;
  }
  if (c.split_k) {
    EXPECT_GT(cuda::gather_qmm_split_k_bytes(p.B * p.M, p.N, p.K), 0u) << what << ": no split-K";
  }
  if (c.route == "expert_tiles_wgmma" && !hopper()) {  // sm_90a code: refused elsewhere, never a silent pass
    EXPECT_THROW(run_route(call, c.route), Error) << what;
    return;
  }
  const bool cheap = c.work() <= kCpuBackendWork || c.route == "op";
  const Tensor cpu = cheap ? cpu_backend(call) : Tensor();
  const std::vector<float> out = c.route == "auto" ? run_selector(c, call, what)
                                 : c.route == "op" ? run_public_op(call, cpu, what)
                                                   : run_route(call, c.route);
  EXPECT_LE(reference_error(call, out), gemm_tolerance(c.dtype)) << what;
  // Every element against a second implementation (the float64 reference may have sampled rows).
  if (cheap) {
    EXPECT_LE(rel_error(out, to_float(cpu)), kRouteAgreement) << what << " vs the CPU backend";
  } else {
    const std::string other = c.route == "simt" ? "rhs_tiles" : "simt";
    EXPECT_LE(rel_error(out, run_route(call, other)), kRouteAgreement) << what << " vs " << other;
  }
}

}  // namespace expertqmm::test
#endif

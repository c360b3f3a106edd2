#include "support/moe_case.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <utility>

#include "core/gather_qmm_problem.h"
#ifdef EXPERTQMM_HAVE_CUDA
#include "cuda/moe_decode_select.h"
#endif
#include "support/reference.h"
#include "support/test_util.h"

namespace expertqmm::test {

namespace {

QuantizedWeight quantized(const Shape& shape, int bits, int group, float scale, DType dtype,
                          QuantMode mode = QuantMode::affine) {
  QuantizedWeight q = random_quantized(shape, bits, group, scale, Device::cpu, mode);
  if (mode == QuantMode::affine && dtype != q.scales.dtype()) {
    q.scales = detail::cast_floating(q.scales, dtype);
    q.biases = detail::cast_floating(q.biases, dtype);
  }
  return q;
}

// Random values ~ 1 + spread * N(0, 1) in dtype.
Tensor around_one(int64_t n, float spread, DType dtype) {
  std::vector<float> v = to_float(random_tensor({n}, DType::f32, spread));
  for (float& f : v) f += 1.0f;
  return from_float(v, {n}, dtype);
}

// The layer of geometry g, built once for consecutive rows of that geometry (built_once).
const Layer& layer_for(const MoeGeometry& g) {
  return built_once(g.name(), [&] { return make_layer(g); });
}

// How far from the CPU's k-th score a score may sit and still be a near-tie: 1/64 of the k-th's
// magnitude plus 1/512 of the row's largest (a k-th score near zero, as at E = 2k with logits
// ~ N(0, 1), still moves by the row's rounding, which scales with its terms, not its own size).
float tie_margin(const std::vector<float>& row_sorted_desc, int k) {
  const float largest = std::max(std::fabs(row_sorted_desc.front()), std::fabs(row_sorted_desc.back()));
  return std::fabs(row_sorted_desc[k - 1]) * (1.0f / 64) + largest * (1.0f / 512) + 1e-6f;
}

std::vector<float> sorted_row(const std::vector<float>& scores, int64_t t, int64_t E) {
  std::vector<float> row(scores.begin() + t * E, scores.begin() + (t + 1) * E);
  std::sort(row.begin(), row.end(), std::greater<float>());
  return row;
}

// True when token t's k-th and (k+1)-th scores are within tie_margin of each other.
bool near_tie(const std::vector<float>& logits, int64_t t, int64_t E, int k) {
  if (k >= E) return false;
  const std::vector<float> row = sorted_row(logits, t, E);
  return row[k - 1] - row[k] <= tie_margin(row, k);
}

// Empty when token t's two expert sets differ only at a near-tie of the CPU's scores: every expert
// only the GPU picked scores within tie_margin below the CPU's k-th, every one only the CPU picked
// within it above the (k+1)-th. Else why not.
std::string swap_outside_tie(const std::vector<float>& scores, int64_t t, int64_t E, int k,
                             const std::vector<int32_t>& cpu_set, const std::vector<int32_t>& gpu_set) {
  const std::vector<float> row = sorted_row(scores, t, E);
  const float margin = tie_margin(row, k), kth = row[k - 1], next = k < E ? row[k] : row[k - 1];
  auto picked = [](const std::vector<int32_t>& set, int32_t e) { return std::find(set.begin(), set.end(), e) != set.end(); };
  for (int32_t e : gpu_set) {
    if (e < 0 || e >= E) return detail::cat("the GPU picked expert ", e, " of ", E);
    if (!picked(cpu_set, e) && scores[t * E + e] < kth - margin)
      return detail::cat("the GPU picked expert ", e, " (score ", scores[t * E + e], ") below the CPU's k-th ", kth,
                         " by more than ", margin);
  }
  for (int32_t e : cpu_set)
    if (!picked(gpu_set, e) && scores[t * E + e] > next + margin)
      return detail::cat("the GPU dropped expert ", e, " (score ", scores[t * E + e], ") above the CPU's (k+1)-th ", next,
                         " by more than ", margin);
  return {};
}

template <class Ref>
double row_error(const std::vector<float>& out, const std::vector<Ref>& ref, int64_t t, int64_t H) {
  return rel_error(std::vector<float>(out.begin() + t * H, out.begin() + (t + 1) * H),
                   std::vector<Ref>(ref.begin() + t * H, ref.begin() + (t + 1) * H));
}

// The layer's output rows against float64 (routed by the device's route()) and, when given, the
// general path's: each row within 3x the tolerance unless the CPU router has a near-tie at that
// token's k-th logit (the layer's router may sum in another order and pick another expert; at most
// half the tokens excused, one at T = 1), and the rows kept within the tolerance together.
void expect_layer_rows_match(const Tensor& h, const Tensor& x, const Layer& l, const MoeGeometry& g,
                             const std::vector<float>& got, const std::vector<float>* general,
                             const std::string& what) {
  const int64_t T = x.size(0);
  const Routing r = route(h.to(Device::cuda), l.gpu.router);
  const std::vector<double> ref = reference_switch_glu_combine(to_float(x), T, g.H, to_i32(r.indices),
                                                               to_float(r.weights), g.k, l.cpu.experts);
  const double tol = gemm_tolerance(g.dtype), row_tol = 3 * tol;
  std::vector<float> logits, got_kept, general_kept;
  std::vector<double> ref_kept;
  int excused = 0;
  for (int64_t t = 0; t < T; ++t) {
    const double e_ref = row_error(got, ref, t, g.H), e_general = general ? row_error(got, *general, t, g.H) : 0.0;
    if (e_ref > row_tol || e_general > row_tol) {
      if (logits.empty()) logits = cpu_router_logits(h, l.cpu.router);
      EXPECT_TRUE(near_tie(logits, t, g.E, g.k)) << what << ": token " << t << " error " << e_ref
                                                 << " vs float64, " << e_general
                                                 << " vs the general path, without a router near-tie";
      ++excused;
      continue;
    }
    got_kept.insert(got_kept.end(), got.begin() + t * g.H, got.begin() + (t + 1) * g.H);
    ref_kept.insert(ref_kept.end(), ref.begin() + t * g.H, ref.begin() + (t + 1) * g.H);
    if (general) general_kept.insert(general_kept.end(), general->begin() + t * g.H, general->begin() + (t + 1) * g.H);
  }
  EXPECT_LE(excused, std::max<int64_t>(1, T / 2)) << what << ": most tokens excused; too little left to compare";
  if (got_kept.empty()) return;
  EXPECT_LE(rel_error(got_kept, ref_kept), tol) << what;
  if (general) {
    EXPECT_LE(rel_error(got_kept, general_kept), tol) << what << " vs the general path";
  }
}

// GPU routing against CPU routing. exact: every token must pick the same experts; otherwise a token
// may differ only where the GPU's pick is within 1/64 (relative) of the CPU's k-th logit, and at most
// half of the tokens with a near-tie at the k-th place (near_tie, on the CPU's logits) may differ: a GPU
// that resolved every near-tie its own way would differ on all of them, while rounding (bf16 logits,
// other summation orders) flips a few. (A fixed share of all tokens, T / 10, failed under racecheck at
// E = 200, T = 37 with 4 near-tie tokens differing: how many near-ties a row has depends on the seed.)
// Weights are compared per expert on tokens whose sets agree.
void expect_routing_match(const Tensor& h, const RouterWeights& r, bool exact, const std::string& what) {
  const int64_t T = h.size(0);
  const int k = r.top_k;
  const Routing c = route(h, r);
  const Routing g = route(h.to(Device::cuda), router_to(r, Device::cuda));
  ASSERT_EQ(g.indices.shape(), (Shape{T, k})) << what;
  ASSERT_EQ(g.indices.dtype(), DType::i32) << what;
  ASSERT_EQ(g.weights.dtype(), h.dtype()) << what;
  const std::vector<int32_t> ci = to_i32(c.indices), gi = to_i32(g.indices);
  const std::vector<float> cw = to_float(c.weights), gw = to_float(g.weights);
  const int64_t E = r.proj.defined() ? r.proj.w.size(0) : r.proj_dense.size(0);
  std::vector<float> logits, gw_matched, cw_matched;
  int64_t differing = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::map<int32_t, float> cmap, gmap;
    for (int j = 0; j < k; ++j) {
      ASSERT_GE(gi[t * k + j], 0) << what;
      ASSERT_LT(gi[t * k + j], E) << what;
      cmap[ci[t * k + j]] = cw[t * k + j];
      gmap[gi[t * k + j]] = gw[t * k + j];
    }
    ASSERT_EQ(static_cast<int>(gmap.size()), k) << what << ": token " << t << " picked an expert twice";
    bool same = true;
    for (const auto& kv : cmap) same = same && gmap.count(kv.first);
    if (same) {
      // Slots are best first on both backends; with equal sets the order can only differ on ties.
      for (const auto& kv : cmap) {
        cw_matched.push_back(kv.second);
        gw_matched.push_back(gmap[kv.first]);
      }
      continue;
    }
    ++differing;
    ASSERT_FALSE(exact) << what << ": token " << t << " picked different experts";
    if (logits.empty()) logits = cpu_router_logits(h, r);
    const std::vector<float> row = sorted_row(logits, t, E);
    const float kth = row[k - 1];
    for (const auto& kv : gmap)
      EXPECT_GE(logits[t * E + kv.first], kth - std::fabs(kth) * (1.0f / 64) - 1e-6f)
          << what << ": token " << t << " picked expert " << kv.first << " (logit " << logits[t * E + kv.first]
          << ") far below the k-th logit " << kth;
  }
  if (differing > 0) {
    int64_t near_ties = 0;
    for (int64_t t = 0; t < T; ++t) near_ties += near_tie(logits, t, E, k);
    EXPECT_LE(differing, std::max<int64_t>(1, near_ties / 2))
        << what << ": " << differing << " tokens disagree, of " << near_ties << " with a near-tie at the k-th place";
  }
  EXPECT_LE(rel_error(gw_matched, cw_matched), exact ? 1e-5 : 1e-2) << what;
  cuda_check();
}

}  // namespace

RouterWeights random_router(int64_t E, int64_t H, int k, DType dtype, int proj_bits, int group, RouterKind kind,
                            bool norm_topk_prob, QuantMode mode) {
  RouterWeights r;
  r.kind = kind;
  r.top_k = k;
  r.norm_topk_prob = norm_topk_prob;
  const bool gemma4 = kind == RouterKind::gemma4;
  const float proj_scale = gemma4 ? 1.0f : 1.0f / std::sqrt(static_cast<float>(H));
  if (proj_bits) r.proj = quantized({E, H}, proj_bits, group, proj_scale, dtype, mode);
  else r.proj_dense = random_tensor({E, H}, dtype, proj_scale);
  if (gemma4) {
    r.scale = around_one(H, 0.1f, dtype);
    r.per_expert_scale = around_one(E, 0.2f, dtype);
  }
  return r;
}

RouterWeights router_to(const RouterWeights& r, Device device) {
  MoeWeights m;
  m.router = r;
  return m.to(device).router;
}

SwitchGLUWeights experts_to(const SwitchGLUWeights& w, Device device) {
  SwitchGLUWeights d = w;
  // Each projection quantized or 16-bit.
  for (auto [q, qd] : {std::pair{&w.gate, &d.gate}, {&w.up, &d.up}, {&w.gate_up, &d.gate_up}, {&w.down, &d.down}})
    if (q->defined()) *qd = to_device(*q, device);
  for (auto [t, td] : {std::pair{&w.gate_dense, &d.gate_dense}, {&w.up_dense, &d.up_dense},
                       {&w.gate_up_dense, &d.gate_up_dense}, {&w.down_dense, &d.down_dense}})
    if (t->defined()) *td = t->to(device);
  return d;
}

Layer make_layer(const MoeGeometry& g) {
  Layer l;
  SwitchGLUWeights& w = l.cpu.experts;
  w.activation = g.act;
  if (g.fused) {
    w.gate_up = quantized({g.E, 2 * g.I, g.H}, g.bits, g.group, 0.05f, g.dtype, g.mode);
  } else {
    w.gate = quantized({g.E, g.I, g.H}, g.bits, g.group, 0.05f, g.dtype, g.mode);
    w.up = quantized({g.E, g.I, g.H}, g.bits, g.group, 0.05f, g.dtype, g.mode);
  }
  w.down = quantized({g.E, g.H, g.I}, g.bits, g.group, 0.05f, g.dtype, g.mode);
  const int router_group = g.router_mode == QuantMode::affine ? 64 : quant_mode_group_size(g.router_mode);
  l.cpu.router = random_router(g.E, g.H, g.k, g.dtype, g.router_bits, router_group, g.router, g.norm_topk_prob,
                               g.router_mode);
  l.gpu.experts = experts_to(w, Device::cuda);
  l.gpu.router = router_to(l.cpu.router, Device::cuda);
  return l;
}

void random_routing(int64_t T, int64_t k, int64_t E, std::vector<int32_t>& ids, std::vector<float>& weights) {
  ids.clear();
  weights.clear();
  std::vector<int32_t> all(E);
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(all.begin(), all.end(), rng());
    ids.insert(ids.end(), all.begin(), all.begin() + k);
    for (int64_t j = 0; j < k; ++j) weights.push_back(uw(rng()));
  }
}

// The reference runs on T * k one-slot "tokens" (x repeated, weight 1): every [t, j] row on its own.
void expect_switch_glu_matches(const Tensor& x, const std::vector<int32_t>& ids, int64_t k, const Layer& l,
                               const std::string& what) {
  const int64_t T = x.size(0), H = x.size(1);
  const Tensor y = switch_glu(x.to(Device::cuda), ids_tensor(ids, {T, k}, Device::cuda), l.gpu.experts);
  ASSERT_EQ(y.shape(), (Shape{T, k, H})) << what;
  ASSERT_EQ(y.device(), Device::cuda) << what;
  const std::vector<float> xs = to_float(x);
  std::vector<float> x_rep;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) x_rep.insert(x_rep.end(), xs.begin() + t * H, xs.begin() + (t + 1) * H);
  const std::vector<float> ones(static_cast<size_t>(T * k), 1.0f);
  const std::vector<double> ref = reference_switch_glu_combine(x_rep, T * k, H, ids, ones, 1, l.cpu.experts);
  const std::vector<float> out = to_float(y);
  const double tol = gemm_tolerance(x.dtype());
  EXPECT_LE(rel_error(out, ref), tol) << what;
  double worst = 0;
  for (int64_t r = 0; r < T * k; ++r) worst = std::max(worst, row_error(out, ref, r, H));
  EXPECT_LE(worst, 3 * tol) << what << ": the worst (token, slot) row";
  cuda_check();
}

Tensor run_layer(const Tensor& h, const Tensor& x, const MoeWeights& w, Workspace& ws) {
  Tensor out = Tensor::empty({x.size(0), x.size(1)}, x.dtype(), Device::cuda);
  poison(out);  // every element must be written
  moe_layer_into(out, h, x, w, ws);
  return out;
}

void expect_close_where_routed_alike(const Tensor& expected, const Tensor& got, const Tensor& router_input,
                                     const RouterWeights& cpu_router, const std::vector<int32_t>& gpu_idx,
                                     const std::string& what) {
  ASSERT_EQ(got.shape(), expected.shape()) << what;
  EXPECT_EQ(got.device(), Device::cuda) << what;
  const int64_t T = expected.size(0), H = expected.size(1), k = cpu_router.top_k;
  const std::vector<int32_t> cpu_idx = to_i32(route(router_input, cpu_router).indices);
  ASSERT_EQ(gpu_idx.size(), cpu_idx.size()) << what;
  const std::vector<float> g = to_float(got), e = to_float(expected);
  std::vector<float> g_same, e_same, scores;
  int64_t rerouted = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> a(cpu_idx.begin() + t * k, cpu_idx.begin() + (t + 1) * k);
    std::vector<int32_t> b(gpu_idx.begin() + t * k, gpu_idx.begin() + (t + 1) * k);
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a != b) {
      if (scores.empty()) scores = cpu_router_logits(router_input, cpu_router);
      const int64_t E = static_cast<int64_t>(scores.size()) / T;
      const std::string why = swap_outside_tie(scores, t, E, static_cast<int>(k), a, b);
      EXPECT_TRUE(why.empty()) << what << ": token " << t << " routed differently off a near-tie: " << why
                               << seed_note();
      ++rerouted;
      continue;
    }
    g_same.insert(g_same.end(), g.begin() + t * H, g.begin() + (t + 1) * H);
    e_same.insert(e_same.end(), e.begin() + t * H, e.begin() + (t + 1) * H);
  }
  EXPECT_LE(rerouted, std::max<int64_t>(1, T / 2)) << what << ": most tokens rerouted; too little left to compare"
                                                  << seed_note();
  EXPECT_LE(rel_error(g_same, e_same), 1e-2) << what << " (" << rerouted << " tokens rerouted) " << seed_note();
}

uint64_t decode_hits() {
  for (const RouteCounters& c : diagnostics::snapshot())
    if (c.primitive == "moe_decode_layer") return c.hits;
  ADD_FAILURE() << "no moe_decode_layer row in snapshot()";
  return 0;
}

void check(const SwitchGluCase& c) {
  const Layer& l = layer_for(c.g);
  std::vector<int32_t> ids;
  std::vector<float> weights;
  if (c.repeats) ids = to_i32(random_ids({c.T, c.g.k}, c.g.E));
  else random_routing(c.T, c.g.k, c.g.E, ids, weights);
  expect_switch_glu_matches(random_tensor({c.T, c.g.H}, c.g.dtype), ids, c.g.k, l, c.name() + " " + seed_note());
}

void check(const MoeLayerCase& c) {
#ifdef EXPERTQMM_HAVE_CUDA
  if (c.path == MoePath::decode && !cuda::decode_router_fits(c.T, c.g.H))
    GTEST_SKIP() << "the decode router's " << c.T << " staged rows of " << c.g.H
                 << " do not fit this device's shared memory (decode_max_smem)";
#endif
  const Layer& l = layer_for(c.g);
  const std::string what = c.name() + " " + seed_note();
  const Tensor h = random_tensor({c.T, c.g.H}, c.g.dtype), x = random_tensor({c.T, c.g.H}, c.g.dtype);
  const Tensor hd = h.to(Device::cuda), xd = x.to(Device::cuda);
  Workspace ws;
  Tensor out;
  if (c.path == MoePath::decode) {
    DecodeSwitchGuard on(RouteSwitch::on);
    const uint64_t before = decode_hits();
    out = run_layer(hd, xd, l.gpu, ws);
    const Tensor again = run_layer(hd, xd, l.gpu, ws);
    cuda_check();
    EXPECT_EQ(decode_hits(), before + 2) << what << ": the decode layer did not serve the calls";
    EXPECT_EQ(out.to_host_bytes(), again.to_host_bytes()) << what << ": two runs differ";
  } else {
    ProductModeGuard mode(c.path == MoePath::separate ? ProductMode::separate : ProductMode::fused);
    out = run_layer(hd, xd, l.gpu, ws);
    cuda_check();
  }
  std::vector<float> general;
  if (c.path == MoePath::decode) {
    DecodeSwitchGuard off(RouteSwitch::off);
    const uint64_t before = decode_hits();
    Workspace ws_general;
    general = to_float(run_layer(hd, xd, l.gpu, ws_general));
    cuda_check();
    EXPECT_EQ(decode_hits(), before) << what << ": the decode layer ran while switched off";
  }
  expect_layer_rows_match(h, x, l, c.g, to_float(out), general.empty() ? nullptr : &general, what);
}

void check(const RouteCase& c) {
  const RouterWeights r = random_router(c.E, c.H, c.k, c.dtype, c.proj_bits, c.group, c.kind, c.norm_topk_prob);
  expect_routing_match(random_tensor({c.T, c.H}, c.dtype), r, c.exact, c.name() + " " + seed_note());
}

}  // namespace expertqmm::test

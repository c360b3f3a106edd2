// What a backend case is called (the test names gtest prints) and the expert ids its patterns make.
#include "support/backend_cases.h"

#include <algorithm>
#include <random>

#include "expertqmm/error.h"
#include "support/test_util.h"

namespace expertqmm::test {

namespace {

const char* short_dtype(DType t) {
  switch (t) {
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f32: return "f32";
    case DType::u32: return "u32";
    case DType::i32: return "i32";
    case DType::u8: return "u8";
  }
  return "unknown";
}

std::string quant(int bits, int group, QuantMode mode = QuantMode::affine) {
  return mode == QuantMode::affine ? detail::cat("q", bits, "g", group) : std::string(quant_mode_name(mode));
}

}  // namespace

double gemm_tolerance(DType t) { return t == DType::bf16 ? 1e-2 : t == DType::f16 ? 5e-3 : 1e-4; }

// ---- names -----------------------------------------------------------------------------------------

Ids uniform(int64_t n) { return {IdsPattern::uniform, n}; }
Ids sorted(int64_t n) { return {IdsPattern::sorted, n}; }
Ids one_expert(int64_t n) { return {IdsPattern::one_expert, n}; }
Ids tails(int64_t step) { return {IdsPattern::tails, step}; }
Ids runs(int64_t first, int64_t n, int64_t m) { return {IdsPattern::runs, n, m, first}; }
Ids per_expert(int64_t n) { return {IdsPattern::per_expert, n}; }
Ids few_experts(int64_t n) { return {IdsPattern::few_experts, n}; }
Ids alternating(int64_t n) { return {IdsPattern::alternating, n}; }
Ids descending(int64_t n) { return {IdsPattern::descending, n}; }

std::string Ids::name() const {
  switch (pattern) {
    case IdsPattern::uniform: return detail::cat("u", n);
    case IdsPattern::sorted: return detail::cat("s", n);
    case IdsPattern::one_expert: return detail::cat("one", n);
    case IdsPattern::tails: return detail::cat("tails", n);
    case IdsPattern::runs: return detail::cat("e", first, "x", n, "_lastx", m);
    case IdsPattern::per_expert: return detail::cat("each", n);
    case IdsPattern::few_experts: return detail::cat("few", n);
    case IdsPattern::alternating: return detail::cat("alt", n);
    case IdsPattern::descending: return detail::cat("desc", n);
  }
  return "unknown";
}

bool Ids::sorted() const {
  return pattern != IdsPattern::uniform && pattern != IdsPattern::alternating && pattern != IdsPattern::descending;
}

std::vector<int32_t> make_ids(const Ids& ids, int64_t E) {
  const int32_t last = static_cast<int32_t>(E - 1);
  auto random_ids = [&](int64_t n) {
    std::uniform_int_distribution<int32_t> d(0, last);
    std::vector<int32_t> v(n);
    for (int32_t& i : v) i = d(rng());
    return v;
  };
  std::vector<int32_t> v;
  switch (ids.pattern) {
    case IdsPattern::uniform: return random_ids(ids.n);
    case IdsPattern::sorted:
    case IdsPattern::descending:
      v = random_ids(ids.n);
      std::sort(v.begin(), v.end());
      if (ids.pattern == IdsPattern::descending) std::reverse(v.begin(), v.end());
      return v;
    case IdsPattern::one_expert: return std::vector<int32_t>(ids.n, static_cast<int32_t>(E * 5 / 8));
    case IdsPattern::tails:
      for (int32_t e = 0; e <= last; ++e) v.insert(v.end(), 1 + ids.n * e, e);
      return v;
    case IdsPattern::runs:
      v.assign(ids.n, static_cast<int32_t>(ids.first));
      v.insert(v.end(), ids.m, last);
      return v;
    case IdsPattern::per_expert:
      for (int32_t e = 0; e <= last; ++e) v.insert(v.end(), ids.n, e);
      return v;
    case IdsPattern::few_experts:
      v = random_ids(ids.n);
      for (int32_t& i : v) i = i % 3 == 0 ? 1 : i % 3 == 1 ? 5 : last;
      std::sort(v.begin(), v.end());
      return v;
    case IdsPattern::alternating:
      for (int64_t i = 0; i < ids.n; ++i) v.push_back(i % 2 ? 0 : last);
      return v;
  }
  return v;
}

int64_t GatherQmmCase::rows() const {
  switch (form) {
    case Form::rows: {
      // The count of every pattern without drawing it.
      const int64_t n = ids.n;
      switch (ids.pattern) {
        case IdsPattern::tails: return E + n * E * (E - 1) / 2;
        case IdsPattern::runs: return n + ids.m;
        case IdsPattern::per_expert: return n * E;
        default: return n;
      }
    }
    case Form::topk: return T * k;
    case Form::batched: return B * M;
  }
  return 0;
}

double GatherQmmCase::work() const { return static_cast<double>(rows()) * N * K; }

std::string GatherQmmCase::name() const {
  std::string form_name;
  switch (form) {
    case Form::rows: form_name = "rows_" + ids.name(); break;
    case Form::topk: form_name = detail::cat("topk", T, "x", k); break;
    case Form::batched: form_name = detail::cat("batch", x_batch, "x", M, "_B", B, transpose ? "" : "_wKN"); break;
  }
  const char* operand_names[] = {"", "_xpad64", "_xpad4", "_woffset"};
  std::string s = detail::cat("gather_qmm_", route, "_", short_dtype(dtype), "_", quant(bits, group, mode), "_E", E, "_N",
                              N, "_K", K, "_", form_name, operand_names[static_cast<int>(operands)]);
  if (refuses) s += "_refuses_" + expect;
  else if (!expect.empty()) s += "_picks_" + expect;
  if (split_k) s += "_splitk";
  return s;
}

// "" for Gemma 4's router (the names rows had before router kinds), else "_softmax_topk[_norenorm]".
static std::string router_suffix(RouterKind kind, bool norm_topk_prob) {
  if (kind == RouterKind::gemma4) return "";
  return detail::cat("_", router_kind_name(kind), norm_topk_prob ? "" : "_norenorm");
}

std::string MoeGeometry::name() const {
  return detail::cat("H", H, "_I", I, "_E", E, "_k", k, "_", quant(bits, group, mode), "_router",
                     router_mode != QuantMode::affine ? std::string(quant_mode_name(router_mode))
                     : router_bits                    ? detail::cat("q", router_bits)
                                                      : std::string("dense"), fused ? "_gateup" : "_gate_up",
                     "_", activation_name(act), "_", short_dtype(dtype), router_suffix(router, norm_topk_prob));
}

std::string SwitchGluCase::name() const {
  return detail::cat("switch_glu_", g.name(), "_T", T, repeats ? "_repeats" : "");
}

std::string MoeLayerCase::name() const {
  const char* paths[] = {"auto", "separate", "decode"};
  return detail::cat("moe_layer_into_", paths[static_cast<int>(path)], "_", g.name(), "_T", T);
}

std::string RouteCase::name() const {
  return detail::cat("route_", proj_bits ? quant(proj_bits, group) : std::string("dense"), "_", short_dtype(dtype),
                     "_E", E, "_H", H, "_k", k, "_T", T, exact ? "_exact" : "", router_suffix(kind, norm_topk_prob));
}

std::string QuantizeCase::name() const {
  return detail::cat("quantize_", values == Values::ties ? "ties" : "edges", "_", short_dtype(dtype), "_",
                     quant(bits, group, mode), "_", rounding == Rounding::gpu ? "gpu" : "cpu", "_", batch, "x", rows);
}

std::string SortCase::name() const {
  return detail::cat("gather_sort_T", T, "_k", k, "_E", E, "_D", D, "_ids", short_dtype(ids));
}

std::string GluCase::name() const {
  std::string dims;
  for (int64_t d : shape) dims += detail::cat(dims.empty() ? "" : "x", d);
  return detail::cat("glu_product_", activation_name(act), "_", short_dtype(dtype), "_", dims);
}

std::string CombineCase::name() const {
  return detail::cat("weighted_combine_T", T, "_k", k, "_D", D, "_y", short_dtype(y), "_w", short_dtype(w),
                     float64 ? "_float64" : "");
}

std::string BackendCase::name() const {
  return std::visit([](const auto& c) { return c.name(); }, spec);
}

void PrintTo(const BackendCase& c, std::ostream* os) { *os << c.name(); }

}  // namespace expertqmm::test

// The cross-backend table (in the spirit of ggml's test-backend-ops): one row per (op or route x
// dtype x bits x group size x shape at a tile edge), each checked on CUDA against the CPU side (the
// float64 reference or the CPU backend) by tests/gpu_backend_ops_test.cpp. A row is plain data: its
// fields are the table's columns and name() spells every one of them, so a failure names its row
// and `--gtest_filter='*/gather_qmm_qmv_*'` picks rows by column. Rows are built by
// backend_cases(); the checks of each op live in gather_case.h, moe_case.h and op_cases.h.
//
// The sanitizer subset: every GPU test whose suite name starts with "Sanitize" (the table's rows
// of Subset::sanitize are instantiated as Sanitize/GpuBackendOps; other tests of the subset sit in
// suites named Sanitize...). scripts/gpu-check runs exactly that filter under compute-sanitizer.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <variant>
#include <vector>

#include "expertqmm/moe.h"

namespace expertqmm::test {

// Sanitize: small enough for compute-sanitizer (memcheck and racecheck run it in gpu-check).
// Large: the rest; the plain GPU test run executes both, each row once.
enum class Subset { sanitize, large };

// docs/numerics.md: a GEMM (and the layers built of them) against float64: bf16 1e-2, f16 5e-3,
// f32 1e-4; route against route (or backend against backend) on the same inputs 1e-2.
double gemm_tolerance(DType t);
constexpr double kRouteAgreement = 1e-2;

// ---- gather_qmm ---------------------------------------------------------------------------------

// Expert ids of a call, as a pattern: uniform random (unsorted or sorted), one expert owning every
// row, expert e owning 1 + n * e rows ("tails": every tail class), n rows of expert `first` then m
// of the last (the experts between empty), n rows for every expert, n rows over experts {1, 5, E-1},
// n rows alternating E-1 / 0, n sorted rows reversed.
enum class IdsPattern { uniform, sorted, one_expert, tails, runs, per_expert, few_experts, alternating, descending };
struct Ids {
  IdsPattern pattern = IdsPattern::uniform;
  int64_t n = 0, m = 0, first = 0;
  std::string name() const;
  bool sorted() const;  // ascending, so a sorted promise holds
};
Ids uniform(int64_t n);
Ids sorted(int64_t n);
Ids one_expert(int64_t n);
Ids tails(int64_t step);
Ids runs(int64_t first, int64_t n, int64_t m);
Ids per_expert(int64_t n);
Ids few_experts(int64_t n);
Ids alternating(int64_t n);
Ids descending(int64_t n);
// The ids for E experts (fresh random draws where the pattern has any).
std::vector<int32_t> make_ids(const Ids& ids, int64_t E);

// How the call's operands are laid out, as mlx-lm produces them:
//   rows     x [R, 1, K], rhs [R], no lhs (SwitchGLU after gather_sort); sorted promise = ids.sorted()
//   topk     x [T, 1, 1, K], rhs [T, k] of distinct experts, lhs broadcast from x's batch
//   batched  x [x_batch, M, K], random lhs and rhs of length B (transpose=false: w [E, K, N])
enum class Form { rows, topk, batched };
// x rows at a batch stride of K + 64 or K + 4 elements (16- and 8-byte aligned), or w one uint32 past
// a 16-byte boundary: what the routes that need aligned rows must refuse.
enum class Operands { contiguous, x_stride_pad64, x_stride_pad4, w_word_offset };

struct GatherQmmCase {
  std::string route;           // "auto": the selector; "op": the public gather_qmm; else a route of the test hook
  DType dtype = DType::bf16;   // activations; scales and biases in it too (bf16 under f32 x: promotion)
  int bits = 4, group = 64;
  int64_t E = 8, N = 0, K = 0;  // w [E, N, K] (transpose=false: [E, K, N])
  QuantMode mode = QuantMode::affine;  // an fp mode: uint8 scales, no biases (bits / group: the mode's)
  Form form = Form::rows;
  Ids ids;                      // rows
  int64_t T = 0, k = 0;         // topk
  int64_t x_batch = 1, M = 1, B = 0;  // batched
  bool transpose = true;
  Operands operands = Operands::contiguous;
  std::string expect;           // auto: the route the selector must pick; refuses: the Fallback the error names
  bool refuses = false;         // the route must throw Error instead of running
  bool split_k = false;         // rhs_tiles must split K into fp32 slices for this shape
  std::string name() const;
  int64_t rows() const;         // B * M of the problem
  double work() const;          // multiply-adds of the whole call
};

// ---- MoE layer -----------------------------------------------------------------------------------

// One layer: experts [E, I, H] (gate, up; or one fused gate_up [E, 2I, H]) and down [E, H, I] of
// `bits`/`group`, a router over E experts choosing k (router_bits 0: a dense projection).
struct MoeGeometry {
  int64_t H = 256, I = 128, E = 8;
  int k = 2;
  int bits = 4, group = 64;
  int router_bits = 8;
  bool fused = false;
  Activation act = Activation::geglu;
  DType dtype = DType::bf16;
  RouterKind router = RouterKind::gemma4;  // softmax_topk: Qwen3-MoE's (router reads un-normalised h)
  bool norm_topk_prob = true;
  QuantMode mode = QuantMode::affine;  // the experts' (an fp mode: its own bits and group size)
  QuantMode router_mode = QuantMode::affine;  // the router projection's (an fp mode: router_bits its bits)
  std::string name() const;
};

// switch_glu(x, ids) against float64, every (token, slot) row. repeats: ids drawn with replacement
// (an expert may appear twice in one token), else k distinct experts per token.
struct SwitchGluCase {
  MoeGeometry g;
  int64_t T = 1;
  bool repeats = false;
  std::string name() const;
};

// moe_layer_into against float64 fed with the device's routing. auto: the library's choice (the
// decode layer where it applies (T <= 16, T * k <= 128), else the general path); separate: ProductMode::
// separate; decode: the decode layer forced on, also against the decode layer forced off (the general
// path), with its hits counted and two runs bit-identical.
enum class MoePath { automatic, separate, decode };
struct MoeLayerCase {
  MoeGeometry g;
  int64_t T = 1;
  MoePath path = MoePath::automatic;
  std::string name() const;
};

// route(h, router) on CUDA against the CPU router. exact: every token picks the same experts and
// the weights agree to 1e-5; else a token may differ only at a near-tie of the CPU's scores (logits,
// or a softmax_topk router's probabilities).
struct RouteCase {
  int64_t E = 8, H = 64;
  int k = 2;
  DType dtype = DType::f32;
  int proj_bits = 0, group = 64;  // 0: dense projection
  int64_t T = 1;
  bool exact = false;
  RouterKind kind = RouterKind::gemma4;
  bool norm_topk_prob = true;
  std::string name() const;
};

// ---- elementwise and layout ops ------------------------------------------------------------------

// quantize then dequantize on CUDA, bit for bit against the CPU backend. edge_cases: groups that are
// random, all negative, constant, zero or of mixed magnitude; ties: codes exactly halfway between two
// levels, where the two rounding flavours must also disagree with each other.
enum class Values { edge_cases, ties };
struct QuantizeCase {
  Values values = Values::edge_cases;
  DType dtype = DType::bf16;
  int bits = 4, group = 64;
  Rounding rounding = Rounding::cpu;
  int64_t batch = 1, rows = 12;  // edge_cases weight [batch, rows, 256]
  QuantMode mode = QuantMode::affine;  // an fp mode: its bits and group size, cpu rounding, edge_cases only
  std::string name() const;
};

// gather_sort then scatter_unsort of x [T, D] by ids [T, k] in `ids` (i32 or u32), bit for bit.
struct SortCase {
  int64_t T = 1, k = 1, E = 4, D = 16;
  DType ids = DType::i32;
  std::string name() const;
};

// glu_product (both product modes) and the public geglu/swiglu against the CPU backend.
struct GluCase {
  Activation act = Activation::geglu;
  DType dtype = DType::bf16;
  Shape shape;
  std::string name() const;
};

// weighted_combine of y [T, k, D] by w [T, k]: against the CPU backend (1 ulp), or with float64 the
// float64 sum (4e-3).
struct CombineCase {
  int64_t T = 1, k = 1, D = 8;
  DType y = DType::bf16, w = DType::bf16;
  bool float64 = false;
  std::string name() const;
};

// ---- the table -----------------------------------------------------------------------------------

using CaseSpec = std::variant<GatherQmmCase, SwitchGluCase, MoeLayerCase, RouteCase, QuantizeCase, SortCase, GluCase,
                              CombineCase>;
struct BackendCase {
  Subset subset = Subset::large;
  CaseSpec spec;
  std::string name() const;  // the op, then every column: unique, letters, digits and '_' only
};
void PrintTo(const BackendCase& c, std::ostream* os);

// The rows of one subset, in table order.
std::vector<BackendCase> backend_cases(Subset subset);

}  // namespace expertqmm::test

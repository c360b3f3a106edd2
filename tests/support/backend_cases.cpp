// The backend-ops table: every case each backend must match the CPU reference on (tests/gpu_backend_ops_test.cpp).
#include "support/backend_cases.h"

#include "expertqmm/error.h"
#include "support/test_util.h"

namespace expertqmm::test {

// ---- the table -------------------------------------------------------------------------------------

namespace {

using Table = std::vector<BackendCase>;

// Every route that takes any row count, and the routes for many rows (qmv stops at 64).
const char* const kAllRoutes[] = {"qmv", "rhs_tiles_bm16", "rhs_tiles_bm32", "rhs_tiles_bm64", "simt"};
const char* const kManyRowRoutes[] = {"rhs_tiles", "rhs_tiles_bm16", "rhs_tiles_bm32", "rhs_tiles_bm64", "simt"};
const char* const kTileKernels[] = {"expert_tiles_mma_sync", "expert_tiles_wgmma"};
// cuda::kQmvMaxRows: the selector sends at most this many rows to qmv (the threshold the bench tunes).
constexpr int64_t kQmvMaxRows = 64;

struct Weight {
  DType dtype;
  int bits, group;
  int64_t E, N, K;
};

GatherQmmCase gq(const std::string& route, const Weight& w) {
  GatherQmmCase c;
  c.route = route;
  c.dtype = w.dtype;
  c.bits = w.bits;
  c.group = w.group;
  c.E = w.E;
  c.N = w.N;
  c.K = w.K;
  return c;
}
GatherQmmCase rows_of(const std::string& route, const Weight& w, Ids ids) {
  GatherQmmCase c = gq(route, w);
  c.ids = ids;
  return c;
}
GatherQmmCase topk_of(const std::string& route, const Weight& w, int64_t T, int64_t k) {
  GatherQmmCase c = gq(route, w);
  c.form = Form::topk;
  c.T = T;
  c.k = k;
  return c;
}
GatherQmmCase batched_of(const std::string& route, const Weight& w, int64_t x_batch, int64_t M, int64_t B,
                         bool transpose = true) {
  GatherQmmCase c = gq(route, w);
  c.form = Form::batched;
  c.x_batch = x_batch;
  c.M = M;
  c.B = B;
  c.transpose = transpose;
  return c;
}
// The selector on c's problem must pick `route` (and the result must be right).
GatherQmmCase picks(GatherQmmCase c, const std::string& route) {
  c.route = "auto";
  c.expect = route;
  return c;
}
// `route` must refuse c's problem with an Error naming `fallback`.
GatherQmmCase refusal(GatherQmmCase c, const std::string& route, const std::string& fallback) {
  c.route = route;
  c.expect = fallback;
  c.refuses = true;
  return c;
}
GatherQmmCase with_operands(GatherQmmCase c, Operands o) {
  c.operands = o;
  return c;
}

void add(Table& t, Subset s, CaseSpec spec) { t.push_back({s, std::move(spec)}); }

// Each block names the shapes it stands for; N and K off the tile grids unless said otherwise.
void gather_qmm_rows(Table& t) {
  const Subset small = Subset::sanitize, large = Subset::large;
  // Odd shapes on every route: N = 200 and K = 192 are multiples of no tile (3 groups of 64); several
  // rows per batch element (M = 3) cut tiles through batch elements.
  const Weight odd{DType::bf16, 4, 64, 8, 200, 192};
  for (const char* r : kAllRoutes) {
    add(t, small, batched_of(r, odd, 5, 1, 13));
    add(t, small, batched_of(r, odd, 4, 3, 7));
  }
  // Every tensor-core bits x group size, with K = 448 (7 groups of 64: an odd count per 64-wide k
  // tile): decode-sized unsorted rows on every route, sorted prefill rows on every many-row route,
  // the selector (the expert tile route) and both kernels of the tile route (wgmma: 4- and 8-bit
  // g64/g128; f16 8-bit below).
  for (int bits : {4, 8})
    for (int group : {32, 64, 128})
      for (int64_t K : {384, 448}) {
        if (K % group != 0) continue;
        const Weight w{DType::bf16, bits, group, 8, 136, K};
        for (const char* r : kAllRoutes) add(t, large, rows_of(r, w, uniform(24)));
        for (const char* r : kManyRowRoutes) add(t, large, rows_of(r, w, sorted(300)));
        add(t, large, picks(rows_of("", w, sorted(300)), "expert_tiles"));
        add(t, large, rows_of("expert_tiles_mma_sync", w, sorted(300)));
        const bool wgmma = group != 32;  // bf16
        add(t, large, wgmma ? rows_of("expert_tiles_wgmma", w, sorted(300))
                            : refusal(rows_of("", w, sorted(300)), "expert_tiles_wgmma", "quantization"));
      }
  // float16 activations and scales (8-bit: no wgmma build, the mma.sync kernel takes them).
  add(t, large, refusal(rows_of("", {DType::f16, 8, 64, 8, 200, 256}, sorted(300)), "expert_tiles_wgmma", "quantization"));
  for (int bits : {4, 8}) {
    const Weight w{DType::f16, bits, 64, 8, 200, 256};
    for (const char* r : kAllRoutes) add(t, large, rows_of(r, w, uniform(24)));
    for (const char* r : kManyRowRoutes) add(t, large, topk_of(r, w, 40, 2));
    add(t, large, picks(topk_of("", w, 40, 2), "rhs_tiles"));
  }
  // Bit widths only simt takes (3, 5 and 6 bits straddle words), transpose=false (groups along N, K
  // = 100 free) and f32 activations over bf16 scales (promoted to f32): the selector picks simt.
  for (int bits : {2, 3, 5, 6})
    for (int group : {32, 64, 128}) {
      const GatherQmmCase c = rows_of("", {DType::bf16, bits, group, 4, 40, 256}, uniform(20));
      add(t, small, picks(c, "simt"));
      add(t, small, refusal(c, "qmv", "quantization"));
      add(t, small, refusal(c, "rhs_tiles", "quantization"));
    }
  for (int bits : {3, 4, 8}) add(t, small, picks(batched_of("", {DType::bf16, bits, 32, 6, 128, 100}, 3, 2, 5, false), "simt"));
  add(t, small, refusal(batched_of("", {DType::bf16, 4, 32, 6, 128, 100}, 3, 2, 5, false), "qmv", "quantization"));
  add(t, small, refusal(batched_of("", {DType::bf16, 4, 32, 6, 128, 100}, 3, 2, 5, false), "rhs_tiles", "quantization"));
  add(t, small, picks(rows_of("", {DType::f32, 4, 32, 4, 72, 160}, sorted(50)), "simt"));
  // MLX's fp modes (E2M1 / E4M3 codes, uint8 scales): qmv (bf16 / f16, decode sizes; E2M1 / E4M3
  // decoded by bit placement), the expert tile route (bf16, sorted rows beyond qmv's: the mma.sync
  // kernel for every mode, the wgmma one for mxfp4 / nvfp4), rhs_tiles (bf16, its BM=16 kernels and
  // their split-K: unsorted rows, top-k, batched, the router's projection) and simt compute them;
  // rhs_tiles' BM 32 / 64 and the wgmma kernel for mxfp8 refuse them (quantization), f16 and f32 go
  // past the tiles (dtype), so the selector picks simt for f16 / f32 prefill rows and for
  // transpose=false. qmv's single-word kernels: w one word off (mx modes: rows are always
  // whole uint4s), K = 144 (nvfp4: 18 words; the mx modes' group of 32 needs K = 160 instead).
  for (QuantMode mode : {QuantMode::mxfp4, QuantMode::mxfp8, QuantMode::nvfp4}) {
    const int64_t odd_k = mode == QuantMode::nvfp4 ? 144 : 160;
    auto fp = [&](GatherQmmCase c) {
      c.mode = mode;
      c.bits = quant_mode_bits(mode);
      c.group = quant_mode_group_size(mode);
      return c;
    };
    for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
      const char* decode_route = dtype == DType::f32 ? "simt" : "qmv";
      add(t, small, picks(fp(rows_of("", {dtype, 4, 64, 8, 72, 192}, uniform(24))), decode_route));
      add(t, small, picks(fp(topk_of("", {dtype, 4, 64, 8, 40, 128}, 5, 2)), decode_route));
      add(t, small, fp(rows_of("simt", {dtype, 4, 64, 8, 72, 192}, uniform(24))));
    }
    for (DType dtype : {DType::bf16, DType::f16}) {
      add(t, small, with_operands(fp(rows_of("qmv", {dtype, 4, 64, 8, 72, 192}, uniform(24))), Operands::w_word_offset));
      add(t, small, fp(rows_of("qmv", {dtype, 4, 64, 8, 40, odd_k}, uniform(9))));
      add(t, large, fp(rows_of("qmv", {dtype, 4, 64, 128, 704, 2816}, uniform(64))));  // Gemma 4's gate / up
    }
    add(t, small, picks(fp(batched_of("", {DType::bf16, 4, 64, 6, 96, 64}, 3, 2, 5, false)), "simt"));
    add(t, small, picks(fp(batched_of("", {DType::bf16, 4, 64, 8, 200, 192}, 4, 3, 7)), "qmv"));
    add(t, large, picks(fp(rows_of("", {DType::bf16, 4, 64, 128, 200, 448}, sorted(300))), "expert_tiles"));
    add(t, large, picks(fp(rows_of("", {DType::bf16, 4, 64, 8, 136, 384}, uniform(300))), "rhs_tiles"));
    add(t, large, picks(fp(topk_of("", {DType::bf16, 4, 64, 8, 200, 256}, 40, 2)), "rhs_tiles"));
    add(t, small, fp(batched_of("rhs_tiles", {DType::bf16, 4, 64, 8, 200, 192}, 4, 3, 7)));
    add(t, small, fp(rows_of("rhs_tiles_bm16", {DType::bf16, 4, 64, 8, 136, 448}, uniform(100))));
    // Split-K of the BM=16 tiles: the router's projection (N = 128, K = 2816) as sorted-less rows
    // and as x [1, T, K], one batch element.
    GatherQmmCase router_rows = fp(rows_of("rhs_tiles", {DType::bf16, 4, 64, 4, 128, 2816}, uniform(300)));
    router_rows.split_k = true;
    add(t, small, router_rows);
    GatherQmmCase router_batch = fp(batched_of("rhs_tiles", {DType::bf16, 4, 64, 1, 128, 2816}, 1, 300, 1));
    router_batch.split_k = true;
    add(t, small, router_batch);
    add(t, large, picks(fp(rows_of("", {DType::f16, 4, 64, 8, 136, 384}, sorted(300))), "simt"));
    add(t, small, refusal(fp(rows_of("", {DType::f16, 4, 64, 8, 136, 384}, sorted(300))), "expert_tiles_mma_sync", "dtype"));
    const GatherQmmCase sorted_rows = fp(rows_of("", {DType::bf16, 4, 64, 8, 136, 384}, sorted(300)));
    for (const char* r : {"rhs_tiles_bm32", "rhs_tiles_bm64"}) add(t, small, refusal(sorted_rows, r, "quantization"));
    const bool wgmma = mode != QuantMode::mxfp8;  // 4-bit codes only
    if (!wgmma) add(t, small, refusal(sorted_rows, "expert_tiles_wgmma", "quantization"));
    // The expert tile route (both kernels' kFp): row counts past qmv's crossing the plan's tile classes
    // (72 = 64 + 8, 200 and 520 over 8 experts: full 64-row tiles and tails of every class; tails:
    // expert e owns 1 + 9e rows), K = 384 and 448 (an odd count of 64-wide k tiles: an mx mode's
    // pair of groups sits in either half of its staged word), N off the 128-column grid; the
    // selector must pick it (a counted hit) and each pinned kernel must agree. Gemma 4's gate / up
    // (704 x 2816) and down (2816 x 704: 11 k tiles) at 520 rows over 128 experts.
    for (int64_t K : {384, 448})
      for (const Ids& ids : {sorted(72), sorted(200), sorted(520), tails(9)}) {
        const GatherQmmCase c = fp(rows_of("", {DType::bf16, 4, 64, 8, K == 384 ? 136 : 200, K}, ids));
        add(t, ids.n == 72 ? small : large, picks(c, "expert_tiles"));
        for (const char* r : {"expert_tiles_mma_sync", "expert_tiles_wgmma"}) {
          if (!wgmma && std::string(r) == "expert_tiles_wgmma") continue;
          GatherQmmCase pinned = c;
          pinned.route = r;
          add(t, large, pinned);
        }
      }
    add(t, large, picks(fp(rows_of("", {DType::bf16, 4, 64, 128, 704, 2816}, sorted(520))), "expert_tiles"));
    add(t, large, picks(fp(rows_of("", {DType::bf16, 4, 64, 128, 2816, 704}, sorted(520))), "expert_tiles"));
  }
  // Row counts from decode to long prefill (tokens x top-k over E), sorted rows and unsorted top-k.
  struct Rows {
    int64_t T, k, E;
  };
  for (const Rows& s : {Rows{1, 1, 8}, Rows{1, 8, 128}, Rows{3, 2, 8}, Rows{64, 8, 128}, Rows{700, 1, 256},
                        Rows{2048, 8, 128}}) {
    const Weight w{DType::bf16, 4, 64, s.E, 200, 192};
    const bool decode = s.T * s.k <= kQmvMaxRows;
    for (const GatherQmmCase& c : {rows_of("", w, sorted(s.T * s.k)), topk_of("", w, s.T, s.k)}) {
      const bool sorted_rows = c.form == Form::rows;
      add(t, large, picks(c, decode ? "qmv" : sorted_rows ? "expert_tiles" : "rhs_tiles"));
      for (const char* r : {"simt", "rhs_tiles"}) {
        GatherQmmCase run = c;
        run.route = r;
        add(t, large, run);
      }
      GatherQmmCase qmv = c;
      qmv.route = "qmv";
      add(t, large, decode ? qmv : refusal(c, "qmv", "shape"));
    }
  }
  // Expert occupancy over 128 experts: most empty, one owning every row, a new run at every row,
  // sorted the wrong way, unsorted.
  const Weight e128{DType::bf16, 4, 64, 128, 200, 192};
  for (const Ids& ids : {few_experts(500), one_expert(1000), alternating(100), descending(333), uniform(333)})
    for (const char* r : {"", "rhs_tiles_bm16", "rhs_tiles_bm32", "simt"}) {
      const GatherQmmCase c = rows_of(r, e128, ids);
      add(t, large, *r ? c : picks(c, ids.sorted() ? "expert_tiles" : "rhs_tiles"));
    }
  // Several rows per batch element: runs of 5 rows cross 16-row tiles (30 rows: qmv still takes them);
  // M = 40: rhs_tiles picks 32-row tiles whose rows share an expert.
  const Weight q8{DType::bf16, 8, 128, 8, 136, 256};
  for (const char* r : kAllRoutes) add(t, large, batched_of(r, q8, 4, 5, 6));
  for (const char* r : kManyRowRoutes) add(t, large, batched_of(r, q8, 3, 40, 4));
  // qmv with several rows per CTA (M >= 2 rows sharing a weight matrix, wide enough for a CTA per
  // SM): at M = 2 the dense MLP's linears (4 rows per CTA, 2 staged); at 3-7 rows (8 rows per CTA
  // from 5) only where rhs_tiles does not take the matrix (K % 64 != 0: group 32, K = 1,056 / 2,080)
  // or many narrow matrices fill the grid (N = 256, 9 of them); the single matrix of a dense linear
  // (x [1, M, K]) and several batch elements, 8- and 4-bit, bf16 and f16; each also on the one-row
  // kernel (the test hook's qmv_one_row), both against the reference. The selector's side
  // (kQmvMaxSharedRows, bench/NOTES.md step 30): a wide matrix rhs_tiles takes goes to rhs_tiles from
  // 3 rows, qmv refusing it; a narrow one (the router's N = 128) stays on qmv to 7; from 8, rhs_tiles.
  struct MultiRow {
    Weight w;
    int64_t x_batch, M, B;
  };
  for (const MultiRow& m : {MultiRow{{DType::bf16, 8, 64, 1, 2112, 2816}, 1, 2, 1},
                            MultiRow{{DType::f16, 4, 128, 2, 2112, 2816}, 2, 2, 2},
                            MultiRow{{DType::bf16, 8, 32, 1, 2112, 1056}, 1, 7, 1},
                            MultiRow{{DType::bf16, 8, 32, 1, 2112, 1056}, 1, 5, 1},
                            MultiRow{{DType::f16, 8, 32, 3, 2120, 1056}, 2, 6, 3},
                            MultiRow{{DType::f16, 4, 32, 2, 2112, 2080}, 2, 6, 2},
                            MultiRow{{DType::bf16, 8, 32, 1, 2112, 2080}, 1, 3, 1},
                            MultiRow{{DType::bf16, 4, 32, 2, 2816, 2080}, 1, 7, 2},
                            MultiRow{{DType::bf16, 8, 64, 9, 256, 1024}, 9, 7, 9},
                            MultiRow{{DType::bf16, 4, 64, 12, 256, 1024}, 12, 3, 12}})
    for (const char* r : {"qmv", "qmv_one_row"}) add(t, large, batched_of(r, m.w, m.x_batch, m.M, m.B));
  const Weight dense8{DType::bf16, 8, 64, 1, 2112, 2816};
  add(t, large, picks(batched_of("", dense8, 1, 2, 1), "qmv"));
  add(t, large, picks(batched_of("", dense8, 1, 3, 1), "rhs_tiles"));
  add(t, large, refusal(batched_of("", dense8, 1, 3, 1), "qmv", "shape"));
  add(t, large, picks(batched_of("", {DType::bf16, 8, 32, 1, 2112, 1056}, 1, 7, 1), "qmv"));  // K % 64 != 0
  add(t, large, picks(batched_of("", {DType::bf16, 8, 64, 1, 128, 2816}, 1, 7, 1), "qmv"));   // the router's
  add(t, large, picks(batched_of("", dense8, 1, 8, 1), "rhs_tiles"));
  add(t, large, refusal(batched_of("", {DType::bf16, 8, 64, 1, 128, 2816}, 1, 8, 1), "qmv", "shape"));
  // Split-K of rhs_tiles' 16-row tiles: few columns, many rows, long K (the router's projection);
  // slices of unequal k-tile counts (K = 576: 9 tiles in 2 slices), N off the 128-column grid, rows
  // off the 16-row grid, unsorted ids; and the router's own form, x [1, T, K] as one batch element.
  struct Split {
    Weight w;
    Ids ids;
  };
  for (const Split& s : {Split{{DType::bf16, 8, 64, 4, 128, 2816}, uniform(300)},
                         Split{{DType::f16, 4, 32, 4, 100, 576}, sorted(130)},
                         Split{{DType::bf16, 4, 128, 3, 128, 768}, uniform(77)},
                         Split{{DType::bf16, 8, 64, 5, 36, 1024}, sorted(200)}})
    for (const char* r : {"rhs_tiles", "rhs_tiles_bm16"}) {
      GatherQmmCase c = rows_of(r, s.w, s.ids);
      c.split_k = c.route == "rhs_tiles";
      add(t, small, c);
    }
  // x [1, T, K] (the router's projection at prefill): rhs_tiles splits BM=16 tiles at 300 rows and
  // BM=64 tiles from 2048 (N <= 128).
  for (int bits : {4, 8})
    for (const char* r : {"rhs_tiles", "rhs_tiles_bm16"}) {
      GatherQmmCase c = batched_of(r, {DType::bf16, bits, 64, 1, 128, 2816}, 1, 300, 1);
      c.split_k = c.route == "rhs_tiles";
      add(t, small, c);
    }
  for (int bits : {4, 8}) {
    GatherQmmCase c = batched_of("rhs_tiles", {DType::bf16, bits, 64, 1, 128, 2816}, 1, 2048, 1);
    c.split_k = true;
    add(t, large, c);
  }
  // Gemma 4 26B-A4B projections (gate/up 704 x 2816, fused gate_up 1408, down 2816 x 704; 4-bit g64)
  // over 8 experts: decode (one token, top-8: the selector takes qmv) and 512 sorted prefill rows.
  for (const auto& nk : {std::pair<int64_t, int64_t>{704, 2816}, {1408, 2816}, {2816, 704}}) {
    const Weight w{DType::bf16, 4, 64, 8, nk.first, nk.second};
    add(t, large, picks(topk_of("", w, 1, 8), "qmv"));
    for (const char* r : kAllRoutes) add(t, large, topk_of(r, w, 1, 8));
    for (const char* r : {"rhs_tiles", "simt"}) add(t, large, rows_of(r, w, sorted(512)));
  }
  // Strided x rows (16- then 8-byte aligned) and weights one word past a 16-byte boundary: qmv and
  // simt take them (single-word loads), the tile routes refuse what they cannot load.
  const Weight strided{DType::bf16, 4, 64, 8, 136, 256};
  for (const char* r : kAllRoutes) add(t, small, with_operands(rows_of(r, strided, uniform(20)), Operands::x_stride_pad64));
  for (Operands o : {Operands::x_stride_pad4, Operands::w_word_offset}) {
    for (const char* r : {"qmv", "simt"}) add(t, small, with_operands(rows_of(r, strided, uniform(20)), o));
    add(t, small, with_operands(refusal(rows_of("", strided, uniform(20)), "rhs_tiles", "alignment"), o));
  }
  // The selector at the qmv threshold, and K = 224 (a multiple of 32, not of 64): qmv for decode,
  // simt beyond, rhs_tiles refuses it.
  const Weight sel{DType::bf16, 4, 64, 8, 64, 256};
  add(t, small, picks(rows_of("", sel, uniform(kQmvMaxRows)), "qmv"));
  add(t, small, picks(rows_of("", sel, uniform(kQmvMaxRows + 1)), "rhs_tiles"));
  const Weight k224{DType::bf16, 4, 32, 8, 64, 224};
  add(t, small, picks(rows_of("", k224, uniform(100)), "simt"));
  add(t, small, picks(rows_of("", k224, uniform(8)), "qmv"));
  add(t, small, refusal(rows_of("", k224, uniform(100)), "rhs_tiles", "alignment"));
  add(t, small, rows_of("simt", k224, uniform(100)));
  // The expert tile route and both of its kernels on its plan's edges: tails of every tile class (1,
  // 14, 27, ... rows), one expert owning every row (four 64-row tiles and a 44-row tail), empty
  // experts between two runs, 96 then 97 rows (the n128 build runs a <= 96-row tile as n96); N not a
  // multiple of the CTA's 128 columns, one k tile (K = 64), group 128 (one group over two k tiles).
  add(t, small, rows_of("expert_tiles", odd, one_expert(300)));
  add(t, small, rows_of("expert_tiles", odd, tails(5)));
  add(t, small, rows_of("expert_tiles", odd, runs(2, 64, 33)));
  const Weight edges[] = {{DType::bf16, 4, 64, 8, 200, 192}, {DType::bf16, 4, 128, 16, 136, 256},
                          {DType::bf16, 4, 64, 4, 8, 64}, {DType::bf16, 4, 64, 6, 712, 640}};
  for (Weight w : edges)
    for (const Ids& ids : {one_expert(300), tails(13), runs(1, 65, 17), runs(0, 96, 97)})
      for (DType dtype : {DType::bf16, DType::f16})
        for (const char* r : kTileKernels) {
          w.dtype = dtype;
          add(t, small, rows_of(r, w, ids));
        }
  // The 8-bit wgmma build (bf16, n128 only) on the same edges: every tile class, a partial column
  // block (N = 712) and 10 k tiles.
  for (const Ids& ids : {one_expert(300), tails(13), runs(1, 65, 17), runs(0, 96, 97)})
    add(t, small, rows_of("expert_tiles_wgmma", {DType::bf16, 8, 64, 6, 712, 640}, ids));
  // Mean rows per expert picks the wgmma build (kWidths: <= 16 rows n32, <= 32 n64, else n128, where
  // an 80-row tile runs as n96 and 130 rows as a full tile and a tail); the skewed patterns above
  // also run tall tiles as pieces of the n32 (E = 16) and n64 (E = 4) builds.
  for (int64_t n : {12, 24, 80, 130})
    for (const char* r : kTileKernels) add(t, small, rows_of(r, odd, per_expert(n)));
  // Exact Gemma 4 expert GEMMs (128 experts, fused gate_up 1408 x 2816 and down 2816 x 704) at 4096,
  // 8192 and 16384 sorted rows (512, 1024, 2048 tokens x top-8).
  for (const auto& nk : {std::pair<int64_t, int64_t>{1408, 2816}, {2816, 704}}) {
    const Weight w{DType::bf16, 4, 64, 128, nk.first, nk.second};
    for (int64_t rows : {4096, 8192, 16384}) add(t, large, picks(rows_of("", w, sorted(rows)), "expert_tiles"));
    for (const char* r : kTileKernels) add(t, large, rows_of(r, w, sorted(4096)));
  }
  // The public op on CUDA: the unsorted decode form, sorted rows, a 3-bit transpose=false weight.
  add(t, small, topk_of("op", {DType::bf16, 4, 64, 16, 200, 256}, 5, 4));
  add(t, small, rows_of("op", {DType::bf16, 4, 64, 16, 200, 256}, sorted(300)));
  add(t, small, batched_of("op", {DType::bf16, 3, 64, 3, 128, 64}, 2, 7, 3, false));
}

void moe_rows(Table& t) {
  const Subset small = Subset::sanitize, large = Subset::large;
  // switch_glu and the whole layer over 8 and 128 experts, both gate/up layouts and activations,
  // top-1/2/8, from one token to 300 (unsorted decode and sorted prefill paths).
  struct Variant {
    int64_t E;
    bool fused;
    Activation act;
  };
  for (const Variant& v : {Variant{8, false, Activation::geglu}, Variant{8, true, Activation::swiglu},
                           Variant{128, false, Activation::swiglu}, Variant{128, true, Activation::geglu}})
    for (int k : {1, 2, 8})
      for (int64_t T : {1, 7, 8, 64, 300}) {
        MoeGeometry g;
        g.E = v.E;
        g.k = k;
        g.fused = v.fused;
        g.act = v.act;
        add(t, large, SwitchGluCase{g, T, false});
        add(t, large, MoeLayerCase{g, T, MoePath::automatic});
      }
  // Small ones for the sanitizer: 4 experts, unsorted (3 x 2 rows) and sorted (9 x 8 rows, experts
  // repeated within a token); the layer at 2 and 40 tokens.
  for (bool fused : {false, true}) {
    MoeGeometry g;
    g.E = 4;
    g.fused = fused;
    add(t, small, SwitchGluCase{g, 3, false});
    g.k = 8;
    add(t, small, SwitchGluCase{g, 9, true});
  }
  for (int64_t T : {2, 40}) add(t, small, MoeLayerCase{MoeGeometry{}, T, MoePath::automatic});
  // 8-bit affine experts (the q8 preset) at prefill sizes, bf16 and f16, group 64 and 128, separate
  // and fused gate/up: at 300 tokens (75 rows per expert) bf16 runs the wgmma kernel's 8-bit build
  // (its GLU, plain and combine forms; from 32 rows per expert: kWgmma8BitMinRowsPerExpert) and f16
  // the mma.sync kernel; at 60 tokens (15 rows per expert) both run the mma.sync kernel.
  for (DType dtype : {DType::bf16, DType::f16})
    for (int group : {64, 128}) {
      MoeGeometry g;
      g.E = 16;
      g.k = 4;
      g.bits = 8;
      g.group = group;
      g.dtype = dtype;
      g.fused = group == 128;
      for (int64_t T : {60, 300}) {
        add(t, large, SwitchGluCase{g, T, false});
        add(t, large, MoeLayerCase{g, T, MoePath::automatic});
      }
    }
  // Experts in MLX's fp modes: the decode layer (mxfp4 / nvfp4 in bf16, T <= 16), qmv (mxfp8 and
  // f16 at decode sizes) and the expert tile route's mma.sync kernel (sorted prefill rows, bf16).
  for (QuantMode mode : {QuantMode::mxfp4, QuantMode::mxfp8, QuantMode::nvfp4})
    for (bool fused : {false, true}) {
      MoeGeometry g;
      g.mode = mode;
      g.bits = quant_mode_bits(mode);
      g.group = quant_mode_group_size(mode);
      g.fused = fused;
      add(t, small, SwitchGluCase{g, 3, false});
      add(t, small, MoeLayerCase{g, 5, MoePath::automatic});
      add(t, large, MoeLayerCase{g, 40, MoePath::automatic});
    }
  // The GLU product as two kernels instead of one, and as one on the same geometry.
  MoeGeometry e16;
  e16.E = 16;
  e16.k = 4;
  e16.fused = true;
  add(t, large, MoeLayerCase{e16, 50, MoePath::separate});
  add(t, large, MoeLayerCase{e16, 50, MoePath::automatic});
  // The decode layer (T <= 16, T * k <= 128; 8-bit experts T <= 8) at Gemma 4's geometry and at small
  // odd ones: bf16 and f16, 4- and 8-bit experts, group 32 / 64 / 128, quantized and dense routers, k
  // from 1 to 8, E = k. From T = 9 an expert can hold more than 8 rows (the plan's groups of 8): at
  // E = 16, k = 8 and T = 16 every expert averages 8 rows; E = k = 8 gives every expert all T rows.
  const std::vector<int64_t> decode_tokens = {1, 2, 3, 7, 8};
  const std::vector<int64_t> decode_tokens_4bit = {1, 2, 3, 7, 8, 9, 12, 16};
  std::vector<std::pair<MoeGeometry, std::vector<int64_t>>> decode = {
      {{2816, 704, 16, 8, 4, 64, 8, false, Activation::geglu, DType::bf16}, decode_tokens_4bit},
      {{2816, 704, 16, 8, 4, 64, 8, true, Activation::geglu, DType::f16}, decode_tokens_4bit},
      {{256, 128, 8, 2, 4, 128, 8, false, Activation::geglu, DType::bf16}, decode_tokens_4bit},
      {{256, 128, 8, 2, 4, 128, 8, true, Activation::swiglu, DType::f16}, decode_tokens},
      {{256, 128, 8, 8, 4, 64, 8, false, Activation::swiglu, DType::bf16}, {1, 3, 8, 11}},  // 16: the sanitizer row
      {{256, 128, 4, 1, 8, 64, 8, true, Activation::geglu, DType::bf16}, decode_tokens}};
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (int bits : {4, 8}) {
      const std::vector<int64_t>& tokens = bits == 4 ? decode_tokens_4bit : decode_tokens;
      decode.push_back({{320, 96, 16, 4, bits, 32, 8, false, Activation::geglu, dtype}, tokens});
      decode.push_back({{320, 96, 16, 4, bits, 32, 4, true, Activation::swiglu, dtype}, tokens});
    }
    decode.push_back({{320, 96, 16, 4, 8, 32, 0, false, Activation::swiglu, dtype}, decode_tokens});
  }
  for (const auto& d : decode)
    for (int64_t T : d.second) add(t, large, MoeLayerCase{d.first, T, MoePath::decode});
  // For the sanitizers: 8 experts, k = 8, 16 tokens (every expert's 16 rows as two plan groups).
  add(t, small, MoeLayerCase{{256, 128, 8, 8, 4, 64, 8, false, Activation::swiglu, DType::bf16}, 16, MoePath::decode});
  // The decode layer's fp4 kernels (mxfp4 group 32, nvfp4 group 16; bf16): separate and fused
  // gate_up, both activations, Gemma 4's geometry, k from 2 to 8 (T = 1 / 8: one and eight rows per
  // expert group; 3: rows shared by tokens; 16: experts over 8 rows, split plan groups); routers affine 8-bit and in each fp mode (the router
  // kernel's kFp), which the general path (rhs_tiles / qmv) also runs at T = 40.
  for (QuantMode mode : {QuantMode::mxfp4, QuantMode::nvfp4}) {
    const int group = quant_mode_group_size(mode);
    std::vector<MoeGeometry> fp_decode = {{2816, 704, 16, 8, 4, group, 8, false, Activation::geglu, DType::bf16},
                                          {320, 96, 16, 4, 4, group, 8, true, Activation::swiglu, DType::bf16},
                                          {256, 128, 8, 2, 4, group, 8, false, Activation::geglu, DType::bf16}};
    for (MoeGeometry& g : fp_decode) {
      g.mode = mode;
      for (int64_t T : {1, 3, 8, 16}) add(t, large, MoeLayerCase{g, T, MoePath::decode});
    }
    for (QuantMode router : {QuantMode::mxfp4, QuantMode::mxfp8, QuantMode::nvfp4}) {
      MoeGeometry g = fp_decode[1];
      g.mode = mode;
      g.router_mode = router;
      g.router_bits = quant_mode_bits(router);
      for (int64_t T : {1, 8}) add(t, large, MoeLayerCase{g, T, MoePath::decode});
      add(t, large, MoeLayerCase{g, 40, MoePath::automatic});
    }
  }
  // Qwen3-MoE: the softmax_topk router and SwiGLU experts through the same layer. Qwen3-30B-A3B's
  // geometry on the decode layer (forced, and against the general path) and at decode, sorted and
  // prefill sizes as the library picks; small ones, with and without renormalisation, on both
  // paths (the decode layer also with 8-bit experts and a dense router).
  MoeGeometry qwen3{2048, 768, 128, 8, 4, 64, 8, false, Activation::swiglu, DType::bf16, RouterKind::softmax_topk};
  // (T = 96: 768 sorted rows, the tile route, and a float64 reference the CPU computes in seconds.)
  for (int64_t T : {1, 8, 16}) add(t, large, MoeLayerCase{qwen3, T, MoePath::decode});
  for (int64_t T : {1, 8, 96}) add(t, large, MoeLayerCase{qwen3, T, MoePath::automatic});
  add(t, large, MoeLayerCase{qwen3, 40, MoePath::separate});
  MoeGeometry qwen3_small{256, 128, 8, 2, 4, 64, 8, false, Activation::swiglu, DType::bf16, RouterKind::softmax_topk};
  for (bool renorm : {true, false}) {
    qwen3_small.norm_topk_prob = renorm;
    for (int64_t T : {9, 40}) add(t, small, MoeLayerCase{qwen3_small, T, MoePath::automatic});
    add(t, renorm ? small : large, MoeLayerCase{qwen3_small, 3, MoePath::decode});  // the sanitizer sees the decode router
    MoeGeometry q8 = qwen3_small;
    q8.bits = 8;
    q8.router_bits = 0;
    q8.dtype = DType::f16;
    add(t, large, MoeLayerCase{q8, 5, MoePath::decode});
  }
}

void route_rows(Table& t) {
  const Subset small = Subset::sanitize, large = Subset::large;
  // f32 routers pick exactly the CPU's experts; bf16 logits tie often (near-ties may differ).
  add(t, small, RouteCase{16, 64, 4, DType::f32, 0, 64, 9, true});
  add(t, large, RouteCase{128, 256, 8, DType::f32, 8, 64, 37, true});
  add(t, large, RouteCase{128, 512, 8, DType::bf16, 8, 64, 64, false});
  add(t, large, RouteCase{64, 256, 2, DType::bf16, 0, 64, 33, false});
  // Gemma 4's router with a bf16 projection at prefill (the dense linear's tile route) and decode.
  for (int64_t T : {512, 3}) add(t, large, RouteCase{128, 2816, 8, DType::bf16, 0, 64, T, false});
  add(t, large, RouteCase{1024, 64, 8, DType::f32, 0, 64, 5, true});  // wide expert counts
  add(t, large, RouteCase{8, 64, 8, DType::f32, 0, 64, 3, true});     // top-k = E
  // Quantized projections of every width and group size, both half dtypes, off the tile grids.
  add(t, small, RouteCase{200, 384, 8, DType::bf16, 4, 128, 37, false});
  add(t, small, RouteCase{40, 256, 8, DType::f16, 8, 32, 300, false});
  add(t, small, RouteCase{128, 2816, 8, DType::bf16, 8, 64, 130, false});
  add(t, small, RouteCase{8, 64, 8, DType::f16, 4, 64, 17, false});
  add(t, small, RouteCase{128, 512, 8, DType::bf16, 4, 32, 9, false});
  // Qwen3-MoE's softmax_topk router (no norm; softmax over all E; top-k; renormalised or not).
  const RouterKind qwen3 = RouterKind::softmax_topk;
  add(t, small, RouteCase{16, 64, 4, DType::f32, 0, 64, 9, true, qwen3, true});
  add(t, small, RouteCase{16, 64, 4, DType::f32, 0, 64, 9, true, qwen3, false});
  add(t, large, RouteCase{128, 256, 8, DType::f32, 8, 64, 37, true, qwen3, true});
  add(t, large, RouteCase{1024, 64, 8, DType::f32, 0, 64, 5, true, qwen3, true});
  add(t, small, RouteCase{128, 2048, 8, DType::bf16, 8, 64, 130, false, qwen3, true});
  add(t, small, RouteCase{40, 256, 8, DType::f16, 8, 32, 300, false, qwen3, false});
}

void op_rows(Table& t) {
  const Subset small = Subset::sanitize, large = Subset::large;
  for (Rounding rounding : {Rounding::cpu, Rounding::gpu})
    for (int bits : {2, 3, 4, 5, 6, 8})
      for (int group : {32, 64, 128}) {
        add(t, small, QuantizeCase{Values::edge_cases, DType::bf16, bits, group, rounding, 1, 12});
        add(t, small, QuantizeCase{Values::ties, DType::f32, bits, group, rounding, 1, 1});
      }
  for (DType dtype : {DType::f16, DType::f32})
    for (Rounding rounding : {Rounding::cpu, Rounding::gpu})
      for (int bits : {3, 4, 8}) add(t, large, QuantizeCase{Values::edge_cases, dtype, bits, 64, rounding, 1, 7});
  add(t, large, QuantizeCase{Values::edge_cases, DType::bf16, 4, 64, Rounding::gpu, 3, 33});  // [E, N, K]
  for (QuantMode mode : {QuantMode::mxfp4, QuantMode::mxfp8, QuantMode::nvfp4})
    for (DType dtype : {DType::bf16, DType::f16, DType::f32})
      add(t, small, QuantizeCase{Values::edge_cases, dtype, quant_mode_bits(mode), quant_mode_group_size(mode),
                                 Rounding::cpu, 2, 12, mode});
  // gather_sort: 80-byte rows (byte-wise copy), 128-byte rows (16-byte copies) with uint32 ids, long
  // runs of equal ids (stability), Gemma's 2048 x 8 over 128.
  add(t, small, SortCase{1, 1, 4, 16, DType::i32});
  add(t, small, SortCase{3, 2, 3, 40, DType::i32});
  add(t, small, SortCase{9, 8, 8, 64, DType::u32});
  add(t, large, SortCase{64, 8, 128, 64, DType::i32});
  add(t, large, SortCase{1000, 3, 5, 24, DType::i32});
  add(t, large, SortCase{2048, 8, 128, 32, DType::i32});
  add(t, large, SortCase{300, 2, 1024, 8, DType::u32});
  for (DType dtype : {DType::bf16, DType::f16, DType::f32})
    for (Activation act : {Activation::geglu, Activation::swiglu})
      for (const Shape& shape : {Shape{3, 5}, Shape{16, 704}, Shape{2, 7, 1408}}) add(t, small, GluCase{act, dtype, shape});
  add(t, small, CombineCase{1, 1, 8, DType::bf16, DType::bf16, false});
  add(t, small, CombineCase{5, 8, 33, DType::bf16, DType::bf16, false});
  add(t, small, CombineCase{3, 2, 64, DType::f32, DType::bf16, false});
  add(t, small, CombineCase{4, 3, 48, DType::f16, DType::f32, false});
  add(t, large, CombineCase{300, 8, 2816, DType::bf16, DType::bf16, true});
}

}  // namespace

std::vector<BackendCase> backend_cases(Subset subset) {
  Table all;
  gather_qmm_rows(all);
  moe_rows(all);
  route_rows(all);
  op_rows(all);
  Table out;
  for (BackendCase& c : all)
    if (c.subset == subset) out.push_back(std::move(c));
  return out;
}

}  // namespace expertqmm::test

// The decode layer's gate/up kernel as a ring of work items (EXPERTQMM_DECODE_GATE_UP_RING; bench/NOTES.md
// step 42): the one-item tile's three steps (moe_decode_tiles.cuh: gate_up_glu_mma_tile's work split)
// as device functions on one shared-memory buffer, and the ring that runs them over two buffers.
// The one-item tile keeps its own body (its SASS is what was measured; the ring is not measured yet).
#pragma once
#include "cuda/moe_decode_tiles.cuh"

namespace expertqmm::cuda::decode {

// The gate/up tile's three steps (gate_up_glu_mma_tile's work split in moe_decode_tiles.cuh says what
// each does), as device functions of one CTA on one shared-memory buffer (L's regions), for the ring
// below. They are copies of gate_up_glu_mma_tile's steps, in the same order: the ring's output bits
// rest on the two staying in step (GpuMoeDecode.GateUpRingGivesTheOneItemGridsBytes checks them),
// until the one-item tile calls these too (bench/NOTES.md step 42).
//
// Step 1: requests expert e's 32 staged code rows of output columns [col0, col0 + 16) with their
// scales and biases into buf, as two commit groups (the first half of the K groups with the scales
// and biases, then the second half).
template <int G, bool kFp>
__device__ __forceinline__ void gate_up_request(const GateUpArgs& a, const GateUpTcLayout& L, int e, int col0,
                                                unsigned char* buf) {
  const int tid = threadIdx.x;
  unsigned char* codes = buf + L.codes;
  uint16_t* sc = reinterpret_cast<uint16_t*>(buf + L.scales);  // raw D, (32 staged rows, groups)
  uint16_t* bi = reinterpret_cast<uint16_t*>(buf + L.biases);
  const int chunks = a.H / 32;  // 16-byte chunks per code row
  const int half_chunks = (L.groups / 2) * (G / 32);
  // 1a. codes: thread (r = tid / 8, j = tid % 8) copies chunks j, j + 8, ... of staged row r (r < 16:
  //     gate, else up), the first half of the K groups as one commit group, the second as another.
  //     Column blocks are whole: I is a multiple of 32 for 4-bit experts (down's K).
  const int64_t gate_first = static_cast<int64_t>(e) * a.gate_rows_per_expert + a.gate_row0 + col0;
  const int64_t up_first = static_cast<int64_t>(e) * a.up_rows_per_expert + a.up_row0 + col0;
  constexpr int kPerRow = kThreads / (2 * kTcRows);  // 8 threads per staged row
  const int r = tid / kPerRow, j = tid % kPerRow;
  const uint4* src = reinterpret_cast<const uint4*>(r < kTcRows ? a.gate.w : a.up.w) +
                     ((r < kTcRows ? gate_first : up_first) + r % kTcRows) * chunks;
  unsigned char* dst = codes + r * L.code_row;
  for (int c = j; c < half_chunks; c += kPerRow) device::cp_async_16(dst + 16 * c, src + c, true);
  // 1b. the scales and biases of the two 16-row spans (contiguous, 32 * groups bytes each, 16-byte
  //     aligned: supports_decode_layer), raw, with the first half. kFp: the two spans of scale
  //     codes (16 * fp_groups bytes each, 16-byte aligned: supports_decode_layer).
  if constexpr (kFp) {
    const int fp_groups = a.H >> a.gate.group_shift;
    unsigned char* to = reinterpret_cast<unsigned char*>(sc);
    for (int i = tid; i < 2 * fp_groups; i += kThreads) {
      const int which = i / fp_groups, c = i - which * fp_groups;  // which: gate, up
      const uint8_t* from = (which == 0 ? a.gate.fp_scales : a.up.fp_scales) + (which == 0 ? gate_first : up_first) * fp_groups;
      device::cp_async_16(to + which * kTcRows * fp_groups + 16 * c, from + 16 * c, true);
    }
  } else {
    const int span_chunks = 2 * L.groups;
    for (int i = tid; i < 4 * span_chunks; i += kThreads) {
      const int which = i / span_chunks, c = i - which * span_chunks;  // which: gate s, gate b, up s, up b
      const uint16_t* base = which == 0 ? a.gate.scales : which == 1 ? a.gate.biases : which == 2 ? a.up.scales : a.up.biases;
      const int64_t first = (which < 2 ? gate_first : up_first) * L.groups;
      uint16_t* to = (which & 1 ? bi : sc) + (which >> 1) * kTcRows * L.groups;
      device::cp_async_16(to + 8 * c, base + first + 8 * c, true);
    }
  }
  device::cp_async_commit();
  for (int c = half_chunks + j; c < chunks; c += kPerRow) device::cp_async_16(dst + 16 * c, src + c, true);
  device::cp_async_commit();
}

// Step 2: the K loop over buf's codes into acc (zeroed by the caller), for the lane's activation row
// (token tok; live_n: the lane's B column is one of the group's rows). next_in_flight: two more commit
// groups (the ring's next item) were issued after buf's, so each half waits for one group more.
template <DType D, int G, bool kFp>
__device__ __forceinline__ void gate_up_k_loop(const GateUpArgs& a, const GateUpTcLayout& L, const unsigned char* buf,
                                               int64_t tok, bool live_n, bool next_in_flight, float (&acc)[2][4]) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  constexpr float kBias = device::kCodeBias<MmaType<D>>;
  const unsigned char* codes = buf + L.codes;
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(buf + L.scales);
  const uint16_t* bi = reinterpret_cast<const uint16_t*>(buf + L.biases);
  const int half_groups = L.groups / 2;
  // 1c. the lane's activation row: B column g is the group's row g (token tok); units of 8 values,
  //     the lane's first unit of group grp is grp * G/8 + t * G/32.
  const uint4* xg = reinterpret_cast<const uint4*>(a.x + tok * a.x_stride) + t * (G / 32);
  auto load_x = [&](int grp, uint4 (&xb)[G / 32]) {
#pragma unroll
    for (int w = 0; w < G / 32; ++w)
      xb[w] = live_n ? packed_x_order(__ldg(xg + grp * (G / 8) + w)) : make_uint4(0u, 0u, 0u, 0u);
  };
  const uint32_t ones[4] = {kTcOnePair<D>, kTcOnePair<D>, kTcOnePair<D>, kTcOnePair<D>};

  // 2. K split across warps; each half as soon as it has landed.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int grp_begin = (h == 0 ? 0 : half_groups) + warp, grp_end = h == 0 ? half_groups : L.groups;
    uint4 xb[G / 32];
    if (grp_begin < grp_end) load_x(grp_begin, xb);  // in flight while the codes land
    if (h == 0) {
      if (next_in_flight) device::cp_async_wait<3>();
      else device::cp_async_wait<1>();
    } else {
      if (next_in_flight) device::cp_async_wait<2>();
      else device::cp_async_wait<0>();
    }
    __syncthreads();
    for (int grp = grp_begin; grp < grp_end; grp += kWarps) {
      uint4 xn[G / 32];
      if (grp + kWarps < grp_end) load_x(grp + kWarps, xn);
      if constexpr (kFp) {
        const int fp_groups = a.H >> a.gate.group_shift, si = fp_scale_index(grp, t, a.gate.group_shift);
        const bool e4m3 = a.gate.fp_mode == static_cast<int>(QuantMode::nvfp4);
        const uint8_t* codes8 = reinterpret_cast<const uint8_t*>(sc);
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {
          const int r = tile * kTcRows + g;
          const uint32_t s_lo = device::FpDequantBf16::scale_pair(codes8[r * fp_groups + si], e4m3);
          const uint32_t s_hi = device::FpDequantBf16::scale_pair(codes8[(r + 8) * fp_groups + si], e4m3);
          tc_fp4_block_dot(codes + r * L.code_row, codes + (r + 8) * L.code_row, grp, t, xb[0], s_lo, s_hi, acc[tile]);
        }
        xb[0] = xn[0];
        continue;
      }
      float xsum[4] = {0.f, 0.f, 0.f, 0.f};  // sum(x) of columns 2t, 2t+1 (c0, c1)
#pragma unroll
      for (int w = 0; w < G / 32; ++w) {
        device::Mma<MmaType<D>>::run(xsum, ones, xb[w].x, xb[w].y);
        device::Mma<MmaType<D>>::run(xsum, ones, xb[w].z, xb[w].w);
      }
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
        const int r = tile * kTcRows + g;
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        tc_group_dot<D, G>(codes + r * L.code_row, codes + (r + 8) * L.code_row, grp, t, xb, c);
        const float s0 = raw_param<D>(sc[r * L.groups + grp]), s1 = raw_param<D>(sc[(r + 8) * L.groups + grp]);
        const float b0 = fmaf(-kBias, s0, raw_param<D>(bi[r * L.groups + grp]));  // b - M s: c holds sum(x (M + q))
        const float b1 = fmaf(-kBias, s1, raw_param<D>(bi[(r + 8) * L.groups + grp]));
        acc[tile][0] = fmaf(s0, c[0], fmaf(b0, xsum[0], acc[tile][0]));
        acc[tile][1] = fmaf(s0, c[1], fmaf(b0, xsum[1], acc[tile][1]));
        acc[tile][2] = fmaf(s1, c[2], fmaf(b1, xsum[0], acc[tile][2]));
        acc[tile][3] = fmaf(s1, c[3], fmaf(b1, xsum[1], acc[tile][3]));
      }
#pragma unroll
      for (int w = 0; w < G / 32; ++w) xb[w] = xn[w];
    }
  }
}

// Step 3: the 8 warps' partials (warp, staged row, activation row) through red (the buffer's codes
// space, free once every warp is past its K loop: the first barrier), summed in warp order, the
// GLU, into hidden[row_of(begin + n), col0 + j].
template <DType D, Activation A, class RowOf>
__device__ __forceinline__ void gate_up_reduce_glu(const GateUpArgs& a, unsigned char* red_space, const float (&acc)[2][4],
                                                   int count, int begin, int col0, RowOf row_of) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  __syncthreads();
  float* red = reinterpret_cast<float*>(red_space);  // [kWarps][32 staged rows][kTcMaxN]
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
    float* rw = red + (warp * 2 * kTcRows + tile * kTcRows + g) * kTcMaxN + 2 * t;
    rw[0] = acc[tile][0];
    rw[1] = acc[tile][1];
    rw[8 * kTcMaxN] = acc[tile][2];
    rw[8 * kTcMaxN + 1] = acc[tile][3];
  }
  __syncthreads();
  for (int i = tid; i < kTcRows * count; i += kThreads) {
    const int j = i % kTcRows, n = i / kTcRows;
    float gate = 0.f, up = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      gate += red[(w * 2 * kTcRows + j) * kTcMaxN + n];
      up += red[(w * 2 * kTcRows + kTcRows + j) * kTcMaxN + n];
    }
    const int64_t out_row = row_of(begin + n);
    a.hidden[out_row * a.I + col0 + j] = Elem<D>::store(device::glu<A>(round_to<D>(gate), round_to<D>(up)));
  }
}

// Work split of the ring: a 1-D grid of at most 2 CTAs per SM (kRingCtasPerSm), 256 threads,
// __launch_bounds__(256, 2). The work items are the one-item grid's CTAs, (expert group g, 16-column
// block cb) in group-major order, item = g * col_blocks + cb over a.group_rows groups; CTA c takes
// items c, c + gridDim.x, ... . Shared memory: two buffers of one item each (GateUpTcLayout, 128-byte
// aligned: 2 x 51 KB for Gemma). While a CTA computes item i from one buffer, item i + gridDim.x's
// codes, scales and biases stream into the other (its two commit groups are issued before item i's
// K loop, which then waits for one group more per half), and the plan entry of the item after that
// is read before item i's K loop as well, so neither round trip stands between two items; the
// one-item grid pays both at every CTA's start (bench/NOTES.md steps 39-41). A CTA stops at the
// first item past the plan's groups (in group-major order every later item is past them too), or at
// an expert id out of range (recorded as a fault: the call is then an error, cuda_check; unlike the
// one-item grid, the CTA's later items are not computed either, so "the same bytes" holds for valid
// plans). The launch sizes the grid by the CTAs that fit an SM (at most 2).
constexpr int kRingCtasPerSm = 2;
// One ring buffer: an item's GateUpTcLayout, rounded up to 128 bytes (the launch asks for two).
__host__ __device__ inline size_t ring_buffer_bytes(const GateUpTcLayout& L) { return (L.total + 127) / 128 * 128; }
template <DType D, int G, Activation A, bool kFp>
__device__ __forceinline__ void gate_up_glu_mma_ring(const GateUpArgs& a, unsigned char* smem) {
  const int g = (threadIdx.x & 31) >> 2;
  const GateUpTcLayout L(a.H, G);
  const size_t buf_bytes = ring_buffer_bytes(L);
  const int col_blocks = a.I / kTcRows;
  const int items = col_blocks * a.group_rows;
  const int stride = gridDim.x;
  // An item's plan entry (with the token of the lane's activation row g), or groups = 0 past the items.
  auto entry = [&](int it) { return it < items ? plan_group(a, it / col_blocks, g) : PlanGroup{0, 0, 0, 0, 0}; };
  // Whether an item is to be computed; a bad expert id is recorded (once per group, by its block 0).
  auto live = [&](int it, const PlanGroup& p) {
    if (it >= items || it / col_blocks >= p.groups) return false;
    if (p.expert >= 0 && p.expert < a.E) return true;
    if (threadIdx.x == 0 && it % col_blocks == 0)
      record_fault(a.faults, kFaultExpertOutOfRange, static_cast<uint32_t>(p.expert), static_cast<uint32_t>(a.E));
    return false;
  };
  int item = blockIdx.x;
  PlanGroup pg = entry(item);
  if (!live(item, pg)) return;  // uniform
  gate_up_request<G, kFp>(a, L, pg.expert, (item % col_blocks) * kTcRows, smem);
  int next = item + stride;
  PlanGroup pn = entry(next);
  for (int k = 0;; ++k) {
    unsigned char* buf = smem + (k & 1) * buf_bytes;
    const bool has_next = live(next, pn);
    if (has_next) gate_up_request<G, kFp>(a, L, pn.expert, (next % col_blocks) * kTcRows, smem + ((k + 1) & 1) * buf_bytes);
    const int after = next + stride;
    const PlanGroup pa = has_next ? entry(after) : PlanGroup{0, 0, 0, 0, 0};  // in flight during the K loop
    const int count = min(pg.count, kTcMaxN);  // a plan group holds <= T <= 8 rows: the mma's n
    const bool live_n = g < count;
    float acc[2][4] = {};
    gate_up_k_loop<D, G, kFp>(a, L, buf, live_n ? pg.token : 0, live_n, has_next, acc);
    gate_up_reduce_glu<D, A>(a, buf + L.codes, acc, count, pg.begin, (item % col_blocks) * kTcRows,
                             [&](int i) { return plan_row(a, i); });
    if (!has_next) break;
    __syncthreads();  // buf's partials read by every thread before item + 2 * stride's request refills it
    item = next;
    pg = pn;
    next = after;
    pn = pa;
  }
}

}  // namespace expertqmm::cuda::decode

// The router's top-k of one token on one warp and the weights of the k: shared by router.cu
// (route_into) and moe_decode_router.cu (the decode layer's router), both router kinds, so all
// pick the same experts in the same slot order with the same tie rules:
//   idx = top_k experts by descending score, NaN first, ties -> higher expert id (MLX's rule,
//         src/cpu/router.cpp and docs/numerics.md; +0 and -0 tie)
//   w   = finish(e, numerator(score[idx], score[idx_0]), sum of the k numerators)  fp32, slot order
// Gemma 4 (warp_topk_softmax): scores are logits, numerator exp(s - s_max), finish
// p / sum * per_expert_scale[e]. Qwen3-MoE (warp_softmax_topk): scores are the rounded softmax
// probabilities, numerator s itself, finish s / sum (renormalised) or s.
#pragma once
#include <cstdint>

namespace expertqmm::cuda::device {

// A 64-bit key whose unsigned order is the routing order: NaN above every number, then larger
// logit, then higher expert id. High word: the float made order-preserving as an unsigned integer
// (-0 first made +0, so the two zeros tie as they do in MLX's comparison); low word: the id.
__device__ __forceinline__ unsigned long long routing_key(float logit, int32_t expert) {
  uint32_t bits = __float_as_uint(logit);
  if (bits == 0x80000000u) bits = 0u;
  uint32_t ordered;
  if (isnan(logit)) ordered = 0xffffffffu;
  else ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | static_cast<uint32_t>(expert);
}

// The logit a routing key was made from (exact up to the sign of a zero: the key's high word is a
// bijection of the float bits once -0 is +0, every NaN becoming one NaN).
__device__ __forceinline__ float key_logit(unsigned long long key) {
  const uint32_t ordered = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
}
__device__ __forceinline__ int32_t key_expert(unsigned long long key) {
  return static_cast<int32_t>(static_cast<uint32_t>(key & 0xffffffffu));
}

constexpr int kTopkCachedKeys = 8;  // keys a lane keeps in registers: E <= 256 is read once

// Top-k over one token's E scores and the weights of the k; called by all 32 lanes of a warp
// (warp-uniform arguments).
//   logit(e)        -> float: the token's score of expert e (already rounded to its dtype)
//   numerator(s, s0) -> float: the slot's share before normalisation (s0: the best score)
//   finish(e, p, sum) -> float: the slot's weight from its numerator and the sum of the k
//   indices         (k,) int32 of this token, best first (written, and re-read for k > 32)
//   store_weight(slot, w): writes the slot's weight (the caller rounds it to its dtype)
// Lane l reads experts l, l+32, ... once into keys (the first 8 in registers, the rest re-read per
// pass). Pass j: each lane finds its largest key strictly below the key picked in pass j-1 (keys
// are distinct, so the k passes pick k distinct experts in order without marking anything), then
// a shuffle max gives every lane the warp's. Slots go in blocks of 32: lane l keeps the key of
// slot 32b + l, writes its index and computes its softmax numerator; the sum is folded in slot
// order through shuffles (the CPU's order), so the weights are written by all lanes at once.
// Slots of earlier blocks (k > 32 only) are recomputed from the indices the same lanes wrote.
template <class Logit, class Numerator, class Finish, class StoreWeight>
__device__ __forceinline__ void warp_topk_weights(Logit logit, int64_t E, int k, Numerator numerator, Finish finish,
                                                  int32_t* indices, StoreWeight store_weight) {
  const int lane = threadIdx.x & 31;
  // 0 is below every key (a key's high word is never 0), so it stands for "no expert".
  unsigned long long cached[kTopkCachedKeys];
#pragma unroll
  for (int c = 0; c < kTopkCachedKeys; ++c) {
    const int64_t e = lane + 32 * c;
    cached[c] = e < E ? routing_key(logit(e), static_cast<int32_t>(e)) : 0ull;
  }
  unsigned long long bound = ~0ull;
  bool first = true;
  float max_logit = 0.0f, sum = 0.0f;
  unsigned long long mine = 0;  // the key of this lane's slot in the current block
  for (int block = 0; block * 32 < k; ++block) {
    const int in_block = min(32, k - block * 32);
    for (int j = 0; j < in_block; ++j) {
      unsigned long long best = 0;
#pragma unroll
      for (int c = 0; c < kTopkCachedKeys; ++c) {
        const unsigned long long key = cached[c];
        if ((first || key < bound) && key > best) best = key;
      }
      for (int64_t e = lane + 32 * kTopkCachedKeys; e < E; e += 32) {
        const unsigned long long key = routing_key(logit(e), static_cast<int32_t>(e));
        if ((first || key < bound) && key > best) best = key;
      }
      for (int off = 16; off > 0; off >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, off);
        best = other > best ? other : best;
      }
      if (lane == j) mine = best;
      bound = best;
      first = false;
    }
    // Slot 0 holds the largest logit (a NaN there propagates, as on the CPU).
    if (block == 0) max_logit = key_logit(__shfl_sync(0xffffffffu, mine, 0));
    const float p = lane < in_block ? numerator(key_logit(mine), max_logit) : 0.0f;
    for (int j = 0; j < in_block; ++j) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, p, j));
    if (lane < in_block) indices[block * 32 + lane] = key_expert(mine);
  }
  const int last_block = (k - 1) / 32;
  for (int block = 0; block <= last_block; ++block) {
    const int slot = block * 32 + lane;
    if (slot >= k) break;
    int32_t e;
    float p;
    if (block == last_block) {
      e = key_expert(mine);
      p = numerator(key_logit(mine), max_logit);
    } else {
      e = indices[slot];  // written by this lane above
      p = numerator(logit(e), max_logit);
    }
    store_weight(slot, finish(e, p, sum));
  }
}

// The slots' weights once lane l < k of a warp holds the routing key of slot l (k <= 32; lanes >= k
// hold anything): the second half of warp_topk_weights for one block, the same arithmetic and
// order: numerators against slot 0's logit, their sum folded in slot order through shuffles, then
// finish. Writes indices[l] and the slot's weight for l < k; called by all 32 lanes.
template <class Numerator, class Finish, class StoreWeight>
__device__ __forceinline__ void warp_weights_of_slots(unsigned long long mine, int k, Numerator numerator,
                                                      Finish finish, int32_t* indices, StoreWeight store_weight) {
  const int lane = threadIdx.x & 31;
  const float max_logit = key_logit(__shfl_sync(0xffffffffu, mine, 0));
  const float p = lane < k ? numerator(key_logit(mine), max_logit) : 0.0f;
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, p, j));
  if (lane < k) {
    const int32_t e = key_expert(mine);
    indices[lane] = e;
    store_weight(lane, finish(e, p, sum));
  }
}

// A token's top-k by rank instead of k passes: the thread of expert i (of E) counts the experts
// whose routing key is larger: key_hi[j] > key_hi[i], or equal with j > i (the key's low word is the
// id, so this is routing_key's order exactly). Ranks are a permutation of 0..E-1; rank r < k is slot
// r. key_hi: the token's E high words in shared memory (routing_key >> 32), written and made visible
// by the caller. About 4 instructions per expert and no shuffle chain, so a CTA ranks every
// expert at once (the decode router's last CTA at 1-2 tokens: one key per thread).
__device__ __forceinline__ int key_rank(const uint32_t* key_hi, int E, int i) {
  const uint32_t mine = key_hi[i];
  auto above = [&](int j) {
    const uint32_t other = key_hi[j];
    return static_cast<int>((other > mine) | ((other == mine) & (j > i)));
  };
  int r[4] = {0, 0, 0, 0};  // four counts, so the adds do not form one chain
  int j = 0;
#pragma unroll 2
  for (; j + 4 <= E; j += 4) {
#pragma unroll
    for (int q = 0; q < 4; ++q) r[q] += above(j + q);
  }
  for (; j < E; ++j) r[0] += above(j);
  return (r[0] + r[1]) + (r[2] + r[3]);
}

// One token's top-k by rank on a CTA (E <= blockDim.x): thread i < E makes expert i's routing key
// from score(i) (a logit read through the L2: another grid or CTA wrote them; or the softmax_topk
// router's probability), ranks it (key_rank) and, for rank r < k, writes slot r's key. key_hi (E)
// and slot_key (k): the caller's shared memory. Called by every thread of the CTA (two barriers);
// slot_key is complete on return.
template <class Score>
__device__ __forceinline__ void cta_rank_topk(Score score, int E, int k, uint32_t* key_hi,
                                              unsigned long long* slot_key) {
  const int tid = threadIdx.x;
  unsigned long long key = 0ull;
  if (tid < E) {
    key = routing_key(score(tid), tid);
    key_hi[tid] = static_cast<uint32_t>(key >> 32);
  }
  __syncthreads();
  if (tid < E) {
    const int rank = key_rank(key_hi, E, tid);
    if (rank < k) slot_key[rank] = key;
  }
  __syncthreads();
}

// The softmax's max logit and 1 / sum of exp(logit - max) over one token's E logits (the lanes
// stride over E, then shuffle reductions), on all 32 lanes; and a probability from them.
template <class Logit>
__device__ __forceinline__ void warp_softmax_stats(Logit logit, int64_t E, float& max_logit, float& inv_sum) {
  const int lane = threadIdx.x & 31;
  max_logit = -INFINITY;
  for (int64_t e = lane; e < E; e += 32) max_logit = fmaxf(max_logit, logit(e));
  for (int off = 16; off > 0; off >>= 1) max_logit = fmaxf(max_logit, __shfl_xor_sync(0xffffffffu, max_logit, off));
  float sum = 0.0f;
  for (int64_t e = lane; e < E; e += 32) sum = __fadd_rn(sum, expf(__fsub_rn(logit(e), max_logit)));
  for (int off = 16; off > 0; off >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, off));
  inv_sum = __fdiv_rn(1.0f, sum);
}
// An expert's routing score under the softmax top-k router: its probability, rounded by round_p.
template <class RoundP>
__device__ __forceinline__ float softmax_topk_score(RoundP round_p, float logit, float max_logit, float inv_sum) {
  return round_p(__fmul_rn(expf(__fsub_rn(logit, max_logit)), inv_sum));
}
// A slot's weight from its probability p and the sum of the k: renormalised or p.
template <class RoundP>
__device__ __forceinline__ float softmax_topk_finish(RoundP round_p, bool renormalize, float p, float k_sum) {
  return renormalize ? round_p(__fdiv_rn(p, round_p(k_sum))) : p;
}
// The Qwen3-MoE router's top-k (RouterKind::softmax_topk, mlx-lm qwen3_moe): p = softmax over the
// token's E logits (fp32, exp * 1/sum), each rounded by round_p (to the logits' dtype); top-k by p;
// weights p (renormalize: round_p(p / round_p(sum of the k)), as mlx-lm's bf16 ops round).
// The lanes stride over E for the max and the sum (shuffle reductions). A NaN logit is skipped by
// the max but makes its exponential, the sum and so every p NaN (the CPU's result).
template <class Logit, class RoundP, class StoreWeight>
__device__ __forceinline__ void warp_softmax_topk(Logit logit, int64_t E, int k, bool renormalize, RoundP round_p,
                                                  int32_t* indices, StoreWeight store_weight) {
  float max_logit, inv_sum;
  warp_softmax_stats(logit, E, max_logit, inv_sum);
  warp_topk_weights(
      [&](int64_t e) { return softmax_topk_score(round_p, logit(e), max_logit, inv_sum); }, E, k,
      [](float p, float) { return p; },
      [&](int32_t, float p, float k_sum) { return softmax_topk_finish(round_p, renormalize, p, k_sum); }, indices,
      store_weight);
}
// The same weights from a slot's key (warp_weights_of_slots; k <= 32): the key holds the score p.
template <class RoundP, class StoreWeight>
__device__ __forceinline__ void warp_softmax_topk_of_slots(unsigned long long mine, int k, bool renormalize,
                                                           RoundP round_p, int32_t* indices, StoreWeight store_weight) {
  warp_weights_of_slots(
      mine, k, [](float p, float) { return p; },
      [&](int32_t, float p, float k_sum) { return softmax_topk_finish(round_p, renormalize, p, k_sum); }, indices,
      store_weight);
}

// The Gemma 4 router's top-k (spec gemma4-moe.md 5): top-k by logit, softmax over the k, times
// per_expert_scale (expert_scale(e) -> float).
__device__ __forceinline__ float topk_softmax_numerator(float s, float s0) { return expf(__fsub_rn(s, s0)); }
template <class ExpertScale>
__device__ __forceinline__ float topk_softmax_finish(ExpertScale expert_scale, int32_t e, float p, float sum) {
  return __fmul_rn(__fdiv_rn(p, sum), expert_scale(e));
}
template <class Logit, class ExpertScale, class StoreWeight>
__device__ __forceinline__ void warp_topk_softmax(Logit logit, int64_t E, int k, ExpertScale expert_scale,
                                                  int32_t* indices, StoreWeight store_weight) {
  warp_topk_weights(
      logit, E, k, [](float s, float s0) { return topk_softmax_numerator(s, s0); },
      [&](int32_t e, float p, float sum) { return topk_softmax_finish(expert_scale, e, p, sum); }, indices,
      store_weight);
}
// The same top-k and weights from a slot's key (warp_weights_of_slots; k <= 32).
template <class ExpertScale, class StoreWeight>
__device__ __forceinline__ void warp_topk_softmax_of_slots(unsigned long long mine, int k, ExpertScale expert_scale,
                                                           int32_t* indices, StoreWeight store_weight) {
  warp_weights_of_slots(
      mine, k, [](float s, float s0) { return topk_softmax_numerator(s, s0); },
      [&](int32_t e, float p, float sum) { return topk_softmax_finish(expert_scale, e, p, sum); }, indices,
      store_weight);
}

}  // namespace expertqmm::cuda::device

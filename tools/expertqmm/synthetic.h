// Synthetic workloads for the CLI: deterministic from a seed, at a preset's real geometry, in valid
// MLX layouts. Quantized weights are made directly (random code words and plausible bf16 scales and
// biases) instead of running the quantizer over hundreds of millions of values. All host tensors.
#pragma once
#include <cstdint>
#include <vector>

#include "expertqmm/moe.h"
#include "presets.h"

namespace expertqmm::cli {

// splitmix64: fast, and good enough for benchmark data; one independent stream per seed.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }          // [0, 1)
  double uniform_open() { return (double(next() >> 11) + 0.5) * 0x1.0p-53; }  // (0, 1)
  double normal();                                                          // N(0, 1)

 private:
  uint64_t state_;
};

// Seed of sub-stream `stream` of `seed` (each tensor draws from its own stream).
uint64_t derive_seed(uint64_t seed, uint64_t stream);

// [E, N, K] quantized weight: uniform random codes; per group scale = ±(0.01 + 0.002 n) with a
// random sign, bias = -scale * (2^(bits-1) - 1/2) so that the dequantized values centre on 0.
// An fp mode: random codes, uint8 scales from detail::finish_synthetic_fp (core/synthetic_fp.h).
QuantizedWeight synthetic_quantized(int64_t E, int64_t N, int64_t K, int bits, int group_size, uint64_t seed,
                                    QuantMode mode = QuantMode::affine);

// gate and up [E, I, H] (or gate_up [E, 2I, H]) and down [E, H, I] of the preset.
SwitchGLUWeights synthetic_experts(const Preset& p, uint64_t seed);

// A learned-looking router of the preset's kind: proj [E, H] ~ N(0, 1/sqrt(H)) (std) quantized to 8
// bits, group 64, as in the QAT checkpoints; for a gemma4 router scale [H] = 1 + 0.05 n,
// per_expert_scale [E] = 1 + 0.05 n. On random tokens it routes close to uniformly at random.
RouterWeights synthetic_router(const Preset& p, uint64_t seed);

// A router that follows a planned routing: proj [E, H] is the identity on the first E columns plus
// N(0, 2e-4) noise (8-bit quantized like the real router), scale is ones, so logit e ~ h[e] / rms(h) / sqrt(H)
// (gemma4) or h[e] (softmax_topk). Paired with steering_tokens it selects exactly the planned experts. Needs H >= E.
RouterWeights steering_router(const Preset& p, uint64_t seed);

// Tokens [T, H] bf16 whose first E columns put the planned experts of each token (indices [T*k])
// far above the rest (4 + a small per-slot step, others 0); the other columns are N(0, 1).
Tensor steering_tokens(const std::vector<int32_t>& indices, int64_t T, const Preset& p, uint64_t seed);

// Random bf16 tokens [T, H] ~ N(0, 1).
Tensor random_tokens(int64_t T, int64_t H, uint64_t seed);

// k distinct experts per token drawn from Zipf(s) popularity (expert of popularity rank r has
// probability proportional to r^-s; ranks are a seeded permutation of the experts), sampled
// without replacement (Gumbel top-k). Returns [T*k] int32, row-major [T, k].
std::vector<int32_t> zipf_routing(int64_t T, int experts, int k, double s, uint64_t seed);

// Routing weights [T*k]: softmax over the k of N(0, 1) logits, as bf16 bits.
std::vector<uint16_t> random_routing_weights(int64_t T, int k, uint64_t seed);

}  // namespace expertqmm::cli

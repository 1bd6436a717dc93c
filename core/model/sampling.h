// Next-token choice from logits: greedy, or temperature + nucleus (top-p)
// sampling with an explicit, seedable generator (reproducible per seed).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace kakeya {

struct SamplingOptions {
  double temperature = 0.0;  // 0: greedy
  double top_p = 1.0;        // (0, 1]
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& opt, at::Device device);
  // logits: [B, V] f32 -> token ids [B] int64 on the logits' device (no host sync).
  at::Tensor sample(const at::Tensor& logits);
  bool greedy() const { return opt_.temperature <= 0.0; }
  // logits: [B, V] -> the distribution sample() draws from (temperature, then the top-p
  // prefix), normalised: [B, V] f32. Sampling only (temperature > 0). Speculative rejection
  // sampling (infer/fused.h) compares the drafter's and the verifier's through it.
  at::Tensor probs(const at::Tensor& logits) const;
  at::Generator& generator() { return gen_; }  // seeded: draws through it are reproducible
  void reset(uint64_t seed) { gen_.set_current_seed(seed); }  // a new run draws what a fresh sampler of `seed` would
  const SamplingOptions& options() const { return opt_; }

 private:
  SamplingOptions opt_;
  at::Generator gen_;
};

}  // namespace kakeya

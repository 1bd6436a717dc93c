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

 private:
  SamplingOptions opt_;
  at::Generator gen_;
};

}  // namespace kakeya

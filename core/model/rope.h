// Rotary position embeddings: inverse frequencies per RoPE type (HF
// transformers' definitions) and cos/sin tables indexed by absolute position,
// so a forward only gathers rows (graph-capturable, no host position math).
#pragma once
#include <ATen/ATen.h>

#include "core/model/config.h"

namespace kakeya {

// [rotary_dim / 2] f32 inverse frequencies for a head of `head_dim`.
at::Tensor rope_inv_freq(const RopeParams& p, int64_t head_dim);

class RopeTable {
 public:
  RopeTable() = default;
  // Tables for positions [0, max_positions) in `dtype` (HF casts cos/sin to the activation dtype).
  RopeTable(const RopeParams& p, int64_t head_dim, int64_t max_positions, at::ScalarType dtype, at::Device device);
  // x: [B, T, H, D]; positions: [T] int64 (or [B, T]: rows at their own positions). Returns
  // x·cos + rotate_half(x)·sin with HF's op order,
  // so bf16 rounding matches transformers. Dimensions past the rotary part pass through.
  at::Tensor apply(const at::Tensor& x, const at::Tensor& positions) const;
  int64_t max_positions() const { return cos_.defined() ? cos_.size(0) : 0; }
  const at::Tensor& cos() const { return cos_; }  // [max_positions, rotary_dim]
  const at::Tensor& sin() const { return sin_; }  // [max_positions, rotary_dim]

 private:
  at::Tensor cos_, sin_;  // [max_positions, rotary_dim]
  int64_t rotary_dim_ = 0;
};

}  // namespace kakeya

#include "core/model/rope.h"

#include <cmath>

#include "core/error.h"

namespace kakeya {

at::Tensor rope_inv_freq(const RopeParams& p, int64_t head_dim) {
  if (p.type == "proportional") {
    // Proportional RoPE (Gemma 4 full layers; transformers' _compute_proportional_rope_parameters):
    // the first floor(partial_rotary_factor·head_dim/2) frequencies of the whole head dim, then
    // zeros up to head_dim/2, all divided by factor. The table stays head_dim wide, so
    // rotate_half pairs d with d + head_dim/2 and the zero-frequency pairs pass through
    // exactly (cos 0 = 1, sin 0 = 0) — not a rotation of the first rotary_dim channels.
    const int64_t angles = (int64_t)std::floor(p.partial_rotary_factor * (double)head_dim / 2.0);
    auto idx = at::arange(0, 2 * angles, 2, at::kLong).to(at::kFloat);
    at::Tensor rotated = 1.0 / at::pow(at::scalar_tensor(p.theta, at::kFloat), idx / (double)head_dim);
    at::Tensor inv = at::cat({rotated, at::zeros({head_dim / 2 - angles}, at::kFloat)});
    return inv / p.factor;
  }
  auto idx = at::arange(0, head_dim, 2, at::kFloat);
  at::Tensor inv = 1.0 / at::pow(at::scalar_tensor(p.theta, at::kFloat), idx / (double)head_dim);
  if (p.type == "linear") {
    inv = inv / p.factor;
  } else if (p.type == "llama3") {
    double old_ctx = (double)p.original_max_position;
    double low_wl = old_ctx / p.low_freq_factor, high_wl = old_ctx / p.high_freq_factor;
    auto wavelen = 2 * M_PI / inv;
    auto scaled = at::where(wavelen > low_wl, inv / p.factor, inv);
    auto smooth = (old_ctx / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor);
    auto smoothed = (1 - smooth) * scaled / p.factor + smooth * scaled;
    auto medium = wavelen.ge(high_wl).logical_and(wavelen.le(low_wl));
    inv = at::where(medium, smoothed, scaled);
  }
  return inv;
}

RopeTable::RopeTable(const RopeParams& p, int64_t head_dim, int64_t max_positions, at::ScalarType dtype,
                     at::Device device) {
  auto inv = rope_inv_freq(p, head_dim);
  rotary_dim_ = inv.size(0) * 2;
  auto pos = at::arange(max_positions, at::kFloat);
  auto freqs = pos.unsqueeze(1) * inv.unsqueeze(0);  // [P, rot/2], f32 as HF
  auto emb = at::cat({freqs, freqs}, -1);
  cos_ = emb.cos().to(device, dtype);
  sin_ = emb.sin().to(device, dtype);
}

at::Tensor RopeTable::apply(const at::Tensor& x, const at::Tensor& positions) const {
  // positions [T]: one table row per token, shared by the batch ([1, T, 1, rot]); [B, T]: each
  // row its own sequence ([B, T, 1, rot]).
  const bool rows = positions.dim() == 2;
  auto cos = (rows ? cos_.index({positions}) : cos_.index_select(0, positions).unsqueeze(0)).unsqueeze(2);
  auto sin = (rows ? sin_.index({positions}) : sin_.index_select(0, positions).unsqueeze(0)).unsqueeze(2);
  int64_t d = x.size(-1);
  auto xr = rotary_dim_ == d ? x : x.slice(-1, 0, rotary_dim_);
  int64_t h = rotary_dim_ / 2;
  auto rotated = at::cat({-xr.slice(-1, h), xr.slice(-1, 0, h)}, -1);
  auto out = xr * cos + rotated * sin;
  return rotary_dim_ == d ? out : at::cat({out, x.slice(-1, rotary_dim_)}, -1);
}

}  // namespace kakeya

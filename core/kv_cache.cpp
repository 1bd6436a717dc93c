#include "core/kv_cache.h"

#include <algorithm>

#include "core/error.h"

namespace kakeya {

KVCache::KVCache(const ModelConfig& cfg, const KVCacheOptions& opt) : cfg_(cfg), opt_(opt) {
  KAKEYA_CHECK(opt.capacity > 0, "KV cache: capacity expected > 0, got " << opt.capacity);
  KAKEYA_CHECK(opt.rollback >= 0, "KV cache: rollback expected >= 0, got " << opt.rollback);
  KAKEYA_CHECK(opt.batch > 0, "KV cache: batch expected > 0, got " << opt.batch);
  auto fopt = at::TensorOptions().dtype(opt.dtype).device(opt.device);
  int64_t s_sliding = std::min(opt.capacity, cfg.sliding_window + opt.rollback);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    int64_t s = cfg.is_sliding(l) ? s_sliding : opt.capacity;
    k_.push_back(at::zeros({opt.batch, cfg.kv_heads(l), s, cfg.layer_head_dim[l]}, fopt));
    v_.push_back(at::zeros({opt.batch, cfg.kv_heads(l), s, cfg.layer_head_dim[l]}, fopt));
  }
  auto iopt = at::TensorOptions().dtype(at::kLong).device(opt.device);
  pos_full_ = at::full({opt.capacity}, -1, iopt);
  pos_sliding_ = at::full({s_sliding}, -1, iopt);
}

const at::Tensor& KVCache::slot_positions(int64_t layer) const {
  return cfg_.is_sliding(layer) ? pos_sliding_ : pos_full_;
}

bool KVCache::write_first(int64_t layer, int64_t t) const {
  if (!cfg_.is_sliding(layer)) return true;
  // Slots overwritten by the chunk held positions p - S for p in the chunk; the
  // chunk's first query still needs p0 - window + 1, hence S >= T + window - 1.
  return slots(layer) >= t + cfg_.sliding_window - 1;
}

void KVCache::mark(const at::Tensor& positions) {
  int64_t t = positions.size(0);
  KAKEYA_CHECK(length_ + t <= opt_.capacity, "KV cache: " << length_ << " + " << t
                                                          << " positions exceed capacity " << opt_.capacity
                                                          << " (raise --context / capacity)");
  pos_full_.index_copy_(0, positions, positions);
  if (t >= pos_sliding_.size(0)) {
    // Only the last S positions of a long chunk stay in the ring.
    auto tail = positions.slice(0, t - pos_sliding_.size(0));
    pos_sliding_.index_copy_(0, tail.remainder(pos_sliding_.size(0)), tail);
  } else {
    pos_sliding_.index_copy_(0, positions.remainder(pos_sliding_.size(0)), positions);
  }
}

void KVCache::write(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  auto& kb = k_[layer];
  auto& vb = v_[layer];
  int64_t s = kb.size(2), t = k.size(2);
  if (!cfg_.is_sliding(layer)) {
    kb.index_copy_(2, positions, k);
    vb.index_copy_(2, positions, v);
    return;
  }
  if (t >= s) {
    auto tail = positions.slice(0, t - s);
    kb.index_copy_(2, tail.remainder(s), k.slice(2, t - s));
    vb.index_copy_(2, tail.remainder(s), v.slice(2, t - s));
  } else {
    auto slot = positions.remainder(s);
    kb.index_copy_(2, slot, k);
    vb.index_copy_(2, slot, v);
  }
}

void KVCache::advance(int64_t t) {
  length_ += t;
  int64_t s = pos_sliding_.size(0);
  if (cfg_.sliding_window > 0 && length_ > s) max_evicted_ = std::max(max_evicted_, length_ - s - 1);
}

void KVCache::truncate(int64_t n) {
  KAKEYA_CHECK(n >= 0 && n <= length_, "KV cache: truncate(" << n << ") outside [0, " << length_ << "]");
  if (n == length_) return;
  // Position n-1's query window starts at n - window; everything from there must still be in the ring.
  // Nothing evicted yet (max_evicted_ = -1) is always fine, also when n < window.
  KAKEYA_CHECK(n == 0 || cfg_.sliding_window == 0 || max_evicted_ < std::max<int64_t>(0, n - cfg_.sliding_window),
               "KV cache: truncate(" << n << ") rolls back past what the sliding ring still holds (rollback="
                                     << opt_.rollback << ", length=" << length_ << ")");
  pos_full_.masked_fill_(pos_full_.ge(n), -1);
  pos_sliding_.masked_fill_(pos_sliding_.ge(n), -1);
  length_ = n;
  if (n == 0) max_evicted_ = -1;
}

int64_t KVCache::bytes() const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += (k_[l].numel() + v_[l].numel()) * k_[l].element_size();
  return b;
}

int64_t KVCache::bytes_per_layer_type(LayerType t) const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    if (cfg_.layer_types[l] == t) b += (k_[l].numel() + v_[l].numel()) * k_[l].element_size();
  return b;
}

int64_t KVCache::full_kv_bytes(int64_t n) const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    b += 2 * opt_.batch * cfg_.kv_heads(l) * n * cfg_.layer_head_dim[l] * k_[l].element_size();
  return b;
}

}  // namespace kakeya

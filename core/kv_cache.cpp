#include "core/kv_cache.h"

#include <algorithm>

#include "core/error.h"

namespace kakeya {

at::Tensor causal_visible(const at::Tensor& slot_pos, const at::Tensor& q_pos, int64_t window) {
  auto sp = slot_pos.unsqueeze(0);  // [1, S]
  auto qp = q_pos.unsqueeze(1);     // [T, 1]
  auto m = sp.ge(0).logical_and(sp.le(qp));
  if (window > 0) m = m.logical_and((qp - sp).lt(window));
  return m;
}

KVCache::KVCache(const ModelConfig& cfg, const KVCacheOptions& opt) : cfg_(cfg), opt_(opt) {
  KAKEYA_CHECK(opt.capacity > 0, "KV cache: capacity expected > 0, got " << opt.capacity);
  KAKEYA_CHECK(opt.rollback >= 0, "KV cache: rollback expected >= 0, got " << opt.rollback);
  KAKEYA_CHECK(opt.batch > 0, "KV cache: batch expected > 0, got " << opt.batch);
  const RestorePolicy& rp = opt.restore;
  if (rp.enabled()) {
    KAKEYA_CHECK(rp.max_chunk >= 1, "KV cache: restore max_chunk expected >= 1, got " << rp.max_chunk);
    KAKEYA_CHECK(rp.max_chunk <= rp.window,
                 "KV cache: restore chunks of " << rp.max_chunk << " tokens exceed the exact window " << rp.window
                                                << " (a chunk's queries would need restored K/V of the chunk itself)");
  }
  auto iopt = at::TensorOptions().dtype(at::kLong).device(opt.device);
  auto setup = [&](TypeState& s, bool sliding) {
    s.policy = rp.enabled() && (sliding ? rp.sliding : rp.full);
    if (s.policy) {
      s.window = rp.window;
      s.ring = rp.linear ? opt.capacity : std::min(opt.capacity, rp.window + std::max(rp.max_chunk - 1, opt.rollback));
      s.rest = sliding && !rp.linear
                   ? std::min(opt.capacity, std::max<int64_t>(1, cfg.sliding_window - rp.window + rp.max_chunk - 1))
                   : opt.capacity;
    } else {
      s.window = sliding ? cfg.sliding_window : 0;
      s.ring = sliding ? std::min(opt.capacity, cfg.sliding_window + opt.rollback) : opt.capacity;
      s.rest = 0;
    }
    s.pos = at::full({s.ring + s.rest}, -1, iopt);
    if (s.policy)
      s.in_restored = at::arange(s.ring + s.rest, iopt).ge(s.ring);
  };
  setup(full_, false);
  setup(sliding_, true);
  auto fopt = at::TensorOptions().dtype(opt.dtype).device(opt.device);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    int64_t s = state(l).ring + state(l).rest;
    k_.push_back(at::zeros({opt.batch, cfg.kv_heads(l), s, cfg.layer_head_dim[l]}, fopt));
    v_.push_back(at::zeros({opt.batch, cfg.kv_heads(l), s, cfg.layer_head_dim[l]}, fopt));
  }
}

const at::Tensor& KVCache::slot_positions(int64_t layer) const { return state(layer).pos; }

bool KVCache::restored(int64_t layer) const { return state(layer).policy; }
int64_t KVCache::exact_slots(int64_t layer) const { return state(layer).ring; }
int64_t KVCache::restored_slots(int64_t layer) const { return state(layer).rest; }

bool KVCache::write_first(int64_t layer, int64_t t) const {
  const TypeState& s = state(layer);
  if (s.policy) return s.ring >= t + s.window - 1 || s.ring == opt_.capacity;
  if (!cfg_.is_sliding(layer)) return true;
  // Slots overwritten by the chunk held positions p - S for p in the chunk; the
  // chunk's first query still needs p0 - window + 1, hence S >= T + window - 1.
  return slots(layer) >= t + cfg_.sliding_window - 1;
}

at::Tensor KVCache::visible(int64_t layer, const at::Tensor& q_pos) const {
  const TypeState& s = state(layer);
  const int64_t span = cfg_.is_sliding(layer) ? cfg_.sliding_window : 0;
  auto m = causal_visible(s.pos, q_pos, span);
  if (!s.policy) return m;
  // Exact copies serve the recent window, restored copies everything older.
  auto recent = (q_pos.unsqueeze(1) - s.pos.unsqueeze(0)).lt(s.window);  // [T, S]
  return m.logical_and(recent.ne(s.in_restored.unsqueeze(0)));
}

at::Tensor KVCache::decode_slot_positions(int64_t layer, const at::Tensor& q_pos) const {
  const TypeState& s = state(layer);
  if (!s.policy) return s.pos;
  return at::where(visible(layer, q_pos).select(0, 0), s.pos, at::full({}, -1, s.pos.options()));
}

void KVCache::mark(const at::Tensor& positions) {
  int64_t t = positions.size(0);
  KAKEYA_CHECK(length_ + t <= opt_.capacity, "KV cache: " << length_ << " + " << t
                                                          << " positions exceed capacity " << opt_.capacity
                                                          << " (raise --context / capacity)");
  for (TypeState* s : {&full_, &sliding_}) {
    if (s->policy) {
      KAKEYA_CHECK(t <= opt_.restore.max_chunk || s->ring == opt_.capacity,
                   "KV cache: a forward of " << t << " tokens exceeds the restore policy's chunk of "
                                             << opt_.restore.max_chunk);
      s->pos.narrow(0, 0, s->ring).index_copy_(0, positions.remainder(s->ring), positions);
    } else if (s == &full_) {
      s->pos.index_copy_(0, positions, positions);
    } else if (t >= s->ring) {
      // Only the last S positions of a long chunk stay in the ring.
      auto tail = positions.slice(0, t - s->ring);
      s->pos.index_copy_(0, tail.remainder(s->ring), tail);
    } else {
      s->pos.index_copy_(0, positions.remainder(s->ring), positions);
    }
  }
}

void KVCache::write(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  auto& kb = k_[layer];
  auto& vb = v_[layer];
  const TypeState& st = state(layer);
  int64_t t = k.size(2);
  if (st.policy) {
    auto slot = positions.remainder(st.ring);
    kb.index_copy_(2, slot, k);
    vb.index_copy_(2, slot, v);
    return;
  }
  int64_t s = kb.size(2);
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

void KVCache::mark_restored(LayerType type, const at::Tensor& positions) {
  TypeState& s = type == LayerType::Sliding ? sliding_ : full_;
  KAKEYA_CHECK(s.policy, "KV cache: mark_restored on a layer type without restoration");
  KAKEYA_CHECK(positions.size(0) <= s.rest, "KV cache: " << positions.size(0) << " restored positions at once exceed the "
                                                         << s.rest << " restored slots");
  s.pos.narrow(0, s.ring, s.rest).index_copy_(0, positions.remainder(s.rest), positions);
}

void KVCache::write_restored(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  const TypeState& s = state(layer);
  KAKEYA_CHECK(s.policy, "KV cache: write_restored on layer " << layer << ", which has no restoration");
  auto slot = positions.remainder(s.rest) + s.ring;
  k_[layer].index_copy_(2, slot, k);
  v_[layer].index_copy_(2, slot, v);
}

std::pair<at::Tensor, at::Tensor> KVCache::exact_kv(int64_t layer, const at::Tensor& positions) const {
  const TypeState& s = state(layer);
  auto slot = s.policy ? positions.remainder(s.ring) : (cfg_.is_sliding(layer) ? positions.remainder(s.ring) : positions);
  return {k_[layer].index_select(2, slot), v_[layer].index_select(2, slot)};
}

void KVCache::advance(int64_t t) {
  length_ += t;
  for (TypeState* s : {&full_, &sliding_})
    if ((s->policy || (s == &sliding_ && cfg_.sliding_window > 0)) && length_ > s->ring)
      s->max_evicted = std::max(s->max_evicted, length_ - s->ring - 1);
}

void KVCache::truncate(int64_t n) {
  KAKEYA_CHECK(n >= 0 && n <= length_, "KV cache: truncate(" << n << ") outside [0, " << length_ << "]");
  if (n == length_) return;
  // Position n-1's query window starts at n - window; everything from there must still be in the ring.
  // Nothing evicted yet (max_evicted = -1) is always fine, also when n < window.
  for (TypeState* s : {&full_, &sliding_})
    KAKEYA_CHECK(n == 0 || s->window == 0 || s->max_evicted < std::max<int64_t>(0, n - s->window),
                 "KV cache: truncate(" << n << ") rolls back past what the " << (s == &full_ ? "full" : "sliding")
                                       << " ring still holds (rollback=" << opt_.rollback << ", length=" << length_
                                       << ")");
  for (TypeState* s : {&full_, &sliding_}) {
    s->pos.masked_fill_(s->pos.ge(n), -1);
    if (n == 0) s->max_evicted = -1;
  }
  length_ = n;
}

int64_t KVCache::layer_bytes(int64_t l) const { return (k_[l].numel() + v_[l].numel()) * k_[l].element_size(); }

int64_t KVCache::bytes() const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += layer_bytes(l);
  return b;
}

int64_t KVCache::bytes_per_layer_type(LayerType t) const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    if (cfg_.layer_types[l] == t) b += layer_bytes(l);
  return b;
}

int64_t KVCache::exact_bytes(LayerType t) const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    if (cfg_.layer_types[l] == t) b += layer_bytes(l) / slots(l) * state(l).ring;
  return b;
}

int64_t KVCache::restored_bytes(LayerType t) const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    if (cfg_.layer_types[l] == t) b += layer_bytes(l) / slots(l) * state(l).rest;
  return b;
}

int64_t KVCache::full_kv_bytes(int64_t n) const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    b += 2 * opt_.batch * cfg_.kv_heads(l) * n * cfg_.layer_head_dim[l] * k_[l].element_size();
  return b;
}

int64_t KVCache::native_kv_bytes(int64_t n) const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) {
    int64_t m = cfg_.is_sliding(l) && cfg_.sliding_window > 0 ? std::min(n, cfg_.sliding_window) : n;
    b += 2 * opt_.batch * cfg_.kv_heads(l) * m * cfg_.layer_head_dim[l] * k_[l].element_size();
  }
  return b;
}

}  // namespace kakeya

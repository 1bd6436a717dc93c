#include "core/model/kv_cache.h"

#include <algorithm>

#include "core/error.h"

namespace kakeya {

at::Tensor causal_visible(const at::Tensor& slot_pos, const at::Tensor& q_pos, int64_t window) {
  auto sp = slot_pos.unsqueeze(-2);  // [1, S] ([B, 1, S])
  auto qp = q_pos.unsqueeze(-1);     // [T, 1] ([B, T, 1])
  auto m = sp.ge(0).logical_and(sp.le(qp));
  if (window > 0) m = m.logical_and((qp - sp).lt(window));
  return m;
}

KVCache::KVCache(const ModelConfig& cfg, const KVCacheOptions& opt) : cfg_(cfg), opt_(opt) {
  KAKEYA_CHECK(opt.capacity > 0, "KV cache: capacity expected > 0, got " << opt.capacity);
  KAKEYA_CHECK(opt.rollback >= 0, "KV cache: rollback expected >= 0, got " << opt.rollback);
  KAKEYA_CHECK(opt.batch > 0, "KV cache: batch expected > 0, got " << opt.batch);
  const RestorePolicy& rp = opt.restore;
  KAKEYA_CHECK(!opt.rows || !rp.linear, "KV cache: independent rows keep rings (no linear restore policy)");
  if (rp.enabled()) {
    // Restoration writes and reads K/V per layer; KV-shared layers have none of their own.
    KAKEYA_CHECK(cfg.num_kv_shared() == 0, "KV cache: restoration is not supported with KV sharing (config field "
                                               << "'num_kv_shared_layers' = " << cfg.num_kv_shared() << ")");
    KAKEYA_CHECK(rp.max_chunk >= 1, "KV cache: restore max_chunk expected >= 1, got " << rp.max_chunk);
    KAKEYA_CHECK(rp.max_step >= 1 && rp.max_step <= rp.max_chunk,
                 "KV cache: restore max_step expected in [1, max_chunk " << rp.max_chunk << "], got " << rp.max_step);
    KAKEYA_CHECK(rp.max_chunk <= rp.window || rp.exact_copies,
                 "KV cache: restore chunks of " << rp.max_chunk << " tokens exceed the exact window " << rp.window
                                                << " (a chunk's queries would need restored K/V of the chunk itself; "
                                                   "only exact copies take longer chunks)");
    KAKEYA_CHECK(!rp.exact_copies || (!rp.full && !rp.linear),
                 "KV cache: exact copies (chunks longer than the window) restore sliding layers only (full-attention "
                 "layers exact or coded), in rings");
    KAKEYA_CHECK(!(rp.full && rp.full_code.defined()),
                 "KV cache: full-attention layers are either restored or coded (full_code "
                     << ops::row_code_name(rp.full_code) << ")");
    KAKEYA_CHECK(!rp.region_code.weighted, "KV cache: restored regions take unweighted codes (region_code "
                                               << ops::row_code_name(rp.region_code) << "; pwB is for full-attention rows)");
  }
  auto iopt = at::TensorOptions().dtype(at::kLong).device(opt.device);
  auto setup = [&](TypeState& s, bool sliding) {
    s.coded = rp.enabled() && !sliding && rp.full_code.defined();
    s.policy = rp.enabled() && (sliding ? rp.sliding : rp.full || s.coded);
    if (s.policy) {
      s.window = rp.window;
      // Every layer of this type drops its restored positions (evict-only): the region need hold
      // only the sinks, and one slot that takes every other position (hidden by the drop mask).
      bool all_drop = !s.coded && !rp.linear, any = false;
      for (int64_t l = 0; l < cfg.num_layers; ++l)
        if (cfg.is_sliding(l) == sliding) {
          any = true;
          all_drop = all_drop && rp.drops(l);
        }
      s.sinks_only = any && all_drop;
      // A chunk longer than the window (exact copies) reads only positions before it from the
      // region: the sliding window's worth, what a chunk of `window` tokens needs.
      const int64_t reach = rp.exact_copies ? std::min(rp.max_chunk, rp.window) : rp.max_chunk;
      // Sliding layers write-first only forwards of <= max_step tokens (Model::forward attends a
      // longer chunk over [ring ++ chunk]); full-attention layers write every chunk first, except
      // coded ones under exact copies, whose prefill chunks attend over [slots ++ chunk] too (their
      // ring then holds the window and a verify block, not a chunk).
      const int64_t step = sliding || (s.coded && rp.exact_copies) ? rp.max_step : rp.max_chunk;
      s.ring = rp.linear ? opt.capacity : std::min(opt.capacity, rp.window + std::max(step - 1, opt.rollback));
      s.rest = s.sinks_only ? rp.sink + 1
               : sliding && !rp.linear
                   ? std::min(opt.capacity, std::max<int64_t>(1, cfg.sliding_window - rp.window + reach - 1))
                   : opt.capacity;
      if (s.coded) {
        s.held = rp.sink;
        s.held_pos = at::arange(s.held, iopt);
      }
    } else {
      s.window = sliding ? cfg.sliding_window : 0;
      s.ring = sliding ? std::min(opt.capacity, cfg.sliding_window + opt.rollback) : opt.capacity;
      s.rest = 0;
    }
    const int64_t slots = s.ring + s.held + s.rest;
    s.pos = opt.rows ? at::full({opt.batch, slots}, -1, iopt) : at::full({slots}, -1, iopt);
    if (s.policy)
      s.in_restored = at::arange(s.ring + s.held + s.rest, iopt).ge(s.ring);
  };
  setup(full_, false);
  setup(sliding_, true);
  auto fopt = at::TensorOptions().dtype(opt.dtype).device(opt.device);
  codes_.resize(cfg.num_layers);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const int64_t H = cfg.kv_heads(l), D = cfg.layer_head_dim[l];
    const TypeState& st = state(l);
    if (cfg.kv_shared(l)) {  // the buffers of the layer it reads (same type, so same slots and shapes)
      at::Tensor k = k_[cfg.kv_layer[l]], v = v_[cfg.kv_layer[l]];
      k_.push_back(k);
      v_.push_back(v);
      continue;
    }
    const ops::RowCode code = st.coded ? ops::layer_code(rp.full_code, rp.full_code_layers, l)
                              : st.policy ? rp.region_code : ops::RowCode{};
    if (code.defined()) {
      ops::check_row_code(D, code, "KV cache: layer " + std::to_string(l) + (st.coded ? " (full_code)" : " (region_code)"));
      ops::CodedSlots& c = codes_[l];
      c.code = code;
      auto bopt = at::TensorOptions().dtype(at::kByte).device(opt.device);
      auto hopt = at::TensorOptions().dtype(at::kHalf).device(opt.device);
      c.k_codes = at::zeros({opt.batch, H, st.rest, ops::code_bytes(D, code.k())}, bopt);
      c.v_codes = at::zeros({opt.batch, H, st.rest, ops::code_bytes(D, code.v())}, bopt);
      c.k_side = at::zeros({opt.batch, H, st.rest, ops::side_halves(D, code)}, hopt);
      c.v_side = at::zeros({opt.batch, H, st.rest, ops::side_halves(D, code)}, hopt);
      if (st.coded && code.rotated()) {  // the session's means, set by its first forward (code_stored)
        c.k_mean = at::zeros({opt.batch, H, D}, at::TensorOptions().dtype(at::kFloat).device(opt.device));
        c.v_mean = at::zeros_like(c.k_mean);
        if (code.weighted) {
          KAKEYA_CHECK(l < (int64_t)rp.full_k_weight.size() && rp.full_k_weight[l].defined(),
                       "KV cache: layer " << l << " codes its rows as " << ops::row_code_name(code)
                                          << " but has no K weights (restore policy full_k_weight)");
          const at::Tensor& w = rp.full_k_weight[l];
          KAKEYA_CHECK(w.dim() == 2 && w.size(0) == H && w.size(1) == D,
                       "KV cache: layer " << l << " K weights " << w.sizes() << ", expected [" << H << ", " << D << "]");
          KAKEYA_CHECK(w.gt(0).all().item<bool>() && w.isfinite().all().item<bool>(),
                       "KV cache: layer " << l << " K weights must be finite and > 0");
          c.k_weight = w.to(at::TensorOptions().dtype(at::kFloat).device(opt.device)).unsqueeze(0).expand({opt.batch, H, D}).contiguous();
        }
      }
      k_.push_back(at::zeros({opt.batch, H, st.ring + st.held, D}, fopt));
      v_.push_back(at::zeros({opt.batch, H, st.ring + st.held, D}, fopt));
      continue;
    }
    k_.push_back(at::zeros({opt.batch, H, st.ring + st.rest, D}, fopt));
    v_.push_back(at::zeros({opt.batch, H, st.ring + st.rest, D}, fopt));
  }
}

bool KVCache::region_coded(int64_t layer) const { return codes_[layer].defined(); }

std::pair<at::Tensor, at::Tensor> KVCache::attend_kv(int64_t layer) const {
  const ops::CodedSlots& c = codes_[layer];
  if (!c.defined()) return {k_[layer], v_[layer]};
  const auto dt = k_[layer].scalar_type();
  auto rows = [&](const at::Tensor& codes, const at::Tensor& side, const ops::RowCode& code, const at::Tensor& mean,
                  const at::Tensor& weight) {
    if (!mean.defined()) return ops::dequantize_rows(codes, side, code, dt);
    auto x = ops::dequantize_rows(codes, side, code, at::kFloat);
    if (weight.defined()) x = x / weight.unsqueeze(2);
    return (x + mean.unsqueeze(2)).to(dt);
  };
  return {at::cat({k_[layer], rows(c.k_codes, c.k_side, c.code.k(), c.k_mean, c.k_weight)}, 2),
          at::cat({v_[layer], rows(c.v_codes, c.v_side, c.code.v(), c.v_mean, at::Tensor())}, 2)};
}

const at::Tensor& KVCache::slot_positions(int64_t layer) const { return state(layer).pos; }

bool KVCache::restored(int64_t layer) const { return state(layer).policy && !state(layer).coded; }
bool KVCache::coded(int64_t layer) const { return state(layer).coded; }
bool KVCache::plain(int64_t layer) const { return !state(layer).policy; }

int64_t KVCache::exact_slots(int64_t layer) const { return state(layer).ring; }
int64_t KVCache::dense_slots(int64_t layer) const { return state(layer).ring + state(layer).held; }
int64_t KVCache::restored_slots(int64_t layer) const { return state(layer).rest; }

bool KVCache::write_first(int64_t layer, int64_t t) const {
  const TypeState& s = state(layer);
  if (s.policy) return s.ring >= t + s.window - 1 || s.ring == opt_.capacity;
  if (!cfg_.is_sliding(layer)) return true;
  // Slots overwritten by the chunk held positions p - S for p in the chunk; the
  // chunk's first query still needs p0 - window + 1, hence S >= T + window - 1. A ring as
  // long as the capacity (contexts shorter than the window) never overwrites anything.
  return slots(layer) >= t + cfg_.sliding_window - 1 || slots(layer) == opt_.capacity;
}

at::Tensor KVCache::visible(int64_t layer, const at::Tensor& q_pos) const {
  return visible_over(layer, state(layer).pos, state(layer).in_restored, q_pos);
}

at::Tensor KVCache::visible_concat(int64_t layer, const at::Tensor& old_pos, const at::Tensor& q_pos) const {
  const TypeState& s = state(layer);
  at::Tensor in_restored;  // the chunk's own slots are exact
  if (s.policy) in_restored = at::cat({s.in_restored, at::zeros({q_pos.size(0)}, s.in_restored.options())});
  return visible_over(layer, at::cat({old_pos, q_pos}), in_restored, q_pos, old_pos.size(-1));
}

at::Tensor KVCache::visible_over(int64_t layer, const at::Tensor& pos, const at::Tensor& in_restored,
                                 const at::Tensor& q_pos, int64_t own_from) const {
  const TypeState& s = state(layer);
  const int64_t span = cfg_.is_sliding(layer) ? cfg_.sliding_window : 0;
  auto m = causal_visible(pos, q_pos, span);
  if (!s.policy) return m;
  // Exact copies serve the recent window, restored (or coded) copies everything older; the
  // forward's own slots (own_from on) are exact at every distance.
  // [T, S] bool ([B, T, S] with rows: pos [B, S], q_pos [B, T]; in_restored [S] is every row's)
  auto recent = (q_pos.unsqueeze(-1) - pos.unsqueeze(-2)).lt(s.window);
  auto rule = recent.ne(in_restored);
  if (own_from >= 0) rule = rule.logical_or(at::arange(pos.size(-1), pos.options()).ge(own_from));
  m = m.logical_and(rule);
  if (s.held > 0) {
    // A coded layer's sinks: their coded rows are hidden (the exact sink slots serve them).
    auto coded_row = at::arange(pos.size(-1), pos.options()).ge(s.ring + s.held).logical_and(in_restored);
    m = m.logical_and(coded_row.logical_and(pos.lt(s.held)).logical_not().unsqueeze(-2));
  }
  if (!opt_.restore.drops(layer)) return m;
  // A dropping layer sees only the sinks of its restored region.
  auto dropped = in_restored.logical_and(pos.ge(opt_.restore.sink));  // [S] ([B, S])
  return m.logical_and(dropped.logical_not().unsqueeze(-2));
}

ops::CopyRule KVCache::copy_rule(int64_t layer) const {
  const TypeState& s = state(layer);
  if (!s.policy) return {};
  return {s.in_restored, s.window, s.held, opt_.restore.drops(layer) ? opt_.restore.sink : -1, codes_[layer]};
}

void KVCache::mark(const at::Tensor& positions) {
  KAKEYA_CHECK(opt_.rows == (positions.dim() == 2), "KV cache: positions " << positions.sizes() << " for a cache "
                   << (opt_.rows ? "of independent rows (expected [B, T])" : "of one sequence (expected [T])"));
  if (opt_.rows) {
    // Each row at its own positions; a row's own length bounds them (the caller's), so only the
    // ring rules are checked here: a forward that wraps a ring would overwrite its own slots.
    const int64_t t = positions.size(1);
    KAKEYA_CHECK(positions.size(0) == opt_.batch, "KV cache: positions for " << positions.size(0) << " rows, cache of "
                                                                            << opt_.batch);
    for (TypeState* s : {&full_, &sliding_}) {
      if (s->policy) {
        KAKEYA_CHECK(t <= opt_.restore.max_step, "KV cache: a forward of " << t << " tokens per row exceeds the "
                                                     << "restore policy's step of " << opt_.restore.max_step);
        const at::Tensor slot = positions.remainder(s->ring);
        s->pos.narrow(1, 0, s->ring).scatter_(1, slot, positions);
        if (s->coded) {  // as one sequence's mark below: row = position, sinks re-marked
          s->marked = positions;
          s->marked_slot = slot;
          s->pos.narrow(1, s->ring + s->held, s->rest).scatter_(1, positions, positions);
          if (s->held > 0) s->pos.narrow(1, s->ring, s->held).copy_(s->held_pos);
        }
      } else if (s == &full_) {
        s->pos.scatter_(1, positions, positions);
      } else if (std::any_of(cfg_.layer_types.begin(), cfg_.layer_types.end(),
                             [](LayerType t) { return t == LayerType::Sliding; })) {
        KAKEYA_CHECK(t <= s->ring, "KV cache: a forward of " << t << " tokens per row exceeds the sliding ring of "
                                                             << s->ring << " slots");
        s->pos.scatter_(1, positions.remainder(s->ring), positions);
      }
    }
    return;
  }
  int64_t t = positions.size(0);
  KAKEYA_CHECK(length_ + t <= opt_.capacity, "KV cache: " << length_ << " + " << t
                                                          << " positions exceed capacity " << opt_.capacity
                                                          << " (raise --context / capacity)");
  for (TypeState* s : {&full_, &sliding_}) {
    if (s->policy) {
      KAKEYA_CHECK(t <= opt_.restore.max_chunk || s->ring == opt_.capacity,
                   "KV cache: a forward of " << t << " tokens exceeds the restore policy's chunk of "
                                             << opt_.restore.max_chunk);
      // A chunk longer than the ring (exact copies) leaves its last ring's worth there.
      const at::Tensor held = t > s->ring ? positions.slice(0, t - s->ring) : positions;
      at::Tensor ring_pos = s->pos.narrow(0, 0, s->ring);
      ops::store_positions(ring_pos, held, s->ring);
      // A coded layer's rows hold every position (row = position), coded as it is written; its
      // sink slots hold the sinks (re-marked: a truncation below them cleared them).
      if (s->coded) {
        s->marked = t > s->ring ? at::Tensor() : positions;
        s->marked_slot = held.remainder(s->ring);
        s->pos.narrow(0, s->ring + s->held, s->rest).index_copy_(0, positions, positions);
        if (s->held > 0) s->pos.narrow(0, s->ring, s->held).copy_(s->held_pos);
      }
    } else if (s == &full_) {
      ops::store_positions(s->pos, positions, 0);
    } else {
      // Only the last S positions of a long chunk stay in the ring.
      ops::store_positions(s->pos, t >= s->ring ? positions.slice(0, t - s->ring) : positions, s->ring);
    }
  }
}

void KVCache::write(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  KAKEYA_CHECK(!cfg_.kv_shared(layer), "KV cache: layer " << layer << " is KV-shared (it reads layer "
                                                         << cfg_.kv_layer[layer] << "'s K/V) and has none to write");
  auto& kb = k_[layer];
  auto& vb = v_[layer];
  const TypeState& st = state(layer);
  int64_t t = k.size(2);
  if (opt_.rows) {  // per row: slot = position mod ring (sliding and policy layers) or position
    const at::Tensor at_row = cfg_.is_sliding(layer) || st.policy ? positions.remainder(st.ring) : positions;
    const auto slot = at_row.view({k.size(0), 1, t, 1}).expand(k.sizes());
    kb.scatter_(2, slot, k);
    vb.scatter_(2, slot, v);
    if (st.coded) code_stored(layer, positions);
    return;
  }
  if (st.policy) {
    const int64_t leave = opt_.restore.exact_copies && !st.coded ? t - st.window : 0;
    if (leave > 0) {
      // Exact copies: the positions of a chunk longer than the window that leave the window
      // within it (a forward's positions are consecutive) get their restored copies now, the
      // last region's worth of them (older ones are past every later query's span); the caller
      // marks them (mark_restored) after the forward, whose queries read them exactly.
      const int64_t keep = std::min(leave, st.rest), from = leave - keep;
      write_restored(layer, k.narrow(2, from, keep), v.narrow(2, from, keep), positions.slice(0, from, leave));
    }
    if (st.coded && t > st.ring) {
      // A chunk longer than the ring (exact copies; it attended over [slots ++ chunk]): coded
      // through the ring a ring's worth at a time (code_rows reads the ring and copies the sinks
      // beside it), which then holds the chunk's last ring's worth. The means come from the whole
      // chunk when it is the session's first.
      if (length_ == 0 && codes_[layer].k_mean.defined()) set_means(layer, k, v, positions);
      for (int64_t a = 0; a < t; a += st.ring) {
        const int64_t n = std::min(st.ring, t - a);
        const auto piece = positions.slice(0, a, a + n), slot = piece.remainder(st.ring);
        kb.index_copy_(2, slot, k.narrow(2, a, n));
        vb.index_copy_(2, slot, v.narrow(2, a, n));
        ops::code_rows(kb, vb, slot, piece, codes_[layer], st.held, st.ring);
      }
      return;
    }
    const int64_t held = std::min(t, st.ring);  // a chunk longer than the ring leaves its last ring's worth
    auto slot = positions.slice(0, t - held).remainder(st.ring);
    kb.index_copy_(2, slot, k.narrow(2, t - held, held));
    vb.index_copy_(2, slot, v.narrow(2, t - held, held));
    if (st.coded) code_stored(layer, positions);
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
  KAKEYA_CHECK(s.sinks_only || positions.size(0) <= s.rest, "KV cache: " << positions.size(0)
                                                                       << " restored positions at once exceed the "
                                                                       << s.rest << " restored slots");
  KAKEYA_CHECK(!s.coded, "KV cache: mark_restored on coded layers (their rows are marked with their positions)");
  KAKEYA_CHECK(!opt_.rows, "KV cache: mark_restored on independent rows (restore through a row's view, row())");
  s.pos.narrow(0, s.ring, s.rest).index_copy_(0, region_slot(s, positions), positions);
}

at::Tensor KVCache::region_slot(const TypeState& s, const at::Tensor& positions) const {
  return s.sinks_only ? positions.clamp_max(opt_.restore.sink) : positions.remainder(s.rest);
}

bool KVCache::sinks_only(int64_t layer) const { return state(layer).sinks_only; }

void KVCache::write_restored(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  const TypeState& s = state(layer);
  KAKEYA_CHECK(s.policy && !s.coded, "KV cache: write_restored on layer " << layer << ", which has no restoration");
  KAKEYA_CHECK(!opt_.rows, "KV cache: write_restored on independent rows (restore through a row's view, row())");
  ops::CodedSlots& c = codes_[layer];
  if (c.defined()) {
    auto slot = region_slot(s, positions);
    auto [kc, ks] = ops::quantize_rows(k, c.code.k());
    auto [vc, vs] = ops::quantize_rows(v, c.code.v());
    c.k_codes.index_copy_(2, slot, kc);
    c.k_side.index_copy_(2, slot, ks);
    c.v_codes.index_copy_(2, slot, vc);
    c.v_side.index_copy_(2, slot, vs);
    return;
  }
  auto slot = region_slot(s, positions) + s.ring;
  k_[layer].index_copy_(2, slot, k);
  v_[layer].index_copy_(2, slot, v);
}

void KVCache::code_stored(int64_t layer, const at::Tensor& positions) {
  const TypeState& s = state(layer);
  KAKEYA_CHECK(s.coded, "KV cache: code_stored on layer " << layer << ", which is not a coded layer");
  ops::CodedSlots& c = codes_[layer];
  const auto slot = positions.is_same(s.marked) ? s.marked_slot : positions.remainder(s.ring);
  if (length_ == 0 && !opt_.rows && c.k_mean.defined())
    set_means(layer, k_[layer].index_select(2, slot), v_[layer].index_select(2, slot), positions);
  // (With rows, each row's means were set by its own first forward, through its row() view.)
  ops::code_rows(k_[layer], v_[layer], slot, positions, codes_[layer], s.held, s.ring);
}

void KVCache::set_means(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  // A session's first forward: its rows past the sinks give the means every later row is coded
  // against (any fixed offset is exact: the reader adds it back; a good one saves bits).
  ops::CodedSlots& c = codes_[layer];
  auto keep = positions.ge(state(layer).held).to(at::kFloat).view({1, 1, -1, 1});  // [1, 1, T, 1]
  auto n = keep.sum().clamp_min(1);
  c.k_mean.copy_((k.to(at::kFloat) * keep).sum(2) / n);
  c.v_mean.copy_((v.to(at::kFloat) * keep).sum(2) / n);
}

ops::CodedSlots KVCache::region_codes(int64_t layer) {
  KAKEYA_CHECK(codes_[layer].defined() && !state(layer).coded,
               "KV cache: region_codes of layer " << layer << ", whose restored region is not coded");
  return codes_[layer];
}

std::pair<at::Tensor, at::Tensor> KVCache::exact_kv(int64_t layer, const at::Tensor& positions) const {
  const TypeState& s = state(layer);
  auto slot = s.policy ? positions.remainder(s.ring) : (cfg_.is_sliding(layer) ? positions.remainder(s.ring) : positions);
  return {k_[layer].index_select(2, slot), v_[layer].index_select(2, slot)};
}

std::pair<at::Tensor, at::Tensor> KVCache::exact_ring(int64_t layer) {
  const TypeState& s = state(layer);
  KAKEYA_CHECK(s.policy && !s.coded, "KV cache: exact_ring of layer " << layer << ", which has no restoration");
  return {k_[layer].narrow(2, 0, s.ring), v_[layer].narrow(2, 0, s.ring)};
}

std::pair<at::Tensor, at::Tensor> KVCache::restored_region(int64_t layer) {
  const TypeState& s = state(layer);
  KAKEYA_CHECK(s.policy && !s.coded && !codes_[layer].defined(),
               "KV cache: restored_region of layer " << layer << ", which has no dense restored region");
  return {k_[layer].narrow(2, s.ring, s.rest), v_[layer].narrow(2, s.ring, s.rest)};
}

void KVCache::advance(int64_t t) {
  KAKEYA_CHECK(!opt_.rows, "KV cache: independent rows keep no common length (advance)");
  length_ += t;
  for (TypeState* s : {&full_, &sliding_})
    if ((s->policy || (s == &sliding_ && cfg_.sliding_window > 0)) && length_ > s->ring)
      s->max_evicted = std::max(s->max_evicted, length_ - s->ring - 1);
}

void KVCache::truncate(int64_t n) {
  KAKEYA_CHECK(!opt_.rows || n == 0, "KV cache: independent rows are cleared, not truncated (truncate(" << n << "))");
  KAKEYA_CHECK(n >= 0 && n <= length_, "KV cache: truncate(" << n << ") outside [0, " << length_ << "]");
  // clear() always empties the slots: a row() view's slots also take the batched steps' positions,
  // which its length does not count.
  if (n == length_ && n > 0) return;
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

KVCache KVCache::row(int64_t b) const {
  KAKEYA_CHECK(opt_.rows && b >= 0 && b < opt_.batch, "KV cache: row(" << b << ") of " << (opt_.rows ? opt_.batch : 0)
                                                                          << " independent rows");
  return slice_rows(b, 1, false);
}

KVCache KVCache::first_rows(int64_t n) const {
  KAKEYA_CHECK(opt_.rows && n >= 1 && n <= opt_.batch, "KV cache: first_rows(" << n << ") of "
                                                           << (opt_.rows ? opt_.batch : 0) << " independent rows");
  return slice_rows(0, n, true);
}

KVCache KVCache::slice_rows(int64_t b, int64_t n, bool rows) const {
  KVCache v = *this;
  v.opt_.batch = n;
  v.opt_.rows = rows;
  v.length_ = 0;
  auto cut = [&](at::Tensor& t) {
    if (t.defined()) t = t.narrow(0, b, n);
  };
  for (auto& t : v.k_) cut(t);
  for (auto& t : v.v_) cut(t);
  for (auto& c : v.codes_)
    for (at::Tensor* t : c.tensors()) cut(*t);
  for (TypeState* s : {&v.full_, &v.sliding_}) {
    s->pos = rows ? s->pos.narrow(0, b, n) : s->pos.select(0, b);
    s->max_evicted = -1;
  }
  return v;
}

int64_t KVCache::layer_bytes(int64_t l) const {
  if (cfg_.kv_shared(l)) return 0;  // aliases kv_layer[l]'s buffers
  return 2 * k_[l].numel() * k_[l].element_size() + region_code_bytes(l);
}

int64_t KVCache::region_code_bytes(int64_t l) const {
  const ops::CodedSlots& c = codes_[l];
  if (!c.defined()) return 0;
  int64_t b = 0;
  for (const at::Tensor* t : c.tensors())
    if (t->defined()) b += t->numel() * t->element_size();
  return b;
}

// Dense bytes of one slot of layer l (K and V).
int64_t KVCache::slot_bytes(int64_t l) const {
  return 2 * opt_.batch * cfg_.kv_heads(l) * cfg_.layer_head_dim[l] * k_[l].element_size();
}

int64_t KVCache::coded_bytes() const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    if (state(l).coded && !cfg_.kv_shared(l)) b += region_code_bytes(l);
  return b;
}

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
    if (cfg_.layer_types[l] == t && !cfg_.kv_shared(l)) b += slot_bytes(l) * (state(l).ring + state(l).held);
  return b;
}

int64_t KVCache::restored_bytes(LayerType t) const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    if (cfg_.layer_types[l] == t && !state(l).coded && !cfg_.kv_shared(l))
      b += codes_[l].defined() ? region_code_bytes(l) : slot_bytes(l) * state(l).rest;
  return b;
}

int64_t KVCache::full_kv_bytes(int64_t n) const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    if (!cfg_.kv_shared(l)) b += slot_bytes(l) * n;
  return b;
}

int64_t KVCache::native_kv_bytes(int64_t n) const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) {
    if (cfg_.kv_shared(l)) continue;
    int64_t m = cfg_.is_sliding(l) && cfg_.sliding_window > 0 ? std::min(n, cfg_.sliding_window) : n;
    b += slot_bytes(l) * m;
  }
  return b;
}

}  // namespace kakeya

#include "infer/restorer.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "calib/codec/calib_bundle.h"
#include "core/error.h"
#include "infer/graph_capture.h"
#include "infer/loop_util.h"
#include "infer/memory.h"

#ifdef KAKEYA_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace kakeya {

void check_restores_something(const RestoreOptions& o, int64_t n_prompt, int64_t max_new) {
  const int64_t context = n_prompt + max_new;
  KAKEYA_CHECK(o.window < context,
               "decode: --window " << o.window << " is larger than the context (prompt " << n_prompt << " + "
                                   << max_new << " new tokens = " << context
                                   << " positions): nothing would ever be restored; use a smaller --window");
}

std::string region_code_names() {
  std::istringstream names(ops::row_code_names());
  std::string out, name;
  while (names >> name)
    if (name != "|" && !ops::parse_row_code(name, "").weighted) out += (out.empty() ? "" : " | ") + name;
  return out;
}

void check_region_code(const ops::RowCode& code, const std::string& flag) {
  KAKEYA_CHECK(!code.weighted, flag << " " << ops::row_code_name(code)
                                    << ": weighted codes are for full-attention rows (--full-code); a restored region "
                                       "takes none | "
                                    << region_code_names());
}

void check_window_chunk(const RestoreOptions& o, const std::string& who) {
  KAKEYA_CHECK(o.window >= 1, who << ": --window expected >= 1, got " << o.window);
  KAKEYA_CHECK(o.chunk >= 0, who << ": --chunk expected >= 0 (0: the window, or " << RestoreOptions::kLongChunk
                                   << " under exact restoration), got " << o.chunk);
  KAKEYA_CHECK(o.chunk <= o.window || o.long_chunks(),
               who << ": --chunk expected in [1, window=" << o.window << "] (0: window), got " << o.chunk
                   << " (a longer chunk would need restored K/V of itself; only exact restoration, --mix-alpha 1 "
                      "with --full-attn exact or codec, takes longer chunks)");
}

void validate_restore(const Model& verifier, const Drafter* drafter, const FTheta* ftheta, const RestoreOptions& o,
                      int64_t n_prompt, int64_t max_new, const std::string& ftheta_origin) {
  const ModelConfig& cfg = verifier.config();
  const int64_t context = n_prompt + max_new;
  KAKEYA_CHECK(n_prompt > 0, "decode: empty prompt (the tokenizer produced no tokens)");
  KAKEYA_CHECK(max_new > 0, "decode: --max-new-tokens expected > 0, got " << max_new);
  if (cfg.max_position_embeddings > 0)
    KAKEYA_CHECK(context <= cfg.max_position_embeddings,
                 "decode: prompt of " << n_prompt << " tokens + " << max_new << " new tokens = " << context
                                      << " positions exceeds the model's limit of " << cfg.max_position_embeddings
                                      << " (max_position_embeddings): shorten the prompt or --max-new-tokens");
  KAKEYA_CHECK(context <= verifier.options().max_positions,
               "decode: prompt of " << n_prompt << " tokens + " << max_new << " new tokens = " << context
                                    << " positions exceeds the loaded RoPE table (" << verifier.options().max_positions
                                    << " positions)");
  KAKEYA_CHECK(o.sink >= 0, "decode: --sink expected >= 0, got " << o.sink);
  check_window_chunk(o, "decode");
  KAKEYA_CHECK(o.mix_alpha >= 0.0 && o.mix_alpha <= 1.0, "decode: --mix-alpha expected in [0, 1], got " << o.mix_alpha);
  KAKEYA_CHECK(o.full_attn != FullAttn::Codec || o.full_code.defined(),
               "decode: --full-attn codec needs a --full-code (" << ops::row_code_names() << ")");
  check_region_code(o.region_code, "decode: --restored-code");
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    if (o.region_code.defined())
      ops::check_row_code(cfg.layer_head_dim[l], o.region_code,
                          "decode: --restored-code on layer " + std::to_string(l));
    if (o.full_attn == FullAttn::Codec && !cfg.is_sliding(l))
      ops::check_row_code(cfg.layer_head_dim[l], ops::layer_code(o.full_code, o.full_code_layers, l),
                          "decode: --full-code on layer " + std::to_string(l));
  }
  if (!o.full_code_layers.empty()) {
    std::string stored;  // the full-attention layers that store K/V: those a layer's own code may name
    for (int64_t i = 0; i < cfg.num_layers; ++i)
      if (cfg.stores_full_kv(i)) stored += (stored.empty() ? "" : ", ") + std::to_string(i);
    for (size_t l = 0; l < o.full_code_layers.size(); ++l)
      KAKEYA_CHECK(!o.full_code_layers[l].defined() || ((int64_t)l < cfg.num_layers && cfg.stores_full_kv(l)),
                   "decode: --full-code " << ops::layer_codes_name(o.full_code, o.full_code_layers) << ": layer " << l
                                          << " is not a full-attention layer that stores K/V (this model's: " << stored << ")");
  }
  bool has_sliding = false, has_full = false;
  for (int64_t l = 0; l < cfg.num_layers; ++l) (cfg.is_sliding(l) ? has_sliding : has_full) = true;
  if (has_sliding)
    KAKEYA_CHECK(o.sink + o.window < cfg.sliding_window,
                 "decode: --sink " << o.sink << " + --window " << o.window << " = " << o.sink + o.window
                                   << " >= the model's sliding window (" << cfg.sliding_window
                                   << "): sliding layers would never read a restored position; use a smaller "
                                      "--window, or --mode ar");
  KAKEYA_CHECK(has_sliding || o.full_attn == FullAttn::Restored,
               "decode: the model has no sliding-attention layers and --full-attn is " << full_attn_name(o.full_attn)
                                                                                        << ": nothing to restore");
  if (o.full_attn == FullAttn::Codec) {
    KAKEYA_CHECK(has_full, "decode: --full-attn codec on a model without full-attention layers");
  }
  if (o.needs_ftheta()) {
    KAKEYA_CHECK(drafter, "decode: restoration with --mix-alpha < 1 needs a drafter (--drafter DIR)");
    KAKEYA_CHECK(ftheta, "decode: restoration with --mix-alpha < 1 needs f_θ (--ftheta DIR)");
  }
  if (drafter) {
    KAKEYA_CHECK(&drafter->target() == &verifier, "decode: the drafter is bound to another verifier model");
    KAKEYA_CHECK(context <= drafter->config().max_position_embeddings || drafter->config().max_position_embeddings <= 0,
                 "decode: " << context << " positions exceed the drafter's limit of "
                            << drafter->config().max_position_embeddings);
  }
  if (ftheta && drafter) ftheta->config().check(cfg, drafter->config(), ftheta_origin);
  resolve_restore_layers(cfg, ftheta, o);  // a bad --restore-layers list fails here, before anything runs
  KAKEYA_CHECK(!(o.stats && o.evict_only()),
               "decode: --stats with --restore-layers none: nothing is restored, so there is no error to measure");
}

// ---------------------------------------------------------------- RestoreStats

std::vector<bool> resolve_restore_layers(const ModelConfig& cfg, const FTheta* f, const RestoreOptions& o) {
  std::vector<bool> covered(cfg.num_layers), out(cfg.num_layers, false);
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    covered[l] = cfg.is_sliding(l) || o.full_attn == FullAttn::Restored;
  std::vector<int64_t> list;
  if (o.layers == "all" || (o.layers == "auto" && (!f || !f->config().restore_layers_measured))) {
    out = covered;
    return out;
  }
  if (o.layers == "none") return out;
  if (o.layers == "auto") {
    list = f->config().restore_layers;
  } else {
    std::stringstream ss(o.layers);
    std::string item;
    while (std::getline(ss, item, ',')) {
      size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      KAKEYA_CHECK(!item.empty() && used == item.size(),
                   "--restore-layers '" << o.layers << "': expected auto, all, none or a comma-separated list of layer ids");
      list.push_back(v);
    }
  }
  for (int64_t l : list) {
    KAKEYA_CHECK(l >= 0 && l < cfg.num_layers,
                 "--restore-layers: layer " << l << " is outside the verifier's " << cfg.num_layers << " layers");
    KAKEYA_CHECK(covered[l], "--restore-layers: layer " << l << " is a full-attention layer, which --full-attn "
                                                        << full_attn_name(o.full_attn) << " keeps exact");
    out[l] = true;
  }
  return out;
}

bool settle_auto_layers(RestoreOptions& o, const FThetaConfig& f) {
  if (o.layers != "auto" || !o.needs_ftheta() || !f.restore_layers_measured || !f.restore_layers.empty()) return false;
  o.layers = "none";
  return true;
}

void set_dropped_layers(RestorePolicy& p, const ModelConfig& cfg, const FTheta* f, const RestoreOptions& o) {
  const std::vector<bool> keep = resolve_restore_layers(cfg, f, o);
  p.drop.assign(cfg.num_layers, false);
  // Only layers restoration covers drop anything: coded full-attention layers use the same
  // region machinery for their coded history, which every query must keep reading.
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    p.drop[l] = !keep[l] && (cfg.is_sliding(l) || o.full_attn == FullAttn::Restored);
  p.sink = o.sink;
}

// ---------------------------------------------------------------- Restorer

bool token_layer(int64_t l) {
  // The first layer reads the token's (scaled) embedding and nothing else: its raw K/V are a
  // function of the token alone, RoPE adds the position. Every later layer mixes positions.
  return l == 0;
}

Restorer::Restorer(const Model& verifier, const Drafter* drafter, const FTheta* ftheta, const RestoreOptions& opt,
                   KVCache& cache)
    : model_(verifier), drafter_(drafter), ftheta_(ftheta), opt_(opt), cache_(cache) {
  const ModelConfig& cfg = verifier.config();
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    if (cache.restored(l)) {
      layers_.push_back(l);
      (cfg.is_sliding(l) ? has_sliding_ : has_full_) = true;
    }
  KAKEYA_CHECK(!layers_.empty(), "restorer: the KV cache has no restore policy");
  KAKEYA_CHECK(cache.options().restore.window == opt.window,
               "restorer: cache window " << cache.options().restore.window << " vs " << opt.window);
  KAKEYA_CHECK(!opt.needs_ftheta() || (drafter && ftheta), "restorer: --mix-alpha < 1 needs a drafter and f_θ");
  const at::Device dev = verifier.device();
  from_token_.assign(cfg.num_layers, false);
  if (opt.token_layers && opt.needs_ftheta())
    for (int64_t l : layers_) from_token_[l] = token_layer(l);
  // The pending rings hold every committed position not restored yet. A forward's queries read
  // restored K/V of every j <= (its last position) - window, so before a forward of positions up to
  // p nothing older than p - window + 1 is pending: window slots, plus the rolled-back tail. (An
  // upkeep batch from `from` is read by forwards launched at from + window - span + 1 or later;
  // the ones running beside it write positions <= from + window - 1, never a slot it reads.)
  ring_ = opt.window + cache.options().rollback;
  if (drafter) {
    capture_ = std::make_unique<TargetFeatureCapture>(verifier, drafter->config().target_layer_ids);
    vtaps_.subscribe(capture_.get());
  }
  if (opt.needs_true_raw()) {
    vtaps_.subscribe(this);
    tk_.resize(cfg.num_layers);
    tv_.resize(cfg.num_layers);
    auto fopt = at::TensorOptions().dtype(verifier.dtype()).device(dev);
    for (int64_t l : layers_) {
      tk_[l] = at::zeros({ring_, cfg.kv_heads(l), cfg.layer_head_dim[l]}, fopt);
      tv_[l] = at::zeros({ring_, cfg.kv_heads(l), cfg.layer_head_dim[l]}, fopt);
    }
  }
  features_in_ = opt.needs_ftheta() && ftheta->config().reads_features();
  if (features_in_) {
    // f_θ reads the target features themselves: the commits keep them in the feature ring.
    const int64_t F = drafter->config().num_features() * cfg.hidden_size;
    feat_ = at::zeros({ring_, F}, at::TensorOptions().dtype(verifier.dtype()).device(dev));
  } else if (opt.needs_ftheta()) {
    const auto& dc = drafter->config();
    auto dopt = at::TensorOptions().dtype(drafter->dtype()).device(drafter->device());
    dk_ = at::zeros({ring_, dc.num_layers, dc.num_kv_heads, dc.head_dim}, dopt);
    dv_ = at::zeros({ring_, dc.num_layers, dc.num_kv_heads, dc.head_dim}, dopt);
  }
  dtap_.self = this;
  dtaps_.subscribe(&dtap_);
  if (opt.stats) acc_ = at::zeros({2, 2, 2, 2}, at::TensorOptions().dtype(at::kDouble).device(dev));
  // The fused path: pure f_θ (no true raw K/V to mix, no statistics), f_θ's fused outputs one
  // equal-width k and v row per verifier layer (no K=V layers), and no v_norm (the kernel
  // stores raw v) — Gemma 3. Everything else takes the reference ops below.
  // Exact restoration (a = 1) takes the same store kernel's copy(): every position copied from
  // the exact ring (through the region's code), as sinks are; no raw rows.
  const bool exact_copy = !opt.needs_ftheta() && !opt.needs_true_raw() && !opt.evict_only();
  kernel_ = opt.kernels && dev.is_cuda() && ops::cuda_kernels_available() && (opt.needs_ftheta() || exact_copy) &&
            !opt.needs_true_raw() && !cfg.v_norm &&
            (verifier.dtype() == at::kFloat || verifier.dtype() == at::kBFloat16);
  if (kernel_) {
    // One store launch: equal K/V widths (ops::RestoreStore), a V decoder per layer, and regions
    // addressed by position mod their slots (not a sinks-only region).
    for (int64_t l : layers_)
      kernel_ = kernel_ && (exact_copy || !ftheta->config().v_from_k[l]) && cfg.kv_heads(l) == cfg.kv_heads(layers_[0]) &&
                cfg.layer_head_dim[l] == cfg.layer_head_dim[layers_[0]] && !cache.sinks_only(l);
  }
  if (kernel_) {
    // One store launch for every layer f_θ restores, one copy launch for the token layers (both
    // every layer at a = 1); sinks leaving the window take their exact K/V, which the exact ring
    // still holds, as do the token layers' positions.
    std::vector<ops::RestoreStore::Layer> learned, copied;
    for (int64_t l : layers_) {
      ops::RestoreStore::Layer L;
      const bool copy = exact_copy || from_token_[l];
      L.k_src = copy ? 0 : ftheta->config().k_offset(l);
      L.v_src = copy ? 0 : ftheta->config().v_offset(l);
      L.args = verifier.rope_args(l, 0, cache.restored_slots(l));
      std::tie(L.args.sink_k, L.args.sink_v) = cache.exact_ring(l);
      L.args.sink = opt.sink;
      L.args.sink_ring = cache.exact_slots(l);
      if (cache.region_coded(l)) L.codes = cache.region_codes(l);
      else std::tie(L.k_cache, L.v_cache) = cache.restored_region(l);
      (copy ? copied : learned).push_back(std::move(L));
    }
    if (!learned.empty()) store_ = std::make_unique<ops::RestoreStore>(std::move(learned));
    if (!copied.empty()) copy_store_ = std::make_unique<ops::RestoreStore>(std::move(copied));
  }
}

void Restorer::on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) {
  if (tap != Tap::KProj && tap != Tap::VProj) return;
  auto& ring = tap == Tap::KProj ? tk_ : tv_;
  if (ctx.layer >= (int64_t)ring.size() || !ring[ctx.layer].defined()) return;
  // x: [1, T, H_kv, D]. Positions of a rejected tail get overwritten when those positions are committed.
  ring[ctx.layer].index_copy_(0, ctx.positions.remainder(ring_), x.select(0, 0).to(ring[ctx.layer].scalar_type()));
}

void Restorer::DrafterTap::on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) {
  if ((tap != Tap::KProj && tap != Tap::VProj) || !self->dk_.defined()) return;
  at::Tensor ring = (tap == Tap::KProj ? self->dk_ : self->dv_).select(1, ctx.layer);  // [ring, H_d, D_d]
  ring.index_copy_(0, ctx.positions.remainder(self->ring_), x.select(0, 0).to(ring.scalar_type()));
}

void Restorer::prepare(int64_t p0, int64_t t) {
  KAKEYA_CHECK(t >= 1 && t <= cache_.options().restore.max_chunk,
               "restorer: a forward of " << t << " tokens exceeds the policy's chunk of "
                                         << cache_.options().restore.max_chunk);
  // The forward's queries p0 .. p0+t-1 read restored K/V of every j <= p0 + t - 1 - window.
  // A chunk longer than the window (exact copies) reads its own positions exactly: only the
  // positions before it need their restored copies.
  const int64_t last = std::min(p0 + t - 1 - opt_.window, p0 - 1);
  if (last <= restored_upto_) return;
  const int64_t first = restored_upto_ + 1;
  restore_at(at::arange(first, last + 1, at::TensorOptions().dtype(at::kLong).device(model_.device())));
  note_restored(last);
}

void Restorer::restore_at(const at::Tensor& js) {
  at::Tensor dk, dv;  // f_θ's inputs the commits kept: the drafter raw K/V, or the target features (both)
  if (features_in_) {
    dk = dv = feat_.index_select(0, js.remainder(ring_));
  } else if (opt_.needs_ftheta()) {
    auto dsl = js.remainder(ring_).to(dk_.device());
    dk = dk_.index_select(0, dsl);
    dv = dv_.index_select(0, dsl);
  }
  restore(js, dk, dv);
}

bool Restorer::commits_on_device() const {
  // commit() projects the drafter context on the host's schedule unless f_θ reads the features
  // the forward stores; a = 1 and evict-only read nothing the commits keep.
  return !opt_.needs_ftheta() || (features_in_ && feat_.defined());
}

int64_t Restorer::ahead_gap() const {
  // Writing j overwrites slot j mod R of a sliding layer's restored ring, i.e. position j - R,
  // which a query q still reads there while q - (j - R) < sliding_window. Every later query
  // has q >= q0, so j <= q0 + R - sliding_window is safe: gap = max(0, sliding_window - 1 - R).
  // A ring as long as the capacity (short sessions) and full-attention layers never wrap.
  const ModelConfig& cfg = model_.config();
  int64_t gap = 0;
  // A sinks-only region (evict-only) is never read past its sinks, which no write overwrites.
  for (int64_t l : layers_)
    if (cfg.is_sliding(l) && !cache_.sinks_only(l) && cache_.restored_slots(l) < cache_.capacity())
      gap = std::max(gap, cfg.sliding_window - 1 - cache_.restored_slots(l));
  return gap;
}

void Restorer::note_restored(int64_t j) {
  if (j <= restored_upto_) return;
  if (j >= opt_.sink) stat_positions_ += j - std::max(restored_upto_ + 1, opt_.sink) + 1;
  restored_upto_ = j;
}

void Restorer::start_upkeep(int64_t span) {
  const int64_t room = opt_.window - ahead_gap() - span + 1;  // what batches may cover and still be early
  KAKEYA_CHECK(room >= 1, "restorer: forwards reaching " << span << " positions leave no room to restore ahead (window "
                                                         << opt_.window << ", gap " << ahead_gap() << ")");
  upkeep_span_ = span;
  upkeep_len_ = std::max<int64_t>(1, room / 2);
  auto iopt = at::TensorOptions().dtype(at::kLong).device(model_.device());
  upkeep_off_ = at::arange(upkeep_len_, iopt);
  upkeep_first_ = at::zeros({1}, iopt);
  if (!opt_.needs_ftheta() || feat_.defined()) return;  // a = 1 restores from the true raw K/V: no drafter work
  const int64_t F = drafter_->config().num_features() * model_.config().hidden_size;
  feat_ = at::zeros({ring_, F}, at::TensorOptions().dtype(model_.dtype()).device(model_.device()));
}

UpkeepBatch Restorer::next_upkeep(int64_t s) {
  KAKEYA_CHECK(upkeep_len_ > 0, "restorer: next_upkeep before start_upkeep");
  if (s - 1 - ahead_gap() - restored_upto_ < upkeep_len_) return {};
  const int64_t from = restored_upto_ + 1;
  note_restored(from + upkeep_len_ - 1);
  return {from, from + opt_.window - upkeep_span_ + 1};
}

void Restorer::upkeep_from(int64_t from) { upkeep_first_.fill_(from); }

void Restorer::stash_step(const at::Tensor& pos) {
  if (!capture_) return;
  if (capture_->stores_all()) capture_->clear();  // the forward wrote them (stash_in_forward)
  else capture_->take_into(nullptr, feat_.defined() ? &feat_ : nullptr, pos);
}

void Restorer::use_feature_ring(at::Tensor ring) {
  KAKEYA_CHECK(feat_.defined() && ring.sizes() == feat_.sizes() && ring.scalar_type() == feat_.scalar_type() &&
                   ring.device() == feat_.device(),
               "restorer: a feature ring of " << (feat_.defined() ? feat_.sizes() : at::IntArrayRef{}) << " expected, got "
                                              << ring.sizes());
  feat_ = std::move(ring);
}

void Restorer::stash_in_forward() {
  if (capture_ && feat_.defined()) capture_->store_into(feat_);
}

void Restorer::stash_features(const at::Tensor& feats, const at::Tensor& pos) {
  if (feat_.defined()) feat_.index_copy_(0, pos.remainder(ring_), feats.select(0, 0));
}

void Restorer::upkeep() {
  at::Tensor js = upkeep_off_ + upkeep_first_;  // [L]
  at::Tensor dk, dv;                            // [L, L_d, H_d, D_d] the drafter raw K/V of js
  if (features_in_) {
    dk = dv = feat_.index_select(0, js.remainder(ring_));  // [L, n·H] f_θ reads the features
  } else if (feat_.defined()) {
    at::Tensor f = feat_.index_select(0, js.remainder(ring_)).unsqueeze(0);  // [1, L, n·H]
    std::tie(dk, dv) = drafter_->context_raw_kv_rows(drafter_->project_context(f));
    dk = dk.select(0, 0);
    dv = dv.select(0, 0);
  }
  restore(js, dk, dv);
}

void Restorer::reset() {
  restored_upto_ = -1;
  stat_positions_ = 0;
  if (acc_.defined()) acc_.zero_();
  if (capture_) capture_->clear();
}

void Restorer::restore(const at::Tensor& js, const at::Tensor& dk, const at::Tensor& dv) {
  if (kernel_) {
    restore_kernel(js, dk, dv);
    return;
  }
  // Layer l's region gets the exact copies the ring still holds (through the region's code).
  auto copy_exact = [&](int64_t l) {
    auto [ek, ev] = cache_.exact_kv(l, js);
    cache_.write_restored(l, ek, ev, js);
  };
  if (!opt_.needs_ftheta() && !opt_.needs_true_raw()) {
    // Exact restoration (a = 1) and evict-only copy every layer. Evict-only's covered layers drop
    // their restored positions (the cache's mask shows only the sinks there), so only its sinks are
    // ever read.
    for (int64_t l : layers_) copy_exact(l);
    if (has_sliding_) cache_.mark_restored(LayerType::Sliding, js);
    if (has_full_) cache_.mark_restored(LayerType::Full, js);
    return;
  }
  const at::Device dev = model_.device();
  const ModelConfig& cfg = model_.config();
  const int64_t N = js.size(0);
  const double a = opt_.mix_alpha;
  auto slot = js.remainder(ring_);
  // Attention sinks keep their exact K/V, which the exact ring still holds (they are leaving the window now).
  at::Tensor sink_kv = opt_.sink > 0 ? js.lt(opt_.sink).view({1, 1, N, 1}) : at::Tensor();
  at::Tensor weight;  // [N, 1, 1] f64: 1 for positions restored through f_θ (not sinks): what the statistics count
  if (opt_.stats) weight = js.ge(opt_.sink).to(at::kDouble).view({N, 1, 1});
  std::vector<std::pair<at::Tensor, at::Tensor>> pred;
  if (opt_.needs_ftheta()) pred = ftheta_->predict(dk, dv);  // per layer [N, H, D]
  for (int64_t l : layers_) {
    if (from_token_[l] && !opt_.needs_true_raw()) {  // restored from the token: its exact K/V (sinks too)
      copy_exact(l);
      continue;
    }
    at::Tensor rk, rv, tk, tv;
    if (opt_.needs_true_raw()) {
      tk = tk_[l].index_select(0, slot);
      tv = tv_[l].index_select(0, slot);
    }
    if (a >= 1.0 || from_token_[l]) {
      rk = tk;
      rv = tv;
    } else {
      rk = pred[l].first.to(dev, model_.dtype());
      rv = pred[l].second.to(dev, model_.dtype());
      if (a > 0.0) {
        rk = tk * a + rk * (1.0 - a);
        rv = tv * a + rv * (1.0 - a);
      }
    }
    auto [k, v] = model_.finish_kv(l, rk.unsqueeze(0), rv.unsqueeze(0), js);  // [1, H, N, D]
    if (opt_.sink > 0) {
      auto [ek, ev] = cache_.exact_kv(l, js);
      k = at::where(sink_kv, ek, k);
      v = at::where(sink_kv, ev, v);
    }
    cache_.write_restored(l, k, v, js);
    if (opt_.stats) {
      const int type = cfg.is_sliding(l) ? 0 : 1;
      auto [ek, ev] = model_.finish_kv(l, tk.unsqueeze(0), tv.unsqueeze(0), js);
      auto sq = [&](const at::Tensor& x) { return (x.to(at::kDouble).pow(2) * weight).sum(); };
      auto sqc = [&](const at::Tensor& x) { return (x.squeeze(0).transpose(0, 1).to(at::kDouble).pow(2) * weight).sum(); };
      acc_[0][type][0][0] += sq(rk - tk);
      acc_[0][type][0][1] += sq(tk);
      acc_[0][type][1][0] += sq(rv - tv);
      acc_[0][type][1][1] += sq(tv);
      acc_[1][type][0][0] += sqc(k - ek);
      acc_[1][type][0][1] += sqc(ek);
      acc_[1][type][1][0] += sqc(v - ev);
      acc_[1][type][1][1] += sqc(ev);
    }
  }
  if (has_sliding_) cache_.mark_restored(LayerType::Sliding, js);
  if (has_full_) cache_.mark_restored(LayerType::Full, js);
}

void Restorer::restore_kernel(const at::Tensor& js, const at::Tensor& dk, const at::Tensor& dv) {
  const int64_t N = js.size(0);
  if (copy_store_) copy_store_->copy(js);  // exact restoration (a = 1), or the token layers
  if (store_) {  // f_θ's rows (built only when f_θ restores some layer)
    const FThetaConfig& fc = ftheta_->config();
    at::Tensor k = ftheta_->predict_fused(dk, false).to(model_.dtype()).view({N, fc.k_out()});  // [N, Σ_l H_kv·D]
    at::Tensor v = ftheta_->predict_fused(dv, true).to(model_.dtype()).view({N, fc.v_out()});   // [N, Σ_l H_kv·D]
    store_->run(k, v, js);
  }
  if (has_sliding_) cache_.mark_restored(LayerType::Sliding, js);
  if (has_full_) cache_.mark_restored(LayerType::Full, js);
}

at::Tensor Restorer::take_features(int64_t n) {
  if (!capture_) return at::Tensor();
  at::Tensor feats = capture_->take();  // [1, T, n·H] of the last forward
  KAKEYA_CHECK(feats.defined() && feats.size(1) >= n,
               "restorer: commit of " << n << " positions without a forward that captured them");
  return feats.size(1) == n ? feats : feats.slice(1, 0, n);
}

void Restorer::note_own_copies(int64_t p0, int64_t n) {
  if (n <= opt_.window) return;
  // The cache stored the copies of the chunk's positions that left the window as it wrote them
  // (RestorePolicy::exact_copies, sliding layers only), the last region's worth of them.
  KAKEYA_CHECK(cache_.options().restore.exact_copies && !has_full_,
               "restorer: a forward of " << n << " positions exceeds the window " << opt_.window);
  const int64_t end = p0 + n - opt_.window, from = std::max(p0, end - cache_.restored_slots(layers_[0]));
  cache_.mark_restored(LayerType::Sliding, at::arange(from, end, at::TensorOptions().dtype(at::kLong).device(model_.device())));
  note_restored(end - 1);
}

void Restorer::commit(int64_t p0, int64_t n, DrafterCache* dcache) {
  note_own_copies(p0, n);
  at::Tensor feats = take_features(n);
  // In store mode (stash_in_forward) the forward has written them into the ring already.
  if (feat_.defined() && !(capture_ && capture_->stores_all()))
    stash_features(feats, at::arange(p0, p0 + n, feat_.options().dtype(at::kLong)));
  if (dcache) {
    KAKEYA_CHECK(drafter_ && dcache->length() == p0,
                 "restorer: drafter cache at " << dcache->length() << ", committing at " << p0);
    drafter_->extend(*dcache, feats, &dtaps_);
  } else if (opt_.needs_ftheta() && !features_in_) {
    auto slot = at::arange(p0, p0 + n, at::TensorOptions().dtype(at::kLong).device(drafter_->device())).remainder(ring_);
    auto [dk, dv] = drafter_->context_raw_kv_rows(drafter_->project_context(feats));  // [1, n, L_d, H_d, D_d]
    dk_.index_copy_(0, slot, dk.select(0, 0));
    dv_.index_copy_(0, slot, dv.select(0, 0));
  }
}

int64_t Restorer::pending_bytes() const { return tensor_bytes(dk_) + tensor_bytes(dv_) + tensor_bytes(feat_); }

int64_t Restorer::true_raw_bytes() const {
  int64_t b = 0;
  for (const auto& t : tk_) b += tensor_bytes(t);
  for (const auto& t : tv_) b += tensor_bytes(t);
  return b;
}

RestoreStats Restorer::stats() const {
  RestoreStats s;
  s.positions = stat_positions_;
  if (!acc_.defined()) return s;
  auto a = acc_.cpu();  // SYNC: diagnostics, read once after a run
  auto p = a.data_ptr<double>();
  for (int sp = 0; sp < 2; ++sp)
    for (int t = 0; t < 2; ++t)
      for (int st = 0; st < 2; ++st)
        for (int e = 0; e < 2; ++e) (sp ? s.cache : s.raw)[t][st][e] = p[((sp * 2 + t) * 2 + st) * 2 + e];
  return s;
}

// Share of the span of the query at q that each layer type sees through exactly one copy per position.
double attention_fraction(const KVCache& cache, const ModelConfig& cfg, bool sliding, int64_t q) {
  int64_t layer = -1;
  for (int64_t l = 0; l < cfg.num_layers && layer < 0; ++l)
    if (cfg.is_sliding(l) == sliding) layer = l;
  if (layer < 0 || q < 0) return -1;
  auto qp = at::full({1}, q, at::TensorOptions().dtype(at::kLong).device(cache.slot_positions(layer).device()));
  auto vis = cache.visible(layer, qp).select(0, 0);
  auto pos = cache.slot_positions(layer).masked_select(vis).cpu();  // SYNC: diagnostics after a run
  std::vector<int64_t> p(pos.data_ptr<int64_t>(), pos.data_ptr<int64_t>() + pos.numel());
  std::sort(p.begin(), p.end());
  const int64_t lo = sliding && cfg.sliding_window > 0 ? std::max<int64_t>(0, q - cfg.sliding_window + 1) : 0;
  const int64_t span = q - lo + 1;
  int64_t once = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    bool dup = (i > 0 && p[i - 1] == p[i]) || (i + 1 < p.size() && p[i + 1] == p[i]);
    if (!dup && p[i] >= lo && p[i] <= q) ++once;
  }
  return (double)once / span;
}

KVCacheOptions restored_cache_options(const Model& v, const FTheta* f, const RestoreOptions& o, int64_t capacity,
                                      bool linear) {
  KVCacheOptions co = v.cache_options(capacity);
  set_dropped_layers(co.restore, v.config(), f, o);
  co.restore.window = o.window;
  co.restore.sliding = true;
  co.restore.full = o.full_attn == FullAttn::Restored;
  if (o.full_attn == FullAttn::Codec) {
    co.restore.full_code = o.full_code;
    co.restore.full_code_layers = o.full_code_layers;
    if (o.full_code_weighted()) {
      KAKEYA_CHECK(!o.calib.empty(), "decode: --full-code " << ops::layer_codes_name(o.full_code, o.full_code_layers)
                                                            << " needs --calib DIR, a bundle with K weights (kakeya calibrate k-weights)");
      co.restore.full_k_weight = CalibBundle::load_k_weights(o.calib, v.config());  // refuses another model's bundle
    }
  }
  // The linear cache serves the reforward reference, which runs chunks of at most the window.
  co.restore.max_chunk = linear ? o.window_chunk() : o.resolved_chunk();
  co.restore.exact_copies = o.long_chunks() && !linear;
  co.restore.linear = linear;
  co.restore.region_code = o.region_code;
  return co;
}

struct ChunkGraph::Impl {
#ifdef KAKEYA_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
  int64_t chunk = 0;
  at::Tensor ids;  // [1, chunk] int64: the chunk's tokens
  at::Tensor pos;  // [chunk] int64: its positions
  double capture_seconds = 0.0;
};

#ifdef KAKEYA_CUDA
namespace {
// One memory pool for every chunk graph of the process: a graph keeps its temporaries (the
// chunk's activations and attention scores, tens of MB at 8k) for its life, so a pool per decoder
// would hold them once per session. Prefills never run concurrently (a process runs one decoder
// at a time), and each replay writes its temporaries before reading them (a graph keeps no output:
// it runs no lm_head).
// The pool is the one of an anchor graph that lives as long as the process: the allocators
// release a pool whose last graph is gone, and a later capture into its id then fails, so the
// pool is shared the way graphs share one, through a graph that stays. The anchor records one
// tiny fill (an empty capture is refused); never destroyed, so that it does not outlive the CUDA
// context at exit.
at::cuda::MempoolId_t chunk_graph_pool() {
  static at::cuda::CUDAGraph* anchor = [] {
    static at::Tensor cell = at::zeros({1}, at::TensorOptions().device(at::kCUDA));
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
    return capture_graph([] { cell.fill_(1); }).release();
  }();
  return anchor->pool();
}
}  // namespace
#endif

ChunkGraph::ChunkGraph() : impl_(std::make_unique<Impl>()) {}
ChunkGraph::~ChunkGraph() = default;
double ChunkGraph::capture_seconds() const { return impl_->capture_seconds; }

bool ChunkGraph::captured() const {
#ifdef KAKEYA_CUDA
  return impl_->graph != nullptr;
#else
  return false;
#endif
}

at::Tensor run_chunks(const Model& v, KVCache& cache, Restorer& r, const at::Tensor& ids, int64_t p0, int64_t chunk,
                      bool want_logits, ChunkGraph* graph) {
  const int64_t n = ids.size(1);
  auto iopt = at::TensorOptions().dtype(at::kLong).device(v.device());
#ifdef KAKEYA_CUDA
  const int64_t window = r.options().window;
  // A chunk longer than the window runs eagerly: the graph restores each chunk's positions
  // window back, which such a chunk has not written yet (it stores their copies as it writes).
  const bool graphs = graph && v.device().is_cuda() && r.commits_on_device() && chunk <= window;
#else
  (void)graph;  // no graphs off CUDA
#endif
  at::Tensor logits;
  for (int64_t s = 0; s < n; s += chunk) {
    const int64_t len = std::min(chunk, n - s), q0 = p0 + s;
    const bool last = s + len == n;
#ifdef KAKEYA_CUDA
    // Steady: prepare() would restore exactly q0 - window .. q0 - window + chunk - 1 (ChunkGraph).
    // The graph runs no lm_head (one row of it took ~120 us of a ~2.5 ms chunk on the H100): the
    // chunk whose logits are wanted runs eagerly.
    if (graphs && len == chunk && !(last && want_logits) && q0 >= window && r.restored_upto() == q0 - window - 1) {
      ChunkGraph::Impl& g = *graph->impl_;
      if (g.graph && g.chunk != chunk) g.graph.reset();
      if (!g.graph) {
        // Captured on a side stream; capture records without running, so the chunk replays after.
        auto t0 = Clock::now();
        g.chunk = chunk;
        g.ids = at::zeros({1, chunk}, iopt);
        g.pos = at::arange(q0, q0 + chunk, iopt);
        c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
        g.graph = capture_graph(
            [&] {
              r.restore_at(g.pos - window);
              ForwardOptions fo;
              fo.taps = r.verifier_taps();
              fo.skip_logits = true;
              fo.advance_cache = false;
              v.forward(g.ids, g.pos, cache, fo);
              r.stash_step(g.pos);
            },
            chunk_graph_pool());
        g.capture_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      }
      g.ids.copy_(ids.slice(1, s, s + len));
      at::arange_out(g.pos, at::Scalar(q0), at::Scalar(q0 + chunk), at::Scalar(1));
      g.graph->replay();
      cache.advance(chunk);
      r.note_restored(q0 + chunk - 1 - window);
      continue;
    }
#endif
    r.prepare(q0, len);
    ForwardOptions fo;
    fo.taps = r.verifier_taps();
    fo.last_logits_only = true;
    fo.skip_logits = !(last && want_logits);
    logits = v.forward(ids.slice(1, s, s + len), at::arange(q0, q0 + len, iopt), cache, fo);
    r.commit(q0, len);
  }
  return logits;
}

// One restored decode step with static buffers: feeds `cur` at `pos`, stores its target
// features for the upkeep, writes the next token into out[step] and back into `cur`,
// advances pos and step. No host values: capturable. Restoration runs in batches between
// steps (Restorer::next_upkeep / upkeep, overlapping the steps on CUDA).

}  // namespace kakeya

#include "infer/fused.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <sstream>

#include "core/error.h"
#include "infer/loop_util.h"

#ifdef KAKEYA_CUDA
#include <c10/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kakeya {

nlohmann::json FusedTiming::to_json() const {
  auto per = [&](double s) { return blocks > 0 ? 1e3 * s / blocks : 0.0; };
  return {{"blocks", blocks},
          {"draft_seconds", draft},
          {"verify_seconds", verify},
          {"restore_seconds", restore},
          {"extend_seconds", extend},
          {"upkeep_seconds", upkeep()},
          {"capture_seconds", capture},
          {"ms_per_block", {{"draft", per(draft)}, {"verify", per(verify)}, {"upkeep", per(upkeep())},
                            {"restore", per(restore)}, {"extend", per(extend)}}}};
}

std::vector<std::string> validate_fused(const Model& v, const Drafter* d, const FTheta* f, const RestoreOptions& ro,
                                        int64_t n_prompt, int64_t max_new, int64_t block_size) {
  KAKEYA_CHECK(d, "fused: --mode fused drafts with the drafter: give --drafter DIR");
  KAKEYA_CHECK(&d->target() == &v,
               "fused: the drafter is bound to another target model (a drafter drafts for the verifier it was "
               "loaded with: load it against this verifier)");
  KAKEYA_CHECK(d->device() == v.device(), "fused: drafter on " << d->device() << ", verifier on " << v.device());
  validate_restore(v, d, f, ro, n_prompt, max_new);
  KAKEYA_CHECK(ro.full_attn != FullAttn::Codec,
               "fused: --full-attn codec is not supported by --mode fused yet (use exact or restored)");
  KAKEYA_CHECK(!ro.stats, "fused: --stats is a diagnostic of --mode restored (fused re-restores positions per block)");
  const int64_t trained = d->config().block_size;
  const int64_t B = block_size > 0 ? block_size : trained;
  KAKEYA_CHECK(B >= 2, "fused: --block-size expected >= 2 (the carried token and one draft), got " << B);
  KAKEYA_CHECK(B <= ro.window,
               "fused: --block-size " << B << " exceeds --window " << ro.window
                                      << ": a verify block's last query would need restored K/V of the block itself; "
                                         "use a block <= the window");
  const int64_t reach = n_prompt + max_new + B;  // the last block drafts/verifies up to B - 1 positions past the budget
  KAKEYA_CHECK(reach <= v.options().max_positions,
               "fused: prompt (" << n_prompt << ") + new tokens (" << max_new << ") + block (" << B
                                 << ") exceed the verifier's RoPE table (" << v.options().max_positions
                                 << " positions): load the model with a longer table");
  const int64_t dmax = d->config().max_position_embeddings;
  KAKEYA_CHECK(dmax <= 0 || reach <= dmax,
               "fused: " << reach << " positions exceed the drafter's limit of " << dmax << " (max_position_embeddings)");
  std::vector<std::string> warn;
  if (B > trained) {
    std::ostringstream os;
    os << "fused: block size " << B << " is larger than the drafter was trained for (block_size " << trained
       << " in " << d->config().origin << "): drafts past position " << trained - 1
       << " are out of distribution (expect a lower τ; output is unchanged)";
    warn.push_back(os.str());
  }
  return warn;
}

namespace {

// Forwards every tap to another set of subscribers (the Restorer's), so one forward
// feeds both our feature capture and the Restorer.
struct TapRelay : TapSubscriber {
  const Taps* to = nullptr;
  void on_tap(Tap t, const TapContext& c, at::Tensor& x) override { to->cb(t, c, x); }
  bool reads(Tap t) const override { return to->reads(t); }  // keeps the forward's fused kernels where it can
};

// The four parts of a block on static buffers (see fused.h). Every part reads its
// positions from the device (pos0_, qpos_), so each can be captured as a CUDA graph.
class Engine {
 public:
  Engine(const Model& v, const Drafter& d, Restorer& rest, KVCache& cache, int64_t B, int64_t cap,
         const SamplingOptions& so)
      : v_(v), d_(d), rest_(rest), cache_(cache), B_(B), cap_(cap), sampler_(so, v.device()),
        capture_(v, d.config().target_layer_ids) {
    const at::Device dev = v.device();
    auto iopt = at::TensorOptions().dtype(at::kLong).device(dev);
    const int64_t A = rest.options().window - rest.ahead_gap();
    KAKEYA_CHECK(A >= B, "fused: restoring ahead covers " << A << " positions per batch, fewer than a block of " << B);
    rest.keep_features();
    pos0_ = at::zeros({1}, iopt);
    qpos_ = at::arange(B, iopt);
    last_ = qpos_.narrow(0, B - 1, 1);
    ar_ = at::arange(B, iopt);
    slot_idx_ = at::arange(cap, iopt);
    blk_ = at::zeros({1, B}, iopt);
    dblk_ = at::full({1, B}, d.config().mask_token_id, iopt);
    report_ = at::zeros({B + 1}, iopt);
    feats_ = at::zeros({1, B, d.config().num_features() * v.config().hidden_size},
                       at::TensorOptions().dtype(v.dtype()).device(dev));
    const auto& dc = d.config();
    auto dopt = at::TensorOptions().dtype(d.dtype()).device(d.device());
    for (int64_t l = 0; l < dc.num_layers; ++l) {
      ck_.push_back(at::zeros({1, dc.num_kv_heads, cap, dc.head_dim}, dopt));
      cv_.push_back(at::zeros({1, dc.num_kv_heads, cap, dc.head_dim}, dopt));
    }
    vtaps_.subscribe(&capture_);
    if (!rest.verifier_taps()->empty()) {
      relay_.to = rest.verifier_taps();
      vtaps_.subscribe(&relay_);
    }
  }

  int64_t B() const { return B_; }
  const at::Tensor& report() const { return report_; }
  int64_t context_bytes() const {
    int64_t b = 0;
    for (const auto& t : ck_) b += t.numel() * t.element_size();
    for (const auto& t : cv_) b += t.numel() * t.element_size();
    return b;
  }

  // Prompt positions [p0, p0 + n) in one forward (n <= the restore chunk): restoration,
  // the verifier, the drafter context of these positions. Logits of the last one if asked.
  at::Tensor prefill_chunk(const at::Tensor& ids, int64_t p0, bool want_logits) {
    const int64_t n = ids.size(1);
    auto pos = at::arange(p0, p0 + n, at::TensorOptions().dtype(at::kLong).device(v_.device()));
    rest_.prepare(p0, n);
    ForwardOptions fo;
    fo.taps = &vtaps_;
    fo.last_logits_only = true;
    fo.skip_logits = !want_logits;
    auto logits = v_.forward(ids, pos, cache_, fo);
    // Restoration inside the prefill (prepare) reads the drafter's raw K/V from the taps.
    write_context(capture_.take(), pos, rest_.drafter_taps());
    return logits;
  }

  // The first block starts at `pos` with `first` ([1] int64, on the device) carried.
  bool sampling() const { return !sampler_.greedy(); }
  at::Tensor pick(const at::Tensor& logits) { return sampler_.sample(logits); }  // [1, V] -> [1]: the first token

  void start(const at::Tensor& first, int64_t pos) {
    blk_.select(1, 0).copy_(first.view({1}));
    pos0_.fill_(pos);
    at::add_out(qpos_, ar_, pos0_);
  }

  // ---- the four parts ----
  // Restores ahead, in one batch of window - gap positions ending at pos0 - 1 - gap
  // (Restorer::upkeep_ahead, from the stored target features): enough for this block and
  // the next ~(window - gap)/τ blocks, so the host runs this part only when a block's
  // queries would read a position not restored yet. Positions restored again get the same
  // K/V; those before 0 clamp to 0.
  void restore() { rest_.upkeep_ahead(pos0_); }

  void draft() {
    dblk_.narrow(1, 0, 1).copy_(blk_.narrow(1, 0, 1));
    at::Tensor h;  // [1, B, H]
    if (d_.block_in_cache_supported()) {
      // CUDA: the block's K/V go into the context cache at their own slots (the next
      // extend() overwrites them with the committed context's), one attention kernel per
      // layer bounded by the block's last position: nothing O(context) but the attention.
      h = d_.forward_block_in_cache(d_.embed(dblk_), qpos_, last_, ck_, cv_, slot_idx_);
    } else {
      h = d_.forward_block(d_.embed(dblk_), qpos_, ck_, cv_, masks());
    }
    at::Tensor hd = h.narrow(1, 1, B_ - 1);  // [1, B-1, H]: the masks' hidden states
    if (sampling()) {
      q_ = sampler_.probs(d_.logits(hd).select(0, 0));  // [B-1, V]: the drafter's distributions, kept for acceptance
      blk_.narrow(1, 1, B_ - 1).copy_(at::multinomial(q_, 1, false, sampler_.generator()).view({1, B_ - 1}));
    } else {
      blk_.narrow(1, 1, B_ - 1).copy_(d_.draft_tokens(hd));
    }
  }

  void verify() {
    ForwardOptions fo;
    fo.taps = &vtaps_;
    fo.advance_cache = false;  // the host advances by the accepted length
    at::Tensor logits = v_.forward(blk_, qpos_, cache_, fo);  // [1, B, V]
    if (sampling()) {
      accept_sampled(logits.select(0, 0));
      feats_.copy_(capture_.take());
      return;
    }
    at::Tensor post = logits.select(0, 0).argmax(-1);         // [B]: the verifier's token after each position
    // Greedy acceptance in the graph: the leading run of drafts equal to the verifier's choice.
    at::Tensor match = blk_.select(0, 0).narrow(0, 1, B_ - 1).eq(post.narrow(0, 0, B_ - 1)).to(at::kLong);
    at::Tensor n = match.cumprod(0).sum().add(1);  // committed: accepted drafts + the verifier's next token
    report_.narrow(0, 0, B_).copy_(post);
    report_.narrow(0, B_, 1).copy_(n.view({1}));
    feats_.copy_(capture_.take());  // the drafter's features of the block, from this same forward
  }

  void extend() {
    // Context K/V (and the Restorer's stored features) at every block position: the
    // rejected tail's are hidden from the draft until the next block overwrites them.
    write_context(feats_, qpos_, nullptr);
    at::Tensor n = report_.narrow(0, B_, 1);  // [1]
    // Carried bonus: the verifier's token after the accepted drafts opens the next block.
    blk_.select(1, 0).copy_(report_.narrow(0, 0, B_).index_select(0, n - 1));
    pos0_.add_(n);
    at::add_out(qpos_, ar_, pos0_);
  }

 private:
  // Speculative rejection sampling of the block (see fused.h): writes report_ as greedy does.
  void accept_sampled(const at::Tensor& logits) {  // [B, V]
    const int64_t n = B_ - 1;
    at::Tensor p = sampler_.probs(logits);                          // [B, V]
    at::Tensor d = blk_.select(0, 0).narrow(0, 1, n);               // [B-1] drafts
    at::Tensor pd = p.narrow(0, 0, n).gather(1, d.view({n, 1})).squeeze(1);
    at::Tensor qd = q_.gather(1, d.view({n, 1})).squeeze(1);
    at::Tensor u = at::rand({n}, sampler_.generator(), p.options());
    at::Tensor ok = (u * qd).lt(pd).to(at::kLong);                  // u < p(d) / q(d)
    at::Tensor acc = ok.cumprod(0).sum();                            // accepted drafts
    // Row i < B-1: the residual max(0, p_i - q_i) (p_i where it vanishes); row B-1: the bonus p_{B-1}.
    at::Tensor r = (p.narrow(0, 0, n) - q_).clamp_min(0.0);
    r = at::where(r.sum(-1, true).gt(0), r, p.narrow(0, 0, n));
    at::Tensor c = at::multinomial(at::cat({r, p.narrow(0, n, 1)}, 0), 1, false, sampler_.generator()).squeeze(1);  // [B]
    at::Tensor idx = at::arange(B_, c.options());
    at::Tensor tokens = at::where(idx.lt(acc), at::cat({d, c.narrow(0, n, 1)}), c);  // drafts, then the sample
    report_.narrow(0, 0, B_).copy_(tokens);
    report_.narrow(0, B_, 1).copy_(acc.add(1).view({1}));
  }

  // The drafter's context K/V at pos [T] from the verifier's features [1, T, n·H], which
  // the Restorer also keeps for restoration (upkeep_ahead projects f_θ's inputs from them).
  void write_context(const at::Tensor& feats, const at::Tensor& pos, const Taps* taps) {
    d_.store_context(d_.project_context(feats), pos, ck_, cv_, taps);
    rest_.stash_features(feats, pos);
  }

  // The reference block forward's masks over [context slots ++ block]: context slot i holds
  // position i; only committed positions (< the block start) are visible: slots at or past
  // it hold a rejected tail or nothing. Per layer [B, cap + B] bool.
  std::vector<at::Tensor> masks() const {
    const auto& dc = d_.config();
    at::Tensor valid = slot_idx_.lt(pos0_);  // [cap]
    std::vector<at::Tensor> m(dc.num_layers);
    for (int64_t l = 0; l < dc.num_layers; ++l) {
      int64_t same = -1;  // layers with the same rule share a mask
      for (int64_t j = 0; j < l && same < 0; ++j)
        if (dc.causal(j) == dc.causal(l) && dc.window(j) == dc.window(l)) same = j;
      if (same >= 0) {
        m[l] = m[same];
        continue;
      }
      at::Tensor ctx = d_.layer_mask(l, qpos_, slot_idx_).logical_and(valid);  // [B, cap]
      m[l] = at::cat({ctx, d_.layer_mask(l, qpos_, qpos_)}, 1);              // [B, cap + B]
    }
    return m;
  }

  const Model& v_;
  const Drafter& d_;
  Restorer& rest_;
  KVCache& cache_;
  const int64_t B_, cap_;
  Sampler sampler_;      // greedy, or temperature/top-p with its seeded generator
  at::Tensor q_;         // [B-1, V] the last draft's distributions (sampling only)
  TargetFeatureCapture capture_;
  TapRelay relay_;
  Taps vtaps_;
  at::Tensor pos0_;      // [1] block start: position of the carried token
  at::Tensor qpos_;      // [B] pos0 + 0..B-1
  at::Tensor last_;      // [1] view of qpos_'s last entry: the draft block's visibility bound
  at::Tensor ar_;        // [B] 0..B-1
  at::Tensor slot_idx_;  // [cap] 0..cap-1 (drafter context slot = position)
  at::Tensor blk_;       // [1, B] verify block: carried token, drafts
  at::Tensor dblk_;      // [1, B] draft block: carried token, MASK × (B-1)
  at::Tensor report_;    // [B + 1] the verifier's B tokens, then n (the one thing the host reads)
  at::Tensor feats_;     // [1, B, n·H] drafter features of the last verify block
  std::vector<at::Tensor> ck_, cv_;  // per drafter layer [1, H_kv, cap, D]: the drafter's context cache
};

KVCacheOptions fused_cache_options(const Model& v, const RestoreOptions& o, int64_t capacity, int64_t B) {
  KVCacheOptions co;
  co.capacity = capacity;
  co.rollback = B;  // a block's rejected tail sits in the exact ring until the next block overwrites it
  co.dtype = v.dtype();
  co.device = v.device();
  co.restore.window = o.window;
  co.restore.sliding = true;
  co.restore.full = o.full_attn == FullAttn::Restored;
  co.restore.max_chunk = std::max(o.resolved_chunk(), B);  // restored regions cover a whole verify block's span
  co.restore.linear = false;
  return co;
}

}  // namespace

FusedResult fused_generate(const Model& v, const Drafter& d, const FTheta* f, const RestoreOptions& ro,
                           const std::vector<int64_t>& prompt, const FusedOptions& opt) {
  FusedResult out;
  out.warnings = validate_fused(v, &d, f, ro, prompt.size(), opt.max_new_tokens, opt.block_size);
  for (const auto& w : out.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
  const int64_t B = opt.block_size > 0 ? opt.block_size : d.config().block_size;
  out.block_size = B;
  const at::Device dev = v.device();
  const int64_t n_prompt = prompt.size(), chunk = ro.resolved_chunk();
  const int64_t cap = n_prompt + opt.max_new_tokens + B;
  KVCache cache(v.config(), fused_cache_options(v, ro, cap, B));
  // The Restorer needs the drafter only for f_θ's inputs (a < 1); our Engine drafts.
  Restorer rest(v, ro.needs_ftheta() ? &d : nullptr, f, ro, cache);
  Engine eng(v, d, rest, cache, B, cap, opt.sampling);
  DecodeResult& res = out.decode;
  res.tokens.reserve(opt.max_new_tokens + B);
  res.committed.reserve(opt.max_new_tokens);

  // ---- prefill: chunks of <= window tokens, as `restored` mode ----
  auto t0 = Clock::now();
  auto ids = at::tensor(prompt, at::kLong).view({1, n_prompt}).to(dev);
  at::Tensor logits;
  for (int64_t s = 0; s < n_prompt; s += chunk) {
    const int64_t len = std::min(chunk, n_prompt - s);
    logits = eng.prefill_chunk(ids.narrow(1, s, len), s, s + len == n_prompt);
  }
  at::Tensor first = eng.pick(logits.select(1, 0));  // [1]
  eng.start(first, n_prompt);
  res.prefill_seconds = seconds_since(t0, dev);
  int64_t tok = first.item<int64_t>();  // SYNC: stream the first token / check for a stop
  res.tokens.push_back(tok);
  if (opt.on_token) opt.on_token(tok);
  bool stopped = is_stop(tok, opt.stop_ids);
  auto t1 = Clock::now();

  const bool cuda = dev.is_cuda();
  at::Tensor host = at::empty({B + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(cuda));
#ifdef KAKEYA_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graphs[4];      // restore, draft, verify, extend
  std::vector<c10::cuda::CUDAEvent> ev;
  if (cuda && opt.time_split)
    for (int i = 0; i < 5; ++i) ev.emplace_back(cudaEventDefault);
#endif
  bool restore_now = false;  // this block's queries read a position not restored yet
  const int64_t gap = rest.ahead_gap();
  auto part = [&](int i) {
    switch (i) {
      case 0: eng.restore(); break;
      case 1: eng.draft(); break;
      case 2: eng.verify(); break;
      default: eng.extend(); break;
    }
  };
  double* split[4] = {&out.split.restore, &out.split.draft, &out.split.verify, &out.split.extend};
  int64_t blocks = 0;
  while (!stopped && (int64_t)res.tokens.size() < opt.max_new_tokens) {
    const int64_t g = res.tokens.size(), s = n_prompt + g - 1;  // s: position of the carried token
    // The block's last query reads restored K/V up to s + B - 1 - window; one batch restores
    // ahead up to s - 1 - gap, which covers it (gap <= window - B) and the next ~(window - B)/τ blocks.
    restore_now = s + B - 1 - ro.window > rest.restored_upto();
#ifdef KAKEYA_CUDA
    if (cuda && opt.cuda_graph && !eng.sampling() && blocks == 1) {
      // The first block ran eagerly (warming cuBLAS, the allocator and every code path);
      // capture records the parts without running them, then every block replays them.
      auto tc = Clock::now();
      c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
      for (int i = 0; i < 4; ++i) {
        graphs[i] = std::make_unique<at::cuda::CUDAGraph>();
        graphs[i]->capture_begin();
        part(i);
        graphs[i]->capture_end();
      }
      out.cuda_graph = true;
      out.split.capture += std::chrono::duration<double>(Clock::now() - tc).count();
    }
    if (cuda) {
      auto stream = c10::cuda::getCurrentCUDAStream();
      for (int i = 0; i < 4; ++i) {
        if (!ev.empty()) ev[i].record(stream);
        if (i == 0 && !restore_now) continue;
        if (graphs[i]) {
          graphs[i]->replay();
        } else {
          part(i);
        }
      }
      if (!ev.empty()) ev[4].record(stream);
      host.copy_(eng.report(), /*non_blocking=*/true);
      stream.synchronize();  // SYNC: the one per block (accepted length and tokens)
      for (size_t i = 0; i + 1 < ev.size(); ++i) *split[i] += ev[i].elapsed_time(ev[i + 1]) / 1e3;
    } else
#endif
    {
      for (int i = restore_now ? 0 : 1; i < 4; ++i) {
        auto tp = Clock::now();
        part(i);
        if (opt.time_split) *split[i] += seconds_since(tp, dev);
      }
      host.copy_(eng.report());
    }
    ++blocks;
    const int64_t* r = host.data_ptr<int64_t>();
    const int64_t n = r[B];
    cache.advance(n);
    if (restore_now) rest.note_restored(s - 1 - gap);
    // Commit within the budget and up to a stop; the device state has moved on by n, which
    // only matters if the loop continued (it does not when produced < n).
    int64_t produced = std::min<int64_t>(n, opt.max_new_tokens - g);
    for (int64_t i = 0; i < produced; ++i)
      if (is_stop(r[i], opt.stop_ids)) {
        produced = i + 1;
        stopped = true;
        break;
      }
    for (int64_t i = 0; i < produced; ++i) {
      res.tokens.push_back(r[i]);
      if (opt.on_token) opt.on_token(r[i]);
    }
    res.committed.push_back(produced);
  }
  res.decode_seconds = seconds_since(t1, dev);
  res.capture_seconds = out.split.capture;
  out.split.blocks = blocks;
  res.restored_positions = std::max<int64_t>(0, rest.restored_upto() + 1);
  res.memory = restored_memory_report(v, &d, f, cache, rest, ro, n_prompt + opt.max_new_tokens);
  bool drafter_weights = false;
  for (auto& l : res.memory.kv)
    if (l.name == "drafter context cache") {
      l.bytes = eng.context_bytes();
      l.note = std::to_string(cap) + " positions (its full-attention layers read every committed position)";
      l.grows = true;
    }
  for (const auto& l : res.memory.weights) drafter_weights |= l.name == "drafter weights";
  if (!drafter_weights)
    res.memory.weights.push_back({"drafter weights", d.weight_bytes(), "embedding and lm_head shared with the verifier"});
  return out;
}

DecodeResult decode_fused(const Model& v, const Drafter* d, const FTheta* f, const std::vector<int64_t>& prompt,
                          const DecodeOptions& opt) {
  KAKEYA_CHECK(d, "fused: --mode fused drafts with the drafter: give --drafter DIR");
  FusedOptions fo;
  fo.max_new_tokens = opt.max_new_tokens;
  fo.block_size = opt.block_size;
  fo.stop_ids = opt.stop_ids;
  fo.on_token = opt.on_token;
  fo.cuda_graph = opt.cuda_graph;
  fo.sampling = opt.sampling;
  auto r = fused_generate(v, *d, f, opt.restore, prompt, fo);
  return std::move(r.decode);
}

}  // namespace kakeya

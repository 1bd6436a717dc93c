#include "infer/fused.h"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <memory>
#include <sstream>

#include "core/error.h"
#include "core/kernels/ops.h"
#include "infer/graph_capture.h"
#include "infer/loop_util.h"

#ifdef KAKEYA_CUDA
#include <c10/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kakeya {

std::vector<std::string> validate_fused(const Model& v, const Drafter* d, const FTheta* f, const RestoreOptions& ro,
                                        int64_t n_prompt, int64_t max_new, int64_t block_size) {
  KAKEYA_CHECK(d, "fused: --mode fused drafts with the drafter: give --drafter DIR");
  KAKEYA_CHECK(&d->target() == &v,
               "fused: the drafter is bound to another target model (a drafter drafts for the verifier it was "
               "loaded with: load it against this verifier)");
  KAKEYA_CHECK(d->device() == v.device(), "fused: drafter on " << d->device() << ", verifier on " << v.device());
  validate_restore(v, d, f, ro, n_prompt, max_new);
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

// The three parts of a block on static buffers (see fused.h). Every part reads its
// positions from the device (pos0_, qpos_), so each can be captured as a CUDA graph.
class Engine {
 public:
  Engine(const Model& v, const Drafter& d, Restorer& rest, KVCache& cache, int64_t B, int64_t cap,
         const SamplingOptions& so)
      : v_(v), d_(d), rest_(rest), cache_(cache), B_(B), cap_(cap), sampler_(so, v.device()),
        capture_(v, d.config().target_layer_ids) {
    const at::Device dev = v.device();
    auto iopt = at::TensorOptions().dtype(at::kLong).device(dev);
    pos0_ = at::zeros({1}, iopt);
    qpos_ = at::arange(B, iopt);
    last_ = qpos_.narrow(0, B - 1, 1);
    ar_ = at::arange(B, iopt);
    slot_idx_ = at::arange(cap, iopt);
    blk_ = at::zeros({1, B}, iopt);
    dblk_ = at::full({1, B}, d.config().mask_token_id, iopt);
    dx_ = at::zeros({1, B, v.config().hidden_size}, at::TensorOptions().dtype(d.dtype()).device(dev));
    if (v.embedding().scalar_type() == d.dtype()) {  // Drafter::embed in one kernel with the block's advance
      emb_.table = v.embedding();
      emb_.scale = d.config().input_embedding_scale;
      emb_.out = dx_.select(0, 0).select(0, 0);
    }
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
    rest_.note_own_copies(p0, n);
    // Restoration inside the prefill (prepare) reads the drafter's raw K/V from the taps.
    at::Tensor feats = capture_.take();  // [1, n, n·H]
    d_.store_context(d_.project_context(feats), pos, ck_, cv_, rest_.drafter_taps());
    rest_.stash_features(feats, pos);
    return logits;
  }

  // The first block starts at `pos` with `first` ([1] int64, on the device) carried.
  bool sampling() const { return !sampler_.greedy(); }
  Sampler& sampler() { return sampler_; }
  at::Tensor pick(const at::Tensor& logits) { return sampler_.sample(logits); }  // [1, V] -> [1]: the first token

  void start(const at::Tensor& first, int64_t pos) {
    blk_.select(1, 0).copy_(first.view({1}));
    dblk_.select(1, 0).copy_(first.view({1}));
    dx_.copy_(d_.embed(dblk_));
    pos0_.fill_(pos);
    at::add_out(qpos_, ar_, pos0_);
  }

  // ---- the three parts (restoration runs in batches beside them: Restorer::upkeep) ----
  void draft() {
    // dx_ = embed([carried, MASK × (B-1)]): rows 1.. are fixed, row 0 follows the carried token
    // (advance_block writes it where the embedding's dtype allows, else here).
    if (!emb_.table.defined()) dx_.narrow(1, 0, 1).copy_(d_.embed(blk_.narrow(1, 0, 1)));
    at::Tensor h;  // [1, B, H]
    if (d_.block_in_cache_supported()) {
      // CUDA: the block's K/V go into the context cache at their own slots (the next
      // extend() overwrites them with the committed context's), one attention kernel per
      // layer bounded by the block's last position: nothing O(context) but the attention.
      h = d_.forward_block_in_cache(dx_, qpos_, last_, ck_, cv_, slot_idx_);
    } else {
      h = d_.forward_block(dx_, qpos_, ck_, cv_, masks());
    }
    at::Tensor hd = h.narrow(1, 1, B_ - 1);  // [1, B-1, H]: the masks' hidden states
    at::Tensor drafts = blk_.narrow(1, 1, B_ - 1);  // [1, B-1]
    if (sampling()) {
      q_ = sampler_.probs(d_.logits(hd).select(0, 0));  // [B-1, V]: the drafter's distributions, kept for acceptance
      drafts.copy_(at::multinomial(q_, 1, false, sampler_.generator()).view({1, B_ - 1}));
    } else {
      d_.draft_tokens_into(hd, drafts);
    }
  }

  void verify() {
    ForwardOptions fo;
    fo.taps = &vtaps_;
    fo.advance_cache = false;  // the host advances by the accepted length
    fo.raw_logits = !sampling();  // greedy acceptance only compares argmaxes
    at::Tensor logits = v_.forward(blk_, qpos_, cache_, fo);  // [1, B, V]
    if (sampling()) accept_sampled(logits.select(0, 0));
    else ops::greedy_accept(logits.select(0, 0), blk_.select(0, 0), report_);  // report_: B verifier tokens, n
    // The drafter's features of the block, from this same forward, where extend() and the
    // Restorer read them (the rejected tail's ring rows are overwritten before anyone reads them).
    capture_.take_into(&feats_, rest_.feature_ring(), qpos_);
  }

  void extend() {
    // Context K/V at every block position: the rejected tail's are hidden from the draft
    // until the next block overwrites them.
    d_.store_context(d_.project_context(feats_), qpos_, ck_, cv_, nullptr);
    // Carried bonus: the verifier's token after the accepted drafts opens the next block.
    ops::advance_block(report_, blk_, pos0_, qpos_, emb_.table.defined() ? &emb_ : nullptr);
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
  at::Tensor ar_;        // [B] 0..B-1 (start)
  at::Tensor slot_idx_;  // [cap] 0..cap-1 (drafter context slot = position)
  at::Tensor blk_;       // [1, B] verify block: carried token, drafts
  at::Tensor dblk_;      // [1, B] draft block: carried token, MASK × (B-1) (start())
  at::Tensor dx_;        // [1, B, H] its embedding: the draft forward's input
  ops::CarriedEmbedding emb_;  // dx_'s row 0 for advance_block (table undefined: draft() embeds it)
  at::Tensor report_;    // [B + 1] the verifier's B tokens, then n (the one thing the host reads)
  at::Tensor feats_;     // [1, B, n·H] drafter features of the last verify block
  std::vector<at::Tensor> ck_, cv_;  // per drafter layer [1, H_kv, cap, D]: the drafter's context cache
};

KVCacheOptions fused_cache_options(const Model& v, const FTheta* f, const RestoreOptions& o, int64_t capacity,
                                   int64_t B) {
  KVCacheOptions co = restored_cache_options(v, f, o, capacity, false);
  co.rollback = B;  // a block's rejected tail sits in the exact ring until the next block overwrites it
  co.restore.max_chunk = std::max(o.resolved_chunk(), B);  // restored regions cover a whole verify block's span
  co.restore.max_step = B;  // verify blocks write before attending (the attention kernel, graph-captured)
  return co;
}

}  // namespace

struct FusedDecoder::Impl {
  const Model& v;
  const Drafter& d;
  const FTheta* f;
  RestoreOptions ro;
  int64_t B, capacity;
  bool lookahead = false;  // the host keeps one block enqueued ahead of the one it reads
  KVCache cache;
  // The Restorer needs the drafter only for f_θ's inputs (a < 1); the Engine drafts.
  Restorer rest;
  Engine eng;
  UpkeepRunner upkeep;
  at::Tensor host[2];  // [B + 1] int64 (pinned on CUDA): a block's report, one buffer per block in flight
#ifdef KAKEYA_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graphs[3];  // draft, verify, extend
  std::vector<c10::cuda::CUDAEvent> ev[2];          // per slot: around the parts (timing)
  std::vector<c10::cuda::CUDAEvent> done;           // per slot: the report has reached the host buffer
#endif

  Impl(const Model& v_, const Drafter& d_, const FTheta* f_, const RestoreOptions& ro_, const DecodeOptions& o,
       int64_t B_, int64_t capacity_)
      : v(v_), d(d_), f(f_), ro(ro_), B(B_), capacity(capacity_),
        cache(v.config(), fused_cache_options(v, f_, ro, capacity + B, B)),
        rest(v, ro.needs_ftheta() ? &d : nullptr, f, ro, cache),
        eng(v, d, rest, cache, B, capacity + B, o.sampling),
        upkeep([this](int64_t from) { rest.upkeep_from(from); }, [this] { rest.upkeep(); }, v.device().is_cuda()) {
    for (auto& h : host) h = at::empty({B + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(v.device().is_cuda()));
    // One block ahead of the host (CUDA): a block is then enqueued knowing only that it starts
    // after the previous one's start, so its queries reach up to 2B - 2 past what the host knows;
    // restoration batches are sized for that span (it must leave room before the window).
    lookahead = v.device().is_cuda() && 2 * B - 1 <= ro.window - rest.ahead_gap();
    rest.start_upkeep(lookahead ? 2 * B - 1 : B);  // before the prefill, whose commits store their target features
  }

  void part(int i) {
    switch (i) {
      case 0: eng.draft(); break;
      case 1: eng.verify(); break;
      default: eng.extend(); break;
    }
  }
};

FusedDecoder::FusedDecoder(const Model& v, const Drafter& d, const FTheta* f, const DecodeOptions& opt,
                           int64_t capacity)
    : Decoder(opt) {
  const RestoreOptions& ro = opt.restore;
  KAKEYA_CHECK(&d.target() == &v,
               "fused: the drafter is bound to another target model (a drafter drafts for the verifier it was "
               "loaded with: load it against this verifier)");
  const int64_t B = opt.block_size > 0 ? opt.block_size : d.config().block_size;
  KAKEYA_CHECK(B >= 2 && B <= ro.window, "fused: --block-size expected in [2, window " << ro.window << "], got " << B);
  impl_ = std::make_unique<Impl>(v, d, f, ro, opt, B, capacity);
}

FusedDecoder::~FusedDecoder() = default;

int64_t FusedDecoder::block_size() const { return impl_->B; }

DecodeResult FusedDecoder::feed(const std::vector<int64_t>& prompt, const DecodeOptions& opt, bool fresh) {
  check_call("fused decoder", prompt.size(), opt, fresh);
  Impl& m = *impl_;
  DecodeResult out;
  out.warnings = validate_fused(m.v, &m.d, m.f, m.ro, prompt.size(), opt.max_new_tokens, opt.block_size);
  for (const auto& w : out.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
  const int64_t B = m.B;  // check_call refused another --block-size
  out.block_size = B;
  const at::Device dev = m.v.device();
  const int64_t n_prompt = prompt.size(), chunk = m.ro.resolved_chunk();
  m.cache.clear();
  m.rest.reset();
  m.eng.sampler().reset(opt.sampling.seed);
  m.upkeep.set_timing(opt.time_split);
  Engine& eng = m.eng;
  DecodeResult& res = out;
  res.tokens.reserve(opt.max_new_tokens + B);
  res.committed.reserve(opt.max_new_tokens);

  // ---- prefill: chunks of <= window tokens (longer at a = 1), as `restored` mode ----
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
  bool stopped = ends_generation(tok, opt);
  auto t1 = Clock::now();

#ifdef KAKEYA_CUDA
  const bool cuda = dev.is_cuda();
  // Sampling draws through an unregistered generator: its parts run eagerly (no graphs).
  const bool graphs = cuda && opt.cuda_graph && !eng.sampling();
  if (cuda && m.done.empty())
    for (int k = 0; k < 2; ++k) {
      m.done.emplace_back(cudaEventDisableTiming);
      for (int i = 0; i < 4; ++i) m.ev[k].emplace_back(cudaEventDefault);
    }
#endif
  double* split[3] = {&out.split.draft, &out.split.verify, &out.split.extend};
  int64_t blocks = 0;  // enqueued
  int64_t allocs0 = -1;  // allocator count before the first replayed block
  // The host reads each block's report once. On CUDA it keeps one block ahead while the budget
  // certainly needs it (tokens so far + B < max_new: whatever the oldest block commits), so the
  // device never waits for the host between blocks; a stop inside the oldest block leaves the
  // one ahead to finish unread (its tokens are dropped; the timing below waits for it).
  std::deque<int> pending;  // host slots of enqueued blocks, oldest first
  int next_slot = 0;
  // Enqueues the next block into the next host slot; its queries start at s_lo at the earliest
  // (exactly, unless it is enqueued before the previous block's report is read: then the host
  // knows only s_lo = the previous start + 1, and the Restorer was set up for that span).
  auto enqueue = [&](int64_t s_lo) {
    const int slot = next_slot;
    next_slot ^= 1;
    pending.push_back(slot);
    // Restoration batches the committed positions (< s_lo) now cover, then the wait for those
    // this block's queries may read.
    for (UpkeepBatch b = m.rest.next_upkeep(s_lo); b.from >= 0; b = m.rest.next_upkeep(s_lo)) m.upkeep.run(b.from, b.read_at);
    m.upkeep.wait(s_lo);
#ifdef KAKEYA_CUDA
    if (graphs && !m.graphs[0] && blocks == 1) {
      // The first block of the first run ran eagerly (warming cuBLAS, the allocator and every
      // code path); capture records the parts without running them, then every block replays them.
      auto tc = Clock::now();
      {
        c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
        // All three or none: a later block replays them all once the first is there.
        std::unique_ptr<at::cuda::CUDAGraph> parts[3];
        for (int i = 0; i < 3; ++i) parts[i] = capture_graph([&] { m.part(i); });
        for (int i = 0; i < 3; ++i) m.graphs[i] = std::move(parts[i]);
      }
      m.upkeep.capture();
      out.split.capture += std::chrono::duration<double>(Clock::now() - tc).count();
    }
    if (cuda) {
      auto stream = c10::cuda::getCurrentCUDAStream();
      const bool replay = graphs && m.graphs[0];
      if (replay && allocs0 < 0) allocs0 = device_allocations(dev);
      auto& ev = m.ev[slot];
      for (int i = 0; i < 3; ++i) {
        if (opt.time_split) ev[i].record(stream);
        if (replay) m.graphs[i]->replay();
        else m.part(i);
      }
      if (opt.time_split) ev[3].record(stream);
      // The report goes to this slot's host buffer before the next block's verify rewrites it.
      m.host[slot].copy_(eng.report(), /*non_blocking=*/true);
      m.done[slot].record(stream);
      out.cuda_graph = out.cuda_graph || replay;
      ++blocks;
      return;
    }
#endif
    for (int i = 0; i < 3; ++i) {
      auto tp = Clock::now();
      m.part(i);
      if (opt.time_split) *split[i] += seconds_since(tp, dev);
    }
    m.host[slot].copy_(eng.report());
    ++blocks;
  };
  int64_t s_known = n_prompt + (int64_t)res.tokens.size() - 1;  // start of the oldest pending block (its carried token)
  if (!stopped && (int64_t)res.tokens.size() < opt.max_new_tokens) enqueue(s_known);
  while (!pending.empty()) {
    const int64_t g = res.tokens.size();
    if (m.lookahead && pending.size() == 1 && g + B < opt.max_new_tokens) enqueue(s_known + 1);
    const int slot = pending.front();
    pending.pop_front();
#ifdef KAKEYA_CUDA
    if (cuda) {
      m.done[slot].synchronize();  // SYNC: the one per block (accepted length and tokens)
      if (opt.time_split)
        for (int i = 0; i < 3; ++i) *split[i] += m.ev[slot][i].elapsed_time(m.ev[slot][i + 1]) / 1e3;
    }
#endif
    const int64_t* r = m.host[slot].data_ptr<int64_t>();
    const int64_t n = r[B];
    m.cache.advance(n);
    // Commit within the budget and up to a stop; the device state has moved on by n, which
    // only matters if the loop continued (it does not when produced < n).
    commit_tokens(r, n, opt, res, stopped);
    s_known += n;
    if (stopped || (int64_t)res.tokens.size() >= opt.max_new_tokens) break;
    if (pending.empty()) enqueue(s_known);
  }
  m.upkeep.drain();
  if (allocs0 >= 0) res.steady_allocations = device_allocations(dev) - allocs0;
  res.decode_seconds = seconds_since(t1, dev);
  res.capture_seconds = out.split.capture;
  out.split.blocks = blocks;
  out.split.restore = m.upkeep.take_seconds();
  out.split.restore_overlapped = m.upkeep.captured() && out.cuda_graph;
  res.restored_positions = std::max<int64_t>(0, m.rest.restored_upto() + 1);
  res.memory = memory();
  return out;
}

MemoryReport FusedDecoder::memory() const {
  const Impl& m = *impl_;
  MemoryReport mem = restored_memory_report(m.v, &m.d, m.f, m.cache, m.rest, m.ro, m.capacity);
  mem.set({MemoryPart::DrafterContext, "drafter context cache", m.eng.context_bytes(),
           std::to_string(m.capacity + m.B) + " positions (its full-attention layers read every committed position)",
           true});
  if (!mem.find(MemoryPart::DrafterWeights))
    mem.add({MemoryPart::DrafterWeights, "drafter weights", m.d.weight_bytes(), "embedding and lm_head shared with the verifier"});
  return mem;
}

int64_t FusedDecoder::capacity() const { return impl_->capacity; }

DecodeResult fused_generate(const Model& v, const Drafter& d, const FTheta* f, const std::vector<int64_t>& prompt,
                            const DecodeOptions& opt) {
  validate_fused(v, &d, f, opt.restore, prompt.size(), opt.max_new_tokens, opt.block_size);  // before anything is allocated
  FusedDecoder dec(v, d, f, opt, (int64_t)prompt.size() + opt.max_new_tokens);
  return dec.run(prompt, opt);
}

}  // namespace kakeya

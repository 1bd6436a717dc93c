#include "infer/restored.h"

#include <algorithm>

#include "core/error.h"
#include "core/kernels/ops.h"
#include "infer/loop_util.h"

namespace kakeya {
namespace {

// One restored decode step with static buffers: feeds `cur` at `pos`, stores its target
// features for the upkeep, writes the next token into out[step] and back into `cur`,
// advances pos and step. No host values: capturable. Restoration runs in batches between
// steps (Restorer::next_upkeep / upkeep, overlapping the steps on CUDA).
struct RestoredStep {
  const Model& model;
  KVCache& cache;
  Restorer& rest;
  Sampler& sampler;
  at::Tensor cur;   // [1, 1] int64
  at::Tensor pos;   // [1] int64
  at::Tensor step;  // [1] int64
  at::Tensor out;   // [capacity] int64
  bool full_head;   // !DecodeOptions::head_screen

  void run() {
    ForwardOptions fo;
    fo.taps = rest.verifier_taps();
    fo.advance_cache = false;
    fo.full_head = full_head;
    const at::Tensor next = step_token(model, cur, pos, cache, fo, sampler);  // [1]
    rest.stash_step(pos);
    ops::advance_step(next, out, step, cur, pos);
  }
};

}  // namespace

RestoredDecoder::RestoredDecoder(const Model& v, const Drafter* d, const FTheta* f, const DecodeOptions& opt,
                                 int64_t capacity)
    : Decoder(opt), v_(v), d_(d), f_(f), cache_(v.config(), restored_cache_options(v, f, opt.restore, capacity, false)),
      rest_(v, d, f, opt.restore, cache_), sampler_(opt.sampling, v.device()) {
  auto iopt = at::TensorOptions().dtype(at::kLong).device(v.device());
  cur_ = at::zeros({1, 1}, iopt);
  pos_ = at::zeros({1}, iopt);
  step_ = at::zeros({1}, iopt);
  out_ = at::zeros({capacity}, iopt);
  rest_.start_upkeep(1);
  rest_.stash_in_forward();
  upkeep_ = std::make_unique<UpkeepRunner>([this](int64_t from) { rest_.upkeep_from(from); }, [this] { rest_.upkeep(); },
                                           v.device().is_cuda());
  loop_.step = [this] { RestoredStep{v_, cache_, rest_, sampler_, cur_, pos_, step_, out_, !opt_.head_screen}.run(); };
  loop_.cur = cur_;
  loop_.step_idx = step_;
  loop_.out = out_;
  loop_.upkeep = upkeep_.get();
  loop_.upkeep_due = [this](int64_t p) { return rest_.next_upkeep(p); };
}

RestoredDecoder::~RestoredDecoder() = default;

DecodeResult RestoredDecoder::feed(const std::vector<int64_t>& tokens, const DecodeOptions& opt, bool fresh) {
  check_call("restored decoder", tokens.size(), opt, fresh);
  const RestoreOptions& ro = opt_.restore;
  const int64_t p0 = fresh ? 0 : cache_.length();
  validate_restore(v_, d_, f_, ro, p0 + (int64_t)tokens.size(), opt.max_new_tokens);
  const at::Device dev = v_.device();
  if (fresh) {
    cache_.clear();
    rest_.reset();
  }
  const int64_t n_fed = p0 + (int64_t)tokens.size();
  sampler_.reset(opt.sampling.seed);
  auto t0 = Clock::now();
  auto ids = at::tensor(tokens, at::kLong).view({1, (int64_t)tokens.size()}).to(dev);
  const bool had_graph = chunks_.captured();
  auto logits =
      run_chunks(v_, cache_, rest_, ids, p0, ro.resolved_chunk(), true, opt_.cuda_graph ? &chunks_ : nullptr);
  pos_.fill_(n_fed);
  step_.zero_();
  // Sampling draws through the graph's captured generator offsets: recapture per run (greedy reuses).
  if (!sampler_.greedy()) loop_.graphs.reset();
  DecodeResult res;
  run_decode_loop(loop_, sampler_.sample(logits.select(1, 0)), cache_, n_fed, opt, t0, dev, res);
  if (!had_graph) res.capture_seconds += chunks_.capture_seconds();  // inside prefill_seconds too
  const int64_t q = cache_.length() - 1;
  res.attention_fraction_sliding = attention_fraction(cache_, v_.config(), true, q);
  res.attention_fraction_full = attention_fraction(cache_, v_.config(), false, q);
  res.restored_positions = std::max<int64_t>(0, rest_.restored_upto() + 1);
  res.served_positions = cache_.length();
  res.memory = memory();
  if (ro.stats) res.stats = rest_.stats();
  return res;
}

MemoryReport RestoredDecoder::memory() const {
  return restored_memory_report(v_, d_, f_, cache_, rest_, opt_.restore, cache_.capacity());
}

ReforwardDecoder::ReforwardDecoder(const Model& v, const Drafter* d, const FTheta* f, const DecodeOptions& opt,
                                   int64_t capacity)
    : Decoder(opt), v_(v), d_(d), f_(f), capacity_(capacity) {}

DecodeResult ReforwardDecoder::feed(const std::vector<int64_t>& prompt, const DecodeOptions& opt, bool fresh) {
  check_call("restored-reforward", prompt.size(), opt, fresh);
  const RestoreOptions& ro = opt_.restore;
  validate_restore(v_, d_, f_, ro, prompt.size(), opt.max_new_tokens);
  const at::Device dev = v_.device();
  // The definition, token by token: chunks of at most the window (a longer prefill chunk reads
  // its own positions exactly, which the definition does not).
  const int64_t chunk = ro.window_chunk();
  Sampler sampler(opt.sampling, dev);
  DecodeResult res;
  std::vector<int64_t> seq = prompt;
  auto t0 = Clock::now(), t1 = t0;
  bool stopped = false;
  while (!stopped && (int64_t)res.tokens.size() < opt.max_new_tokens) {
    // The whole prefix again, from an empty cache with one slot per position.
    const int64_t n = seq.size();
    KVCache cache(v_.config(), restored_cache_options(v_, f_, ro, n, true));
    Restorer rest(v_, d_, f_, ro, cache);
    auto ids = at::tensor(seq, at::kLong).view({1, n}).to(dev);
    auto logits = run_chunks(v_, cache, rest, ids, 0, chunk, true);
    int64_t tok = sampler.sample(logits.select(1, 0)).item<int64_t>();  // SYNC: the next token extends the prefix
    if (res.tokens.empty()) {
      res.prefill_seconds = seconds_since(t0, dev);
      t1 = Clock::now();
    }
    res.tokens.push_back(tok);
    seq.push_back(tok);
    if (opt.on_token) opt.on_token(tok);
    stopped = ends_generation(tok, opt);
    if (stopped || (int64_t)res.tokens.size() == opt.max_new_tokens) {
      const int64_t q = n - 1;
      res.attention_fraction_sliding = attention_fraction(cache, v_.config(), true, q);
      res.attention_fraction_full = attention_fraction(cache, v_.config(), false, q);
      res.restored_positions = std::max<int64_t>(0, rest.restored_upto() + 1);
      res.served_positions = n;
      res.memory = last_memory_ = restored_memory_report(v_, d_, f_, cache, rest, ro, n);
      if (ro.stats) res.stats = rest.stats();
    }
  }
  res.decode_seconds = seconds_since(t1, dev);
  return res;
}

ScoreResult score_restored(const Model& v, const Drafter* dr, const FTheta* ft, const std::vector<int64_t>& ids,
                           const RestoreOptions& ro, RestoreStats* stats) {
  KAKEYA_CHECK(ids.size() >= 2, "score: need at least 2 tokens, got " << ids.size());
  validate_restore(v, dr, ft, ro, ids.size(), 1);
  check_restores_something(ro, ids.size(), 1);
  // Every scored token reads older positions as a decode step does: chunks of at most the window
  // (a longer prefill chunk would read its own positions exactly).
  const int64_t n = ids.size(), chunk = ro.window_chunk();
  KVCache cache(v.config(), restored_cache_options(v, ft, ro, n, false));
  Restorer rest(v, dr, ft, ro, cache);
  auto w = at::tensor(ids, at::kLong).view({1, n}).to(v.device());
  auto iopt = at::TensorOptions().dtype(at::kLong).device(v.device());
  ScoreResult res;
  for (int64_t s = 0; s < n - 1; s += chunk) {
    const int64_t len = std::min(chunk, n - 1 - s);
    rest.prepare(s, len);
    ForwardOptions fo;
    fo.taps = rest.verifier_taps();
    auto logits = v.forward(w.slice(1, s, s + len), at::arange(s, s + len, iopt), cache, fo);  // [1, len, V]
    rest.commit(s, len);
    score_chunk(logits.squeeze(0), w.slice(1, s + 1, s + 1 + len).squeeze(0), res);
  }
  if (stats) *stats = rest.stats();
  return res;
}

}  // namespace kakeya

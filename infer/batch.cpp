#include "infer/batch.h"

#include <algorithm>
#include <map>

#include "core/error.h"
#include "core/model/moe.h"
#include "infer/generate.h"
#include "infer/memory.h"

#ifdef KAKEYA_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kakeya {

#ifdef KAKEYA_CUDA
struct BatchDecoder::Graphs {
  std::map<int64_t, std::unique_ptr<at::cuda::CUDAGraph>> by_rows;  // bucket -> its step
};
#else
struct BatchDecoder::Graphs {};
#endif

namespace {

KVCacheOptions pool_options(const Model& model, const FTheta* ftheta, const DecodeOptions& opt, int64_t max_rows,
                            int64_t capacity) {
  KAKEYA_CHECK(max_rows >= 1, "batch decoder: --batch expected >= 1, got " << max_rows);
  KAKEYA_CHECK(opt.mode == DecodeMode::Ar || opt.mode == DecodeMode::Restored,
               "batch decoder: --mode " << decode_mode_name(opt.mode) << " does not batch (ar or restored)");
  KVCacheOptions co = opt.mode == DecodeMode::Restored ? restored_cache_options(model, ftheta, opt.restore, capacity, false)
                                                       : ar_cache_options(model, capacity);
  co.batch = max_rows;
  co.rows = true;
  return co;
}

}  // namespace

BatchDecoder::BatchDecoder(const Model& model, const Drafter* drafter, const FTheta* ftheta, const DecodeOptions& opt,
                           int64_t max_rows, int64_t capacity)
    : model_(model),
      drafter_(drafter),
      ftheta_(ftheta),
      opt_(opt),
      pool_(model.config(), pool_options(model, ftheta, opt, max_rows, capacity)),
      graphs_(std::make_unique<Graphs>()) {
  if (restores()) {
    // The restored step writes no true raw K/V and no statistics (the research options).
    KAKEYA_CHECK(!opt.restore.needs_true_raw(),
                 "batch decoder: --mix-alpha " << opt.restore.mix_alpha << (opt.restore.stats ? " with --stats" : "")
                                               << " keeps true raw K/V per session; batched restored rows take "
                                               << "--mix-alpha 0 without --stats");
    validate_restore(model, drafter, ftheta, opt.restore, 1, 1);
  }
  for (int64_t b = 0; b < max_rows; ++b) {
    rows_.push_back(std::make_unique<Row>(pool_.row(b), b));
    if (!restores()) continue;
    Row& r = *rows_.back();
    r.rest = std::make_unique<Restorer>(model, drafter, ftheta, opt.restore, r.cache);
    r.chunks = std::make_unique<ChunkGraph>();
    r.rest->start_upkeep(1);  // decode steps reach one position
    if (at::Tensor* f = r.rest->feature_ring()) {
      if (b == 0) {  // every row's ring has this shape: one ring holds them all
        ring_ = f->size(0);
        feat_ring_ = at::zeros({max_rows * ring_, f->size(1)}, f->options());
      }
      r.rest->use_feature_ring(feat_ring_.narrow(0, b * ring_, ring_));
    }
    r.rest->stash_in_forward();
  }
  auto iopt = at::TensorOptions().dtype(at::kLong).device(model.device());
  ids_ = at::zeros({max_rows, 1}, iopt);
  pos_ = at::zeros({max_rows, 1}, iopt);
  live_ = at::zeros({max_rows, 1}, iopt);
  next_ = at::zeros({max_rows}, iopt);
  if (feat_ring_.defined()) {
    feats_ = std::make_unique<TargetFeatureCapture>(model, drafter->config().target_layer_ids);
    feat_base_ = at::arange(max_rows, iopt) * ring_;
    feat_rows_ = at::zeros({max_rows}, iopt);
  }
}

BatchDecoder::~BatchDecoder() = default;

int64_t BatchDecoder::kv_bytes() const {
  int64_t b = pool_.bytes();
  for (const auto& r : rows_)
    if (r->rest) b += r->rest->pending_bytes();  // each row's part of the feature ring (or its drafter K/V ring)
  return b;
}

int64_t BatchDecoder::rows_in_use() const {
  for (int64_t b = max_rows() - 1; b >= 0; --b)
    if (rows_[b]->seq) return b + 1;
  return 0;
}

#ifdef KAKEYA_CUDA
at::cuda::CUDAGraph* BatchDecoder::graph(int64_t rows) {
  // The experts' gathered path (no host sync) takes up to kMoeGatherMaxTokens rows.
  if (!opt_.cuda_graph || !model_.device().is_cuda() || (model_.config().moe() && rows > kMoeGatherMaxTokens))
    return nullptr;
  auto& g = graphs_->by_rows[rows];
  if (!g) {
    // Once eagerly first: libraries set up what a capture may not (a cuBLAS handle, workspaces
    // for this shape). It writes the same K/V (and features) the replay then writes again, and
    // its inputs are put back for the replay.
    const at::Tensor ids = ids_.clone(), pos = pos_.clone();
    run_rows(rows);
    ids_.copy_(ids);
    pos_.copy_(pos);
    // Captured on a side stream (CUDA graphs require one); capture records without running.
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
    g = std::make_unique<at::cuda::CUDAGraph>();
    g->capture_begin();
    run_rows(rows);
    g->capture_end();
  }
  return g.get();
}
#endif

void BatchDecoder::capture_all() {
#ifdef KAKEYA_CUDA
  for (int64_t n = 1;; n *= 2) {
    graph(std::min(n, max_rows()));
    if (n >= max_rows()) break;
  }
#endif
}

at::Tensor BatchDecoder::run_rows(int64_t n) {
  KVCache rows = pool_.first_rows(n);
  ForwardOptions fo;
  fo.last_logits_only = true;
  at::Tensor feat_rows;
  if (feats_) {
    // Row b's features go to its ring part, at its position mod the ring.
    feat_rows = feat_rows_.narrow(0, 0, n);
    at::add_out(feat_rows, feat_base_.narrow(0, 0, n), pos_.narrow(0, 0, n).view({-1}).remainder(ring_));
    feats_->store_into(feat_ring_, feat_rows);
    fo.taps = &feats_->taps();
  }
  at::Tensor logits = model_.forward(ids_.narrow(0, 0, n), pos_.narrow(0, 0, n), rows, fo).select(1, 0);  // [n, V]
  if (feats_) {
    // A last-layer feature is final-normed after the forward: written here (the others were stored).
    if (feats_->stores_all()) feats_->clear();
    else feats_->take_into(nullptr, &feat_ring_, feat_rows);
  }
  next_.narrow(0, 0, n).copy_(logits.argmax(-1));  // every greedy row at once
  // The next step's inputs, on the device: each seated row feeds its token at its next position
  // (free rows stay at position 0), so a steady step copies nothing from the host.
  ids_.narrow(0, 0, n).copy_(next_.narrow(0, 0, n).view({n, 1}));
  pos_.narrow(0, 0, n).add_(live_.narrow(0, 0, n));
  return logits;
}

std::pair<int64_t, int64_t> BatchDecoder::join(const std::vector<int64_t>& prompt, const SamplingOptions& sampling,
                                               int64_t max_new_tokens) {
  KAKEYA_CHECK(size() < max_rows(), "batch decoder: all " << max_rows() << " rows are taken");
  KAKEYA_CHECK(!prompt.empty(), "batch decoder: empty prompt");
  KAKEYA_CHECK(max_new_tokens >= 1, "batch decoder: max_new_tokens expected >= 1, got " << max_new_tokens);
  const int64_t n = (int64_t)prompt.size();
  KAKEYA_CHECK(n + max_new_tokens <= capacity(), "batch decoder: " << n << " prompt + " << max_new_tokens
                                                                   << " new tokens exceed the " << capacity()
                                                                   << " positions of a row");
  if (restores()) validate_restore(model_, drafter_, ftheta_, opt_.restore, n, max_new_tokens);
  Row* row = nullptr;
  for (auto& r : rows_)
    if (!r->seq) {
      row = r.get();
      break;
    }
  Seq s;
  s.id = next_id_++;
  s.sampler = std::make_unique<Sampler>(sampling, model_.device());
  s.sampler->reset(sampling.seed);
  // The prompt alone, as the one-sequence decoder prefills it, into the row.
  row->cache.clear();
  auto ids = at::tensor(prompt, at::kLong).view({1, n}).to(model_.device());
  at::Tensor logits;
  if (row->rest) {
    row->rest->reset();
    logits = run_chunks(model_, row->cache, *row->rest, ids, 0, opt_.restore.resolved_chunk(), true,
                        opt_.cuda_graph ? row->chunks.get() : nullptr);
  } else {
    ForwardOptions fo;
    fo.last_logits_only = true;
    logits = model_.forward(ids, row->cache, fo);
  }
  const at::Tensor first = s.sampler->sample(logits.select(1, 0));  // [1]
  // The row's first step feeds its first token at position n (later steps feed themselves).
  const int64_t b = row->index;
  ids_.narrow(0, b, 1).copy_(first.view({1, 1}));
  pos_.narrow(0, b, 1).fill_(n);
  live_.narrow(0, b, 1).fill_(1);
  const int64_t tok = first.item<int64_t>();  // SYNC: the first token goes to its client now
  s.length = n;
  s.end = n + max_new_tokens;
  row->seq = std::move(s);
  ++seated_;
  return {row->seq->id, tok};
}

std::vector<std::pair<int64_t, int64_t>> BatchDecoder::step() {
  const int64_t n = rows_in_use();
  if (n == 0) return {};
  bool sampled = false;
  // ids_ / pos_ already hold each seated row's last token and its position (join, then each
  // step); free rows feed their last token at position 0 into rows no sequence holds (as do rows
  // past n of a graph's bucket).
  for (int64_t b = 0; b < n; ++b) {
    Row& r = *rows_[b];
    if (!r.seq) continue;
    const Seq& s = *r.seq;
    KAKEYA_CHECK(s.length + 1 < s.end, "batch decoder: sequence " << s.id << " has produced its "
                                                                  << s.end - s.length << " tokens; it must leave");
    sampled = sampled || !s.sampler->greedy();
    // The row's restoration batches due before its step (in place, on the step's stream).
    if (r.rest)
      for (UpkeepBatch u = r.rest->next_upkeep(s.length); u.from >= 0; u = r.rest->next_upkeep(s.length)) {
        r.rest->upkeep_from(u.from);
        r.rest->upkeep();
      }
  }
  bool ran = false;
#ifdef KAKEYA_CUDA
  int64_t bucket = 1;
  while (bucket < n) bucket *= 2;
  if (!sampled)
    if (at::cuda::CUDAGraph* g = graph(std::min(bucket, max_rows()))) {
      g->replay();
      ran = true;
    }
#endif
  if (!ran) {
    const at::Tensor logits = run_rows(n);
    if (sampled)
      for (int64_t b = 0; b < n; ++b)
        if (rows_[b]->seq && !rows_[b]->seq->sampler->greedy()) {
          next_.narrow(0, b, 1).copy_(rows_[b]->seq->sampler->sample(logits.narrow(0, b, 1)));
          ids_.narrow(0, b, 1).copy_(next_.narrow(0, b, 1).view({1, 1}));  // it feeds its sample, not the argmax
        }
  }
  const at::Tensor host = next_.narrow(0, 0, n).cpu();  // SYNC: each row's token goes to its client
  const int64_t* t = host.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t b = 0; b < n; ++b) {
    if (!rows_[b]->seq) continue;
    Seq& s = *rows_[b]->seq;
    s.length += 1;
    out.emplace_back(s.id, t[b]);
  }
  return out;
}

void BatchDecoder::leave(int64_t id) {
  auto it = std::find_if(rows_.begin(), rows_.end(), [&](const auto& r) { return r->seq && r->seq->id == id; });
  KAKEYA_CHECK(it != rows_.end(), "batch decoder: no sequence " << id);
  (*it)->seq.reset();
  const int64_t b = (*it)->index;
  pos_.narrow(0, b, 1).fill_(0);  // a free row decodes at position 0 (see step)
  live_.narrow(0, b, 1).fill_(0);
  --seated_;
}

}  // namespace kakeya

#include "infer/batch.h"

#include <algorithm>
#include <map>

#include "core/error.h"
#include "core/model/moe.h"
#include "infer/generate.h"

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

KVCacheOptions pool_options(const Model& model, int64_t max_rows, int64_t capacity) {
  KAKEYA_CHECK(max_rows >= 1, "batch decoder: --batch expected >= 1, got " << max_rows);
  KVCacheOptions co = ar_cache_options(model, capacity);
  co.batch = max_rows;
  co.rows = true;
  return co;
}

}  // namespace

BatchDecoder::BatchDecoder(const Model& model, int64_t max_rows, int64_t capacity, bool cuda_graphs)
    : model_(model),
      pool_(model.config(), pool_options(model, max_rows, capacity)),
      prefill_(model.config(), ar_cache_options(model, capacity)),
      cuda_graphs_(cuda_graphs),
      graphs_(std::make_unique<Graphs>()) {
  auto iopt = at::TensorOptions().dtype(at::kLong).device(model.device());
  ids_ = at::zeros({max_rows, 1}, iopt);
  pos_ = at::zeros({max_rows, 1}, iopt);
  next_ = at::zeros({max_rows}, iopt);
}

BatchDecoder::~BatchDecoder() = default;

#ifdef KAKEYA_CUDA
at::cuda::CUDAGraph* BatchDecoder::graph(int64_t rows) {
  // The experts' gathered path (no host sync) takes up to kMoeGatherMaxTokens rows.
  if (!cuda_graphs_ || !model_.device().is_cuda() || (model_.config().moe() && rows > kMoeGatherMaxTokens))
    return nullptr;
  auto& g = graphs_->by_rows[rows];
  if (!g) {
    // Once eagerly first: libraries set up what a capture may not (a cuBLAS handle, workspaces
    // for this shape). It writes the same K/V the replay then writes again.
    run_rows(rows);
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
  at::Tensor logits = model_.forward(ids_.narrow(0, 0, n), pos_.narrow(0, 0, n), rows, fo).select(1, 0);  // [n, V]
  next_.narrow(0, 0, n).copy_(logits.argmax(-1));  // every greedy row at once
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
  Seq s;
  s.id = next_id_++;
  s.sampler = std::make_unique<Sampler>(sampling, model_.device());
  s.sampler->reset(sampling.seed);
  // The prompt alone, as ArDecoder prefills it, then its K/V into the first free row.
  prefill_.clear();
  ForwardOptions fo;
  fo.last_logits_only = true;
  auto ids = at::tensor(prompt, at::kLong).view({1, n}).to(model_.device());
  auto first = s.sampler->sample(model_.forward(ids, prefill_, fo).select(1, 0));  // [1]
  pool_.load_row(size(), prefill_);
  s.last = first.item<int64_t>();  // SYNC: the first token goes to its client now
  s.length = n;
  s.end = n + max_new_tokens;
  seqs_.push_back(std::move(s));
  return {seqs_.back().id, seqs_.back().last};
}

std::vector<std::pair<int64_t, int64_t>> BatchDecoder::step() {
  const int64_t B = size();
  if (B == 0) return {};
  bool sampled = false;
  // Rows past B of a graph's bucket feed token 0 at position 0 into rows no sequence holds.
  std::vector<int64_t> ids(max_rows(), 0), pos(max_rows(), 0);
  for (int64_t b = 0; b < B; ++b) {
    const Seq& s = seqs_[b];
    KAKEYA_CHECK(s.length + 1 < s.end, "batch decoder: sequence " << s.id << " has produced its "
                                                                  << s.end - s.length << " tokens; it must leave");
    ids[b] = s.last;
    pos[b] = s.length;
    sampled = sampled || !s.sampler->greedy();
  }
  ids_.view({-1}).copy_(at::tensor(ids, at::kLong));
  pos_.view({-1}).copy_(at::tensor(pos, at::kLong));
  bool ran = false;
#ifdef KAKEYA_CUDA
  int64_t bucket = 1;
  while (bucket < B) bucket *= 2;
  if (!sampled)
    if (at::cuda::CUDAGraph* g = graph(std::min(bucket, max_rows()))) {
      g->replay();
      ran = true;
    }
#endif
  if (!ran) {
    const at::Tensor logits = run_rows(B);
    if (sampled)
      for (int64_t b = 0; b < B; ++b)
        if (!seqs_[b].sampler->greedy())
          next_.narrow(0, b, 1).copy_(seqs_[b].sampler->sample(logits.narrow(0, b, 1)));
  }
  const at::Tensor host = next_.narrow(0, 0, B).cpu();  // SYNC: each row's token goes to its client
  const int64_t* t = host.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> out(B);
  for (int64_t b = 0; b < B; ++b) {
    Seq& s = seqs_[b];
    s.length += 1;
    s.last = t[b];
    out[b] = {s.id, t[b]};
  }
  return out;
}

void BatchDecoder::leave(int64_t id) {
  auto it = std::find_if(seqs_.begin(), seqs_.end(), [&](const Seq& s) { return s.id == id; });
  KAKEYA_CHECK(it != seqs_.end(), "batch decoder: no sequence " << id);
  const int64_t row = it - seqs_.begin(), last = size() - 1;
  if (row != last) {
    pool_.copy_row(last, row);
    *it = std::move(seqs_.back());
  }
  seqs_.pop_back();
  pool_.clear_row(last);
}

}  // namespace kakeya

#include "infer/score.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace kakeya {

double ScoreResult::mean_nll() const {
  double s = 0;
  for (double lp : logprobs) s -= lp;
  return logprobs.empty() ? 0.0 : s / logprobs.size();
}
double ScoreResult::perplexity() const { return std::exp(mean_nll()); }
double ScoreResult::top1_rate() const {
  int64_t s = 0;
  for (int32_t t : top1) s += t;
  return top1.empty() ? 0.0 : (double)s / top1.size();
}

void score_chunk(const at::Tensor& logits, const at::Tensor& tgt, ScoreResult& res) {
  const int64_t len = tgt.size(0);
  auto lp = at::log_softmax(logits, -1).gather(1, tgt.unsqueeze(1)).squeeze(1);
  auto hit = logits.argmax(-1).eq(tgt);
  auto lp_cpu = lp.to(at::kDouble).cpu();  // SYNC: per chunk, results leave the device
  auto hit_cpu = hit.cpu();
  auto tgt_cpu = tgt.cpu();
  for (int64_t i = 0; i < len; ++i) {
    res.logprobs.push_back(lp_cpu[i].item<double>());
    res.top1.push_back(hit_cpu[i].item<bool>() ? 1 : 0);
    res.targets.push_back(tgt_cpu[i].item<int64_t>());
  }
}

ScoreResult score(const Model& model, const std::vector<int64_t>& ids, const ScoreOptions& opt) {
  KAKEYA_CHECK(ids.size() >= 2, "score: need at least 2 tokens, got " << ids.size());
  KAKEYA_CHECK(opt.context == 0 || opt.context >= 2, "score: --context expected 0 or >= 2, got " << opt.context);
  KAKEYA_CHECK(opt.chunk > 0, "score: chunk expected > 0");
  const int64_t n = ids.size();
  const int64_t ctx = opt.context > 0 ? opt.context : n;
  const KVCacheOptions co = model.cache_options(ctx + 1);
  KAKEYA_CHECK(co.capacity <= model.options().max_positions,
               "score: window of " << ctx << " tokens exceeds the position table (" << model.options().max_positions << ")");
  KVCache cache(model.config(), co);
  ScoreResult res;
  int64_t total = n, done = 0;
  for (int64_t start = 0; start < n; start += ctx) {
    std::vector<int64_t> win(ids.begin() + start, ids.begin() + std::min(n, start + ctx));
    if (start > 0 && opt.bos_id >= 0 && win.front() != opt.bos_id) win.insert(win.begin(), opt.bos_id);
    if (win.size() < 2) break;
    cache.clear();
    auto w = at::tensor(win, at::kLong).to(model.device()).view({1, (int64_t)win.size()});
    for (int64_t c = 0; c < (int64_t)win.size() - 1; c += opt.chunk) {
      int64_t len = std::min<int64_t>(opt.chunk, win.size() - 1 - c);
      auto logits = model.forward(w.slice(1, c, c + len), cache).squeeze(0);  // [len, V] f32
      score_chunk(logits, w.slice(1, c + 1, c + 1 + len).squeeze(0), res);
      done += len;
      if (opt.on_progress) opt.on_progress(done, total);
    }
  }
  return res;
}

}  // namespace kakeya

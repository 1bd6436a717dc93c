// Teacher-forced scoring: log-probability of every token given its prefix,
// through the same forward and KV cache as decoding (so a codec or a restored
// cache is judged by exactly what decoding would see).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/model/model.h"

namespace kakeya {

struct ScoreOptions {
  int64_t context = 0;  // window length; 0: the whole sequence is one window
  int64_t chunk = 256;  // tokens per forward inside a window (bounds the [chunk, V] logits)
  int64_t bos_id = -1;  // prepended to windows after the first when >= 0
  std::function<void(int64_t done, int64_t total)> on_progress;
};

struct ScoreResult {
  std::vector<int64_t> targets;    // scored token ids
  std::vector<double> logprobs;    // log p(target | prefix), natural log
  std::vector<int32_t> top1;       // 1 if the argmax equals the target
  double mean_nll() const;
  double perplexity() const;
  double top1_rate() const;
};

// Appends one chunk's scores: logits [len, V] f32 at the positions before targets [len].
void score_chunk(const at::Tensor& logits, const at::Tensor& targets, ScoreResult& res);

// ids: the token sequence. Windows of `context` tokens (the last may be
// shorter) are scored independently; the first token of a window is context only.
ScoreResult score(const Model& model, const std::vector<int64_t>& ids, const ScoreOptions& opt);

}  // namespace kakeya

#include "train/draft_vocab.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace kakeya::train {

void count_tokens(const Tokenizer& tok, const std::vector<CorpusFile>& files, Domain d, VocabCounts& counts) {
  const int64_t V = tok.vocab_size();
  for (auto* c : {&counts.train, &counts.heldout})
    if ((int64_t)c->size() != V) c->assign(V, 0);
  for (const auto& f : files) {
    auto& c = f.heldout ? counts.heldout : counts.train;
    for (int32_t id : tok.encode(corpus_text(f, d), /*add_special=*/false)) {
      KAKEYA_CHECK(id >= 0 && id < V, f.path << ": token id " << id << " outside the vocabulary of " << V);
      ++c[id];
    }
    ++(f.heldout ? counts.heldout_files : counts.train_files);
  }
}

at::Tensor top_ids(const std::vector<int64_t>& counts, int64_t k) {
  const int64_t V = counts.size();
  KAKEYA_CHECK(k > 0 && k <= V, "draft vocabulary: " << k << " tokens asked of a vocabulary of " << V);
  std::vector<int64_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  order.resize(k);
  return at::tensor(order, at::kLong);
}

double coverage(const std::vector<int64_t>& counts, const at::Tensor& ids) {
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if (total == 0) return 1.0;
  auto a = ids.accessor<int64_t, 1>();
  int64_t in = 0;
  for (int64_t i = 0; i < ids.size(0); ++i) in += counts.at(a[i]);
  return (double)in / (double)total;
}

}  // namespace kakeya::train

// The draft vocabulary of FR-Spec (arXiv 2502.14856; core/model/drafter.h set_draft_vocab):
// the K most frequent tokens of the drafter's training text. Counts come from the same
// sources and the same file split as train-drafter's data (train/drafter_data.h): files
// held out there are not counted, and their tokens measure the coverage a user gets.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "core/io/tokenizer.h"
#include "train/drafter_data.h"

namespace kakeya::train {

struct VocabCounts {
  std::vector<int64_t> train, heldout;  // [V] token counts over the train / held-out files
  int64_t train_files = 0, heldout_files = 0;
};

// Tokenizes every file of `files` (corpus_text, no special tokens) into the counts of its split.
void count_tokens(const Tokenizer& tok, const std::vector<CorpusFile>& files, Domain d, VocabCounts& counts);

// The k most frequent ids of `counts` (ties: the lower id first): [k] int64, most frequent first.
// Throws when fewer than k ids exist in the vocabulary.
at::Tensor top_ids(const std::vector<int64_t>& counts, int64_t k);

// Share of the tokens in `counts` whose id is in `ids` (1 when counts are empty).
double coverage(const std::vector<int64_t>& counts, const at::Tensor& ids);

}  // namespace kakeya::train

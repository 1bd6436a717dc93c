// Online f_θ training data (`kakeya train-ftheta --online`): no capture on disk. The verifier
// (and, for the drafter_kv input, the drafter) run in the training loop: each training sequence
// is made when a batch draws it, by one tapped forward (data/capture.h capture_sequence on the
// device), so the corpus can be as large as the text is, not as the disk or a GPU lease's
// transfer limit allow.
//
// Corpus (tools/ftheta_corpus.py): DIR/train.txt and DIR/heldout.txt, documents separated by a
// line holding only "<|doc|>", split by source file (a file is wholly in one of them). Text
// sequences: the documents in a seeded order, their tokens concatenated with a blank line
// between documents and cut into pieces of seq_len - 1 tokens, each behind BOS, so every
// sequence fills seq_len positions (a restored layer's whole sliding window at every length).
// Synthetic long-context sequences (data/longeval.h, TRAIN split: its own templates, keys,
// seeds and haystack, disjoint from the evaluation suite's) take every `synthetic_every`-th
// slot of the training stream, the task families in turn.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/io/tokenizer.h"
#include "train/ftheta_train.h"

namespace kakeya::train {

struct OnlineCorpusOptions {
  std::string dir;                  // train.txt + heldout.txt
  int64_t seq_len = 1024;           // tokens per sequence, BOS included
  int64_t heldout = 8;              // held-out sequences (the first of heldout.txt's packing)
  int64_t synthetic_every = 8;      // every n-th training sequence is a synthetic task (0: none)
  int64_t max_train_tokens = 0;     // cap on the text tokens packed (0: all)
  uint64_t seed = 0;                // document order
  std::string synthetic_source_dir = "data";  // data/ of the repo: the train split's default haystack is data/codec/calib.txt
};

struct OnlineCorpus {
  std::vector<std::vector<int64_t>> text;     // packed training text sequences [seq_len]
  std::vector<std::vector<int64_t>> heldout;  // packed held-out sequences [seq_len]
  int64_t n_train = 0;                        // training stream length (text + synthetic slots)
  nlohmann::json describe;                    // inputs (files, sha256, bytes), counts, options
};

// One corpus file's documents packed into up to max_seqs (0: all) sequences of seq_len tokens.
std::vector<std::vector<int64_t>> pack_corpus_file(const Tokenizer& tok, const std::string& path, int64_t seq_len,
                                                   uint64_t seed, int64_t max_seqs);

// Reads and packs DIR's corpus. Throws naming the file when it is missing, empty, or too small
// for `heldout` sequences of seq_len.
OnlineCorpus load_online_corpus(const Tokenizer& tok, const OnlineCorpusOptions& o);

// Training stream slot i: a packed text sequence, or a synthetic task prompt of seq_len tokens.
std::vector<int64_t> online_tokens(const Tokenizer& tok, const OnlineCorpus& c, const OnlineCorpusOptions& o,
                                   int64_t i);

// f_θ training data of one token sequence, made now on the verifier's device: the verifier's raw
// q/k/v and attention outputs of every layer, and f_θ's input (the drafter's raw context K/V, or
// the target features), in bf16 like a capture stores them.
FThetaSequence online_sequence(const Model& verifier, const Drafter& drafter, const FThetaConfig& fc,
                               const std::vector<int64_t>& tokens);

}  // namespace kakeya::train

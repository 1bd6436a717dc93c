// RULER-style long-context tasks (Hsieh et al. 2024, "RULER: What's the Real
// Context Size of Your Long-Context Language Models?"), token-exact, for
// `kakeya eval-long` (oracle vs evict-only vs restored decoders).
//
//   [BOS] [chat prefix] [in-context example] instruction
//   body (haystack / noise / word list / coded text, facts inserted) ...
//   question [chat suffix] answer prefix
//
// Families (task names as on the command line; RULER's configurations):
//   niah_single_digits   one needle "One of the special magic numbers for <key> is: <7 digits>."
//                        in natural-text lines; the question asks for <key>
//   niah_single_words    the same with a word value ("<word>-<word>")
//   niah_single_uuid     the same with a UUID value (8-4-4-4-12 hex, version 4)
//   niah_multikey        4 needles with distinct keys, one of them asked for
//   niah_multivalue      4 needles with the same key; all 4 values are asked for
//   niah_multiquery      4 needles with distinct keys; all 4 are asked for
//   vt                   variable tracking: "VAR ABCDE = 12345", then 4 hops "VAR FGHIJ =
//                        VAR ABCDE" ... one statement per line among repeated noise lines
//                        ("The grass is green. ..."); answer: the 5 variables; one
//                        in-context example first (3-letter names)
//   cwe                  common words extraction: "1. w 2. w ..." where 10 words appear
//                        30 times and the others 3 (6 and 1 below 4096 tokens); answer:
//                        the 10; one in-context example first
//   fwe                  frequent words extraction: Zipf(α=2) counts over 6-letter coded
//                        words, rank 1 is the noise "..."; answer: ranks 2-4
// Needle depths are drawn from RULER's 40 depths (0..100%) and snapped to a haystack
// line boundary; vt statements go to random noise-line boundaries, in chain order.
// Score: RULER's string_match_all, the share of answers found (ASCII case-insensitive)
// in the generated text.
//
// Held out by construction: a model trained on the train split never sees the eval
// split's templates, seeds, key vocabulary or haystack text.
//   - Templates: the eval split uses RULER's wording; the train split has its own
//     ("secret code" needles, "Query:"/"Reply:", "REG X := ..." with other noise
//     sentences, "[1] term" lists, "~~" as the coded-text noise). long_template_phrases
//     lists each split's phrases; tests/test_longeval.cpp proves none appears in a
//     prompt of the other split.
//   - Seeds: eval sample s uses generator seed s, train s + 2^41 (s < 2^40), so no
//     generator state is shared with each other or with data/niah.h's ranges (train
//     there: s + 2^40).
//   - Vocabulary: keys, word values and cwe words come from the even-indexed entries
//     of a word list in longeval.cpp (eval) or the odd ones (train); the list shares
//     no word with niah.cpp's key lists. vt names have 5 letters (example: 3) in eval,
//     6 (example: 4) in train; fwe coded words 6 letters in eval, 7 in train.
//   - Haystack (niah_*): eval reads data/longeval/haystack_eval.txt (Debian man pages,
//     tools/longeval_corpus.py), train data/codec/calib.txt (Python documentation);
//     the two share no 64-character window.
//
// Token-exact length as in data/niah.h: the prompt concatenates separately encoded
// pieces (line by line, list item by list item) and the body's last piece is cut at
// a token boundary to fill the budget. prompt_text = tokenizer.decode(prompt_ids).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/io/tokenizer.h"
#include "data/niah.h"

namespace kakeya::data {

enum class LongSplit { Train, Eval };
const char* long_split_name(LongSplit s);  // "train" / "eval"

// Every task name, in the order of the header comment.
std::vector<std::string> long_task_names();
// The largest max_new_tokens of any task: a prompt of C tokens and its answer fit C + this.
int64_t long_task_max_new_tokens();
// Throws kakeya::Error "unknown task 'x': expected one of ..." for a name not in long_task_names().
void check_long_task(const std::string& name);

struct LongTaskOptions {
  LongSplit split = LongSplit::Eval;
  std::string task = "niah_single_digits";
  uint64_t seed = 0;                // sample number within the split (< 2^40)
  int64_t context_tokens = 4096;    // total prompt length in tokens, exact
  ChatFormat chat = ChatFormat::None;
  bool answer_prefix = true;        // end with the split's answer prefix ("... are", "... they are:")
  std::string haystack_file;        // niah_* haystack; empty: the split's default under source_dir
  std::string source_dir = "data";  // the repository's data/ folder
};

struct LongSample {
  std::string task;
  std::vector<int64_t> prompt_ids;        // [context_tokens], BOS first
  std::string prompt_text;                // decode(prompt_ids)
  std::vector<std::string> answers;       // every string the generation must contain
  std::vector<int64_t> needle_positions;  // ascending: first token of each niah needle (distractors
                                          // included) or vt statement; empty for cwe / fwe
  int64_t max_new_tokens = 0;             // generation budget that fits the answers (per task)
  uint64_t rng_seed = 0;                  // the seed actually used (split offset applied)
};

// <source_dir>/longeval/haystack_eval.txt (eval) or <source_dir>/codec/calib.txt (train).
std::string default_long_haystack_file(LongSplit s, const std::string& source_dir);

// Throws kakeya::Error for an unknown task, a seed >= 2^40, a context too small for
// the fixed parts (naming both numbers) or an unusable haystack file (naming it).
LongSample make_long_sample(const Tokenizer& tok, const LongTaskOptions& opt);

// RULER's string_match_all: share of `answers` found in `generated`, ASCII
// case-insensitive (0..1; 0 for no answers).
double long_task_score(const std::vector<std::string>& answers, const std::string& generated);

// The split's template phrases (the literal text between placeholders and line
// breaks, at least 12 characters), sorted: what must never reach the other split.
std::vector<std::string> long_template_phrases(LongSplit s);

}  // namespace kakeya::data

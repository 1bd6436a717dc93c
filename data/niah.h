// Synthetic needle-in-a-haystack prompts, used by capture (training prompts)
// and by the decoder's NIAH ladder (evaluation prompts).
//
//   [BOS] [chat prefix] instruction line
//   haystack lines ... needle line ... haystack lines ... (one needle per depth)
//   question line [chat suffix] answer prefix
//
// Needle: "The special magic number for <key> is <7 digits>." (the prototype's
// "secret code" pattern with the wording of the RULER/LongBench family).
// Question: "What is the special magic number for <key>?" (several needles:
// "What are the special magic numbers for <k1>, <k2> and <k3>?"). Recall = share
// of the needles' numbers that appear in the generated text.
//
// Haystack: natural text lines, consecutive from a seeded start line (wrapping).
// Default sources (data/codec/, made by tools/codec_corpus.py from the Python
// documentation topics, see data/codec/sources.json): the train split reads
// calib.txt, the eval split eval.txt; the two share no topic and no 64-char window.
//
// Train and eval are disjoint by construction, not by luck: sample seeds live in
// disjoint ranges (train: seed + 2^40), keys use disjoint adjective halves (eval:
// even-indexed adjectives, train: odd), and the default haystack files are disjoint.
//
// Token-exact length: the prompt is the concatenation of separately encoded
// pieces (each line encoded without special tokens, "\n" included), so the total
// is known exactly; the last haystack line before the question is cut at a token
// boundary to fill the budget. prompt_text = tokenizer.decode(prompt_ids).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/io/tokenizer.h"

namespace kakeya::data {

enum class NiahSplit { Train, Eval };
const char* niah_split_name(NiahSplit s);  // "train" / "eval"

// Prompt wrapping. Gemma: "<start_of_turn>user\n…<end_of_turn>\n<start_of_turn>model\n"
// (the Gemma 3 chat template); ChatML: "<|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n".
enum class ChatFormat { None, Gemma, ChatML };
const char* chat_format_name(ChatFormat f);  // "none" / "gemma" / "chatml"
ChatFormat parse_chat_format(const std::string& name);  // also "auto" is not accepted here (use detect)
// Gemma when the tokenizer has <start_of_turn> and <end_of_turn> tokens, ChatML
// when it has <|im_start|> and <|im_end|>, None otherwise.
ChatFormat detect_chat_format(const Tokenizer& tok);
// The user turn around a prompt's text: opened before it, closed after it up to the
// start of the model's turn ("\n" for None).
std::string chat_user_open(ChatFormat f);
std::string chat_user_close(ChatFormat f);

struct NiahOptions {
  NiahSplit split = NiahSplit::Eval;
  uint64_t seed = 0;                 // sample number within the split (< 2^40)
  int64_t context_tokens = 1024;     // total prompt length in tokens, exact
  std::vector<double> depths{0.5};   // one needle per entry; depth in [0, 1] of the haystack
  ChatFormat chat = ChatFormat::None;
  bool answer_prefix = true;         // end with "The special magic number for <key> is" (single needle)
  std::string haystack_file;         // empty: the split's default under source_dir
  std::string source_dir = "data/codec";  // where the default haystack files live
};

struct NiahSample {
  std::vector<int64_t> prompt_ids;       // [context_tokens]
  std::string prompt_text;               // decode(prompt_ids)
  std::vector<std::string> keys;         // per needle
  std::vector<std::string> answers;      // per needle: the 7-digit number
  std::vector<int64_t> needle_positions; // per needle: index in prompt_ids of the needle's first token
  uint64_t rng_seed = 0;                 // the seed actually used (split offset applied)
};

// Haystack lines of a text file (non-empty lines, trailing spaces stripped). Cached per path.
const std::vector<std::string>& haystack_lines(const std::string& path);
std::string default_haystack_file(NiahSplit s, const std::string& source_dir);

// Throws kakeya::Error when context_tokens is too small for the fixed parts
// (naming both), a depth is outside [0, 1], or the haystack file is unusable.
NiahSample make_niah(const Tokenizer& tok, const NiahOptions& opt);

// Share of `answers` found verbatim in `generated` (0..1; 0 for no answers).
double niah_recall(const std::vector<std::string>& answers, const std::string& generated);

}  // namespace kakeya::data

// Training data for a DFlash drafter: prompts cut from local text, continued
// greedily by the target itself, cached to disk.
//
// Sources (documented in train/README.md):
//   code   *.py under the given roots (the Python standard library), skipping test
//          suites, site-packages, idlelib, lib2to3 and encodings (generated codec tables)
//   prose  documentation and license text under the given roots: dist-info METADATA
//          (the package's long description; the RFC 822 header is dropped), README*,
//          *.md, *.rst, LICENSE*/LICENCE*/COPYING*/NOTICE*/AUTHORS*, Debian copyright
// Files with identical contents count once. Held-out split by file: a file is
// held out when FNV-1a(contents) mod 100 < heldout_percent, so the split depends
// on the text only (not on paths or the machine). Held-out prose prompts are
// taken from descriptive files only (no license text: license boilerplate repeats
// across files and would make the held-out split leak).
//
// Prompt: [BOS] + (prompt_len - 1) tokens of a file, starting at a line start.
// Continuation: gen_len tokens of the target's greedy decoding (batched), cut
// after a stop token (the sequence's length records where).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/model/model.h"
#include "core/io/tokenizer.h"

namespace kakeya::train {

enum class Domain { Code, Prose };
const char* domain_name(Domain d);  // "code" / "prose"

struct CorpusFile {
  std::string path;
  uint64_t hash = 0;      // FNV-1a of the contents
  int64_t bytes = 0;
  bool heldout = false;
  bool eval_ok = true;    // may give held-out evaluation prompts (prose: not license text)
};

// Walks `roots` (files or directories; symlinks not followed) and keeps the
// files of `d` as described above, sorted by path, duplicates dropped.
std::vector<CorpusFile> list_corpus(const std::vector<std::string>& roots, Domain d, int heldout_percent);

// The text a file contributes (prose METADATA: without its header).
std::string corpus_text(const CorpusFile& f, Domain d);

struct PromptOptions {
  int64_t prompt_len = 64;       // tokens, BOS included
  int64_t max_prompts = 1000;
  int64_t bytes_per_prompt = 1000;  // a file gives about bytes / this many prompts (at least 1)
  int64_t max_per_file = 256;
  uint64_t seed = 0;
  bool first_at_start = true;  // a file's first prompt is its beginning (else a random line start too)
};
// Prompts of exactly prompt_len tokens from `files` (held-out or train, as the
// caller selects), spread over files (shuffled, seeded) and over each file.
std::vector<std::vector<int64_t>> make_prompts(const Tokenizer& tok, int64_t bos_id, const std::vector<CorpusFile>& files,
                                               Domain d, const PromptOptions& opt);

// Prompts and their greedy continuations: tokens [N, P + G] int64 (CPU), lengths [N]
// int64 = P + generated tokens up to and including the first stop (P + G without one).
struct Sequences {
  at::Tensor tokens;   // [N, P + G] int64
  at::Tensor lengths;  // [N] int64
  int64_t prompt_len = 0;
  int64_t size() const { return tokens.defined() ? tokens.size(0) : 0; }
};

// Greedy continuations by `target`, `batch` prompts per forward (all prompts
// have the same length, so a batch needs no padding).
Sequences generate_continuations(const Model& target, const std::vector<std::vector<int64_t>>& prompts,
                                 int64_t gen_len, int64_t batch, const std::vector<int64_t>& stop_ids,
                                 const std::string& label);

// The rows of several sets in order (same prompt length and width; data-parallel parts).
Sequences concat_sequences(const std::vector<Sequences>& parts);
void save_sequences(const std::string& path, const Sequences& s, const std::map<std::string, std::string>& metadata);
// Throws naming the file on a missing or malformed cache.
Sequences load_sequences(const std::string& path, std::map<std::string, std::string>* metadata = nullptr);

}  // namespace kakeya::train

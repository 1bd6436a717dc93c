// Incremental detokenization for streaming (kakeya serve, decode --prompt): TextStream turns
// generated token ids into text pieces that are safe to show as they come, and StopFilter cuts
// the text at the first stop string, holding back what could still become one.
//
// A token alone is not text: it may be part of a UTF-8 character (byte-fallback pieces), and
// decoders may treat it differently at the start of a sequence. So TextStream decodes a window
// of the recent tokens (Tokenizer::decode(ids, skip_special)) after every token and emits what
// it adds to the window's text already out, holding back a trailing incomplete UTF-8 sequence
// and trailing U+FFFD (which a later byte token may still complete into a character). The
// window starts at the tokens whose text was last fully out, so every decode of one window has
// the same start and only differences within a window are read; it moves on whenever all of its
// text is out, so a push costs a decode of a few tokens, not of the whole generation (a batch of
// 64 sequences pushes 64 tokens per step). Concatenating every push() and the final finish()
// gives decode(all tokens).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kakeya {

class Tokenizer;

class TextStream {
 public:
  // `tok` must outlive the stream. skip_special: drop special tokens (<eos>, ...) from the text.
  explicit TextStream(const Tokenizer& tok, bool skip_special = true);
  // Appends `token`; returns the new text that is safe to emit (often empty: held back).
  std::string push(int64_t token);
  // Everything not emitted yet (held-back bytes, decoded as the tokenizer decodes them).
  // After it, the concatenation of all returned pieces equals decode(tokens()).
  std::string finish();
  void reset();  // a new generation
  const std::vector<int32_t>& tokens() const { return ids_; }
  const std::string& emitted() const { return emitted_; }

  // The length of `s`'s prefix that no later byte can change: `s` minus a trailing incomplete
  // UTF-8 sequence and minus trailing U+FFFD characters.
  static size_t stable_prefix(const std::string& s);

 private:
  const Tokenizer* tok_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  std::string emitted_;
  size_t prefix_ = 0, read_ = 0;  // the window: ids_[prefix_ ..]; its text up to read_ is out
  std::string base_;              // decode(ids_[prefix_, read_))
  size_t extra_ = 0;              // bytes out past base_ in this window
};

// Stop strings over streamed text: push() returns the text that can be emitted (nothing that
// could be the start of a stop string is released until the next text decides it); once a stop
// string occurs, push() returns the text before it, stopped() turns true and the stop string and
// everything after it are dropped. finish() releases the held-back tail when generation ended
// without a stop. With no stop strings it passes text straight through.
class StopFilter {
 public:
  explicit StopFilter(std::vector<std::string> stops = {});  // empty strings are ignored
  std::string push(const std::string& text);
  std::string finish();
  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }  // the stop string found ("" if none)

 private:
  std::vector<std::string> stops_;
  std::string pending_;  // received, not released: could be the start of a stop string
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace kakeya

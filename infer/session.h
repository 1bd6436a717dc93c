// A decode session: one conversation held in one decoder's caches between calls. Each
// send() feeds only the new tokens (a user turn) after everything the session already holds
// (earlier prompts and the tokens it generated) and decodes after them: nothing is prefilled
// twice. The server keeps one per worker and reuses it when a request extends the previous
// conversation (infer/server.h).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "infer/decoder.h"

namespace kakeya {

class Session {
 public:
  // drafter/ftheta as the mode needs them (infer/decoder.h); capacity: the most positions the
  // conversation may reach (every turn + every generated token).
  Session(const Model& verifier, const Drafter* drafter, const FTheta* ftheta, const DecodeOptions& opt,
          int64_t capacity);
  // Appends `tokens` to the conversation and decodes up to opt.max_new_tokens after them
  // (result.tokens: this turn's generated tokens). Throws, leaving the session empty, when the
  // conversation would exceed the capacity or the options differ from the session's fixed ones.
  DecodeResult send(const std::vector<int64_t>& tokens, const DecodeOptions& opt);
  void reset();                                                   // a new conversation; caches stay allocated
  const std::vector<int64_t>& history() const { return history_; }  // every token so far: fed and generated
  int64_t capacity() const { return decoder_->capacity(); }
  const DecodeOptions& options() const { return decoder_->options(); }
  MemoryReport memory() const { return decoder_->memory(); }

 private:
  std::unique_ptr<Decoder> decoder_;
  std::vector<int64_t> history_;
};

}  // namespace kakeya

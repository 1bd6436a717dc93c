// One interface every decode mode implements, kept across calls as a server keeps it across
// requests: a Decoder is built for its options and a capacity (the most positions one
// conversation reaches), allocates its caches and static buffers once, captures its CUDA
// graphs on the first greedy run and replays them in every later one.
//   ar                  ArDecoder (infer/generate.h): the full-KV oracle
//   restored            RestoredDecoder (infer/restored.h), `--full-attn codec` included
//   restored-reforward  ReforwardDecoder (infer/restored.h): the slow reference, keeps nothing
//   fused               FusedDecoder (infer/fused.h): restored + speculative blocks
// run() starts a conversation; extend() continues it, feeding only the new tokens after what
// the caches hold (infer/session.h keeps the token history around it). decode() is a Decoder
// used once.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "infer/memory.h"
#include "infer/options.h"
#include "infer/result.h"

namespace kakeya {

class Decoder {
 public:
  virtual ~Decoder() = default;
  Decoder(const Decoder&) = delete;  // the decode loops' functions hold `this`
  Decoder& operator=(const Decoder&) = delete;
  // A new conversation: forgets what the caches hold, feeds `prompt`, decodes after it.
  DecodeResult run(const std::vector<int64_t>& prompt, const DecodeOptions& opt) { return feed(prompt, opt, true); }
  // Continues the conversation: feeds `tokens` at the positions after the ones the caches hold
  // and decodes after them. The previous call's last generated token was not fed yet: it comes
  // first in `tokens`. Only where extends(); the caller reads every token of the previous call
  // (DecodeOptions::reads_each_token), so nothing past its end went through the verifier.
  DecodeResult extend(const std::vector<int64_t>& tokens, const DecodeOptions& opt) { return feed(tokens, opt, false); }
  virtual bool extends() const { return true; }  // false: every call starts over (the reforward reference)
  virtual int64_t capacity() const = 0;           // positions one conversation may reach
  virtual int64_t length() const = 0;             // positions the caches hold now
  virtual MemoryReport memory() const = 0;        // what the caches hold, at capacity
  const DecodeOptions& options() const { return opt_; }

 protected:
  explicit Decoder(const DecodeOptions& opt) : opt_(opt) {}
  // fresh: clear the caches first (run); otherwise continue after length() (extend).
  virtual DecodeResult feed(const std::vector<int64_t>& tokens, const DecodeOptions& opt, bool fresh) = 0;
  // The options the caches and graphs depend on must match the built ones, tokens must be
  // given, and length() + tokens + new tokens must fit: throws naming what differs.
  void check_call(const char* who, int64_t n_tokens, const DecodeOptions& opt, bool fresh) const;
  DecodeOptions opt_;
};

// The decoder of opt.mode. drafter/ftheta: required by the restored modes unless a = 1 or
// evict-only; fused drafts with the drafter. capacity: prompt + new tokens of the longest
// conversation. Throws on bad input with the flag at fault.
std::unique_ptr<Decoder> make_decoder(const Model& verifier, const Drafter* drafter, const FTheta* ftheta,
                                      const DecodeOptions& opt, int64_t capacity);

// The checks decode() runs before anything is allocated (validate_restore / validate_fused,
// the model's position limit): throws on bad input with the flag and value at fault.
void decode_checks(const Model& verifier, const Drafter* drafter, const FTheta* ftheta,
                   const std::vector<int64_t>& prompt, const DecodeOptions& opt);

// One decode: a decoder for prompt + new tokens, used once.
DecodeResult decode(const Model& verifier, const Drafter* drafter, const FTheta* ftheta,
                    const std::vector<int64_t>& prompt, const DecodeOptions& opt);

}  // namespace kakeya

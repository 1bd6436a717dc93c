#include "infer/session.h"

#include "core/error.h"

namespace kakeya {

Session::Session(const Model& v, const Drafter* d, const FTheta* f, const DecodeOptions& opt, int64_t capacity)
    : decoder_(make_decoder(v, d, f, opt, capacity)) {}

void Session::reset() { history_.clear(); }

DecodeResult Session::send(const std::vector<int64_t>& tokens, const DecodeOptions& opt) {
  KAKEYA_CHECK(!tokens.empty(), "session: nothing to send (the tokenizer produced no tokens)");
  // Every token is read as it comes, so the caches never run past the last one kept: the
  // next turn continues exactly where this one ended.
  DecodeOptions o = opt;
  o.stream = true;
  std::vector<int64_t> feed;
  const bool fresh = history_.empty() || !decoder_->extends();
  if (fresh) {
    feed = history_;  // a decoder that keeps nothing is fed the whole conversation again
  } else {
    feed.push_back(history_.back());  // generated last turn, not fed yet
  }
  feed.insert(feed.end(), tokens.begin(), tokens.end());
  DecodeResult r;
  try {
    r = fresh ? decoder_->run(feed, o) : decoder_->extend(feed, o);
  } catch (...) {
    history_.clear();  // the caches may hold part of a failed call
    throw;
  }
  history_.insert(history_.end(), tokens.begin(), tokens.end());
  history_.insert(history_.end(), r.tokens.begin(), r.tokens.end());
  return r;
}

}  // namespace kakeya

#include "core/io/text_stream.h"

#include <algorithm>

#include "core/io/tokenizer.h"

namespace kakeya {

namespace {

const std::string kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Bytes a UTF-8 sequence starting with `lead` has (1 for ASCII and for bytes that start none).
size_t sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;  // a continuation byte or an invalid lead: nothing more will complete it
}

}  // namespace

size_t TextStream::stable_prefix(const std::string& s) {
  size_t n = s.size();
  for (;;) {
    const size_t before = n;
    // A trailing incomplete sequence: back over up to 3 continuation bytes to its lead byte.
    size_t i = n, cont = 0;
    while (i > 0 && cont < 3 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) {
      --i;
      ++cont;
    }
    if (i > 0) {
      const size_t lead = i - 1;
      const size_t len = sequence_length(static_cast<unsigned char>(s[lead]));
      if (len > 1 && lead + len > n) n = lead;
    }
    while (n >= 3 && s.compare(n - 3, 3, kReplacement) == 0) n -= 3;
    if (n == before) return n;
  }
}

TextStream::TextStream(const Tokenizer& tok, bool skip_special) : tok_(&tok), skip_special_(skip_special) {}

std::string TextStream::push(int64_t token) {
  ids_.push_back(static_cast<int32_t>(token));
  const std::string text = tok_->decode(std::vector<int32_t>(ids_.begin() + prefix_, ids_.end()), skip_special_);
  // Earlier text changed (a decoder that rewrites its past): wait; finish() settles it.
  if (text.compare(0, base_.size(), base_) != 0) return "";
  const size_t start = base_.size() + extra_, stable = stable_prefix(text);
  std::string out;
  if (stable > start) {
    out = text.substr(start, stable - start);
    extra_ += out.size();
    emitted_ += out;
  }
  if (stable == text.size()) {
    // Everything decoded is out: the next window starts at the tokens of this push, whose text
    // (decoded from there, so with the same start as every later decode of the window) is out.
    prefix_ = read_;
    read_ = ids_.size();
    base_ = tok_->decode(std::vector<int32_t>(ids_.begin() + prefix_, ids_.end()), skip_special_);
    extra_ = 0;
  }
  return out;
}

std::string TextStream::finish() {
  const std::string text = tok_->decode(ids_, skip_special_);
  size_t common = 0;
  while (common < text.size() && common < emitted_.size() && text[common] == emitted_[common]) ++common;
  // common < emitted_.size() only when the decoder rewrote emitted text; nothing can take it back.
  std::string out = text.substr(common);
  emitted_ = text;
  return out;
}

void TextStream::reset() {
  ids_.clear();
  emitted_.clear();
  base_.clear();
  prefix_ = read_ = extra_ = 0;
}

StopFilter::StopFilter(std::vector<std::string> stops) {
  for (auto& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

std::string StopFilter::push(const std::string& text) {
  if (stopped_) return "";
  pending_ += text;
  if (stops_.empty()) {
    std::string out;
    out.swap(pending_);
    return out;
  }
  // The earliest occurrence of any stop string ends the text there.
  size_t best = std::string::npos;
  for (const auto& s : stops_) {
    const size_t at = pending_.find(s);
    if (at != std::string::npos && (best == std::string::npos || at < best)) {
      best = at;
      matched_ = s;
    }
  }
  if (best != std::string::npos) {
    std::string out = pending_.substr(0, best);
    pending_.clear();
    stopped_ = true;
    return out;
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const auto& s : stops_) {
    for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k) {
      if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopFilter::finish() {
  std::string out;
  if (!stopped_) out.swap(pending_);
  return out;
}

}  // namespace kakeya

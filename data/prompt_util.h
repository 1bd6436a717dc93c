// Pieces the synthetic prompt generators (data/niah.h, data/longeval.h) share.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/io/tokenizer.h"

namespace kakeya::data {

// splitmix64: a portable generator (std distributions differ between standard libraries), so a
// seed gives the same prompt everywhere.
struct SplitMix64 {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return next() % n; }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }
};

// A prompt piece encoded on its own (no special tokens): prompts are concatenations of pieces,
// so their length in tokens is known exactly.
inline std::vector<int64_t> encode_piece(const Tokenizer& tok, const std::string& s) {
  auto ids = tok.encode(s, false);
  return std::vector<int64_t>(ids.begin(), ids.end());
}

}  // namespace kakeya::data

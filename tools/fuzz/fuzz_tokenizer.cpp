// libFuzzer target for the tokenizer.json reader. The input is a
// tokenizer.json, optionally followed by a NUL byte and a text to encode (a
// fixed sample is used otherwise). Loading may throw kakeya::Error; once a
// file loads, encoding and decoding anything must work or throw kakeya::Error,
// and every id the model produces must name a vocabulary entry. Crashes,
// sanitizer reports, hangs, other exceptions and broken promises (trap) are bugs.
// FUZZ_SOURCES: core/io/tokenizer.cpp
#include "core/error.h"
#include "core/io/tokenizer.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

const char* const kSamples[] = {"Hello world, it's 2024!", "  tabs\tand\nnewlines\r\n", "日本語 😀 e\u0301 \xff",
                                "<s>special</s> <|endoftext|> [MASK]", ""};

void exercise(const kakeya::Tokenizer& tok, const std::string& text) {
  const std::vector<int32_t> ids = tok.encode(text, false);
  for (int32_t id : ids) {
    if (id < 0 || id >= tok.vocab_size()) __builtin_trap();
    try {
      tok.token(id);
    } catch (const kakeya::Error&) {
      __builtin_trap();  // encode produced an id with no vocabulary entry
    }
  }
  tok.decode(ids, false);
  tok.decode(ids, true);
  tok.decode(tok.encode(text, true), true);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  std::optional<kakeya::Tokenizer> tok;
  try {
    tok.emplace(kakeya::Tokenizer::from_json_string(input.substr(0, nul), "fuzz.json"));
    if (nul != std::string::npos) {
      exercise(*tok, input.substr(nul + 1, 512));
    } else {
      for (const char* s : kSamples) exercise(*tok, s);
    }
    // Arbitrary ids, unknown ones included.
    std::vector<int32_t> ids;
    for (size_t i = 0; i + 1 < size && ids.size() < 32; i += 2)
      ids.push_back(static_cast<int32_t>((data[i] << 8 | data[i + 1]) % (tok->vocab_size() + 3)) - 1);
    tok->decode(ids, false);
    tok->decode(ids, true);
    tok->token_id("a");
  } catch (const kakeya::Error&) {
    // Bad files and inputs (e.g. Unigram without unk_id, regex budget) end here.
  }
  return 0;
}

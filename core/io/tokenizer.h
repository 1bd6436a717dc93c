// Native reader of HF tokenizer.json. Supported models: BPE (with byte
// fallback and the SentencePiece "▁" normalizer/pre-tokenizer, as Gemma uses),
// byte-level BPE (GPT-2 / Qwen2 / Llama-3 pre-tokenizer regexes), and Unigram.
// Added/special tokens are matched before the model runs. Parity with the
// `tokenizers` package is tested in tests/test_tokenizer.cpp; core/io/tokenizer.cpp
// lists the supported normalizers, pre-tokenizers, post-processors and decoders.
// Text that is not valid UTF-8 is encoded as if each ill-formed sequence were
// U+FFFD. truncation/padding settings in the file are ignored.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kakeya {

class Tokenizer {
 public:
  // Parses `path` (a tokenizer.json). Throws kakeya::Error naming the file and
  // the JSON field on anything unsupported or malformed.
  static Tokenizer from_file(const std::string& path);
  static Tokenizer from_json_string(const std::string& json, const std::string& origin);

  // add_special: apply the post-processor's template (e.g. prepend BOS), as
  // `tokenizers`' encode(text, add_special_tokens=True) does.
  std::vector<int32_t> encode(const std::string& text, bool add_special = true) const;
  // skip_special: drop special added tokens, as decode(ids, skip_special_tokens=True).
  // Streaming callers decode the whole prefix and emit the difference: a
  // token alone may be part of a UTF-8 character or lose a leading space.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  // One past the largest id of the model or an added token.
  int64_t vocab_size() const;
  int32_t token_id(const std::string& token) const;  // -1 if absent
  // Throws kakeya::Error for an id that names no token.
  const std::string& token(int32_t id) const;
  // BOS: the first id the post-processor's single-sequence template puts
  // before the text (-1 if none). EOS: the first of "<eos>", "<|endoftext|>",
  // "<|im_end|>", "</s>" that is a token (-1 if none); at the model level the
  // config.json eos_token_id is the authority.
  int32_t bos_id() const;
  int32_t eos_id() const;

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kakeya

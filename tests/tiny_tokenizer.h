// A tiny byte-fallback BPE tokenizer.json (the Gemma scheme in miniature) for tests of the
// tokenizer and of what decodes through it: "▁" for spaces, byte tokens for every UTF-8 byte
// the tests use (é, 日, 😀, U+FFFD).
#pragma once

namespace kakeya::test {

// ids: <unk> 0, a 1, b 2, ab 3, ▁ 4, <s> 5 (special), then byte tokens.
inline const char* const kTinyBpe = R"({
  "version": "1.0",
  "added_tokens": [{"id": 5, "content": "<s>", "special": true, "normalized": false}],
  "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
  "pre_tokenizer": null,
  "post_processor": {"type": "TemplateProcessing",
                     "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                     "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [5], "tokens": ["<s>"]}}},
  "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                                               {"type": "ByteFallback"}, {"type": "Fuse"}]},
  "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": true, "fuse_unk": true,
            "vocab": {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "▁": 4, "<s>": 5,
                      "<0xC3>": 6, "<0xA9>": 7, "<0xE6>": 8, "<0x97>": 9, "<0xA5>": 10,
                      "<0xF0>": 11, "<0x9F>": 12, "<0x98>": 13, "<0x80>": 14,
                      "<0xEF>": 15, "<0xBF>": 16, "<0xBD>": 17},
            "merges": [["a", "b"]]}
})";
enum : int64_t { A = 1, B = 2, AB = 3, SP = 4, BOS = 5, C3 = 6, A9 = 7, E6 = 8, X97 = 9, A5 = 10,
                 F0 = 11, X9F = 12, X98 = 13, X80 = 14, EF = 15, BF = 16, BD = 17 };

}  // namespace kakeya::test

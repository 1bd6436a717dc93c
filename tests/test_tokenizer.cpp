// Parity of kakeya::Tokenizer with the `tokenizers` package on the fixtures of
// tests/fixtures/make_tokenizer_fixtures.py, plus the real Gemma tokenizer and
// error handling on bad tokenizer.json files.
#include "core/io/tokenizer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "core/error.h"
#include "tests/tiny_tokenizer.h"

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;
using kakeya::Tokenizer;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  if (!v) ADD_FAILURE() << name << " is not set: run the tests through ctest";
  return v ? v : "";
}

std::string fixtures() { return env("KAKEYA_FIXTURES") + "/tokenizers"; }

json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open " + path);
  return json::parse(f);
}

std::string show(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20) out += "\\x" + std::string(1, "0123456789abcdef"[c >> 4]) + "0123456789abcdef"[c & 15];
    else out += static_cast<char>(c);
    if (out.size() > 120) return out + "...";
  }
  return out;
}

// Compares everything a cases file holds; returns the number of strings compared.
size_t check_parity(const std::string& name, const std::string& tokenizer_path) {
  const json fx = read_json(fixtures() + "/" + name + ".cases.json");
  const Tokenizer tok = Tokenizer::from_file(tokenizer_path);
  size_t compared = 0, mismatches = 0;
  const auto fail = [&](const std::string& what) {
    if (++mismatches <= 10) ADD_FAILURE() << name << ": " << what;
  };
  for (const json& c : fx["cases"]) {
    const std::string text = c["text"];
    ++compared;
    if (c.contains("error")) {
      try {
        tok.encode(text, false);
        fail("'" + show(text) + "': tokenizers raised (" + c["error"].get<std::string>() + "), kakeya did not");
      } catch (const kakeya::Error&) {
      }
      continue;
    }
    const auto ids = tok.encode(text, false);
    const auto ids_special = tok.encode(text, true);
    if (ids != c["ids"].get<std::vector<int32_t>>()) fail("encode('" + show(text) + "') differs");
    if (ids_special != c["ids_special"].get<std::vector<int32_t>>())
      fail("encode('" + show(text) + "', add_special) differs");
    const auto expected_ids = c["ids_special"].get<std::vector<int32_t>>();
    if (tok.decode(expected_ids, false) != c["decode"].get<std::string>())
      fail("decode of '" + show(text) + "' gives '" + show(tok.decode(expected_ids, false)) + "', expected '" +
           show(c["decode"]) + "'");
    if (tok.decode(expected_ids, true) != c["decode_skip"].get<std::string>())
      fail("decode(skip_special) of '" + show(text) + "' gives '" + show(tok.decode(expected_ids, true)) +
           "', expected '" + show(c["decode_skip"]) + "'");
  }
  for (const json& d : fx["decode_cases"]) {
    const auto ids = d["ids"].get<std::vector<int32_t>>();
    if (tok.decode(ids, false) != d["text"].get<std::string>()) fail("decode of random ids " + d["ids"].dump());
    if (tok.decode(ids, true) != d["text_skip"].get<std::string>())
      fail("decode(skip_special) of random ids " + d["ids"].dump());
  }
  for (const json& t : fx["tokens"]) {
    const int32_t id = t["id"];
    if (tok.token(id) != t["token"].get<std::string>()) fail("token(" + std::to_string(id) + ")");
    if (tok.token_id(t["token"]) != t["token_to_id"].get<int32_t>()) fail("token_id('" + show(t["token"]) + "')");
  }
  EXPECT_EQ(tok.vocab_size(), fx["vocab_size"].get<int64_t>()) << name;
  EXPECT_EQ(tok.bos_id(), fx["bos_id"].get<int32_t>()) << name;
  EXPECT_EQ(tok.eos_id(), fx["eos_id"].get<int32_t>()) << name;
  if (fx.contains("big")) {
    const std::string text = fx["big"]["text"];
    const auto t0 = std::chrono::steady_clock::now();
    const auto ids = tok.encode(text, false);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++compared;
    if (ids != fx["big"]["ids"].get<std::vector<int32_t>>()) fail("encode of the 1 MB text differs");
    EXPECT_LT(s, 5.0) << name << ": encoding " << text.size() << " bytes took " << s << " s";
    std::cout << "[ parity   ] " << name << ": " << text.size() << " bytes -> " << ids.size() << " ids in " << s
              << " s\n";
  }
  EXPECT_EQ(mismatches, 0u) << name << ": " << mismatches << " mismatches in " << compared << " strings";
  std::cout << "[ parity   ] " << name << ": " << compared << " strings, " << fx["decode_cases"].size()
            << " id lists, " << fx["tokens"].size() << " vocab lookups compared\n";
  return compared;
}

class TokenizerParity : public ::testing::TestWithParam<const char*> {};

TEST_P(TokenizerParity, MatchesTokenizersPackage) {
  const std::string name = GetParam();
  EXPECT_GT(check_parity(name, fixtures() + "/" + name + ".json"), 300u);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TokenizerParity,
                         ::testing::Values("qwen2_bpe", "llama3_bpe", "llama3_bpe_string_merges", "gpt2_bpe",
                                           "o200k_bpe", "spm_bpe", "spm_bpe_unk", "spm_metaspace", "bpe_affixes",
                                           "unigram", "unigram_nfd", "unigram_bytes"),
                         [](const auto& info) { return std::string(info.param); });

// The embedded default model's tokenizer. CI fetches the model first, so a
// missing file is a failure, never a skip.
TEST(TokenizerGemma, MatchesTokenizersPackage) {
  const std::string path = env("KAKEYA_MODEL_DIR") + "/tokenizer.json";
  ASSERT_TRUE(fs::exists(path)) << path << " is missing: run `make model` first";
  ASSERT_TRUE(fs::exists(fixtures() + "/gemma.cases.json"))
      << "no Gemma fixture: the fixture step did not see " << path;
  EXPECT_GT(check_parity("gemma", path), 300u);
}

TEST(TokenizerGemma, SpecialIds) {
  const std::string path = env("KAKEYA_MODEL_DIR") + "/tokenizer.json";
  ASSERT_TRUE(fs::exists(path)) << path << " is missing: run `make model` first";
  const Tokenizer tok = Tokenizer::from_file(path);
  EXPECT_EQ(tok.vocab_size(), 262144);
  EXPECT_EQ(tok.bos_id(), 2);
  EXPECT_EQ(tok.eos_id(), 1);
  EXPECT_EQ(tok.token(2), "<bos>");
  EXPECT_EQ(tok.encode("Hello world", true), (std::vector<int32_t>{2, 9259, 1902}));
  EXPECT_EQ(tok.decode({2, 9259, 1902}, true), "Hello world");
}

// ---------------------------------------------------------------------------
// Behaviour the fixtures cannot express (Python strings are valid Unicode).

using namespace kakeya::test;

TEST(TokenizerBasics, InvalidUtf8InputIsReplacedLikeLossyDecoding) {
  const Tokenizer tok = Tokenizer::from_json_string(kTinyBpe, "tiny.json");
  EXPECT_EQ(tok.encode("ab", false), (std::vector<int32_t>{3}));
  // Each maximal ill-formed subsequence becomes one U+FFFD (EF BF BD).
  const std::vector<int32_t> fffd{EF, BF, BD};
  EXPECT_EQ(tok.encode("\xff", false), fffd);
  EXPECT_EQ(tok.encode("\xe6\x97", false), fffd);  // truncated 3-byte sequence
  std::vector<int32_t> two = fffd;
  two.insert(two.end(), fffd.begin(), fffd.end());
  EXPECT_EQ(tok.encode("\xc0\xaf", false), two);  // overlong: two bad bytes
  EXPECT_EQ(tok.decode({EF, BF, BD}, false), "\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode({EF}, false), "\xEF\xBF\xBD");  // lone byte token
  EXPECT_EQ(tok.decode({999, -1, 1}, false), "a");    // unknown ids are dropped
}

TEST(TokenizerBasics, Lookups) {
  const Tokenizer tok = Tokenizer::from_json_string(kTinyBpe, "tiny.json");
  EXPECT_EQ(tok.token_id("ab"), 3);
  EXPECT_EQ(tok.token_id("zz"), -1);
  EXPECT_EQ(tok.token(3), "ab");
  EXPECT_THROW(tok.token(100), kakeya::Error);
  EXPECT_THROW(tok.token(-1), kakeya::Error);
  EXPECT_EQ(tok.bos_id(), 5);
  EXPECT_EQ(tok.eos_id(), -1);
  EXPECT_EQ(tok.vocab_size(), 18);
  EXPECT_EQ(tok.encode("ab ab", true), (std::vector<int32_t>{5, 3, 4, 3}));
  EXPECT_EQ(tok.decode({5, 3, 4, 3}, true), "ab ab");
  EXPECT_EQ(tok.decode({5, 3, 4, 3}, false), "<s>ab ab");
}

// Writes `text` to a fresh file and expects loading it to fail with a message
// naming the file and `field`.
void expect_load_error(const std::string& text, const std::string& field) {
  const fs::path dir = fs::temp_directory_path() / ("kakeya_tok_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "tokenizer.json").string();
  std::ofstream(path) << text;
  try {
    Tokenizer::from_file(path);
    ADD_FAILURE() << "no error for " << field;
  } catch (const kakeya::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(field), std::string::npos) << "expected '" << field << "' in: " << msg;
  }
  fs::remove_all(dir);
}

std::string tiny_with(const std::string& key, const std::string& value) {
  json j = json::parse(kTinyBpe);
  j[key] = json::parse(value);
  return j.dump();
}

TEST(TokenizerErrors, LoadErrorsNameFileAndField) {
  expect_load_error("{\"model\": ", "malformed JSON");
  expect_load_error("[]", "must be a JSON object");
  expect_load_error("{\"version\": \"1.0\"}", "model is missing");
  expect_load_error(tiny_with("model", R"({"type": "WordPiece", "vocab": {}})"),
                    "model.type 'WordPiece' is not supported (expected BPE or Unigram)");
  expect_load_error(tiny_with("model", R"({"type": "BPE", "merges": []})"), "model.vocab is missing");
  expect_load_error(tiny_with("model", R"({"type": "BPE", "vocab": {"a": -1}, "merges": []})"), "model.vocab['a']");
  expect_load_error(tiny_with("model", R"({"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]})"),
                    "model.merges[0] token 'b' is not in model.vocab");
  expect_load_error(tiny_with("model", R"({"type": "BPE", "vocab": {"a": 0}, "merges": ["a a a"]})"),
                    "model.merges[0]");
  expect_load_error(tiny_with("model", R"({"type": "BPE", "vocab": {"a": 0}, "merges": [], "dropout": 0.1})"),
                    "model.dropout");
  expect_load_error(tiny_with("model", R"({"type": "Unigram", "vocab": [["a", -1.0]], "unk_id": 3})"),
                    "model.unk_id");
  expect_load_error(tiny_with("model", R"({"type": "Unigram", "vocab": [["a"]]})"), "model.vocab[0]");
  expect_load_error(tiny_with("normalizer", R"({"type": "NFKC"})"), "normalizer.type 'NFKC' is not supported");
  expect_load_error(tiny_with("normalizer", R"({"type": "Sequence", "normalizers": [{"type": "Lowercase"}]})"),
                    "normalizer.normalizers[0].type 'Lowercase'");
  expect_load_error(tiny_with("pre_tokenizer", R"({"type": "BertPreTokenizer"})"),
                    "pre_tokenizer.type 'BertPreTokenizer' is not supported");
  expect_load_error(tiny_with("pre_tokenizer", R"({"type": "Split", "pattern": {"Regex": "\\p{Han}+"},
                                                   "behavior": "Isolated", "invert": false})"),
                    "pre_tokenizer.pattern.Regex");
  expect_load_error(tiny_with("pre_tokenizer", R"({"type": "Split", "pattern": {"Regex": "(a"},
                                                   "behavior": "Isolated", "invert": false})"),
                    "pre_tokenizer.pattern.Regex");
  expect_load_error(tiny_with("pre_tokenizer", R"({"type": "Split", "pattern": {"String": " "},
                                                   "behavior": "Sideways", "invert": false})"),
                    "pre_tokenizer.behavior");
  expect_load_error(tiny_with("pre_tokenizer", R"({"type": "Metaspace", "replacement": "ab"})"),
                    "pre_tokenizer.replacement");
  expect_load_error(tiny_with("post_processor", R"({"type": "TemplateProcessing", "special_tokens": {},
                                                    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}]})"),
                    "post_processor.single[0].SpecialToken.id");
  expect_load_error(tiny_with("decoder", R"({"type": "CTC"})"), "decoder.type 'CTC' is not supported");
  expect_load_error(tiny_with("added_tokens", R"([{"id": 1}])"), "added_tokens[0].content is missing");
  std::string deep = R"({"type": "Fuse"})";
  for (int i = 0; i < 100; ++i) deep = R"({"type": "Sequence", "decoders": [)" + deep + "]}";
  expect_load_error(tiny_with("decoder", deep), "nests Sequences too deeply");
}

TEST(TokenizerErrors, MissingFileIsAnError) {
  EXPECT_THROW(Tokenizer::from_file("/nonexistent/tokenizer.json"), kakeya::Error);
}

TEST(TokenizerErrors, UnigramWithoutUnkFailsCleanly) {
  const Tokenizer tok = Tokenizer::from_json_string(
      R"({"model": {"type": "Unigram", "vocab": [["a", -1.0], ["b", -2.0]]}})", "uni.json");
  EXPECT_EQ(tok.encode("ab", false), (std::vector<int32_t>{0, 1}));
  EXPECT_THROW(tok.encode("abc", false), kakeya::Error);
}

TEST(TokenizerErrors, ExponentialRegexIsAnErrorNotAHang) {
  const std::string j = tiny_with("pre_tokenizer", R"({"type": "Split", "pattern": {"Regex": "(?:a|a)*b"},
                                                        "behavior": "Isolated", "invert": false})");
  const Tokenizer tok = Tokenizer::from_json_string(j, "evil.json");
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(tok.encode(std::string(64, 'a'), false), kakeya::Error);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
}

}  // namespace

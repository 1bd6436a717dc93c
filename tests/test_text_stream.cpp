// Incremental detokenization (core/io/text_stream.h): pieces are valid UTF-8 as they come,
// multi-byte characters split over byte-fallback tokens are held back until complete, and the
// pieces add up to decode(all). A tiny byte-fallback BPE written here, and the real Gemma
// tokenizer ($KAKEYA_MODEL_DIR, as test_tokenizer does) on text whose rare characters it
// spells with byte tokens. StopFilter: stop strings across pieces, held-back prefixes.
#include "core/io/text_stream.h"
#include "tests/tiny_tokenizer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/io/tokenizer.h"

namespace {

using kakeya::StopFilter;
using kakeya::TextStream;
using namespace kakeya::test;
using kakeya::Tokenizer;
namespace fs = std::filesystem;


bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = s[i];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

// Pushes every id; checks each piece is valid UTF-8 and that pieces + finish == decode(ids).
std::vector<std::string> stream_all(const Tokenizer& tok, const std::vector<int64_t>& ids) {
  TextStream ts(tok);
  std::vector<std::string> pieces;
  std::string joined;
  for (int64_t id : ids) {
    pieces.push_back(ts.push(id));
    EXPECT_TRUE(valid_utf8(pieces.back())) << "piece " << pieces.size() - 1 << " is not valid UTF-8";
    joined += pieces.back();
  }
  pieces.push_back(ts.finish());
  joined += pieces.back();
  const std::vector<int32_t> ids32(ids.begin(), ids.end());
  EXPECT_EQ(joined, tok.decode(ids32, true));
  EXPECT_EQ(ts.emitted(), tok.decode(ids32, true));
  return pieces;
}

TEST(TextStream, SplitTwoByteCharacterIsHeldBack) {
  const Tokenizer tok = Tokenizer::from_json_string(kTinyBpe, "tiny.json");
  const auto p = stream_all(tok, {A, C3, A9, B});
  EXPECT_EQ(p, (std::vector<std::string>{"a", "", "\xC3\xA9", "b", ""}));
}

TEST(TextStream, SplitThreeAndFourByteCharacters) {
  const Tokenizer tok = Tokenizer::from_json_string(kTinyBpe, "tiny.json");
  // 日 = E6 97 A5, 😀 = F0 9F 98 80
  const auto p = stream_all(tok, {E6, X97, A5, SP, F0, X9F, X98, X80, AB});
  EXPECT_EQ(p, (std::vector<std::string>{"", "", "\xE6\x97\xA5", " ", "", "", "", "\xF0\x9F\x98\x80", "ab", ""}));
}

TEST(TextStream, SpecialTokensAreSkipped) {
  const Tokenizer tok = Tokenizer::from_json_string(kTinyBpe, "tiny.json");
  const auto p = stream_all(tok, {BOS, A, SP, B});
  EXPECT_EQ(p, (std::vector<std::string>{"", "a", " ", "b", ""}));
}

TEST(TextStream, IllFormedBytesComeOutAsReplacementOnceDecided) {
  const Tokenizer tok = Tokenizer::from_json_string(kTinyBpe, "tiny.json");
  // A lone lead byte followed by ASCII: one U+FFFD, released with the ASCII after it.
  auto p = stream_all(tok, {C3, A});
  EXPECT_EQ(p[0], "");
  EXPECT_EQ(p[1] + p[2], tok.decode({C3, A}, true));
  // An incomplete sequence at the very end comes out of finish().
  p = stream_all(tok, {A, E6, X97});
  EXPECT_EQ(p[0], "a");
  EXPECT_EQ(p[1] + p[2], "");
  EXPECT_EQ(p[3], tok.decode({E6, X97}, true));
  // A real U+FFFD (EF BF BD) is held until something follows it or the stream ends.
  p = stream_all(tok, {EF, BF, BD});
  EXPECT_EQ(p[3], "\xEF\xBF\xBD");
  p = stream_all(tok, {EF, BF, BD, B});
  EXPECT_EQ(p[3], "\xEF\xBF\xBD" "b");
}

TEST(TextStream, StablePrefix) {
  EXPECT_EQ(TextStream::stable_prefix(""), 0u);
  EXPECT_EQ(TextStream::stable_prefix("ab"), 2u);
  EXPECT_EQ(TextStream::stable_prefix("a\xC3"), 1u);
  EXPECT_EQ(TextStream::stable_prefix("a\xC3\xA9"), 3u);
  EXPECT_EQ(TextStream::stable_prefix("a\xF0\x9F\x98"), 1u);
  EXPECT_EQ(TextStream::stable_prefix("a\xEF\xBF\xBD\xEF\xBF\xBD"), 1u);
  EXPECT_EQ(TextStream::stable_prefix("a\xEF\xBF\xBD\xE6\x97"), 1u);
  EXPECT_EQ(TextStream::stable_prefix("a\xEF\xBF\xBD" "b"), 5u);
}

TEST(TextStream, ResetStartsOver) {
  const Tokenizer tok = Tokenizer::from_json_string(kTinyBpe, "tiny.json");
  TextStream ts(tok);
  EXPECT_EQ(ts.push(A), "a");
  ts.reset();
  EXPECT_TRUE(ts.tokens().empty());
  EXPECT_EQ(ts.push(B), "b");
  EXPECT_EQ(ts.emitted(), "b");
}

// The embedded default model's tokenizer (CI fetches the model first: a missing file fails).
TEST(TextStreamGemma, MultiByteCharactersSplitAcrossTokens) {
  const char* dir = std::getenv("KAKEYA_MODEL_DIR");
  ASSERT_NE(dir, nullptr) << "KAKEYA_MODEL_DIR is not set: run the tests through ctest";
  const std::string path = std::string(dir) + "/tokenizer.json";
  ASSERT_TRUE(fs::exists(path)) << path << " is missing: run `make model` first";
  const Tokenizer tok = Tokenizer::from_file(path);
  // 𝔘, ꙮ, 𓀀 and ǅ have no piece of their own: Gemma spells them with byte tokens.
  const std::string text = "héllo wörld 日本語 😀🦄 𝔘𝔫𝔦 ꙮ 𓀀 ǅ\n\tdone: «ok» — 100%";
  const auto ids32 = tok.encode(text, true);
  const std::vector<int64_t> ids(ids32.begin(), ids32.end());
  const auto pieces = stream_all(tok, ids);
  size_t held = 0;
  for (size_t i = 0; i + 1 < pieces.size(); ++i) held += pieces[i].empty();
  EXPECT_GE(held, 6u) << "expected byte tokens of split characters to be held back";
  std::string joined;
  for (const auto& p : pieces) joined += p;
  EXPECT_EQ(joined, text);
}

TEST(StopFilter, PassesThroughWithoutStops) {
  StopFilter f;
  EXPECT_EQ(f.push("abc"), "abc");
  EXPECT_EQ(f.push(""), "");
  EXPECT_EQ(f.finish(), "");
  EXPECT_FALSE(f.stopped());
  StopFilter g({""});  // empty stop strings are ignored
  EXPECT_EQ(g.push("x"), "x");
}

TEST(StopFilter, StopAcrossPiecesIsCutAndHeldBack) {
  StopFilter f({"END", "\n\n"});
  EXPECT_EQ(f.push("Hello E"), "Hello ");  // "E" could start "END"
  EXPECT_EQ(f.push("N"), "");
  EXPECT_EQ(f.push("D and more"), "");
  EXPECT_TRUE(f.stopped());
  EXPECT_EQ(f.matched(), "END");
  EXPECT_EQ(f.push("later"), "");
  EXPECT_EQ(f.finish(), "");
}

TEST(StopFilter, HeldPrefixIsReleasedWhenItDoesNotMatch) {
  StopFilter f({"END", "\n\n"});
  EXPECT_EQ(f.push("Hel"), "Hel");
  EXPECT_EQ(f.push("lo\n"), "lo");
  EXPECT_EQ(f.push("x EN"), "\nx ");
  EXPECT_EQ(f.finish(), "EN");
  EXPECT_FALSE(f.stopped());
}

TEST(StopFilter, EarliestStopWins) {
  StopFilter f({"world", "lo"});
  EXPECT_EQ(f.push("hello world"), "hel");
  EXPECT_EQ(f.matched(), "lo");
  StopFilter g({"\n\n"});
  EXPECT_EQ(g.push("a\n"), "a");
  EXPECT_EQ(g.push("\nb"), "");
  EXPECT_TRUE(g.stopped());
  StopFilter h({"abc"});
  EXPECT_EQ(h.push("abc"), "");  // at the very start
  EXPECT_TRUE(h.stopped());
}

TEST(StopFilter, MultiByteStopStrings) {
  StopFilter f({"日本"});
  EXPECT_EQ(f.push("a\xE6\x97\xA5"), "a");
  EXPECT_EQ(f.push("\xE6\x9C\xAC" "b"), "");
  EXPECT_TRUE(f.stopped());
  StopFilter g({"日本"});
  EXPECT_EQ(g.push("a\xE6\x97\xA5"), "a");
  EXPECT_EQ(g.push("x"), "\xE6\x97\xA5x");
}

}  // namespace

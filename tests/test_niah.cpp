// NIAH prompts (data/niah.h) with the real Gemma 3 tokenizer: exact token
// length, needles where they are said to be, train/eval disjointness (seeds,
// keys, needles, haystack text), determinism, the recall scorer and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <set>

#include "core/error.h"
#include "data/niah.h"
#include "tests/test_util.h"

using namespace kakeya;
using namespace kakeya::data;

namespace {

const Tokenizer& tok() {
  static Tokenizer t = Tokenizer::from_file(test::real_model_dir() + "/tokenizer.json");
  return t;
}

NiahOptions opts(NiahSplit split, uint64_t seed, int64_t len, std::vector<double> depths, ChatFormat chat) {
  NiahOptions o;
  o.split = split;
  o.seed = seed;
  o.context_tokens = len;
  o.depths = std::move(depths);
  o.chat = chat;
  o.source_dir = test::env_or_fail("KAKEYA_SOURCE_DIR") + "/data/codec";
  return o;
}

std::string decode(const std::vector<int64_t>& ids, size_t from, size_t to) {
  return tok().decode(std::vector<int32_t>(ids.begin() + from, ids.begin() + to));
}

}  // namespace

TEST(Niah, GemmaTokenizerGetsTheGemmaChatTemplate) { EXPECT_EQ(detect_chat_format(tok()), ChatFormat::Gemma); }

TEST(Niah, ExactLengthAndNeedlePositions) {
  for (auto chat : {ChatFormat::None, ChatFormat::Gemma})
    for (int64_t len : {128, 257, 1000, 4096})
      for (auto depths : std::vector<std::vector<double>>{{0.0}, {0.5}, {1.0}, {0.1, 0.5, 0.9}}) {
        auto s = make_niah(tok(), opts(NiahSplit::Eval, (uint64_t)len, len, depths, chat));
        const std::string what = std::string(chat_format_name(chat)) + " len " + std::to_string(len);
        ASSERT_EQ((int64_t)s.prompt_ids.size(), len) << what;
        EXPECT_EQ(s.prompt_ids[0], tok().bos_id()) << what;
        ASSERT_EQ(s.keys.size(), depths.size());
        ASSERT_EQ(s.answers.size(), depths.size());
        ASSERT_EQ(s.needle_positions.size(), depths.size());
        std::set<std::string> keys(s.keys.begin(), s.keys.end());
        EXPECT_EQ(keys.size(), s.keys.size()) << "keys within a sample are distinct";
        for (size_t i = 0; i < depths.size(); ++i) {
          const int64_t p = s.needle_positions[i];
          ASSERT_GE(p, 0);
          const std::string needle = "The special magic number for " + s.keys[i] + " is " + s.answers[i] + ".";
          EXPECT_EQ(decode(s.prompt_ids, p, std::min(s.prompt_ids.size(), (size_t)p + 40)).rfind(needle, 0), 0u)
              << what << ": needle " << i << " not at " << p;
          EXPECT_EQ(s.answers[i].size(), 7u);
          EXPECT_NE(s.prompt_text.find(needle), std::string::npos);
          const size_t q = s.prompt_text.rfind("Question:");
          ASSERT_NE(q, std::string::npos);
          EXPECT_NE(s.prompt_text.find(s.keys[i], q), std::string::npos) << "the question names every key";
        }
        // Depth order is kept in the haystack (0 before 0.5 before 1).
        if (depths.size() == 3) EXPECT_LT(s.needle_positions[0], s.needle_positions[1]);
        if (depths.size() == 3) EXPECT_LT(s.needle_positions[1], s.needle_positions[2]);
        if (chat == ChatFormat::Gemma) {
          EXPECT_EQ(s.prompt_text.rfind("<bos><start_of_turn>user\n", 0), 0u) << s.prompt_text.substr(0, 60);
          EXPECT_NE(s.prompt_text.find("<end_of_turn>\n<start_of_turn>model\n"), std::string::npos);
        }
      }
  // A needle at depth 0.5 sits near the middle of a long prompt, depth 0 near the start.
  auto mid = make_niah(tok(), opts(NiahSplit::Eval, 7, 4096, {0.5}, ChatFormat::None));
  EXPECT_NEAR((double)mid.needle_positions[0] / 4096, 0.5, 0.05);
  auto start = make_niah(tok(), opts(NiahSplit::Eval, 7, 4096, {0.0}, ChatFormat::None));
  EXPECT_LT(start.needle_positions[0], 40);
}

TEST(Niah, TrainAndEvalAreDisjoint) {
  const std::string dir = test::env_or_fail("KAKEYA_SOURCE_DIR") + "/data/codec";
  std::set<std::string> train_keys, eval_keys, train_needles, eval_needles;
  std::set<uint64_t> train_seeds, eval_seeds;
  // Lines with real text (rules like "=====" and table borders repeat in any document).
  auto prose = [](const std::string& l) {
    return std::count_if(l.begin(), l.end(), [](char c) { return std::isalpha((unsigned char)c); }) >= 40;
  };
  std::set<std::string> eval_lines;
  for (const auto& l : haystack_lines(default_haystack_file(NiahSplit::Eval, dir)))
    if (prose(l)) eval_lines.insert(l);
  std::set<std::string> train_lines;
  for (const auto& l : haystack_lines(default_haystack_file(NiahSplit::Train, dir)))
    if (prose(l)) train_lines.insert(l);
  for (uint64_t i = 0; i < 300; ++i) {
    // The same sample number in both splits: disjointness must not depend on the caller's seeds.
    auto tr = make_niah(tok(), opts(NiahSplit::Train, i, 160, {0.3, 0.7}, ChatFormat::None));
    auto ev = make_niah(tok(), opts(NiahSplit::Eval, i, 160, {0.3, 0.7}, ChatFormat::None));
    train_seeds.insert(tr.rng_seed);
    eval_seeds.insert(ev.rng_seed);
    for (size_t k = 0; k < 2; ++k) {
      train_keys.insert(tr.keys[k]);
      eval_keys.insert(ev.keys[k]);
      train_needles.insert(tr.keys[k] + "=" + tr.answers[k]);
      eval_needles.insert(ev.keys[k] + "=" + ev.answers[k]);
    }
    // Haystack text: no long eval line in a train prompt and vice versa.
    for (const auto& l : eval_lines) ASSERT_EQ(tr.prompt_text.find(l), std::string::npos) << "eval line in train: " << l;
    for (const auto& l : train_lines) ASSERT_EQ(ev.prompt_text.find(l), std::string::npos) << "train line in eval: " << l;
  }
  auto disjoint = [](const auto& a, const auto& b) {
    for (const auto& x : a)
      if (b.count(x)) return false;
    return true;
  };
  EXPECT_TRUE(disjoint(train_seeds, eval_seeds));
  EXPECT_TRUE(disjoint(train_keys, eval_keys));
  EXPECT_TRUE(disjoint(train_needles, eval_needles));
  EXPECT_GT(train_keys.size(), 200u);  // enough variety that the model cannot memorize keys
  EXPECT_GT(eval_keys.size(), 200u);
  EXPECT_FALSE(eval_lines.empty());
  EXPECT_FALSE(train_lines.empty());
}

TEST(Niah, DeterministicPerSeedAndVariedAcrossSeeds) {
  auto a = make_niah(tok(), opts(NiahSplit::Train, 42, 512, {0.4}, ChatFormat::Gemma));
  auto b = make_niah(tok(), opts(NiahSplit::Train, 42, 512, {0.4}, ChatFormat::Gemma));
  auto c = make_niah(tok(), opts(NiahSplit::Train, 43, 512, {0.4}, ChatFormat::Gemma));
  EXPECT_EQ(a.prompt_ids, b.prompt_ids);
  EXPECT_EQ(a.answers, b.answers);
  EXPECT_NE(a.prompt_ids, c.prompt_ids);
}

TEST(Niah, RecallScorer) {
  EXPECT_DOUBLE_EQ(niah_recall({"1234567"}, "The special magic number is 1234567."), 1.0);
  EXPECT_DOUBLE_EQ(niah_recall({"1234567"}, "The special magic number is 1234568."), 0.0);
  EXPECT_DOUBLE_EQ(niah_recall({"1234567", "7654321"}, "1234567 and 765432"), 0.5);
  EXPECT_DOUBLE_EQ(niah_recall({}, "anything"), 0.0);
}

TEST(Niah, BadInput) {
  auto o = opts(NiahSplit::Eval, 0, 20, {0.5}, ChatFormat::Gemma);
  try {
    make_niah(tok(), o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too small"), std::string::npos) << e.what();
  }
  o.context_tokens = 256;
  o.depths = {1.5};
  EXPECT_THROW(make_niah(tok(), o), Error);
  o.depths = {};
  EXPECT_THROW(make_niah(tok(), o), Error);
  o.depths = {0.5};
  o.seed = uint64_t(1) << 40;
  EXPECT_THROW(make_niah(tok(), o), Error);
  o.seed = 0;
  o.haystack_file = "/nonexistent/haystack.txt";
  try {
    make_niah(tok(), o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/haystack.txt"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_chat_format("llama"), Error);
}

// RULER-style long-context tasks (data/longeval.h) with the real Gemma 3 tokenizer:
// exact token length, answers where the task says (needles, chains, word counts),
// the scorer, determinism, per-task generation budgets, train/eval disjointness
// (template phrases, seeds, vocabularies, default haystack files) and bad input.
// Torch-free: the environment is read directly (tests/test_util.h needs LibTorch).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string_view>
#include <unordered_map>

#include "core/error.h"
#include "data/longeval.h"
#include "data/niah.h"

using namespace kakeya;
using namespace kakeya::data;

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  if (!v) ADD_FAILURE() << "environment variable " << name << " is not set (run the tests through ctest)";
  return v ? v : "";
}

const Tokenizer& tok() {
  static Tokenizer t = Tokenizer::from_file(env("KAKEYA_MODEL_DIR") + "/tokenizer.json");
  return t;
}

std::string data_dir() { return env("KAKEYA_SOURCE_DIR") + "/data"; }

std::string read(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path << " is missing (tracked in git)";
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

LongTaskOptions opts(LongSplit split, const std::string& task, uint64_t seed, int64_t len,
                     ChatFormat chat = ChatFormat::None) {
  LongTaskOptions o;
  o.split = split;
  o.task = task;
  o.seed = seed;
  o.context_tokens = len;
  o.chat = chat;
  o.source_dir = data_dir();
  return o;
}

std::string decode(const std::vector<int64_t>& ids, size_t from, size_t to) {
  return tok().decode(std::vector<int32_t>(ids.begin() + from, ids.begin() + std::min(to, ids.size())));
}

// Split-specific literals the checks below parse prompts with.
struct Shape {
  std::string needle_start, needle_key, needle_value;  // "<start> ... <key sep> KEY <value sep> VALUE.\n"
  std::string question;                                // start of the final question (niah_*)
  std::string statement;                               // vt statement keyword
  std::string assign;                                  // vt assignment operator
  std::string list_start, list_end;                    // around the cwe list / fwe text (last occurrence)
};
Shape shape(LongSplit s, const std::string& task) {
  const bool eval = s == LongSplit::Eval;
  Shape sh;
  sh.needle_start = eval ? "One of the special magic " : "Remember: the secret ";
  sh.needle_key = eval ? " for " : " of ";
  sh.needle_value = eval ? " is: " : " equals ";
  sh.question = eval ? "\nWhat " : "\nQuery: ";
  sh.statement = eval ? "VAR " : "REG ";
  sh.assign = eval ? " = " : " := ";
  if (task == "cwe") sh.list_start = eval ? "appear most often.\n" : "keep count of them.\n";
  if (task == "fwe") sh.list_start = eval ? "coded words." : "occur most.";
  sh.list_end = eval ? "\nQuestion: " : "\nQuery: ";
  return sh;
}

// niah_*: (key, value) of every needle in the prompt, in prompt order.
std::vector<std::pair<std::string, std::string>> needles(const LongSample& s, const Shape& sh) {
  std::vector<std::pair<std::string, std::string>> out;
  const std::string& t = s.prompt_text;
  for (size_t p = t.find(sh.needle_start); p != std::string::npos; p = t.find(sh.needle_start, p + 1)) {
    const size_t k = t.find(sh.needle_key, p) + sh.needle_key.size();
    const size_t v = t.find(sh.needle_value, k);
    const size_t e = t.find(".\n", v);
    out.emplace_back(t.substr(k, v - k), t.substr(v + sh.needle_value.size(), e - v - sh.needle_value.size()));
  }
  return out;
}

// cwe / fwe: occurrences of each word of the (last) list, item numbers skipped.
std::map<std::string, int> list_counts(const LongSample& s, const Shape& sh) {
  const std::string& t = s.prompt_text;
  const size_t a = t.rfind(sh.list_start) + sh.list_start.size();
  const size_t b = t.rfind(sh.list_end);
  std::istringstream in(t.substr(a, b - a));
  std::map<std::string, int> counts;
  std::string w;
  while (in >> w)
    if (!std::isdigit((unsigned char)w[0]) && w[0] != '[') ++counts[w];
  return counts;
}

// Short markers of each split's wording; the eval ones occur in no train haystack
// line and the train ones in no eval haystack line (DefaultHaystacksShareNoText).
const std::vector<std::string> kEvalMarkers = {"special magic",  "provided text", "Question:",  "Answer:", "\nVAR ",
                                               "grass is green", "numbered list", "coded text", "memorize"};
const std::vector<std::string> kTrainMarkers = {
    "secret code", "secret passphrase",  "secret identifier",   "Query:",        "Reply:",
    "\nREG ",      "cat sat on the mat", "enumerated sequence", "invented token"};

const std::vector<std::string> kTasks = {"niah_single_digits", "niah_single_words", "niah_single_uuid",
                                         "niah_multikey",      "niah_multivalue",   "niah_multiquery",
                                         "vt",                 "cwe",               "fwe"};

}  // namespace

TEST(LongEval, TaskNames) {
  EXPECT_EQ(long_task_names(), kTasks);
  for (const auto& t : kTasks) EXPECT_NO_THROW(check_long_task(t));
  try {
    check_long_task("niah_single_emoji");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("unknown task 'niah_single_emoji'"), std::string::npos) << m;
    EXPECT_NE(m.find("expected one of niah_single_digits, "), std::string::npos) << m;
    EXPECT_NE(m.find("fwe"), std::string::npos) << m;
  }
}

TEST(LongEval, ExactLengthAndAnswersWhereTheTaskSays) {
  for (auto split : {LongSplit::Eval, LongSplit::Train})
    for (const auto& task : kTasks)
      for (auto chat : {ChatFormat::None, ChatFormat::Gemma})
        for (int64_t len : {1500, 4096, 6001}) {
          const std::string what = std::string(long_split_name(split)) + " " + task + " " + chat_format_name(chat) +
                                   " len " + std::to_string(len);
          const auto s = make_long_sample(tok(), opts(split, task, (uint64_t)len + 3, len, chat));
          const Shape sh = shape(split, task);
          ASSERT_EQ((int64_t)s.prompt_ids.size(), len) << what;
          EXPECT_EQ(s.prompt_ids[0], tok().bos_id()) << what;
          EXPECT_EQ(s.task, task);
          ASSERT_FALSE(s.answers.empty()) << what;
          EXPECT_GT(s.max_new_tokens, 0);
          if (chat == ChatFormat::Gemma) {
            EXPECT_EQ(s.prompt_text.rfind("<bos><start_of_turn>user\n", 0), 0u) << what;
            EXPECT_NE(s.prompt_text.find("<end_of_turn>\n<start_of_turn>model\n"), std::string::npos) << what;
          }
          // The scorer: all answers -> 1, one answer wrong -> < 1.
          std::string all;
          for (const auto& a : s.answers) all += a + ", ";
          EXPECT_DOUBLE_EQ(long_task_score(s.answers, all), 1.0) << what;
          std::string wrong = all;
          wrong[0] = wrong[0] == 'Q' ? 'R' : 'Q';
          EXPECT_LT(long_task_score(s.answers, wrong), 1.0) << what;
          EXPECT_TRUE(std::is_sorted(s.needle_positions.begin(), s.needle_positions.end())) << what;

          if (task.rfind("niah_", 0) == 0) {
            // Needles: 4 for multi*, 1 for single; every answer is the value of a
            // needle whose key the question names, the distractors' keys are not asked.
            const auto ns = needles(s, sh);
            ASSERT_EQ(ns.size(), task.find("multi") != std::string::npos ? 4u : 1u) << what;
            ASSERT_EQ(s.needle_positions.size(), ns.size()) << what;
            for (int64_t p : s.needle_positions)
              EXPECT_EQ(decode(s.prompt_ids, p, p + 12).rfind(sh.needle_start, 0), 0u) << what << " at " << p;
            const size_t q = s.prompt_text.rfind(sh.question);
            ASSERT_NE(q, std::string::npos) << what;
            const std::string question = s.prompt_text.substr(q);
            std::set<std::string> asked_keys;
            for (const auto& a : s.answers) {
              auto it = std::find_if(ns.begin(), ns.end(), [&](const auto& kv) { return kv.second == a; });
              ASSERT_NE(it, ns.end()) << what << ": answer " << a << " is no needle's value";
              EXPECT_NE(question.find(it->first), std::string::npos) << what << ": key " << it->first << " not asked";
              asked_keys.insert(it->first);
            }
            for (const auto& [key, value] : ns) {
              if (!asked_keys.count(key)) {
                EXPECT_EQ(question.find(key), std::string::npos) << what << ": distractor " << key << " asked";
              }
            }
            const size_t asked = task == "niah_multiquery" ? 4 : 1;
            EXPECT_EQ(asked_keys.size(), asked) << what;
            EXPECT_EQ(s.answers.size(), task == "niah_multikey" ? 1u : ns.size()) << what;
            if (task == "niah_single_digits" || task.find("multi") != std::string::npos) {
              for (const auto& a : s.answers)
                EXPECT_TRUE(a.size() == 7 && std::all_of(a.begin(), a.end(), ::isdigit)) << what << ": " << a;
            }
            if (task == "niah_single_uuid") {
              const std::string& u = s.answers[0];
              ASSERT_EQ(u.size(), 36u) << u;
              for (size_t i : {8, 13, 18, 23}) EXPECT_EQ(u[i], '-') << u;
              EXPECT_EQ(u[14], '4') << u;
            }
          } else if (task == "vt") {
            // The chain: names[0] = value, names[j] = names[j-1], in prompt order.
            ASSERT_EQ(s.answers.size(), 5u) << what;
            ASSERT_EQ(s.needle_positions.size(), 5u) << what;
            const size_t body = s.prompt_text.rfind(split == LongSplit::Eval ? "following text.\n\n" : "by step.\n\n");
            size_t at = s.prompt_text.find("\n" + sh.statement + s.answers[0] + sh.assign, body);
            ASSERT_NE(at, std::string::npos) << what;
            for (size_t j = 1; j < 5; ++j) {
              const std::string st =
                  "\n" + sh.statement + s.answers[j] + sh.assign + sh.statement + s.answers[j - 1] + "\n";
              const size_t next = s.prompt_text.find(st, body);
              ASSERT_NE(next, std::string::npos) << what << ": " << st;
              EXPECT_GT(next, at) << what;
              at = next;
            }
            for (int64_t p : s.needle_positions)
              EXPECT_EQ(decode(s.prompt_ids, p, p + 4).rfind(sh.statement, 0), 0u) << what << " at " << p;
            for (const auto& a : s.answers) EXPECT_EQ(a.size(), split == LongSplit::Eval ? 5u : 6u);
          } else {
            // cwe: the 10 answers are the most frequent list words, by a wide margin;
            // fwe: the 3 answers are the most frequent coded words after the noise.
            EXPECT_TRUE(s.needle_positions.empty());
            auto counts = list_counts(s, sh);
            ASSERT_EQ(s.answers.size(), task == "cwe" ? 10u : 3u) << what;
            int lo = 1 << 30, hi = 0;
            for (const auto& a : s.answers) lo = std::min(lo, counts[a]);
            for (const auto& [w, c] : counts)
              if (std::find(s.answers.begin(), s.answers.end(), w) == s.answers.end() && w != "..." && w != "~~")
                hi = std::max(hi, c);
            EXPECT_GT(lo, hi) << what;
            if (task == "cwe") {
              EXPECT_GE(lo, len < 4096 ? 6 : 30) << what;
            }
            if (task == "fwe") {
              const std::string noise = split == LongSplit::Eval ? "..." : "~~";
              EXPECT_GT(counts[noise], lo) << what;
              for (const auto& a : s.answers) EXPECT_EQ(a.size(), split == LongSplit::Eval ? 6u : 7u);
            }
          }
        }
}

TEST(LongEval, AnswerPrefixAndCwePoolExhaustion) {
  // Without the answer prefix the prompt ends with the chat suffix.
  auto o = opts(LongSplit::Eval, "niah_multivalue", 5, 1024, ChatFormat::Gemma);
  o.answer_prefix = false;
  auto s = make_long_sample(tok(), o);
  ASSERT_EQ((int64_t)s.prompt_ids.size(), 1024);
  const std::string end = "<end_of_turn>\n<start_of_turn>model\n";
  ASSERT_GE(s.prompt_text.size(), end.size());
  EXPECT_EQ(s.prompt_text.substr(s.prompt_text.size() - end.size()), end);
  // A cwe list longer than the word pool allows at 30/3 repeats raises both counts.
  auto c = make_long_sample(tok(), opts(LongSplit::Train, "cwe", 1, 16384));
  auto counts = list_counts(c, shape(LongSplit::Train, "cwe"));
  EXPECT_EQ((int64_t)c.prompt_ids.size(), 16384);
  EXPECT_GT(counts.size(), 200u);
  EXPECT_GE(counts[c.answers[0]], 60);
}

TEST(LongEval, GenerationBudgetsFitTheAnswers) {
  for (auto split : {LongSplit::Eval, LongSplit::Train})
    for (const auto& task : kTasks)
      for (uint64_t seed = 0; seed < 5; ++seed) {
        auto s = make_long_sample(tok(), opts(split, task, seed, 4096));
        std::string list;
        for (size_t i = 0; i < s.answers.size(); ++i) list += (i ? ", " : "") + s.answers[i];
        // Room for the answers plus as much again for the model's own phrasing.
        EXPECT_LE(2 * (int64_t)tok().encode(" " + list, false).size(), s.max_new_tokens)
            << long_split_name(split) << " " << task << ": " << list;
      }
}

TEST(LongEval, DeterministicPerSeedAndVariedAcrossSeedsAndTasks) {
  for (const auto& task : kTasks) {
    auto a = make_long_sample(tok(), opts(LongSplit::Train, task, 42, 2048, ChatFormat::Gemma));
    auto b = make_long_sample(tok(), opts(LongSplit::Train, task, 42, 2048, ChatFormat::Gemma));
    auto c = make_long_sample(tok(), opts(LongSplit::Train, task, 43, 2048, ChatFormat::Gemma));
    EXPECT_EQ(a.prompt_ids, b.prompt_ids) << task;
    EXPECT_EQ(a.answers, b.answers) << task;
    EXPECT_EQ(a.rng_seed, b.rng_seed) << task;
    EXPECT_NE(a.prompt_ids, c.prompt_ids) << task;
    EXPECT_NE(a.answers, c.answers) << task;
  }
  auto d = make_long_sample(tok(), opts(LongSplit::Eval, "niah_single_digits", 7, 2048));
  auto m = make_long_sample(tok(), opts(LongSplit::Eval, "niah_multikey", 7, 2048));
  EXPECT_NE(d.answers[0], m.answers[0]) << "tasks sharing a seed draw differently";
}

TEST(LongEval, TrainAndEvalShareNoTemplatePhrase) {
  const auto eval_phrases = long_template_phrases(LongSplit::Eval);
  const auto train_phrases = long_template_phrases(LongSplit::Train);
  ASSERT_GT(eval_phrases.size(), 20u);
  ASSERT_GT(train_phrases.size(), 20u);
  EXPECT_TRUE(std::find(eval_phrases.begin(), eval_phrases.end(),
                        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.") !=
              eval_phrases.end());
  std::set<std::string> eval_seen, train_seen;  // phrases found in their own split's prompts
  for (const auto& task : kTasks)
    for (uint64_t seed = 0; seed < 3; ++seed)
      for (int64_t len : {1200, 4200}) {
        // The same sample number in both splits: disjointness must not depend on the caller's seeds.
        const auto ev = make_long_sample(tok(), opts(LongSplit::Eval, task, seed, len, ChatFormat::Gemma));
        const auto tr = make_long_sample(tok(), opts(LongSplit::Train, task, seed, len, ChatFormat::Gemma));
        for (const auto& p : eval_phrases) {
          ASSERT_EQ(tr.prompt_text.find(p), std::string::npos) << "eval phrase in a train " << task << " prompt: " << p;
          if (ev.prompt_text.find(p) != std::string::npos) eval_seen.insert(p);
        }
        for (const auto& p : train_phrases) {
          ASSERT_EQ(ev.prompt_text.find(p), std::string::npos)
              << "train phrase in an eval " << task << " prompt: " << p;
          if (tr.prompt_text.find(p) != std::string::npos) train_seen.insert(p);
        }
        for (const auto& m : kEvalMarkers) ASSERT_EQ(tr.prompt_text.find(m), std::string::npos) << task << ": " << m;
        for (const auto& m : kTrainMarkers) ASSERT_EQ(ev.prompt_text.find(m), std::string::npos) << task << ": " << m;
      }
  // Every listed phrase is real: it occurs in some prompt of its own split.
  EXPECT_EQ(eval_seen.size(), eval_phrases.size());
  EXPECT_EQ(train_seen.size(), train_phrases.size());
}

TEST(LongEval, TrainAndEvalShareNoSeedsOrVocabulary) {
  std::set<uint64_t> eval_seeds, train_seeds;
  std::set<std::string> eval_keys, train_keys, eval_words, train_words, eval_names, train_names, eval_coded,
      train_coded;
  auto words_of = [](const std::string& key, std::set<std::string>& into) {
    for (size_t a = 0, b; a <= key.size(); a = b + 1) {
      b = std::min(key.find('-', a), key.size());
      into.insert(key.substr(a, b - a));
    }
  };
  for (uint64_t i = 0; i < 60; ++i)
    for (auto split : {LongSplit::Eval, LongSplit::Train}) {
      const bool eval = split == LongSplit::Eval;
      for (const std::string task : {"niah_multiquery", "niah_single_words", "vt", "fwe"}) {
        auto s = make_long_sample(tok(), opts(split, task, i, 900));
        (eval ? eval_seeds : train_seeds).insert(s.rng_seed);
        if (task == "niah_multiquery" || task == "niah_single_words")
          for (const auto& [key, value] : needles(s, shape(split, task))) {
            (eval ? eval_keys : train_keys).insert(key);
            words_of(key, eval ? eval_words : train_words);
            if (task == "niah_single_words") words_of(value, eval ? eval_words : train_words);
          }
        if (task == "vt") (eval ? eval_names : train_names).insert(s.answers.begin(), s.answers.end());
        if (task == "fwe") (eval ? eval_coded : train_coded).insert(s.answers.begin(), s.answers.end());
      }
    }
  // cwe lists of a few seeds show (nearly) a split's whole word list.
  for (auto split : {LongSplit::Eval, LongSplit::Train})
    for (uint64_t i = 0; i < 6; ++i) {
      auto s = make_long_sample(tok(), opts(split, "cwe", i, 8000));
      for (const auto& [w, c] : list_counts(s, shape(split, "cwe")))
        if (c > 1) (split == LongSplit::Eval ? eval_words : train_words).insert(w);
    }
  auto disjoint = [](const auto& a, const auto& b) {
    for (const auto& x : a)
      if (b.count(x)) return false;
    return true;
  };
  EXPECT_TRUE(disjoint(eval_seeds, train_seeds));
  for (uint64_t s : eval_seeds) EXPECT_LT(s, uint64_t(1) << 40);
  for (uint64_t s : train_seeds)
    EXPECT_GE(s, uint64_t(1) << 41) << "train seeds stay clear of data/niah.h's train range";
  EXPECT_TRUE(disjoint(eval_keys, train_keys));
  EXPECT_TRUE(disjoint(eval_words, train_words));
  EXPECT_TRUE(disjoint(eval_names, train_names));
  EXPECT_TRUE(disjoint(eval_coded, train_coded));
  EXPECT_GT(eval_keys.size(), 250u);  // enough variety that a model cannot memorize keys
  EXPECT_GT(train_keys.size(), 250u);
  EXPECT_GT(eval_words.size(), 300u);
  EXPECT_GT(train_words.size(), 300u);
  // No eval key word in data/niah.h's prompts either (f_θ training captures its train split).
  std::set<std::string> niah_words;
  for (auto split : {NiahSplit::Train, NiahSplit::Eval})
    for (uint64_t i = 0; i < 200; ++i) {
      NiahOptions n;
      n.split = split;
      n.seed = i;
      n.context_tokens = 160;
      n.depths = {0.3, 0.7};
      n.source_dir = data_dir() + "/codec";
      for (const auto& k : make_niah(tok(), n).keys) words_of(k, niah_words);
    }
  EXPECT_TRUE(disjoint(eval_words, niah_words));
  EXPECT_TRUE(disjoint(train_words, niah_words));
}

TEST(LongEval, DefaultHaystacksShareNoText) {
  const std::string eval_path = default_long_haystack_file(LongSplit::Eval, data_dir());
  const std::string train_path = default_long_haystack_file(LongSplit::Train, data_dir());
  EXPECT_EQ(eval_path, data_dir() + "/longeval/haystack_eval.txt");
  EXPECT_EQ(train_path, data_dir() + "/codec/calib.txt");
  ASSERT_GE(haystack_lines(eval_path).size(), 16u);
  ASSERT_GE(haystack_lines(train_path).size(), 16u);
  // Every 64-character window (whitespace runs folded to one space) of the train
  // text, by hash; a hash hit in the eval text is then compared character by character.
  auto folded = [](const std::string& path) {
    std::string out;
    for (char c : read(path)) {
      const bool space = std::isspace((unsigned char)c);
      if (!space || (!out.empty() && out.back() != ' ')) out += space ? ' ' : c;
    }
    return out;
  };
  const std::string train = folded(train_path), eval = folded(eval_path);
  ASSERT_GT(train.size(), 100000u);
  ASSERT_GT(eval.size(), 100000u);
  constexpr size_t kWindow = 64;
  std::unordered_multimap<size_t, size_t> windows;  // hash -> offset in train
  windows.reserve(train.size());
  std::hash<std::string_view> h;
  for (size_t i = 0; i + kWindow <= train.size(); ++i)
    windows.emplace(h(std::string_view(train).substr(i, kWindow)), i);
  size_t shared = 0;
  std::string example;
  for (size_t i = 0; i + kWindow <= eval.size(); ++i) {
    const std::string_view w = std::string_view(eval).substr(i, kWindow);
    auto [a, b] = windows.equal_range(h(w));
    for (auto it = a; it != b; ++it)
      if (std::string_view(train).substr(it->second, kWindow) == w) {
        if (shared++ == 0) example = std::string(w);
        break;
      }
  }
  EXPECT_EQ(shared, 0u) << "e.g. '" << example << "'";
  // Neither file holds the other split's markers (so the marker checks above test
  // the templates, not the haystacks).
  const std::string train_raw = "\n" + read(train_path), eval_raw = "\n" + read(eval_path);
  for (const auto& m : kEvalMarkers) EXPECT_EQ(train_raw.find(m), std::string::npos) << m;
  for (const auto& m : kTrainMarkers) EXPECT_EQ(eval_raw.find(m), std::string::npos) << m;
}

TEST(LongEval, Scorer) {
  EXPECT_DOUBLE_EQ(long_task_score({"1234567"}, "The special magic number is 1234567."), 1.0);
  EXPECT_DOUBLE_EQ(long_task_score({"1234567"}, "The special magic number is 1234568."), 0.0);
  EXPECT_DOUBLE_EQ(long_task_score({"ABCDE", "FGHIJ"}, "they are: abcde, FGHIX"), 0.5);
  EXPECT_DOUBLE_EQ(long_task_score({"apple-violin"}, "APPLE-VIOLIN"), 1.0);
  EXPECT_DOUBLE_EQ(long_task_score({}, "anything"), 0.0);
}

TEST(LongEval, BadInput) {
  for (const auto& task : kTasks) {
    auto o = opts(LongSplit::Eval, task, 0, 64);
    try {
      make_long_sample(tok(), o);
      ADD_FAILURE() << task << ": no error";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(task + ": context_tokens 64 is too small"), std::string::npos) << m;
      EXPECT_NE(m.find(" tokens"), std::string::npos) << m;
    }
  }
  auto o = opts(LongSplit::Eval, "vt", uint64_t(1) << 40, 1024);
  EXPECT_THROW(make_long_sample(tok(), o), Error);
  o.task = "niah_sideways";
  o.seed = 0;
  try {
    make_long_sample(tok(), o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown task 'niah_sideways'"), std::string::npos) << e.what();
  }
  o.task = "niah_single_uuid";
  o.haystack_file = "/nonexistent/haystack.txt";
  try {
    make_long_sample(tok(), o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/haystack.txt"), std::string::npos) << e.what();
  }
  o.haystack_file.clear();
  o.source_dir = "/nonexistent/data";
  o.split = LongSplit::Train;
  try {
    make_long_sample(tok(), o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/data/codec/calib.txt"), std::string::npos) << e.what();
  }
}

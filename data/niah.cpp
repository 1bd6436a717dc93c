#include "data/niah.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "core/error.h"
#include "data/prompt_util.h"

namespace kakeya::data {

namespace {

// Train seeds are offset by 2^40 (opt.seed must stay below it), so the two
// splits never share a generator state.
constexpr uint64_t kTrainSeedOffset = uint64_t(1) << 40;

// Key words. Eval keys take the even-indexed adjectives, train keys the odd ones,
// so no key (hence no needle) is shared between the splits.
const char* const kAdjectives[] = {
    "amber",  "brave",   "calm",    "dusty",  "eager",  "faint",   "gentle", "hollow", "icy",     "jolly",
    "keen",   "lively",  "mellow",  "narrow", "odd",    "pale",    "quiet",  "rapid",  "silent",  "tidy",
    "upper",  "vivid",   "wary",    "young",  "zesty",  "bold",    "crisp",  "dim",    "early",   "fancy",
    "grand",  "humble",  "ivory",   "jagged", "kind",   "lucky",   "misty",  "noble",  "olive",   "proud",
    "rusty",  "sharp",   "tender",  "urban",  "velvet", "wild",    "yellow", "zealous", "bright", "cosmic",
    "distant", "elegant", "frozen", "golden", "hidden", "inner",   "jade",   "lunar",  "marble",  "northern"};
const char* const kNouns[] = {
    "river",   "falcon",  "lantern", "meadow",  "harbor",  "compass", "orchard", "glacier", "anchor",  "beacon",
    "canyon",  "dolphin", "ember",   "forest",  "garden",  "island",  "jungle",  "kettle",  "ladder",  "mirror",
    "needle",  "ocean",   "pebble",  "quarry",  "ribbon",  "saddle",  "tunnel",  "valley",  "willow",  "violin",
    "castle",  "bridge",  "candle",  "desert",  "engine",  "feather", "galaxy",  "hammer",  "iceberg", "journal",
    "kingdom", "lagoon",  "magnet",  "nebula",  "oasis",   "puzzle",  "rocket",  "signal",  "temple",  "thunder"};
constexpr int kNumAdjectives = sizeof(kAdjectives) / sizeof(kAdjectives[0]);
constexpr int kNumNouns = sizeof(kNouns) / sizeof(kNouns[0]);

using Rng = SplitMix64;
constexpr auto enc = encode_piece;

void append(std::vector<int64_t>& dst, const std::vector<int64_t>& src) { dst.insert(dst.end(), src.begin(), src.end()); }

std::string join_keys(const std::vector<std::string>& keys) {
  std::string s;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i > 0) s += i + 1 == keys.size() ? " and " : ", ";
    s += keys[i];
  }
  return s;
}

}  // namespace

const char* niah_split_name(NiahSplit s) { return s == NiahSplit::Train ? "train" : "eval"; }

const char* chat_format_name(ChatFormat f) {
  switch (f) {
    case ChatFormat::Gemma: return "gemma";
    case ChatFormat::ChatML: return "chatml";
    default: return "none";
  }
}

ChatFormat parse_chat_format(const std::string& name) {
  if (name == "none") return ChatFormat::None;
  if (name == "gemma") return ChatFormat::Gemma;
  if (name == "chatml") return ChatFormat::ChatML;
  KAKEYA_FAIL("chat format: expected none | gemma | chatml, got '" << name << "'");
}

ChatFormat detect_chat_format(const Tokenizer& tok) {
  if (tok.token_id("<start_of_turn>") >= 0 && tok.token_id("<end_of_turn>") >= 0) return ChatFormat::Gemma;
  if (tok.token_id("<|im_start|>") >= 0 && tok.token_id("<|im_end|>") >= 0) return ChatFormat::ChatML;
  return ChatFormat::None;
}

std::string chat_user_open(ChatFormat f) {
  switch (f) {
    case ChatFormat::Gemma: return "<start_of_turn>user\n";
    case ChatFormat::ChatML: return "<|im_start|>user\n";
    default: return "";
  }
}

std::string chat_user_close(ChatFormat f) {
  switch (f) {
    case ChatFormat::Gemma: return "<end_of_turn>\n<start_of_turn>model\n";
    case ChatFormat::ChatML: return "<|im_end|>\n<|im_start|>assistant\n";
    default: return "\n";
  }
}

std::string default_haystack_file(NiahSplit s, const std::string& source_dir) {
  return source_dir + (s == NiahSplit::Train ? "/calib.txt" : "/eval.txt");
}

const std::vector<std::string>& haystack_lines(const std::string& path) {
  static std::mutex mu;
  static std::map<std::string, std::vector<std::string>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(path);
  if (it != cache.end()) return it->second;
  std::ifstream f(path);
  KAKEYA_CHECK(f.good(), path << ": cannot open the NIAH haystack file");
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(f, line)) {
    while (!line.empty() && (line.back() == ' ' || line.back() == '\r' || line.back() == '\t')) line.pop_back();
    if (!line.empty()) lines.push_back(line);
  }
  KAKEYA_CHECK(lines.size() >= 16, path << ": NIAH haystack needs at least 16 non-empty lines, got " << lines.size());
  return cache.emplace(path, std::move(lines)).first->second;
}

NiahSample make_niah(const Tokenizer& tok, const NiahOptions& opt) {
  KAKEYA_CHECK(opt.seed < kTrainSeedOffset, "NIAH seed must be < 2^40, got " << opt.seed);
  KAKEYA_CHECK(!opt.depths.empty(), "NIAH: at least one needle depth is needed");
  for (double d : opt.depths)
    KAKEYA_CHECK(d >= 0.0 && d <= 1.0 && std::isfinite(d), "NIAH: needle depth must be in [0, 1], got " << d);
  NiahSample out;
  out.rng_seed = opt.seed + (opt.split == NiahSplit::Train ? kTrainSeedOffset : 0);
  Rng rng{out.rng_seed};
  const int parity = opt.split == NiahSplit::Eval ? 0 : 1;

  // Needles: distinct keys within the sample, 7-digit numbers.
  const size_t n = opt.depths.size();
  KAKEYA_CHECK(n <= 32, "NIAH: at most 32 needles, got " << n);
  while (out.keys.size() < n) {
    int a = 2 * (int)rng.below(kNumAdjectives / 2) + parity;
    std::string key = std::string(kAdjectives[a]) + "-" + kNouns[rng.below(kNumNouns)];
    if (std::find(out.keys.begin(), out.keys.end(), key) != out.keys.end()) continue;
    out.keys.push_back(key);
    out.answers.push_back(std::to_string(1000000 + rng.below(9000000)));
  }

  // Fixed pieces.
  std::vector<int64_t> head, tail;
  if (tok.bos_id() >= 0) head.push_back(tok.bos_id());
  const std::string user_open = chat_user_open(opt.chat);
  const std::string user_close = chat_user_close(opt.chat);
  append(head, enc(tok, user_open + "Read the text below and remember the special magic numbers hidden in it.\n\n"));
  const std::string all_keys = join_keys(out.keys);
  std::string question = n == 1 ? "\nQuestion: What is the special magic number for " + all_keys + "?"
                                : "\nQuestion: What are the special magic numbers for " + all_keys + "?";
  std::string answer;
  if (opt.answer_prefix)
    answer = n == 1 ? "Answer: The special magic number for " + all_keys + " is"
                    : "Answer: The special magic numbers for " + all_keys + " are";
  append(tail, enc(tok, question + user_close + answer));
  std::vector<std::vector<int64_t>> needles;
  int64_t needle_tokens = 0;
  for (size_t i = 0; i < n; ++i) {
    needles.push_back(enc(tok, "The special magic number for " + out.keys[i] + " is " + out.answers[i] + ".\n"));
    needle_tokens += (int64_t)needles.back().size();
  }
  const int64_t fixed = (int64_t)(head.size() + tail.size()) + needle_tokens;
  const int64_t budget = opt.context_tokens - fixed;
  KAKEYA_CHECK(budget >= 0, "NIAH: context_tokens " << opt.context_tokens << " is too small: the instruction, "
                                                    << n << " needle(s) and the question alone take " << fixed
                                                    << " tokens");

  // Haystack: consecutive lines from a seeded start, the last one cut to fill the budget.
  const auto& lines =
      haystack_lines(opt.haystack_file.empty() ? default_haystack_file(opt.split, opt.source_dir) : opt.haystack_file);
  size_t li = rng.below(lines.size());
  std::vector<std::vector<int64_t>> hay;  // whole lines (with "\n"), then possibly one cut line
  std::vector<int64_t> boundary{0};       // token offset of each line start within the haystack
  int64_t used = 0;
  bool last_cut = false;
  while (used < budget) {
    auto ids = enc(tok, lines[li] + "\n");
    li = (li + 1) % lines.size();
    if (used + (int64_t)ids.size() > budget) {  // cut at a token boundary
      ids.resize(budget - used);
      last_cut = true;
    }
    used += (int64_t)ids.size();
    hay.push_back(std::move(ids));
    boundary.push_back(used);
  }

  // Needle i goes to the line boundary nearest depth_i of the haystack (ties: earlier).
  // Only boundaries of whole lines qualify (a needle never splits a line); the end
  // after a cut last line is no line boundary, the question follows it there.
  const size_t max_slot = last_cut ? hay.size() - 1 : hay.size();
  std::vector<size_t> slot(n);  // insert before hay[slot]
  for (size_t i = 0; i < n; ++i) {
    const double target = opt.depths[i] * used;
    size_t best = 0;
    for (size_t b = 0; b <= max_slot; ++b)
      if (std::abs(boundary[b] - target) < std::abs(boundary[best] - target)) best = b;
    slot[i] = best;
  }
  out.prompt_ids = head;
  out.needle_positions.assign(n, -1);
  for (size_t b = 0; b <= hay.size(); ++b) {
    for (size_t i = 0; i < n; ++i)
      if (slot[i] == b) {
        out.needle_positions[i] = (int64_t)out.prompt_ids.size();
        append(out.prompt_ids, needles[i]);
      }
    if (b < hay.size()) append(out.prompt_ids, hay[b]);
  }
  append(out.prompt_ids, tail);
  KAKEYA_CHECK((int64_t)out.prompt_ids.size() == opt.context_tokens,
               "NIAH: internal length error: built " << out.prompt_ids.size() << " tokens for " << opt.context_tokens);
  out.prompt_text = tok.decode(std::vector<int32_t>(out.prompt_ids.begin(), out.prompt_ids.end()));
  return out;
}

double niah_recall(const std::vector<std::string>& answers, const std::string& generated) {
  if (answers.empty()) return 0.0;
  int64_t hit = 0;
  for (const auto& a : answers) hit += generated.find(a) != std::string::npos;
  return (double)hit / (double)answers.size();
}

}  // namespace kakeya::data

// Native reader of HF tokenizer.json, following the `tokenizers` crate
// (0.23) step by step so that ids match exactly:
//   added tokens split off the raw text -> normalizer -> added tokens matched
//   on the normalized text -> pre-tokenizer -> model -> post-processor.
// Offsets are not tracked (the runtime needs ids only), except the one bit
// that changes ids: whether a piece starts at the beginning of the input
// (Metaspace prepend_scheme "first").
//
// Regexes in Split/Replace are Oniguruma patterns in `tokenizers`; they are
// run here by a small backtracking matcher supporting the subset that
// tokenizer files use (classes with \p{..}, \s, \d, \w, quantifiers,
// (?i:..), (?:..), lookahead). Anything else is rejected when loading.
//
// Supported: models BPE, Unigram; normalizers Sequence, Replace, Prepend,
// Strip, ByteLevel, NFC, NFD; pre-tokenizers Sequence, Split, ByteLevel,
// Metaspace, Digits, WhitespaceSplit; post-processors TemplateProcessing,
// BertProcessing, RobertaProcessing, ByteLevel, Sequence; decoders Sequence,
// Replace, ByteFallback, Fuse, Strip, Metaspace, ByteLevel, BPEDecoder.
#include "core/io/tokenizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/io/unicode_tables.h"

namespace kakeya {
namespace {

using json = nlohmann::json;
namespace uc = kakeya::unicode;

// ---------------------------------------------------------------------------
// UTF-8 and Unicode properties

constexpr char32_t kReplacementChar = 0xFFFD;

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Length of the well-formed UTF-8 sequence at s[i], or 0 if ill-formed; `sub`
// receives the length of its maximal valid prefix (the "maximal subpart" that
// one U+FFFD replaces, as Rust's from_utf8_lossy and Python do).
size_t utf8_seq_len(const std::string& s, size_t i, size_t* sub) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  *sub = 1;
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k < n; ++k) {
    if (i + k >= s.size()) return 0;
    const unsigned char x = b(i + k);
    if (x < (k == 1 ? lo : 0x80) || x > (k == 1 ? hi : 0xBF)) return 0;
    *sub = k + 1;
  }
  return n;
}

std::string utf8_lossy(const std::string& in) {
  std::string out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size();) {
    size_t sub;
    const size_t n = utf8_seq_len(in, i, &sub);
    if (n == 0) {
      append_utf8(out, kReplacementChar);
      i += sub;
    } else {
      out.append(in, i, n);
      i += n;
    }
  }
  return out;
}

bool is_valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    size_t sub;
    const size_t n = utf8_seq_len(s, i, &sub);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

// Decodes the code point at s[i] of a valid UTF-8 string.
inline char32_t decode_at(const std::string& s, size_t i, size_t* len) {
  const auto b = [&](size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[k])); };
  const char32_t c = b(i);
  if (c < 0x80) {
    *len = 1;
    return c;
  }
  if (c < 0xE0) {
    *len = 2;
    return ((c & 0x1F) << 6) | (b(i + 1) & 0x3F);
  }
  if (c < 0xF0) {
    *len = 3;
    return ((c & 0x0F) << 12) | ((b(i + 1) & 0x3F) << 6) | (b(i + 2) & 0x3F);
  }
  *len = 4;
  return ((c & 0x07) << 18) | ((b(i + 1) & 0x3F) << 12) | ((b(i + 2) & 0x3F) << 6) | (b(i + 3) & 0x3F);
}

inline size_t char_len_at(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

std::vector<char32_t> to_code_points(const std::string& s) {
  std::vector<char32_t> out;
  for (size_t i = 0, n; i < s.size(); i += n) out.push_back(decode_at(s, i, &n));
  return out;
}

uint8_t category_slow(char32_t cp) {
  const uint32_t key = (static_cast<uint32_t>(cp) << 5) | 31u;
  const auto* end = std::end(uc::kCategoryRuns);
  const auto* it = std::upper_bound(std::begin(uc::kCategoryRuns), end, key);
  return static_cast<uint8_t>(*(it - 1) & 31u);
}

uint8_t category(char32_t cp) {
  static const std::array<uint8_t, 128> ascii = [] {
    std::array<uint8_t, 128> t{};
    for (char32_t c = 0; c < 128; ++c) t[c] = category_slow(c);
    return t;
  }();
  return cp < 128 ? ascii[cp] : category_slow(cp);
}

constexpr uint32_t cat_bit(uc::Category c) { return 1u << c; }
constexpr uint32_t kCatL = cat_bit(uc::Lu) | cat_bit(uc::Ll) | cat_bit(uc::Lt) | cat_bit(uc::Lm) | cat_bit(uc::Lo);
constexpr uint32_t kCatM = cat_bit(uc::Mn) | cat_bit(uc::Mc) | cat_bit(uc::Me);
constexpr uint32_t kCatN = cat_bit(uc::Nd) | cat_bit(uc::Nl) | cat_bit(uc::No);
constexpr uint32_t kCatP = cat_bit(uc::Pc) | cat_bit(uc::Pd) | cat_bit(uc::Ps) | cat_bit(uc::Pe) |
                           cat_bit(uc::Pi) | cat_bit(uc::Pf) | cat_bit(uc::Po);
constexpr uint32_t kCatS = cat_bit(uc::Sm) | cat_bit(uc::Sc) | cat_bit(uc::Sk) | cat_bit(uc::So);
constexpr uint32_t kCatZ = cat_bit(uc::Zs) | cat_bit(uc::Zl) | cat_bit(uc::Zp);
constexpr uint32_t kCatC = cat_bit(uc::Cc) | cat_bit(uc::Cf) | cat_bit(uc::Cs) | cat_bit(uc::Co) | cat_bit(uc::Cn);

inline bool in_cats(char32_t cp, uint32_t mask) { return (mask >> category(cp)) & 1u; }

// The White_Space property: Rust's char::is_whitespace and regex \s, and
// Oniguruma's Unicode \s (0009-000D, 0085, Zs, Zl, Zp) are all this set.
bool is_white_space(char32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D);
  if (c < 0x85) return false;
  return c == 0x85 || in_cats(c, kCatZ);
}

// Oniguruma's Unicode \w: Letter | Mark | Decimal_Number | Connector_Punctuation.
bool is_onig_word(char32_t c) {
  return in_cats(c, kCatL | kCatM | cat_bit(uc::Nd) | cat_bit(uc::Pc));
}

// Rust regex's \w (used by `tokenizers` for AddedToken.single_word):
// Alphabetic | Mark | Decimal_Number | Connector_Punctuation | Join_Control.
// Alphabetic adds Nl and the few Other_Alphabetic symbols that are not marks
// (circled and squared Latin letters).
bool is_rust_word(char32_t c) {
  if (in_cats(c, kCatL | kCatM | cat_bit(uc::Nd) | cat_bit(uc::Pc) | cat_bit(uc::Nl))) return true;
  return c == 0x200C || c == 0x200D || (c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) ||
         (c >= 0x1F150 && c <= 0x1F169) || (c >= 0x1F170 && c <= 0x1F189);
}

// ---------------------------------------------------------------------------
// Canonical normalization (NFC, NFD): the standard algorithm, as the
// unicode-normalization crate behind `tokenizers` runs it.

uint8_t combining_class(char32_t cp) {
  if (cp < 0x300) return 0;
  const uint32_t key = (static_cast<uint32_t>(cp) << 8) | 0xFFu;
  const auto* it = std::upper_bound(std::begin(uc::kCombiningClassRuns), std::end(uc::kCombiningClassRuns), key);
  return static_cast<uint8_t>(*(it - 1) & 0xFFu);
}

// Hangul syllables decompose and compose arithmetically.
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

void decompose(char32_t c, std::u32string& out) {
  if (c >= kSBase && c < kSBase + kSCount) {
    const char32_t s = c - kSBase;
    out += kLBase + s / kNCount;
    out += kVBase + (s % kNCount) / kTCount;
    if (s % kTCount) out += kTBase + s % kTCount;
    return;
  }
  const auto* end = std::end(uc::kDecompositions);
  const auto* it = std::lower_bound(std::begin(uc::kDecompositions), end, c,
                                    [](const uc::Decomposition& d, char32_t v) { return d.cp < v; });
  if (it == end || it->cp != c) {
    out += c;
    return;
  }
  decompose(it->first, out);
  if (it->second) decompose(it->second, out);
}

char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  const auto* end = std::end(uc::kCompositions);
  const auto* it = std::lower_bound(std::begin(uc::kCompositions), end, std::make_pair(a, b),
                                    [](const uc::Composition& c, const std::pair<char32_t, char32_t>& v) {
                                      return std::make_pair(c.first, c.second) < v;
                                    });
  return it != end && it->first == a && it->second == b ? it->composite : 0;
}

// NFD, then (compose) the canonical composition of UAX #15.
std::string unicode_normalize(const std::string& s, bool compose) {
  std::u32string d;
  size_t len;
  for (size_t i = 0; i < s.size(); i += len) decompose(decode_at(s, i, &len), d);
  // Canonical ordering: each run of non-starters sorted stably by class.
  for (size_t i = 0; i < d.size();) {
    if (combining_class(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && combining_class(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + i, d.begin() + j,
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  if (compose && !d.empty()) {
    size_t starter = 0, out = 1;
    // A leading non-starter has no starter to compose with.
    int last_class = combining_class(d[0]) ? 256 : 0;
    for (size_t i = 1; i < d.size(); ++i) {
      const int cls = combining_class(d[i]);
      const char32_t composite = compose_pair(d[starter], d[i]);
      if (composite && (last_class < cls || last_class == 0)) {
        d[starter] = composite;
        continue;
      }
      if (cls == 0) starter = out;
      last_class = cls;
      d[out++] = d[i];
    }
    d.resize(out);
  }
  std::string r;
  r.reserve(s.size());
  for (char32_t c : d) append_utf8(r, c);
  return r;
}

// ---------------------------------------------------------------------------
// Regex: the subset of Oniguruma syntax used by tokenizer files.

struct CharClass {
  struct Item {
    enum Kind : uint8_t { kRange, kCats, kSpace, kWord, kDigit } kind;
    bool negated;
    char32_t lo, hi;
    uint32_t cats;
  };
  std::vector<Item> items;
  bool negated = false;
  bool icase = false;

  bool matches_exact(char32_t c) const {
    for (const Item& it : items) {
      bool m = false;
      switch (it.kind) {
        case Item::kRange: m = c >= it.lo && c <= it.hi; break;
        case Item::kCats: m = in_cats(c, it.cats); break;
        case Item::kSpace: m = is_white_space(c); break;
        case Item::kWord: m = is_onig_word(c); break;
        case Item::kDigit: m = in_cats(c, cat_bit(uc::Nd)); break;
      }
      if (m != it.negated) return true;
    }
    return false;
  }
};

// Case variants that Oniguruma's Unicode case folding relates to an ASCII
// letter: its other case, plus U+017F LONG S ~ s and U+212A KELVIN SIGN ~ k.
int case_variants(char32_t c, char32_t out[3]) {
  int n = 0;
  char32_t lower = c;
  if (c >= 'A' && c <= 'Z') lower = c + 32;
  if (c == 0x17F) lower = 's';
  if (c == 0x212A) lower = 'k';
  if (lower >= 'a' && lower <= 'z') {
    out[n++] = lower;
    out[n++] = lower - 32;
    if (lower == 's') out[n++] = 0x17F;
    if (lower == 'k') out[n++] = 0x212A;
  } else {
    out[n++] = c;
  }
  return n;
}

bool class_matches(const CharClass& cls, char32_t c) {
  bool m = cls.matches_exact(c);
  if (!m && cls.icase) {
    char32_t v[3];
    const int n = case_variants(c, v);
    for (int k = 0; k < n && !m; ++k) m = v[k] != c && cls.matches_exact(v[k]);
  }
  return m != cls.negated;
}

struct RNode;
using RSeq = std::vector<RNode>;

struct RNode {
  enum Kind : uint8_t { kChar, kClass, kGroup, kRepeat, kLook } kind = kChar;
  char32_t ch = 0;
  bool icase = false;
  int cls = -1;
  std::vector<RSeq> alts;  // kGroup/kLook: alternatives; kRepeat: alts[0] is the body
  int min = 0, max = -1;   // kRepeat; max -1 = unbounded
  bool greedy = true, possessive = false;
  bool negate = false;     // kLook: (?!..)

  bool single_char() const { return kind == kChar || kind == kClass; }
};

class Regex {
 public:
  // Throws std::invalid_argument with a reason on unsupported syntax.
  static Regex parse(const std::string& pattern);
  static Regex literal(const std::string& text);

  // Non-overlapping matches, as Rust's onig::Regex::find_iter yields them.
  std::vector<std::pair<size_t, size_t>> find_all(const std::string& s) const;

 private:
  friend class RegexParser;
  friend class RegexMatcher;
  std::vector<RSeq> alts_;
  std::vector<CharClass> classes_;
  std::string literal_;  // non-empty: the pattern is this plain string
};

class RegexParser {
 public:
  RegexParser(const std::string& p, Regex& re) : cps_(to_code_points(p)), re_(re) {}

  void parse() {
    if (starts_with(U"(?i)")) {
      pos_ += 4;
      icase_ = true;
    }
    re_.alts_ = parse_alternatives(0);
    if (pos_ != cps_.size()) fail("unbalanced ')'");
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw std::invalid_argument(why + " at character " + std::to_string(pos_));
  }
  bool at_end() const { return pos_ >= cps_.size(); }
  char32_t peek(size_t k = 0) const { return pos_ + k < cps_.size() ? cps_[pos_ + k] : 0; }
  bool starts_with(const std::u32string& s) const {
    for (size_t k = 0; k < s.size(); ++k)
      if (peek(k) != s[k] || pos_ + k >= cps_.size()) return false;
    return true;
  }

  std::vector<RSeq> parse_alternatives(int depth) {
    if (depth > 64) fail("groups nested too deeply");
    std::vector<RSeq> alts;
    alts.push_back(parse_sequence(depth));
    while (!at_end() && peek() == '|') {
      ++pos_;
      alts.push_back(parse_sequence(depth));
    }
    return alts;
  }

  RSeq parse_sequence(int depth) {
    RSeq seq;
    while (!at_end() && peek() != '|' && peek() != ')') {
      RNode atom = parse_atom(depth);
      seq.push_back(parse_quantifier(std::move(atom)));
    }
    return seq;
  }

  bool parse_number(int* out) {
    size_t start = pos_;
    long v = 0;
    while (!at_end() && peek() >= '0' && peek() <= '9') {
      v = v * 10 + (peek() - '0');
      if (v > 100000) fail("repeat count above 100000");
      ++pos_;
    }
    *out = static_cast<int>(v);
    return pos_ > start;
  }

  RNode parse_quantifier(RNode atom) {
    int min, max;
    const size_t save = pos_;
    const char32_t c = peek();
    if (c == '?') {
      min = 0, max = 1, ++pos_;
    } else if (c == '*') {
      min = 0, max = -1, ++pos_;
    } else if (c == '+') {
      min = 1, max = -1, ++pos_;
    } else if (c == '{') {
      // Oniguruma reads a '{' that does not form {n}, {n,}, {,m} or {n,m} as a literal.
      ++pos_;
      const bool has_min = parse_number(&min);
      if (!has_min) min = 0;
      max = min;
      if (peek() == ',') {
        ++pos_;
        if (!parse_number(&max)) max = -1;
      }
      if (peek() != '}' || (!has_min && max < 0)) {
        pos_ = save;
        return atom;
      }
      ++pos_;
      if (max >= 0 && max < min) fail("repeat range {n,m} with m < n");
    } else {
      return atom;
    }
    if (atom.kind == RNode::kLook) fail("quantifier on a lookahead");
    RNode rep;
    rep.kind = RNode::kRepeat;
    rep.min = min;
    rep.max = max;
    if (peek() == '?') {
      rep.greedy = false;
      ++pos_;
    } else if (peek() == '+' && c != '{') {
      rep.possessive = true;
      ++pos_;
    }
    rep.alts.push_back(RSeq{std::move(atom)});
    if (rep.possessive && !rep.alts[0][0].single_char()) fail("possessive quantifier on a group");
    if (peek() == '?' || peek() == '*' || peek() == '+') fail("nested quantifier");
    return rep;
  }

  RNode make_class(CharClass cls) {
    cls.icase = icase_;
    re_.classes_.push_back(std::move(cls));
    RNode n;
    n.kind = RNode::kClass;
    n.cls = static_cast<int>(re_.classes_.size() - 1);
    return n;
  }

  RNode parse_atom(int depth) {
    const char32_t c = peek();
    if (c == '(') {
      ++pos_;
      RNode n;
      n.kind = RNode::kGroup;
      const bool saved_icase = icase_;
      if (peek() == '?') {
        if (starts_with(U"?:")) {
          pos_ += 2;
        } else if (starts_with(U"?i:")) {
          pos_ += 3;
          icase_ = true;
        } else if (starts_with(U"?-i:")) {
          pos_ += 4;
          icase_ = false;
        } else if (starts_with(U"?=") || starts_with(U"?!")) {
          n.kind = RNode::kLook;
          n.negate = peek(1) == '!';
          pos_ += 2;
        } else {
          fail("unsupported group syntax '(?" + std::string(1, static_cast<char>(peek(1) < 128 ? peek(1) : '?')) + "'");
        }
      }
      n.alts = parse_alternatives(depth + 1);
      icase_ = saved_icase;
      if (at_end() || peek() != ')') fail("missing ')'");
      ++pos_;
      return n;
    }
    if (c == '[') return make_class(parse_class());
    if (c == '.') {
      ++pos_;
      CharClass cls;  // Oniguruma's '.' excludes only '\n'
      cls.negated = true;
      cls.items.push_back({CharClass::Item::kRange, false, '\n', '\n', 0});
      return make_class(std::move(cls));
    }
    if (c == '\\') {
      ++pos_;
      CharClass cls;
      char32_t lit;
      if (parse_escape(&cls, &lit)) return make_class(std::move(cls));
      return make_char(lit);
    }
    if (c == '^' || c == '$') fail("anchors are not supported");
    if (c == '*' || c == '+' || c == '?') fail("quantifier without operand");
    ++pos_;
    return make_char(c);
  }

  RNode make_char(char32_t c) {
    RNode n;
    n.kind = RNode::kChar;
    n.ch = c;
    char32_t v[3];
    n.icase = icase_ && case_variants(c, v) > 1;
    return n;
  }

  static bool category_by_name(const std::string& name, uint32_t* mask) {
    static const std::unordered_map<std::string, uint32_t> names = [] {
      std::unordered_map<std::string, uint32_t> m = {
          {"L", kCatL}, {"Letter", kCatL}, {"M", kCatM}, {"Mark", kCatM}, {"N", kCatN}, {"Number", kCatN},
          {"P", kCatP}, {"Punctuation", kCatP}, {"S", kCatS}, {"Symbol", kCatS}, {"Z", kCatZ},
          {"Separator", kCatZ}, {"C", kCatC}, {"Other", kCatC},
          {"LC", cat_bit(uc::Lu) | cat_bit(uc::Ll) | cat_bit(uc::Lt)},
          {"L&", cat_bit(uc::Lu) | cat_bit(uc::Ll) | cat_bit(uc::Lt)}};
      static const char* const kShort[] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                           "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                           "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};
      for (int i = 0; i < uc::kNumCategories; ++i) m[kShort[i]] = 1u << i;
      return m;
    }();
    auto it = names.find(name);
    if (it == names.end()) return false;
    *mask = it->second;
    return true;
  }

  uint32_t parse_hex(size_t max_digits, bool braced) {
    uint32_t v = 0;
    size_t n = 0;
    while (n < max_digits && !at_end()) {
      const char32_t d = peek();
      int x = d >= '0' && d <= '9' ? int(d - '0') : d >= 'a' && d <= 'f' ? int(d - 'a' + 10)
                                                  : d >= 'A' && d <= 'F' ? int(d - 'A' + 10) : -1;
      if (x < 0) break;
      v = v * 16 + x;
      ++n, ++pos_;
      if (v > 0x10FFFF) fail("code point above U+10FFFF");
    }
    if (n == 0) fail("expected hex digits");
    if (braced) {
      if (peek() != '}') fail("missing '}'");
      ++pos_;
    }
    if (v >= 0xD800 && v <= 0xDFFF) fail("surrogate code point");
    return v;
  }

  // After a backslash: fills `cls` and returns true for class escapes,
  // else stores the literal character.
  bool parse_escape(CharClass* cls, char32_t* lit) {
    if (at_end()) fail("trailing backslash");
    const char32_t c = peek();
    ++pos_;
    using Item = CharClass::Item;
    switch (c) {
      case 's': case 'S':
        cls->items.push_back({Item::kSpace, c == 'S', 0, 0, 0});
        return true;
      case 'w': case 'W':
        cls->items.push_back({Item::kWord, c == 'W', 0, 0, 0});
        return true;
      case 'd': case 'D':
        cls->items.push_back({Item::kDigit, c == 'D', 0, 0, 0});
        return true;
      case 'p': case 'P': {
        bool neg = c == 'P';
        std::string name;
        if (peek() == '{') {
          ++pos_;
          if (peek() == '^') {
            neg = !neg;
            ++pos_;
          }
          while (!at_end() && peek() != '}') {
            if (peek() >= 128) fail("bad property name");
            name += static_cast<char>(peek());
            ++pos_;
          }
          if (at_end()) fail("missing '}'");
          ++pos_;
        } else if (!at_end() && peek() < 128) {
          name = std::string(1, static_cast<char>(peek()));
          ++pos_;
        }
        uint32_t mask;
        if (!category_by_name(name, &mask)) fail("unsupported property \\p{" + name + "}");
        cls->items.push_back({Item::kCats, neg, 0, 0, mask});
        return true;
      }
      case 't': *lit = '\t'; return false;
      case 'n': *lit = '\n'; return false;
      case 'r': *lit = '\r'; return false;
      case 'f': *lit = '\f'; return false;
      case 'v': *lit = '\v'; return false;
      case 'a': *lit = 0x07; return false;
      case 'e': *lit = 0x1B; return false;
      case 'x':
        if (peek() == '{') {
          ++pos_;
          *lit = parse_hex(8, true);
        } else {
          *lit = parse_hex(2, false);
        }
        return false;
      case 'u': *lit = parse_hex(4, false); return false;
      default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
          fail(std::string("unsupported escape \\") + static_cast<char>(c));
        *lit = c;
        return false;
    }
  }

  CharClass parse_class() {
    ++pos_;  // '['
    CharClass cls;
    using Item = CharClass::Item;
    if (peek() == '^') {
      cls.negated = true;
      ++pos_;
    }
    bool first = true;
    while (true) {
      if (at_end()) fail("missing ']'");
      char32_t c = peek();
      if (c == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      if (c == '[') fail("nested character classes are not supported");
      if (c == '&' && peek(1) == '&') fail("class intersection is not supported");
      char32_t lo;
      ++pos_;
      if (c == '\\') {
        if (parse_escape(&cls, &lo)) continue;
      } else {
        lo = c;
      }
      if (peek() == '-' && peek(1) != ']' && pos_ + 1 < cps_.size()) {
        ++pos_;
        char32_t hi = peek();
        ++pos_;
        if (hi == '\\') {
          CharClass dummy;
          if (parse_escape(&dummy, &hi)) fail("class escape as range end");
        } else if (hi == '[') {
          fail("nested character classes are not supported");
        }
        if (hi < lo) fail("empty range in character class");
        cls.items.push_back({Item::kRange, false, lo, hi, 0});
      } else {
        cls.items.push_back({Item::kRange, false, lo, lo, 0});
      }
    }
    return cls;
  }

  std::vector<char32_t> cps_;
  size_t pos_ = 0;
  bool icase_ = false;
  Regex& re_;
};

Regex Regex::parse(const std::string& pattern) {
  Regex re;
  RegexParser(pattern, re).parse();
  return re;
}

Regex Regex::literal(const std::string& text) {
  Regex re;
  re.literal_ = text;
  RSeq seq;
  for (char32_t c : to_code_points(text)) {
    RNode n;
    n.ch = c;
    seq.push_back(n);
  }
  re.alts_.push_back(std::move(seq));
  return re;
}

// Backtracking matcher in continuation-passing style. Runs of one
// character class are matched by a loop rather than recursion, so depth grows
// with the pattern, not the text; a step budget turns patterns that
// backtrack exponentially into an error instead of a hang.
class RegexMatcher {
 public:
  RegexMatcher(const Regex& re, const std::string& s) : re_(re), s_(s) {
    budget_ = 10'000'000 + 512 * static_cast<uint64_t>(s.size());
  }

  // Leftmost match starting at or after `from` (a char boundary).
  bool search(size_t from, size_t* start, size_t* end) {
    for (size_t p = from;; p += char_len_at(s_, p)) {
      if (match_at(p, end)) {
        *start = p;
        return true;
      }
      if (p >= s_.size()) return false;
    }
  }

 private:
  struct Cont {
    const RSeq* seq;
    size_t idx;
    const Cont* next;
    const RNode* rep;  // non-null: resume repetition `rep` after one more iteration
    int count;
    size_t iter_start;
  };

  bool match_at(size_t pos, size_t* end) {
    for (const RSeq& alt : re_.alts_)
      if (seq(alt, 0, pos, nullptr, end, 0)) return true;
    return false;
  }

  bool char_matches(const RNode& n, size_t pos, size_t* len) const {
    if (pos >= s_.size()) return false;
    const char32_t c = decode_at(s_, pos, len);
    if (n.kind == RNode::kClass) return class_matches(re_.classes_[n.cls], c);
    if (c == n.ch) return true;
    if (!n.icase) return false;
    char32_t v[3];
    const int k = case_variants(n.ch, v);
    for (int i = 0; i < k; ++i)
      if (v[i] == c) return true;
    return false;
  }

  void tick(int depth) {
    if (++steps_ > budget_) throw Error("regex backtracking limit exceeded");
    if (depth > 2000) throw Error("regex recursion limit exceeded");
  }

  bool resume(const Cont* k, size_t pos, size_t* end, int depth) {
    if (k == nullptr) {
      *end = pos;
      return true;
    }
    if (k->rep) return repeat(*k->rep, k->count, pos, k->iter_start, k->next, end, depth + 1);
    return seq(*k->seq, k->idx, pos, k->next, end, depth + 1);
  }

  bool repeat(const RNode& n, int count, size_t pos, size_t iter_start, const Cont* after, size_t* end,
              int depth) {
    tick(depth);
    // An iteration that consumed nothing ends the loop (it could repeat forever).
    const bool stalled = pos == iter_start;
    const bool can_more = !stalled && (n.max < 0 || count < n.max);
    const bool can_stop = count >= n.min || stalled;
    const Cont body_k{nullptr, 0, after, &n, count + 1, pos};
    if (n.greedy) {
      if (can_more && seq(n.alts[0], 0, pos, &body_k, end, depth + 1)) return true;
      return can_stop && resume(after, pos, end, depth);
    }
    if (can_stop && resume(after, pos, end, depth)) return true;
    return can_more && seq(n.alts[0], 0, pos, &body_k, end, depth + 1);
  }

  bool seq(const RSeq& q, size_t i, size_t pos, const Cont* k, size_t* end, int depth) {
    tick(depth);
    for (; i < q.size(); ++i) {
      const RNode& n = q[i];
      size_t len;
      switch (n.kind) {
        case RNode::kChar:
        case RNode::kClass:
          if (!char_matches(n, pos, &len)) return false;
          pos += len;
          continue;
        case RNode::kGroup: {
          const Cont next{&q, i + 1, k, nullptr, 0, 0};
          for (const RSeq& alt : n.alts)
            if (seq(alt, 0, pos, &next, end, depth + 1)) return true;
          return false;
        }
        case RNode::kLook: {
          size_t ignored;
          bool found = false;
          for (const RSeq& alt : n.alts)
            if (seq(alt, 0, pos, nullptr, &ignored, depth + 1)) {
              found = true;
              break;
            }
          if (found == n.negate) return false;
          continue;
        }
        case RNode::kRepeat:
          if (n.alts[0][0].single_char()) return repeat_char(n, q, i, pos, k, end, depth);
          {
            const Cont after{&q, i + 1, k, nullptr, 0, 0};
            return repeat(n, 0, pos, std::numeric_limits<size_t>::max(), &after, end, depth + 1);
          }
      }
    }
    return resume(k, pos, end, depth);
  }

  bool repeat_char(const RNode& n, const RSeq& q, size_t i, size_t pos, const Cont* k, size_t* end, int depth) {
    const RNode& atom = n.alts[0][0];
    size_t len;
    if (!n.greedy) {
      for (int count = 0;; ++count) {
        if (count >= n.min && seq(q, i + 1, pos, k, end, depth + 1)) return true;
        if ((n.max >= 0 && count >= n.max) || !char_matches(atom, pos, &len)) return false;
        pos += len;
        tick(depth);
      }
    }
    int count = 0;
    size_t p = pos;
    while ((n.max < 0 || count < n.max) && char_matches(atom, p, &len)) {
      p += len;
      ++count;
    }
    if (count < n.min) return false;
    if (n.possessive) return seq(q, i + 1, p, k, end, depth + 1);
    for (;; --count) {
      if (seq(q, i + 1, p, k, end, depth + 1)) return true;
      if (count == n.min) return false;
      do --p;
      while ((static_cast<unsigned char>(s_[p]) & 0xC0) == 0x80);
    }
  }

  const Regex& re_;
  const std::string& s_;
  uint64_t steps_ = 0, budget_;
};

std::vector<std::pair<size_t, size_t>> Regex::find_all(const std::string& s) const {
  std::vector<std::pair<size_t, size_t>> out;
  if (!literal_.empty()) {
    for (size_t p = s.find(literal_); p != std::string::npos; p = s.find(literal_, p + literal_.size()))
      out.emplace_back(p, p + literal_.size());
    return out;
  }
  RegexMatcher m(*this, s);
  // onig's FindMatches: an empty match right where the previous match ended
  // is skipped by advancing one character.
  size_t last_end = 0;
  bool have_last = false;
  size_t last_match_end = 0;
  while (last_end <= s.size()) {
    size_t a, b;
    if (!m.search(last_end, &a, &b)) break;
    if (a == b && have_last && last_match_end == b) {
      if (last_end >= s.size()) break;
      last_end += char_len_at(s, last_end);
      continue;
    }
    last_end = b;
    last_match_end = b;
    have_last = true;
    out.emplace_back(a, b);
  }
  return out;
}

// ---------------------------------------------------------------------------
// Splitting, as NormalizedString::split with a Pattern.

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Span {
  size_t start, end;
  bool is_match;
};

// Pattern::find_matches: the whole string as ordered spans, matches flagged.
std::vector<Span> spans_from_matches(const std::string& s, const std::vector<std::pair<size_t, size_t>>& matches) {
  std::vector<Span> out;
  if (s.empty()) return {{0, 0, false}};
  size_t prev = 0;
  for (auto [a, b] : matches) {
    if (prev != a) out.push_back({prev, a, false});
    out.push_back({a, b, true});
    prev = b;
  }
  if (prev != s.size()) out.push_back({prev, s.size(), false});
  return out;
}

template <typename Pred>
std::vector<Span> spans_from_char_predicate(const std::string& s, Pred pred) {
  std::vector<Span> out;
  if (s.empty()) return {{0, 0, false}};
  size_t last = 0, len;
  for (size_t i = 0; i < s.size(); i += len) {
    const char32_t c = decode_at(s, i, &len);
    if (pred(c)) {
      if (last < i) out.push_back({last, i, false});
      out.push_back({i, i + len, true});
      last = i + len;
    }
  }
  if (s.size() > last) out.push_back({last, s.size(), false});
  return out;
}

// Returns [start, end) ranges to keep, per behavior (empty ones included;
// callers drop them as PreTokenizedString::split does).
std::vector<std::pair<size_t, size_t>> apply_behavior(std::vector<Span> m, SplitBehavior b) {
  std::vector<std::pair<size_t, size_t>> out;
  switch (b) {
    case SplitBehavior::kIsolated:
      for (const Span& x : m) out.emplace_back(x.start, x.end);
      break;
    case SplitBehavior::kRemoved:
      for (const Span& x : m)
        if (!x.is_match) out.emplace_back(x.start, x.end);
      break;
    case SplitBehavior::kContiguous: {
      bool prev = false;
      for (const Span& x : m) {
        if (x.is_match == prev && !out.empty())
          out.back().second = x.end;
        else
          out.emplace_back(x.start, x.end);
        prev = x.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool prev = false;
      for (const Span& x : m) {
        if (x.is_match && !prev && !out.empty())
          out.back().second = x.end;
        else
          out.emplace_back(x.start, x.end);
        prev = x.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool prev = false;
      for (auto it = m.rbegin(); it != m.rend(); ++it) {
        if (it->is_match && !prev && !out.empty())
          out.back().first = it->start;
        else
          out.emplace_back(it->start, it->end);
        prev = it->is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Pipeline pieces

// A split of the input. `token` >= 0: an added token already resolved.
// `at_origin`: the split begins at offset 0 of the original input.
struct Piece {
  std::string text;
  int32_t token = -1;
  bool at_origin = false;
};

// Applies `split_fn(piece) -> sub-ranges` to every unresolved piece, keeping
// non-empty results; only the sub-piece at offset 0 keeps `at_origin`.
template <typename F>
void split_pieces(std::vector<Piece>& pieces, F split_fn) {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece& p : pieces) {
    if (p.token >= 0) {
      out.push_back(std::move(p));
      continue;
    }
    for (auto [a, b] : split_fn(p.text)) {
      if (a == b) continue;
      out.push_back({p.text.substr(a, b - a), -1, p.at_origin && a == 0});
    }
  }
  pieces = std::move(out);
}

// GPT-2's byte <-> printable character table.
struct ByteMap {
  std::array<std::string, 256> to_char;
  std::unordered_map<char32_t, uint8_t> to_byte;
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = printable ? b : 256 + n++;
      append_utf8(to_char[b], c);
      to_byte[c] = static_cast<uint8_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

std::string byte_level_encode(const std::string& s) {
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char b : s) out += byte_map().to_char[b];
  return out;
}

// The "<0xAB>" token name for a byte.
std::string byte_token(uint8_t b) {
  static const char* hex = "0123456789ABCDEF";
  return std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
}

const char* const kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// ---- Normalizers

struct Normalizer {
  virtual ~Normalizer() = default;
  virtual void apply(std::string& s) const = 0;
};

struct SequenceNormalizer : Normalizer {
  std::vector<std::unique_ptr<Normalizer>> parts;
  void apply(std::string& s) const override {
    for (const auto& p : parts) p->apply(s);
  }
};

struct ReplaceNormalizer : Normalizer {
  Regex pattern;
  std::string content;
  void apply(std::string& s) const override {
    const auto matches = pattern.find_all(s);
    if (matches.empty()) return;
    std::string out;
    out.reserve(s.size());
    for (const Span& x : spans_from_matches(s, matches)) {
      if (x.is_match)
        out += content;
      else
        out.append(s, x.start, x.end - x.start);
    }
    s = std::move(out);
  }
};

struct PrependNormalizer : Normalizer {
  std::string prefix;
  void apply(std::string& s) const override {
    if (!s.empty()) s.insert(0, prefix);
  }
};

struct StripNormalizer : Normalizer {
  bool left = false, right = false;
  void apply(std::string& s) const override {
    size_t a = 0, b = s.size(), len;
    if (left)
      while (a < b && is_white_space(decode_at(s, a, &len))) a += len;
    if (right)
      while (b > a) {
        size_t p = b - 1;
        while ((static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
        if (!is_white_space(decode_at(s, p, &len))) break;
        b = p;
      }
    s = s.substr(a, b - a);
  }
};

struct UnicodeNormalizer : Normalizer {  // NFC, NFD
  bool compose = true;
  void apply(std::string& s) const override {
    // Below U+0300 NFC changes nothing, and below U+00C0 NFD neither: most
    // text skips the work.
    const unsigned char first_affected = compose ? 0xCC : 0xC3;
    if (std::none_of(s.begin(), s.end(), [&](char c) { return static_cast<unsigned char>(c) >= first_affected; }))
      return;
    s = unicode_normalize(s, compose);
  }
};

struct ByteLevelNormalizer : Normalizer {
  void apply(std::string& s) const override { s = byte_level_encode(s); }
};

// ---- Pre-tokenizers

struct PreTokenizer {
  virtual ~PreTokenizer() = default;
  virtual void apply(std::vector<Piece>& pieces) const = 0;
};

struct SequencePreTokenizer : PreTokenizer {
  std::vector<std::unique_ptr<PreTokenizer>> parts;
  void apply(std::vector<Piece>& pieces) const override {
    for (const auto& p : parts) p->apply(pieces);
  }
};

struct SplitPreTokenizer : PreTokenizer {
  Regex pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  void apply(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](const std::string& s) {
      auto spans = spans_from_matches(s, pattern.find_all(s));
      if (invert)
        for (Span& x : spans) x.is_match = !x.is_match;
      return apply_behavior(std::move(spans), behavior);
    });
  }
};

struct ByteLevelPreTokenizer : PreTokenizer {
  bool add_prefix_space = true;
  bool use_regex = true;
  Regex gpt2 = Regex::parse(kGpt2Pattern);
  void apply(std::vector<Piece>& pieces) const override {
    for (Piece& p : pieces)
      if (p.token < 0 && add_prefix_space && !p.text.empty() && p.text[0] != ' ') p.text.insert(0, " ");
    if (use_regex)
      split_pieces(pieces, [&](const std::string& s) {
        return apply_behavior(spans_from_matches(s, gpt2.find_all(s)), SplitBehavior::kIsolated);
      });
    for (Piece& p : pieces)
      if (p.token < 0) p.text = byte_level_encode(p.text);
  }
};

enum class PrependScheme { kAlways, kFirst, kNever };

struct MetaspacePreTokenizer : PreTokenizer {
  char32_t replacement = 0x2581;
  std::string rep;
  PrependScheme scheme = PrependScheme::kAlways;
  bool split = true;
  void apply(std::vector<Piece>& pieces) const override {
    for (Piece& p : pieces) {
      if (p.token >= 0) continue;
      std::string t;
      t.reserve(p.text.size() + 8);
      for (char c : p.text) {
        if (c == ' ')
          t += rep;
        else
          t += c;
      }
      const bool starts = t.compare(0, rep.size(), rep) == 0;
      if (!t.empty() && !starts &&
          (scheme == PrependScheme::kAlways || (scheme == PrependScheme::kFirst && p.at_origin)))
        t.insert(0, rep);
      p.text = std::move(t);
    }
    if (split)
      split_pieces(pieces, [&](const std::string& s) {
        return apply_behavior(spans_from_char_predicate(s, [&](char32_t c) { return c == replacement; }),
                              SplitBehavior::kMergedWithNext);
      });
  }
};

struct DigitsPreTokenizer : PreTokenizer {
  bool individual = false;
  void apply(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](const std::string& s) {
      return apply_behavior(spans_from_char_predicate(s, [](char32_t c) { return in_cats(c, kCatN); }),
                            individual ? SplitBehavior::kIsolated : SplitBehavior::kContiguous);
    });
  }
};

struct WhitespaceSplitPreTokenizer : PreTokenizer {
  void apply(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [](const std::string& s) {
      return apply_behavior(spans_from_char_predicate(s, is_white_space), SplitBehavior::kRemoved);
    });
  }
};

// ---- Models

class ByteTrie {
 public:
  // Later duplicates of a key overwrite earlier ones.
  void build(std::vector<std::pair<std::string, int32_t>> keys) {
    std::stable_sort(keys.begin(), keys.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    nodes_.assign(1, Node{0, 0, -1});
    edges_.clear();
    // Builds children of each node contiguously, breadth-first over ranges
    // of the sorted keys that share a prefix (no recursion: keys may be long).
    struct Job {
      uint32_t node;
      size_t lo, hi, depth;
    };
    std::vector<Job> jobs{{0, 0, keys.size(), 0}};
    while (!jobs.empty()) {
      const Job j = jobs.back();
      jobs.pop_back();
      size_t lo = j.lo;
      while (lo < j.hi && keys[lo].first.size() == j.depth) nodes_[j.node].id = keys[lo++].second;
      nodes_[j.node].edge_begin = static_cast<uint32_t>(edges_.size());
      uint32_t count = 0;
      for (size_t a = lo; a < j.hi; ++count) {
        const unsigned char label = keys[a].first[j.depth];
        size_t b = a;
        while (b < j.hi && static_cast<unsigned char>(keys[b].first[j.depth]) == label) ++b;
        const auto child = static_cast<uint32_t>(nodes_.size());
        nodes_.push_back(Node{0, 0, -1});
        edges_.push_back(Edge{label, child});
        jobs.push_back({child, a, b, j.depth + 1});
        a = b;
      }
      nodes_[j.node].edge_count = count;
    }
  }

  uint32_t root() const { return 0; }
  // Child of `node` along byte `b`, or 0 (the root is never a child).
  uint32_t child(uint32_t node, unsigned char b) const {
    const Node& n = nodes_[node];
    const Edge* first = edges_.data() + n.edge_begin;
    const Edge* last = first + n.edge_count;
    const Edge* it = std::lower_bound(first, last, b, [](const Edge& e, unsigned char v) { return e.label < v; });
    return it != last && it->label == b ? it->child : 0;
  }
  int32_t id(uint32_t node) const { return nodes_[node].id; }

 private:
  struct Node {
    uint32_t edge_begin, edge_count;
    int32_t id;
  };
  struct Edge {
    unsigned char label;
    uint32_t child;
  };
  std::vector<Node> nodes_;
  std::vector<Edge> edges_;
};

struct Model {
  virtual ~Model() = default;
  virtual void tokenize(const std::string& s, std::vector<int32_t>& out) const = 0;
  virtual int32_t token_to_id(const std::string& t) const = 0;
  virtual const std::string* id_to_token(int32_t id) const = 0;
  virtual int64_t size() const = 0;        // `tokenizers`' Model::get_vocab_size
  virtual int32_t max_id() const = 0;
};

class BpeModel : public Model {
 public:
  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<int32_t, std::string> vocab_r;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a,b) -> (rank, new id)
  std::string unk_token, prefix, suffix;
  bool has_unk = false, has_prefix = false, has_suffix = false;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::string origin;

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  void tokenize(const std::string& s, std::vector<int32_t>& out) const override {
    if (s.empty()) return;
    if (ignore_merges) {
      auto it = vocab.find(s);
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    merge_word(s, out);
  }

  int32_t token_to_id(const std::string& t) const override {
    auto it = vocab.find(t);
    return it == vocab.end() ? -1 : it->second;
  }
  const std::string* id_to_token(int32_t id) const override {
    auto it = vocab_r.find(id);
    return it == vocab_r.end() ? nullptr : &it->second;
  }
  int64_t size() const override { return static_cast<int64_t>(vocab.size()); }
  int32_t max_id() const override {
    int32_t m = -1;
    for (const auto& kv : vocab_r) m = std::max(m, kv.first);
    return m;
  }

 private:
  struct Symbol {
    int32_t c;
    int64_t prev, next;
    size_t len;
  };
  struct Merge {
    size_t pos;
    int32_t rank, new_id;
    // std::priority_queue pops the largest: lowest rank first, then leftmost.
    bool operator<(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };

  // BPE::merge_word then Word::merge_all, with no dropout.
  void merge_word(const std::string& w, std::vector<int32_t>& out) const {
    std::vector<Symbol> sym;
    sym.reserve(w.size());
    const auto add = [&](int32_t c, size_t len) {
      const auto n = static_cast<int64_t>(sym.size());
      if (!sym.empty()) sym.back().next = n;
      sym.push_back({c, n - 1, -1, len});
    };
    bool unk_pending = false;
    int32_t unk_id = 0;
    size_t unk_len = 0;
    std::string piece;
    for (size_t i = 0, len; i < w.size(); i += len) {
      len = char_len_at(w, i);
      piece.clear();
      if (i != 0 && has_prefix) piece += prefix;
      piece.append(w, i, len);
      if (i + len >= w.size() && has_suffix) piece += suffix;
      auto it = vocab.find(piece);
      if (it != vocab.end()) {
        if (unk_pending) {
          add(unk_id, unk_len);
          unk_pending = false;
        }
        add(it->second, len);
        continue;
      }
      if (byte_fallback) {
        std::vector<int32_t> bytes;
        for (unsigned char b : piece) {
          auto bt = vocab.find(byte_token(b));
          if (bt == vocab.end()) break;
          bytes.push_back(bt->second);
        }
        if (bytes.size() == piece.size()) {
          // Each byte token counts as one byte of the word, as `tokenizers` does.
          for (int32_t id : bytes) add(id, 1);
          continue;
        }
      }
      if (has_unk) {
        auto u = vocab.find(unk_token);
        if (u == vocab.end())
          throw Error(origin + ": model.unk_token '" + unk_token + "' is not in model.vocab");
        if (unk_pending && fuse_unk) {
          unk_len += len;
        } else {
          if (unk_pending) add(unk_id, unk_len);
          unk_pending = true;
          unk_id = u->second;
          unk_len = len;
        }
      }
    }
    if (unk_pending) add(unk_id, unk_len);

    std::priority_queue<Merge> queue;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto m = merges.find(pair_key(sym[i].c, sym[i + 1].c));
      if (m != merges.end()) queue.push({i, m->second.first, m->second.second});
    }
    while (!queue.empty()) {
      const Merge top = queue.top();
      queue.pop();
      Symbol& cur = sym[top.pos];
      if (cur.len == 0 || cur.next == -1) continue;
      const auto next_pos = static_cast<size_t>(cur.next);
      const Symbol right = sym[next_pos];
      // Stale entry: the pair changed since it was queued.
      auto m = merges.find(pair_key(cur.c, right.c));
      if (m == merges.end() || m->second.second != top.new_id) continue;
      cur.c = top.new_id;
      cur.len += right.len;
      cur.next = right.next;
      sym[next_pos].len = 0;
      if (right.next > -1 && static_cast<size_t>(right.next) < sym.size()) sym[right.next].prev = top.pos;
      if (cur.prev >= 0) {
        auto pm = merges.find(pair_key(sym[cur.prev].c, cur.c));
        if (pm != merges.end()) queue.push({static_cast<size_t>(cur.prev), pm->second.first, pm->second.second});
      }
      if (cur.next >= 0 && static_cast<size_t>(cur.next) < sym.size()) {
        auto nm = merges.find(pair_key(cur.c, sym[cur.next].c));
        if (nm != merges.end()) queue.push({top.pos, nm->second.first, nm->second.second});
      }
    }
    for (const Symbol& s : sym)
      if (s.len != 0) out.push_back(s.c);
  }
};

class UnigramModel : public Model {
 public:
  std::vector<std::pair<std::string, double>> pieces;
  std::unordered_map<std::string, int32_t> token_to_ids;
  ByteTrie trie;
  double min_score = std::numeric_limits<double>::infinity();
  int32_t unk_id = -1;
  bool byte_fallback = false;
  std::string origin;

  void finish() {
    std::vector<std::pair<std::string, int32_t>> keys;
    keys.reserve(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) {
      token_to_ids[pieces[i].first] = static_cast<int32_t>(i);
      min_score = std::min(min_score, pieces[i].second);
    }
    for (const auto& kv : token_to_ids) keys.emplace_back(kv.first, kv.second);
    trie.build(std::move(keys));
  }

  void tokenize(const std::string& s, std::vector<int32_t>& out) const override {
    if (s.empty()) return;
    for (const auto& [start, end] : viterbi(s)) {
      const std::string piece = s.substr(start, end - start);
      auto it = token_to_ids.find(piece);
      if (it != token_to_ids.end()) {
        out.push_back(it->second);
        continue;
      }
      if (byte_fallback) {
        std::vector<int32_t> bytes;
        for (unsigned char b : piece) {
          auto bt = token_to_ids.find(byte_token(b));
          if (bt == token_to_ids.end()) break;
          bytes.push_back(bt->second);
        }
        if (bytes.size() == piece.size()) {
          out.insert(out.end(), bytes.begin(), bytes.end());
          continue;
        }
      }
      out.push_back(require_unk(piece));
    }
  }

  int32_t token_to_id(const std::string& t) const override {
    auto it = token_to_ids.find(t);
    return it == token_to_ids.end() ? -1 : it->second;
  }
  const std::string* id_to_token(int32_t id) const override {
    return id >= 0 && static_cast<size_t>(id) < pieces.size() ? &pieces[id].first : nullptr;
  }
  int64_t size() const override { return static_cast<int64_t>(pieces.size()); }
  int32_t max_id() const override { return static_cast<int32_t>(pieces.size()) - 1; }

 private:
  static constexpr double kUnkPenalty = 10.0;

  int32_t require_unk(const std::string& text) const {
    if (unk_id < 0)
      throw Error(origin + ": Unigram model has no unk_id, cannot encode '" + text + "'");
    return unk_id;
  }

  // Unigram::encode_optimized: best-scoring segmentation; consecutive unknown
  // characters are fused into one piece. Returns byte ranges.
  std::vector<std::pair<size_t, size_t>> viterbi(const std::string& s) const {
    struct Node {
      int32_t id = 0;
      double score = 0.0;
      int64_t start = -1;
    };
    const size_t n = s.size();
    const double unk_score = min_score - kUnkPenalty;
    std::vector<Node> best(n + 1);
    for (size_t pos = 0; pos < n;) {
      const double base = best[pos].score;
      const size_t mblen = char_len_at(s, pos);
      bool has_single = false;
      uint32_t node = trie.root();
      for (size_t k = pos; k < n; ++k) {
        node = trie.child(node, static_cast<unsigned char>(s[k]));
        if (node == 0) break;
        const int32_t id = trie.id(node);
        if (id < 0) continue;
        const size_t key_end = k + 1;
        const double cand = pieces[id].second + base;
        Node& t = best[key_end];
        if (t.start < 0 || cand > t.score) {
          t.score = cand;
          t.start = static_cast<int64_t>(pos);
          t.id = id;
        }
        if (key_end - pos == mblen) has_single = true;
      }
      if (!has_single) {
        Node& t = best[pos + mblen];
        const double cand = unk_score + base;
        if (t.start < 0 || cand > t.score) {
          t.score = cand;
          t.start = static_cast<int64_t>(pos);
          t.id = require_unk(s.substr(pos, mblen));
        }
      }
      pos += mblen;
    }
    std::vector<std::pair<size_t, size_t>> out;
    bool fusing = false;
    for (size_t end = n; end > 0;) {
      const Node& node = best[end];
      const auto start = static_cast<size_t>(node.start);
      if (node.id == unk_id && fusing) {
        out.back().first = start;
      } else {
        out.emplace_back(start, end);
      }
      fusing = node.id == unk_id;
      end = start;
    }
    std::reverse(out.begin(), out.end());
    return out;
  }
};

// ---- Post-processors

struct PostProcessor {
  virtual ~PostProcessor() = default;
  virtual void apply(std::vector<int32_t>& ids, bool add_special) const = 0;
  virtual int32_t bos() const = 0;  // -1 if the processor prepends nothing
};

struct TemplateProcessor : PostProcessor {
  // Entries: -1 = the sequence, else index into `specials`.
  std::vector<int> single;
  std::vector<std::vector<int32_t>> specials;
  void apply(std::vector<int32_t>& ids, bool add_special) const override {
    std::vector<int32_t> out;
    out.reserve(ids.size() + 4);
    for (int e : single) {
      if (e < 0)
        out.insert(out.end(), ids.begin(), ids.end());
      else if (add_special)
        out.insert(out.end(), specials[e].begin(), specials[e].end());
    }
    ids = std::move(out);
  }
  int32_t bos() const override {
    for (int e : single) {
      if (e < 0) return -1;
      if (!specials[e].empty()) return specials[e][0];
    }
    return -1;
  }
};

struct ClsSepProcessor : PostProcessor {  // BertProcessing, RobertaProcessing
  int32_t cls = 0, sep = 0;
  void apply(std::vector<int32_t>& ids, bool add_special) const override {
    if (!add_special) return;
    ids.insert(ids.begin(), cls);
    ids.push_back(sep);
  }
  int32_t bos() const override { return cls; }
};

struct NoopProcessor : PostProcessor {  // ByteLevel: offsets only
  void apply(std::vector<int32_t>&, bool) const override {}
  int32_t bos() const override { return -1; }
};

struct SequenceProcessor : PostProcessor {
  std::vector<std::unique_ptr<PostProcessor>> parts;
  void apply(std::vector<int32_t>& ids, bool add_special) const override {
    for (const auto& p : parts) p->apply(ids, add_special);
  }
  int32_t bos() const override {
    for (const auto& p : parts)
      if (p->bos() >= 0) return p->bos();
    return -1;
  }
};

// ---- Decoders

struct Decoder {
  virtual ~Decoder() = default;
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};

struct SequenceDecoder : Decoder {
  std::vector<std::unique_ptr<Decoder>> parts;
  void apply(std::vector<std::string>& t) const override {
    for (const auto& p : parts) p->apply(t);
  }
};

struct ReplaceDecoder : Decoder {
  Regex pattern;
  std::string content;
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      std::string out;
      for (const Span& x : spans_from_matches(t, pattern.find_all(t))) {
        if (x.is_match)
          out += content;
        else
          out.append(t, x.start, x.end - x.start);
      }
      t = std::move(out);
    }
  }
};

struct ByteFallbackDecoder : Decoder {
  // Parses "<0xAB>" the way Rust's u8::from_str_radix(.., 16) reads the two
  // characters (which also accepts a '+' sign before a single digit).
  static bool parse_byte(const std::string& t, uint8_t* out) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return false;
    const auto hex = [](char c) {
      return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    };
    if (t[3] == '+') {
      const int d = hex(t[4]);
      if (d < 0) return false;
      *out = static_cast<uint8_t>(d);
      return true;
    }
    const int hi = hex(t[3]), lo = hex(t[4]);
    if (hi < 0 || lo < 0) return false;
    *out = static_cast<uint8_t>(hi * 16 + lo);
    return true;
  }

  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string bytes;
    const auto flush = [&] {
      if (bytes.empty()) return;
      if (is_valid_utf8(bytes)) {
        out.push_back(bytes);
      } else {
        for (size_t i = 0; i < bytes.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      bytes.clear();
    };
    for (std::string& t : tokens) {
      uint8_t b;
      if (parse_byte(t, &b)) {
        bytes += static_cast<char>(b);
        continue;
      }
      flush();
      out.push_back(std::move(t));
    }
    flush();
    tokens = std::move(out);
  }
};

struct FuseDecoder : Decoder {
  void apply(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

struct StripDecoder : Decoder {
  char32_t content = ' ';
  size_t start = 0, stop = 0;
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      const std::vector<char32_t> cps = to_code_points(t);
      size_t a = 0, b = cps.size();
      for (size_t i = 0; i < start && i < cps.size() && cps[i] == content; ++i) a = i + 1;
      for (size_t i = 0; i < stop && i < cps.size() && cps[cps.size() - 1 - i] == content; ++i)
        b = cps.size() - 1 - i;
      std::string out;
      for (size_t i = a; i < b; ++i) append_utf8(out, cps[i]);
      t = std::move(out);
    }
  }
};

struct MetaspaceDecoder : Decoder {
  char32_t replacement = 0x2581;
  PrependScheme scheme = PrependScheme::kAlways;
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      size_t len;
      for (size_t k = 0; k < tokens[i].size(); k += len) {
        const char32_t c = decode_at(tokens[i], k, &len);
        if (c != replacement)
          out.append(tokens[i], k, len);
        else if (i != 0 || scheme == PrependScheme::kNever)
          out += ' ';
      }
      tokens[i] = std::move(out);
    }
  }
};

struct ByteLevelDecoder : Decoder {
  void apply(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& t : tokens) {
      std::string mapped;
      bool all = true;
      size_t len;
      for (size_t k = 0; k < t.size() && all; k += len) {
        auto it = byte_map().to_byte.find(decode_at(t, k, &len));
        if (it == byte_map().to_byte.end())
          all = false;
        else
          mapped += static_cast<char>(it->second);
      }
      bytes += all ? mapped : t;
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

struct BpeSuffixDecoder : Decoder {  // BPEDecoder
  std::string suffix;
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      const std::string rep = i + 1 == tokens.size() ? "" : " ";
      std::string& t = tokens[i];
      if (suffix.empty()) continue;
      std::string out;
      size_t prev = 0;
      for (size_t p = t.find(suffix); p != std::string::npos; p = t.find(suffix, prev)) {
        out.append(t, prev, p - prev);
        out += rep;
        prev = p + suffix.size();
      }
      out.append(t, prev, std::string::npos);
      t = std::move(out);
    }
  }
};

// ---- Added tokens

struct AddedToken {
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

struct AddedMatch {
  size_t start, end;
  int32_t id;
};

}  // namespace

// ---------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string origin;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Model> model;
  std::unique_ptr<PostProcessor> post_processor;
  std::unique_ptr<Decoder> decoder;

  std::unordered_map<std::string, int32_t> added_ids;     // content -> id
  std::unordered_map<int32_t, AddedToken> added_tokens;   // id -> token (last added wins)
  std::unordered_map<int32_t, std::string> added_strings; // id -> decode form (normalized when it differs)
  std::unordered_set<std::string> special_contents;
  ByteTrie raw_trie, norm_trie;
  bool has_raw = false, has_norm = false;
  int32_t bos = -1, eos = -1;
  int64_t vocab_size = 0;

  int32_t token_to_id(const std::string& t) const {
    auto it = added_ids.find(t);
    return it != added_ids.end() ? it->second : model->token_to_id(t);
  }
  const std::string* id_to_token(int32_t id) const {
    auto it = added_strings.find(id);
    return it != added_strings.end() ? &it->second : model->id_to_token(id);
  }

  void add_tokens(const std::vector<AddedToken>& tokens) {
    // AddedVocabulary::add_tokens: an id comes from an existing entry with the
    // same content, else the next free id after the model's vocabulary (the
    // "id" written in the file is not used, as in `tokenizers`).
    int32_t next_id = static_cast<int32_t>(model->size());
    for (const AddedToken& t : tokens) {
      if (t.content.empty()) continue;
      int32_t id = token_to_id(t.content);
      if (id < 0) id = next_id++;
      added_ids[t.content] = id;
      if (t.special) special_contents.insert(t.content);
      added_tokens[id] = t;
    }
    std::vector<std::pair<std::string, int32_t>> raw, norm;
    for (const auto& [id, t] : added_tokens) {
      std::string form = t.content;
      if (t.normalized && normalizer) normalizer->apply(form);
      added_strings[id] = form;
      if (form.empty()) continue;
      (t.normalized ? norm : raw).emplace_back(form, id);
    }
    has_raw = !raw.empty();
    has_norm = !norm.empty();
    raw_trie.build(std::move(raw));
    norm_trie.build(std::move(norm));
  }

  // AddedVocabulary::find_matches: leftmost-longest, non-overlapping; a
  // rejected single_word match still consumes its text.
  std::vector<AddedMatch> find_added(const std::string& s, const ByteTrie& trie) const {
    std::vector<AddedMatch> out;
    size_t start_offset = 0;
    for (size_t p = 0; p < s.size();) {
      uint32_t node = trie.root();
      size_t best_end = 0;
      int32_t best_id = -1;
      for (size_t k = p; k < s.size(); ++k) {
        node = trie.child(node, static_cast<unsigned char>(s[k]));
        if (node == 0) break;
        if (trie.id(node) >= 0) {
          best_id = trie.id(node);
          best_end = k + 1;
        }
      }
      if (best_id < 0) {
        ++p;
        continue;
      }
      size_t start = p, stop = best_end;
      p = best_end;
      const AddedToken& t = added_tokens.at(best_id);
      if (t.single_word) {
        bool word_before = false, word_after = false;
        if (start > 0) {
          size_t q = start - 1, len;
          while ((static_cast<unsigned char>(s[q]) & 0xC0) == 0x80) --q;
          word_before = is_rust_word(decode_at(s, q, &len));
        }
        if (stop < s.size()) {
          size_t len;
          word_after = is_rust_word(decode_at(s, stop, &len));
        }
        if (word_before || word_after) continue;
      }
      if (t.lstrip) {
        size_t a = start;
        while (a > 0) {
          size_t q = a - 1, len;
          while ((static_cast<unsigned char>(s[q]) & 0xC0) == 0x80) --q;
          if (!is_white_space(decode_at(s, q, &len))) break;
          a = q;
        }
        start = std::max(a, start_offset);
      }
      if (t.rstrip) {
        size_t len;
        while (stop < s.size() && is_white_space(decode_at(s, stop, &len))) stop += len;
        p = stop;
      }
      out.push_back({start, stop, best_id});
      start_offset = stop;
    }
    return out;
  }

  void split_added(std::vector<Piece>& pieces, const ByteTrie& trie, bool has_patterns, bool normalize) const {
    std::vector<Piece> out;
    for (Piece& p : pieces) {
      if (p.token >= 0) {
        out.push_back(std::move(p));
        continue;
      }
      if (normalize && normalizer) normalizer->apply(p.text);
      if (!has_patterns) {
        if (!p.text.empty()) out.push_back(std::move(p));
        continue;
      }
      size_t prev = 0;
      for (const AddedMatch& m : find_added(p.text, trie)) {
        if (prev < m.start) out.push_back({p.text.substr(prev, m.start - prev), -1, p.at_origin && prev == 0});
        out.push_back({std::string(), m.id, false});
        prev = m.end;
      }
      if (prev < p.text.size()) out.push_back({p.text.substr(prev), -1, p.at_origin && prev == 0});
    }
    pieces = std::move(out);
  }

  std::vector<int32_t> encode(const std::string& raw_text, bool add_special) const {
    const std::string text = is_valid_utf8(raw_text) ? raw_text : utf8_lossy(raw_text);
    std::vector<Piece> pieces{{text, -1, true}};
    split_added(pieces, raw_trie, has_raw, false);
    split_added(pieces, norm_trie, has_norm, true);
    if (pre_tokenizer) pre_tokenizer->apply(pieces);
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    // Words repeat a lot in real text; memoize the model per encode call.
    std::unordered_map<std::string, std::vector<int32_t>> cache;
    for (const Piece& p : pieces) {
      if (p.token >= 0) {
        ids.push_back(p.token);
        continue;
      }
      if (p.text.size() > 256) {
        model->tokenize(p.text, ids);
        continue;
      }
      auto it = cache.find(p.text);
      if (it == cache.end()) {
        std::vector<int32_t> word;
        model->tokenize(p.text, word);
        it = cache.emplace(p.text, std::move(word)).first;
      }
      ids.insert(ids.end(), it->second.begin(), it->second.end());
    }
    if (post_processor) post_processor->apply(ids, add_special);
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      const std::string* t = id_to_token(id);
      if (t == nullptr) continue;  // unknown ids are dropped, as in `tokenizers`
      if (skip_special && special_contents.count(*t)) continue;
      tokens.push_back(*t);
    }
    if (!decoder) {
      std::string out;
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (i) out += ' ';
        out += tokens[i];
      }
      return out;
    }
    if (tokens.empty()) return std::string();
    decoder->apply(tokens);
    std::string out;
    for (const std::string& t : tokens) out += t;
    return out;
  }
};

// ---------------------------------------------------------------------------
// Loading

namespace {

// serde_json's float parsing without its float_roundtrip feature, which is
// what `tokenizers` gets: the digits are gathered into a u64 and scaled by one
// multiply or divide by a power of ten, so values with 17 significant digits
// (as Python writes them) can land 1 ulp away from the correctly rounded
// double. Unigram scores must be bit-identical or Viterbi ties flip.
bool serde_f64(const std::string& s, double* out) {
  static const std::vector<double> pow10 = [] {
    std::vector<double> t;
    for (int k = 0; k <= 308; ++k) t.push_back(std::strtod(("1e" + std::to_string(k)).c_str(), nullptr));
    return t;
  }();
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const auto overflows = [&](uint64_t sig, uint64_t d) { return sig >= kMax / 10 && (sig > kMax / 10 || d > kMax % 10); };
  const auto digit = [&](size_t i) { return i < s.size() && s[i] >= '0' && s[i] <= '9'; };
  size_t i = 0;
  const bool negative = i < s.size() && s[i] == '-';
  if (negative) ++i;
  uint64_t sig = 0;
  int64_t exponent = 0;
  bool full = false;  // once the integer part overflows, its further digits only scale
  for (; digit(i); ++i) {
    const uint64_t d = static_cast<uint64_t>(s[i] - '0');
    if (full || overflows(sig, d)) {
      full = true;
      ++exponent;
    } else {
      sig = sig * 10 + d;
    }
  }
  if (i < s.size() && s[i] == '.') {
    bool dropped = false;  // fraction digits after the first that overflows are ignored
    for (++i; digit(i); ++i) {
      const uint64_t d = static_cast<uint64_t>(s[i] - '0');
      if (dropped || overflows(sig, d)) {
        dropped = true;
      } else {
        sig = sig * 10 + d;
        --exponent;
      }
    }
  }
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    bool positive_exp = true;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) positive_exp = s[i++] == '+';
    int64_t e = 0;
    for (; digit(i); ++i) {
      e = e * 10 + (s[i] - '0');
      if (e > std::numeric_limits<int32_t>::max()) {
        if (sig != 0 && positive_exp) return false;
        *out = negative ? -0.0 : 0.0;
        return true;
      }
    }
    exponent = positive_exp ? exponent + e : exponent - e;
  }
  double f = static_cast<double>(sig);
  while (true) {
    const uint64_t a = static_cast<uint64_t>(exponent < 0 ? -exponent : exponent);
    if (a < pow10.size()) {
      if (exponent >= 0) {
        f *= pow10[a];
        if (std::isinf(f)) return false;
      } else {
        f /= pow10[a];
      }
      break;
    }
    if (f == 0.0) break;
    if (exponent >= 0) return false;
    f /= 1e308;
    exponent += 308;
  }
  *out = negative ? -f : f;
  return true;
}

// model.vocab and model.merges of a tokenizer.json, captured from SAX events:
// as nlohmann DOM nodes they cost several times the parse itself (Gemma: 262k
// vocab entries, 514k merges).
struct BulkModel {
  struct Merge {
    std::string a, b;
    bool legacy;  // "a b" form, held whole in `a`
  };
  bool vocab_object = false, vocab_array = false, merges = false;
  std::vector<std::pair<std::string, json>> vocab_entries;  // {token: id}
  std::vector<std::pair<std::string, double>> pieces;       // [[piece, score], ...]
  std::vector<Merge> merge_list;
  int64_t bad_vocab = -1, bad_merge = -1;  // first malformed entry
};

// Builds the DOM through nlohmann's SAX interface so that floats can be
// converted from their text by serde_f64, and model.vocab/merges go to BulkModel.
class DomBuilder {
 public:
  DomBuilder(json& root, BulkModel& bulk, std::string origin)
      : root_(root), bulk_(bulk), origin_(std::move(origin)) {}

  bool null() { return scalar(nullptr); }
  bool boolean(bool v) { return scalar(v); }
  bool number_integer(json::number_integer_t v) { return scalar(v); }
  bool number_unsigned(json::number_unsigned_t v) { return scalar(v); }
  bool number_float(json::number_float_t, const json::string_t& text) {
    double v;
    if (!serde_f64(text, &v)) throw Error(origin_ + ": number " + text + " is out of range");
    return scalar(v);
  }
  bool string(json::string_t& v) {
    if (mode_ == kNone || (mode_ == kVocabObject && depth_ == 0)) return scalar(std::move(v));
    if (mode_ == kMerges && depth_ == 0) {
      bulk_.merge_list.push_back({std::move(v), std::string(), true});
    } else if (depth_ == 1 && mode_ != kVocabObject && fields_ == 0) {
      first_ = std::move(v);
      ++fields_;
    } else if (mode_ == kMerges && depth_ == 1 && fields_ == 1) {
      second_ = std::move(v);
      ++fields_;
    } else {
      bad_scalar();
    }
    return true;
  }
  bool binary(json::binary_t&) { return scalar(nullptr); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool key(json::string_t& k) {
    key_ = std::move(k);
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    throw Error(origin_ + ": malformed JSON: " + e.what());
  }

 private:
  enum Mode { kNone, kVocabObject, kVocabArray, kMerges };

  template <typename T>
  bool scalar(T&& v) {
    if (mode_ == kNone) {
      add(json(std::forward<T>(v)));
    } else if (mode_ == kVocabObject && depth_ == 0) {
      bulk_.vocab_entries.emplace_back(key_, json(std::forward<T>(v)));
    } else if (mode_ == kVocabArray && depth_ == 1 && fields_ == 1) {
      const json j(std::forward<T>(v));
      if (j.is_number()) {
        score_ = j.get<double>();
        ++fields_;
      } else {
        bad_scalar();
      }
    } else {
      bad_scalar();
    }
    return true;
  }

  // A scalar where the entry's shape does not allow one.
  void bad_scalar() {
    if (depth_ == 0) mark_bad();
    entry_ok_ = false;
  }
  void mark_bad() {
    int64_t& bad = mode_ == kMerges ? bulk_.bad_merge : bulk_.bad_vocab;
    if (bad < 0) bad = static_cast<int64_t>(entry_count());
    if (mode_ == kMerges) bulk_.merge_list.push_back({});
    else if (mode_ == kVocabArray) bulk_.pieces.emplace_back();
    else bulk_.vocab_entries.emplace_back(entry_key_, json());
  }
  size_t entry_count() const {
    return mode_ == kMerges ? bulk_.merge_list.size() : mode_ == kVocabArray ? bulk_.pieces.size()
                                                                             : bulk_.vocab_entries.size();
  }

  bool open(json container) {
    if (mode_ != kNone) {
      // Entries are [a, b] / [piece, score]: one level of nesting is expected.
      if (depth_ == 0 && mode_ != kVocabObject && container.is_array()) {
        fields_ = 0;
        entry_ok_ = true;
      } else {
        if (depth_ == 0) entry_key_ = key_;
        entry_ok_ = false;
      }
      ++depth_;
      return true;
    }
    const bool in_model = stack_.size() == 2 && keys_[1] == "model" && stack_[1]->is_object();
    if (stack_.size() == 1 && stack_[0]->is_object() && key_ == "model") bulk_ = BulkModel();
    if (in_model && key_ == "vocab") {
      mode_ = container.is_object() ? kVocabObject : kVocabArray;
      (mode_ == kVocabObject ? bulk_.vocab_object : bulk_.vocab_array) = true;
      bulk_.vocab_entries.clear();
      bulk_.pieces.clear();
      bulk_.bad_vocab = -1;
      depth_ = 0;
      return true;
    }
    if (in_model && key_ == "merges" && container.is_array()) {
      mode_ = kMerges;
      bulk_.merges = true;
      bulk_.merge_list.clear();
      bulk_.bad_merge = -1;
      depth_ = 0;
      return true;
    }
    keys_.push_back(stack_.empty() || stack_.back()->is_array() ? std::string() : key_);
    stack_.push_back(add(std::move(container)));
    return true;
  }

  bool close() {
    if (mode_ == kNone) {
      stack_.pop_back();
      keys_.pop_back();
      return true;
    }
    if (depth_ == 0) {
      mode_ = kNone;
      return true;
    }
    if (--depth_ == 0) {
      const bool ok = entry_ok_ && fields_ == 2;
      if (!ok) {
        mark_bad();
      } else if (mode_ == kMerges) {
        bulk_.merge_list.push_back({std::move(first_), std::move(second_), false});
      } else {
        bulk_.pieces.emplace_back(std::move(first_), score_);
      }
    }
    return true;
  }

  // Pointers into the parent chain stay valid: only the innermost container grows.
  json* add(json v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& top = *stack_.back();
    if (top.is_array()) {
      top.push_back(std::move(v));
      return &top.back();
    }
    json& slot = top[key_];
    slot = std::move(v);
    return &slot;
  }

  json& root_;
  BulkModel& bulk_;
  std::string origin_;
  std::vector<json*> stack_;
  std::vector<std::string> keys_;  // key of each open container in its parent
  std::string key_;
  Mode mode_ = kNone;
  int depth_ = 0;
  int fields_ = 0;
  bool entry_ok_ = true;
  std::string first_, second_, entry_key_;
  double score_ = 0;
};

class Loader {
 public:
  Loader(std::string origin, const BulkModel& bulk) : origin_(std::move(origin)), bulk_(bulk) {}

  [[noreturn]] void fail(const std::string& path, const std::string& msg) const {
    throw Error(origin_ + ": " + path + " " + msg);
  }

  const json& field(const json& obj, const std::string& path, const char* key) const {
    if (!obj.is_object()) fail(path, "must be an object");
    auto it = obj.find(key);
    if (it == obj.end()) fail(join(path, key), "is missing");
    return *it;
  }
  static std::string join(const std::string& path, const std::string& key) {
    return path.empty() ? key : path + "." + key;
  }
  static const json* optional(const json& obj, const char* key) {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }

  std::string get_string(const json& obj, const std::string& path, const char* key) const {
    const json& v = field(obj, path, key);
    if (!v.is_string()) fail(join(path, key), "must be a string");
    return v.get<std::string>();
  }
  std::string opt_string(const json& obj, const std::string& path, const char* key, const std::string& dflt) const {
    const json* v = optional(obj, key);
    if (!v) return dflt;
    if (!v->is_string()) fail(join(path, key), "must be a string");
    return v->get<std::string>();
  }
  bool opt_bool(const json& obj, const std::string& path, const char* key, bool dflt) const {
    const json* v = optional(obj, key);
    if (!v) return dflt;
    if (!v->is_boolean()) fail(join(path, key), "must be true or false");
    return v->get<bool>();
  }
  uint64_t get_uint(const json& v, const std::string& path, uint64_t max) const {
    if (!v.is_number_unsigned() || v.get<uint64_t>() > max)
      fail(path, "must be an integer in [0, " + std::to_string(max) + "]");
    return v.get<uint64_t>();
  }
  int32_t get_id(const json& v, const std::string& path) const {
    return static_cast<int32_t>(get_uint(v, path, std::numeric_limits<int32_t>::max()));
  }
  char32_t get_char(const json& obj, const std::string& path, const char* key) const {
    const std::string s = get_string(obj, path, key);
    const auto cps = to_code_points(s);
    if (cps.size() != 1) fail(join(path, key), "must be a single character, got '" + s + "'");
    return cps[0];
  }
  std::string type_of(const json& obj, const std::string& path) const {
    if (!obj.is_object()) fail(path, "must be an object");
    return get_string(obj, path, "type");
  }
  void check_depth(int depth, const std::string& path) const {
    if (depth > 32) fail(path, "nests Sequences too deeply");
  }

  Regex pattern(const json& obj, const std::string& path) const {
    const json& p = field(obj, path, "pattern");
    const std::string pp = join(path, "pattern");
    if (!p.is_object() || p.size() != 1) fail(pp, "must be {\"String\": ...} or {\"Regex\": ...}");
    if (p.contains("String")) {
      if (!p["String"].is_string()) fail(pp + ".String", "must be a string");
      return Regex::literal(p["String"].get<std::string>());
    }
    if (p.contains("Regex")) {
      if (!p["Regex"].is_string()) fail(pp + ".Regex", "must be a string");
      const std::string re = p["Regex"].get<std::string>();
      try {
        return Regex::parse(re);
      } catch (const std::invalid_argument& e) {
        fail(pp + ".Regex", "'" + re + "' is not supported: " + e.what());
      }
    }
    fail(pp, "must be {\"String\": ...} or {\"Regex\": ...}");
  }

  const json& array(const json& obj, const std::string& path, const char* key) const {
    const json& a = field(obj, path, key);
    if (!a.is_array()) fail(join(path, key), "must be an array");
    return a;
  }

  std::unique_ptr<Normalizer> normalizer(const json& j, const std::string& path, int depth = 0) const {
    check_depth(depth, path);
    const std::string type = type_of(j, path);
    if (type == "Sequence") {
      auto n = std::make_unique<SequenceNormalizer>();
      const json& parts = array(j, path, "normalizers");
      for (size_t i = 0; i < parts.size(); ++i)
        n->parts.push_back(normalizer(parts[i], path + ".normalizers[" + std::to_string(i) + "]", depth + 1));
      return n;
    }
    if (type == "Replace") {
      auto n = std::make_unique<ReplaceNormalizer>();
      n->pattern = pattern(j, path);
      n->content = get_string(j, path, "content");
      return n;
    }
    if (type == "Prepend") {
      auto n = std::make_unique<PrependNormalizer>();
      n->prefix = get_string(j, path, "prepend");
      return n;
    }
    if (type == "Strip") {
      auto n = std::make_unique<StripNormalizer>();
      n->left = opt_bool(j, path, "strip_left", false);
      n->right = opt_bool(j, path, "strip_right", false);
      return n;
    }
    if (type == "ByteLevel") return std::make_unique<ByteLevelNormalizer>();
    if (type == "NFC" || type == "NFD") {
      auto n = std::make_unique<UnicodeNormalizer>();
      n->compose = type == "NFC";
      return n;
    }
    fail(path + ".type", "'" + type +
                             "' is not supported (expected Sequence, Replace, Prepend, Strip, ByteLevel, NFC or NFD)");
  }

  SplitBehavior behavior(const json& j, const std::string& path) const {
    const std::string b = get_string(j, path, "behavior");
    if (b == "Removed") return SplitBehavior::kRemoved;
    if (b == "Isolated") return SplitBehavior::kIsolated;
    if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
    if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
    if (b == "Contiguous") return SplitBehavior::kContiguous;
    fail(join(path, "behavior"), "'" + b + "' is not a split behavior");
  }

  PrependScheme prepend_scheme(const json& j, const std::string& path) const {
    const std::string s = opt_string(j, path, "prepend_scheme", "always");
    PrependScheme scheme;
    if (s == "always")
      scheme = PrependScheme::kAlways;
    else if (s == "first")
      scheme = PrependScheme::kFirst;
    else if (s == "never")
      scheme = PrependScheme::kNever;
    else
      fail(join(path, "prepend_scheme"), "'" + s + "' is not one of always, first, never");
    // Older files say add_prefix_space: false instead of prepend_scheme: never.
    const json* aps = optional(j, "add_prefix_space");
    if (aps && aps->is_boolean() && !aps->get<bool>()) {
      if (scheme != PrependScheme::kNever)
        fail(join(path, "add_prefix_space"), "false does not match prepend_scheme '" + s + "'");
    }
    return scheme;
  }

  std::unique_ptr<PreTokenizer> pre_tokenizer(const json& j, const std::string& path, int depth = 0) const {
    check_depth(depth, path);
    const std::string type = type_of(j, path);
    if (type == "Sequence") {
      auto p = std::make_unique<SequencePreTokenizer>();
      const json& parts = array(j, path, "pretokenizers");
      for (size_t i = 0; i < parts.size(); ++i)
        p->parts.push_back(pre_tokenizer(parts[i], path + ".pretokenizers[" + std::to_string(i) + "]", depth + 1));
      return p;
    }
    if (type == "Split") {
      auto p = std::make_unique<SplitPreTokenizer>();
      p->pattern = pattern(j, path);
      p->behavior = behavior(j, path);
      const json& inv = field(j, path, "invert");
      if (!inv.is_boolean()) fail(join(path, "invert"), "must be true or false");
      p->invert = inv.get<bool>();
      return p;
    }
    if (type == "ByteLevel") {
      auto p = std::make_unique<ByteLevelPreTokenizer>();
      p->add_prefix_space = opt_bool(j, path, "add_prefix_space", true);
      p->use_regex = opt_bool(j, path, "use_regex", true);
      return p;
    }
    if (type == "Metaspace") {
      auto p = std::make_unique<MetaspacePreTokenizer>();
      p->replacement = get_char(j, path, "replacement");
      append_utf8(p->rep, p->replacement);
      p->scheme = prepend_scheme(j, path);
      p->split = opt_bool(j, path, "split", true);
      return p;
    }
    if (type == "Digits") {
      auto p = std::make_unique<DigitsPreTokenizer>();
      p->individual = opt_bool(j, path, "individual_digits", false);
      return p;
    }
    if (type == "WhitespaceSplit") return std::make_unique<WhitespaceSplitPreTokenizer>();
    fail(path + ".type", "'" + type +
                             "' is not supported (expected Sequence, Split, ByteLevel, Metaspace, Digits or "
                             "WhitespaceSplit)");
  }

  std::unique_ptr<Model> model(const json& j, const std::string& path) const {
    if (!j.is_object()) fail(path, "must be an object");
    std::string type;
    if (j.contains("type"))
      type = get_string(j, path, "type");
    else  // `tokenizers` also accepts untagged models
      type = bulk_.merges || j.contains("merges") ? "BPE" : "Unigram";
    if (type == "BPE") return bpe(j, path);
    if (type == "Unigram") return unigram(j, path);
    fail(path + ".type", "'" + type + "' is not supported (expected BPE or Unigram)");
  }

  std::unique_ptr<Model> bpe(const json& j, const std::string& path) const {
    auto m = std::make_unique<BpeModel>();
    m->origin = origin_;
    const json* dropout = optional(j, "dropout");
    if (dropout && !(dropout->is_number() && dropout->get<double>() == 0.0))
      fail(path + ".dropout", "is not supported (must be null or 0: encoding would be random)");
    if (const json* u = optional(j, "unk_token")) {
      if (!u->is_string()) fail(path + ".unk_token", "must be a string");
      m->unk_token = u->get<std::string>();
      m->has_unk = true;
    }
    if (const json* p = optional(j, "continuing_subword_prefix")) {
      if (!p->is_string()) fail(path + ".continuing_subword_prefix", "must be a string");
      m->prefix = p->get<std::string>();
      m->has_prefix = true;
    }
    if (const json* s = optional(j, "end_of_word_suffix")) {
      if (!s->is_string()) fail(path + ".end_of_word_suffix", "must be a string");
      m->suffix = s->get<std::string>();
      m->has_suffix = true;
    }
    m->fuse_unk = opt_bool(j, path, "fuse_unk", false);
    m->byte_fallback = opt_bool(j, path, "byte_fallback", false);
    m->ignore_merges = opt_bool(j, path, "ignore_merges", false);

    if (!bulk_.vocab_object) {
      if (!bulk_.vocab_array) field(j, path, "vocab");  // "is missing" when absent
      fail(path + ".vocab", "must be an object {token: id}");
    }
    m->vocab.reserve(bulk_.vocab_entries.size());
    for (const auto& [tok, v] : bulk_.vocab_entries) m->vocab[tok] = get_id(v, path + ".vocab['" + tok + "']");
    for (const auto& [tok, id] : m->vocab) m->vocab_r[id] = tok;

    if (!bulk_.merges) {
      field(j, path, "merges");
      fail(path + ".merges", "must be an array");
    }
    m->merges.reserve(bulk_.merge_list.size());
    for (size_t i = 0; i < bulk_.merge_list.size(); ++i) {
      const std::string mp = path + ".merges[" + std::to_string(i) + "]";
      if (static_cast<int64_t>(i) == bulk_.bad_merge) fail(mp, "must be \"a b\" or [\"a\", \"b\"]");
      const BulkModel::Merge& e = bulk_.merge_list[i];
      std::string a = e.a, b = e.b;
      if (e.legacy) {
        const size_t sp = e.a.find(' ');
        if (sp == std::string::npos || e.a.find(' ', sp + 1) != std::string::npos)
          fail(mp, "'" + e.a + "' must be two tokens separated by one space");
        a = e.a.substr(0, sp);
        b = e.a.substr(sp + 1);
      }
      const auto ia = m->vocab.find(a), ib = m->vocab.find(b);
      if (ia == m->vocab.end()) fail(mp, "token '" + a + "' is not in " + path + ".vocab");
      if (ib == m->vocab.end()) fail(mp, "token '" + b + "' is not in " + path + ".vocab");
      // BpeBuilder forms the merged token by cutting prefix-length bytes off
      // b, whether or not b carries the continuing_subword_prefix.
      const size_t cut = m->has_prefix ? m->prefix.size() : 0;
      if (b.size() < cut) fail(mp, "token '" + b + "' is shorter than the continuing_subword_prefix");
      const std::string merged = a + b.substr(cut);
      const auto in = m->vocab.find(merged);
      if (in == m->vocab.end()) fail(mp, "merged token '" + merged + "' is not in " + path + ".vocab");
      m->merges[BpeModel::pair_key(ia->second, ib->second)] = {static_cast<int32_t>(i), in->second};
    }
    return m;
  }

  std::unique_ptr<Model> unigram(const json& j, const std::string& path) const {
    auto m = std::make_unique<UnigramModel>();
    m->origin = origin_;
    if (!bulk_.vocab_array) {
      if (!bulk_.vocab_object) field(j, path, "vocab");  // "is missing" when absent
      fail(path + ".vocab", "must be an array of [\"piece\", score]");
    }
    if (bulk_.bad_vocab >= 0) fail(path + ".vocab[" + std::to_string(bulk_.bad_vocab) + "]", "must be [\"piece\", score]");
    m->pieces = bulk_.pieces;
    if (m->pieces.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
      fail(path + ".vocab", "is too large");
    if (const json* u = optional(j, "unk_id")) {
      const uint64_t id = get_uint(*u, path + ".unk_id", std::numeric_limits<int32_t>::max());
      if (id >= m->pieces.size())
        fail(path + ".unk_id", std::to_string(id) + " is outside the vocabulary of " +
                                   std::to_string(m->pieces.size()));
      m->unk_id = static_cast<int32_t>(id);
    }
    m->byte_fallback = opt_bool(j, path, "byte_fallback", false);
    m->finish();
    return m;
  }

  std::unique_ptr<PostProcessor> post_processor(const json& j, const std::string& path, int depth = 0) const {
    check_depth(depth, path);
    const std::string type = type_of(j, path);
    if (type == "TemplateProcessing") {
      auto p = std::make_unique<TemplateProcessor>();
      const json& specials = field(j, path, "special_tokens");
      if (!specials.is_object()) fail(path + ".special_tokens", "must be an object");
      std::unordered_map<std::string, int> index;
      for (auto it = specials.begin(); it != specials.end(); ++it) {
        const std::string sp = path + ".special_tokens['" + it.key() + "']";
        const json& ids = array(it.value(), sp, "ids");
        std::vector<int32_t> v;
        for (size_t i = 0; i < ids.size(); ++i) v.push_back(get_id(ids[i], sp + ".ids[" + std::to_string(i) + "]"));
        index[it.key()] = static_cast<int>(p->specials.size());
        p->specials.push_back(std::move(v));
      }
      const json& single = array(j, path, "single");
      for (size_t i = 0; i < single.size(); ++i) {
        const std::string ep = path + ".single[" + std::to_string(i) + "]";
        const json& e = single[i];
        if (e.is_object() && e.contains("Sequence")) {
          const std::string id = get_string(e["Sequence"], ep + ".Sequence", "id");
          if (id != "A") fail(ep + ".Sequence.id", "must be 'A' in a single-sequence template, got '" + id + "'");
          p->single.push_back(-1);
        } else if (e.is_object() && e.contains("SpecialToken")) {
          const std::string id = get_string(e["SpecialToken"], ep + ".SpecialToken", "id");
          auto it = index.find(id);
          if (it == index.end()) fail(ep + ".SpecialToken.id", "'" + id + "' is not in " + path + ".special_tokens");
          p->single.push_back(it->second);
        } else {
          fail(ep, "must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
        }
      }
      return p;
    }
    if (type == "BertProcessing" || type == "RobertaProcessing") {
      auto p = std::make_unique<ClsSepProcessor>();
      const auto pair_id = [&](const char* key) {
        const json& v = field(j, path, key);
        if (!v.is_array() || v.size() != 2 || !v[0].is_string())
          fail(join(path, key), "must be [\"token\", id]");
        return get_id(v[1], join(path, key) + "[1]");
      };
      p->cls = pair_id("cls");
      p->sep = pair_id("sep");
      return p;
    }
    if (type == "ByteLevel") return std::make_unique<NoopProcessor>();
    if (type == "Sequence") {
      auto p = std::make_unique<SequenceProcessor>();
      const json& parts = array(j, path, "processors");
      for (size_t i = 0; i < parts.size(); ++i)
        p->parts.push_back(post_processor(parts[i], path + ".processors[" + std::to_string(i) + "]", depth + 1));
      return p;
    }
    fail(path + ".type", "'" + type +
                             "' is not supported (expected TemplateProcessing, ByteLevel, BertProcessing, "
                             "RobertaProcessing or Sequence)");
  }

  std::unique_ptr<Decoder> decoder(const json& j, const std::string& path, int depth = 0) const {
    check_depth(depth, path);
    const std::string type = type_of(j, path);
    if (type == "Sequence") {
      auto d = std::make_unique<SequenceDecoder>();
      const json& parts = array(j, path, "decoders");
      for (size_t i = 0; i < parts.size(); ++i)
        d->parts.push_back(decoder(parts[i], path + ".decoders[" + std::to_string(i) + "]", depth + 1));
      return d;
    }
    if (type == "Replace") {
      auto d = std::make_unique<ReplaceDecoder>();
      d->pattern = pattern(j, path);
      d->content = get_string(j, path, "content");
      return d;
    }
    if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
    if (type == "Fuse") return std::make_unique<FuseDecoder>();
    if (type == "Strip") {
      auto d = std::make_unique<StripDecoder>();
      d->content = get_char(j, path, "content");
      d->start = get_uint(field(j, path, "start"), path + ".start", 1u << 20);
      d->stop = get_uint(field(j, path, "stop"), path + ".stop", 1u << 20);
      return d;
    }
    if (type == "Metaspace") {
      auto d = std::make_unique<MetaspaceDecoder>();
      d->replacement = get_char(j, path, "replacement");
      d->scheme = prepend_scheme(j, path);
      return d;
    }
    if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
    if (type == "BPEDecoder") {
      auto d = std::make_unique<BpeSuffixDecoder>();
      d->suffix = opt_string(j, path, "suffix", "</w>");
      return d;
    }
    fail(path + ".type", "'" + type +
                             "' is not supported (expected Sequence, Replace, ByteFallback, Fuse, Strip, "
                             "Metaspace, ByteLevel or BPEDecoder)");
  }

  std::vector<AddedToken> added_tokens(const json& root) const {
    std::vector<AddedToken> out;
    const json* list = optional(root, "added_tokens");
    if (!list) return out;
    if (!list->is_array()) fail("added_tokens", "must be an array");
    for (size_t i = 0; i < list->size(); ++i) {
      const std::string p = "added_tokens[" + std::to_string(i) + "]";
      const json& e = (*list)[i];
      AddedToken t;
      t.content = get_string(e, p, "content");
      t.special = opt_bool(e, p, "special", false);
      t.single_word = opt_bool(e, p, "single_word", false);
      t.lstrip = opt_bool(e, p, "lstrip", false);
      t.rstrip = opt_bool(e, p, "rstrip", false);
      t.normalized = opt_bool(e, p, "normalized", !t.special);
      out.push_back(std::move(t));
    }
    return out;
  }

 private:
  std::string origin_;
  const BulkModel& bulk_;
};

// EOS by name: the first of these present. The model's config.json
// eos_token_id is the authority; this covers tokenizer-only use.
const char* const kEosNames[] = {"<eos>", "<|endoftext|>", "<|im_end|>", "</s>"};

}  // namespace

Tokenizer Tokenizer::from_json_string(const std::string& text, const std::string& origin) {
  json root;
  BulkModel bulk;
  DomBuilder builder(root, bulk, origin);
  try {
    json::sax_parse(text, &builder);
  } catch (const json::exception& e) {
    throw Error(origin + ": malformed JSON: " + e.what());
  }
  Loader ld(origin, bulk);
  if (!root.is_object()) ld.fail("(root)", "must be a JSON object");
  if (const json* v = Loader::optional(root, "version")) {
    if (!v->is_string() || v->get<std::string>() != "1.0") ld.fail("version", "must be \"1.0\"");
  }
  auto impl = std::make_unique<Impl>();
  impl->origin = origin;
  if (const json* n = Loader::optional(root, "normalizer")) impl->normalizer = ld.normalizer(*n, "normalizer");
  if (const json* p = Loader::optional(root, "pre_tokenizer"))
    impl->pre_tokenizer = ld.pre_tokenizer(*p, "pre_tokenizer");
  impl->model = ld.model(ld.field(root, "", "model"), "model");
  if (const json* p = Loader::optional(root, "post_processor"))
    impl->post_processor = ld.post_processor(*p, "post_processor");
  if (const json* d = Loader::optional(root, "decoder")) impl->decoder = ld.decoder(*d, "decoder");
  impl->add_tokens(ld.added_tokens(root));

  impl->bos = impl->post_processor ? impl->post_processor->bos() : -1;
  for (const char* name : kEosNames) {
    impl->eos = impl->token_to_id(name);
    if (impl->eos >= 0) break;
  }
  int32_t max_id = impl->model->max_id();
  for (const auto& kv : impl->added_tokens) max_id = std::max(max_id, kv.first);
  impl->vocab_size = static_cast<int64_t>(max_id) + 1;
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KAKEYA_CHECK(f, path << ": cannot open tokenizer file");
  std::ostringstream ss;
  ss << f.rdbuf();
  KAKEYA_CHECK(!f.bad(), path << ": read error");
  return from_json_string(ss.str(), path);
}

std::vector<int32_t> Tokenizer::encode(const std::string& text, bool add_special) const {
  return impl_->encode(text, add_special);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  return impl_->decode(ids, skip_special);
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

int32_t Tokenizer::token_id(const std::string& token) const { return impl_->token_to_id(token); }

const std::string& Tokenizer::token(int32_t id) const {
  const std::string* t = impl_->id_to_token(id);
  KAKEYA_CHECK(t != nullptr, impl_->origin << ": token id " << id << " is not in the vocabulary");
  return *t;
}

int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

}  // namespace kakeya

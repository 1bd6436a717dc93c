#include "train/drafter_data.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/io/safetensors.h"

namespace kakeya::train {

const char* domain_name(Domain d) { return d == Domain::Code ? "code" : "prose"; }

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string lower(std::string s) {
  for (auto& c : s) c = (char)std::tolower((unsigned char)c);
  return s;
}

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KAKEYA_CHECK(f.good(), path << ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

const std::set<std::string>& skipped_dirs(Domain d) {
  // Test suites and vendored packages are not the stdlib's own code; encodings/
  // holds generated codec tables (trivially predictable, they would inflate τ).
  static const std::set<std::string> code{"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__",
                                          "lib2to3", "encodings", "turtledemo", "node_modules"};
  static const std::set<std::string> prose{"__pycache__", "test", "tests", "node_modules", "examples"};
  return d == Domain::Code ? code : prose;
}

bool is_license_name(const std::string& lname) {
  for (const char* p : {"license", "licence", "copying", "notice", "authors", "copyright"})
    if (starts_with(lname, p)) return true;
  return false;
}

bool wanted_file(const std::string& name, Domain d) {
  if (d == Domain::Code) return ends_with(name, ".py");
  const std::string l = lower(name);
  if (name == "METADATA" || name == "PKG-INFO") return true;
  if (ends_with(l, ".gz") || ends_with(l, ".py") || ends_with(l, ".json") || ends_with(l, ".html")) return false;
  if (starts_with(l, "readme") || is_license_name(l)) return true;
  return ends_with(l, ".md") || ends_with(l, ".rst");
}

void walk(const std::string& path, Domain d, std::vector<std::string>& out) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISREG(st.st_mode)) {
    out.push_back(path);
    return;
  }
  if (!S_ISDIR(st.st_mode)) return;  // symlinks and devices are not followed
  DIR* dir = ::opendir(path.c_str());
  if (!dir) return;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(dir)) names.push_back(e->d_name);
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  for (const auto& n : names) {
    if (n == "." || n == ".." || n[0] == '.') continue;
    const std::string child = path + "/" + n;
    struct stat cs;
    if (::lstat(child.c_str(), &cs) != 0) continue;
    if (S_ISDIR(cs.st_mode)) {
      if (!skipped_dirs(d).count(n)) walk(child, d, out);
    } else if (S_ISREG(cs.st_mode) && wanted_file(n, d)) {
      out.push_back(child);
    }
  }
}

std::string basename_of(const std::string& p) {
  auto i = p.find_last_of('/');
  return i == std::string::npos ? p : p.substr(i + 1);
}

// Mostly text, and for prose mostly words: binary blobs and tables are not prose.
bool looks_like(const std::string& text, Domain d) {
  if (text.size() < 400) return false;
  int64_t printable = 0, wordy = 0;
  for (unsigned char c : text) {
    if (c >= 0x20 || c == '\n' || c == '\t' || c == '\r') ++printable;
    if (std::isalpha(c) || c == ' ' || c >= 0x80) ++wordy;
  }
  if (printable < (int64_t)(0.98 * text.size())) return false;
  return d == Domain::Code || wordy >= (int64_t)(0.7 * text.size());
}

}  // namespace

std::string corpus_text(const CorpusFile& f, Domain d) {
  std::string t = read_all(f.path);
  const std::string name = basename_of(f.path);
  if (d == Domain::Prose && (name == "METADATA" || name == "PKG-INFO")) {
    // The RFC 822 header (Name:, Requires-Dist:, ...) ends at the first blank line; the description follows.
    auto p = t.find("\n\n");
    t = p == std::string::npos ? std::string() : t.substr(p + 2);
  }
  return t;
}

std::vector<CorpusFile> list_corpus(const std::vector<std::string>& roots, Domain d, int heldout_percent) {
  KAKEYA_CHECK(heldout_percent >= 0 && heldout_percent < 100,
               "--heldout-percent expected in [0, 100), got " << heldout_percent);
  std::vector<std::string> paths;
  for (const auto& r : roots) {
    struct stat st;
    KAKEYA_CHECK(::stat(r.c_str(), &st) == 0, r << ": " << domain_name(d) << " source not found");
    walk(r, d, paths);
  }
  std::sort(paths.begin(), paths.end());
  std::vector<CorpusFile> out;
  std::set<uint64_t> seen;
  for (const auto& p : paths) {
    if (d == Domain::Code && !ends_with(p, ".py")) continue;
    CorpusFile f;
    f.path = p;
    std::string text;
    try {
      text = corpus_text(f, d);
    } catch (const Error&) {
      continue;  // unreadable: not part of the corpus
    }
    if (text.size() > (4u << 20) || !looks_like(text, d)) continue;
    f.hash = fnv1a(text);
    if (!seen.insert(f.hash).second) continue;  // identical contents count once
    f.bytes = text.size();
    f.heldout = (int)(f.hash % 100) < heldout_percent;
    f.eval_ok = d == Domain::Code || !is_license_name(lower(basename_of(p)));
    out.push_back(f);
  }
  return out;
}

std::vector<std::vector<int64_t>> make_prompts(const Tokenizer& tok, int64_t bos_id, const std::vector<CorpusFile>& files,
                                               Domain d, const PromptOptions& opt) {
  KAKEYA_CHECK(opt.prompt_len >= 2, "--prompt-len expected >= 2, got " << opt.prompt_len);
  std::vector<const CorpusFile*> order;
  for (const auto& f : files) order.push_back(&f);
  std::mt19937_64 rng(opt.seed);
  std::shuffle(order.begin(), order.end(), rng);
  const int64_t P = opt.prompt_len;
  // Round-robin over files: pass k takes the k-th prompt of every file that has one,
  // so a cap on the count still spreads prompts over as many files as possible.
  std::vector<std::vector<int64_t>> out;
  std::map<const CorpusFile*, std::string> texts;
  for (int64_t pass = 0; pass < opt.max_per_file && (int64_t)out.size() < opt.max_prompts; ++pass) {
    bool any = false;
    for (const CorpusFile* f : order) {
      if ((int64_t)out.size() >= opt.max_prompts) break;
      const int64_t n = std::clamp<int64_t>(f->bytes / std::max<int64_t>(1, opt.bytes_per_prompt), 1, opt.max_per_file);
      if (pass >= n) continue;
      any = true;
      auto it = texts.find(f);
      if (it == texts.end()) it = texts.emplace(f, corpus_text(*f, d)).first;
      const std::string& text = it->second;
      // Offset of this prompt: the file's own seeded stream, so adding files changes no other file's prompts.
      std::mt19937_64 frng(opt.seed ^ f->hash ^ (0x9e3779b97f4a7c15ull * (uint64_t)(pass + 1)));
      size_t o = frng() % std::max<size_t>(1, text.size());
      if (pass == 0 && opt.first_at_start) o = 0;  // a file's first prompt is its beginning
      else if (auto nl = text.find('\n', o); nl != std::string::npos) o = nl + 1;
      if (o >= text.size()) continue;
      auto ids = tok.encode(text.substr(o, P * 16), /*add_special=*/false);
      if ((int64_t)ids.size() < P - 1) continue;  // too close to the end of the file
      std::vector<int64_t> p{bos_id};
      p.insert(p.end(), ids.begin(), ids.begin() + (P - 1));
      out.push_back(std::move(p));
    }
    if (!any) break;
  }
  return out;
}

Sequences generate_continuations(const Model& target, const std::vector<std::vector<int64_t>>& prompts,
                                 int64_t gen_len, int64_t batch, const std::vector<int64_t>& stop_ids,
                                 const std::string& label) {
  KAKEYA_CHECK(!prompts.empty(), label << ": no prompts to continue");
  KAKEYA_CHECK(gen_len > 0 && batch > 0, label << ": gen_len and batch must be positive");
  const int64_t N = prompts.size(), P = prompts[0].size(), S = P + gen_len;
  for (const auto& p : prompts) KAKEYA_CHECK((int64_t)p.size() == P, label << ": prompts differ in length");
  const at::Device dev = target.device();
  auto iopt = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor tokens = at::empty({N, S}, at::kLong);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t b0 = 0; b0 < N; b0 += batch) {
    const int64_t n = std::min(batch, N - b0);
    std::vector<int64_t> flat;
    for (int64_t i = 0; i < n; ++i) flat.insert(flat.end(), prompts[b0 + i].begin(), prompts[b0 + i].end());
    at::Tensor ids = at::tensor(flat, at::kLong).view({n, P}).to(dev);  // [n, P]
    KVCache cache(target.config(), target.cache_options(S, n));
    ForwardOptions fo;
    fo.last_logits_only = true;
    at::Tensor out = at::empty({n, gen_len}, iopt);  // [n, G]
    at::Tensor next = target.forward(ids, cache, fo).select(1, 0).argmax(-1);  // [n]
    out.select(1, 0).copy_(next);
    for (int64_t t = 1; t < gen_len; ++t) {
      next = target.forward(next.view({n, 1}), cache, fo).select(1, 0).argmax(-1);  // stays on the device
      out.select(1, t).copy_(next);
    }
    tokens.slice(0, b0, b0 + n).slice(1, 0, P).copy_(ids.cpu());
    tokens.slice(0, b0, b0 + n).slice(1, P).copy_(out.cpu());  // SYNC: one copy per batch
    double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int64_t done = b0 + n;
    std::fprintf(stderr, "\r[data] %s %lld/%lld sequences, %.0f tok/s, ETA %.0fs   ", label.c_str(), (long long)done,
                 (long long)N, done * gen_len / std::max(el, 1e-9), el / done * (N - done));
  }
  std::fprintf(stderr, "\n");
  // Length: through the first stop token of the continuation (its text ends there).
  at::Tensor lengths = at::full({N}, S, at::kLong);
  auto tk = tokens.accessor<int64_t, 2>();
  auto ln = lengths.accessor<int64_t, 1>();
  for (int64_t i = 0; i < N; ++i)
    for (int64_t t = P; t < S; ++t)
      if (std::find(stop_ids.begin(), stop_ids.end(), tk[i][t]) != stop_ids.end()) {
        ln[i] = t + 1;
        break;
      }
  return {tokens, lengths, P};
}

Sequences concat_sequences(const std::vector<Sequences>& parts) {
  KAKEYA_CHECK(!parts.empty(), "concat_sequences: no parts");
  std::vector<at::Tensor> tokens, lengths;
  for (const auto& p : parts) {
    KAKEYA_CHECK(p.prompt_len == parts[0].prompt_len && p.tokens.size(1) == parts[0].tokens.size(1),
                 "concat_sequences: parts differ in prompt length or width");
    tokens.push_back(p.tokens);
    lengths.push_back(p.lengths);
  }
  return {at::cat(tokens), at::cat(lengths), parts[0].prompt_len};
}

void save_sequences(const std::string& path, const Sequences& s, const std::map<std::string, std::string>& metadata) {
  auto md = metadata;
  md["prompt_len"] = std::to_string(s.prompt_len);
  save_safetensors(path, {{"tokens", s.tokens.to(at::kInt)}, {"lengths", s.lengths.to(at::kInt)}}, md);
}

Sequences load_sequences(const std::string& path, std::map<std::string, std::string>* metadata) {
  TensorStore st = TensorStore::open_file(path);
  Sequences s;
  s.tokens = st.get("tokens").to(at::kLong);
  s.lengths = st.get("lengths").to(at::kLong);
  auto md = st.metadata();
  KAKEYA_CHECK(s.tokens.dim() == 2 && s.lengths.dim() == 1 && s.lengths.size(0) == s.tokens.size(0),
               path << ": tensors 'tokens' [N, S] and 'lengths' [N] expected");
  KAKEYA_CHECK(md.count("prompt_len"), path << ": metadata 'prompt_len' missing");
  s.prompt_len = std::stoll(md["prompt_len"]);
  if (metadata) *metadata = md;
  return s;
}

}  // namespace kakeya::train

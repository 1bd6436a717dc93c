#include "train/ftheta_online.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>

#include "core/error.h"
#include "core/io/fs.h"
#include "data/capture.h"
#include "data/longeval.h"

namespace kakeya::train {
using json = nlohmann::json;

namespace {

// Documents of a corpus file: the text between lines holding only "<|doc|>", empty ones dropped.
std::vector<std::string> read_documents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KAKEYA_CHECK(in, path << ": cannot open (an f_theta corpus file made by tools/ftheta_corpus.py)");
  std::vector<std::string> docs;
  std::string line, cur;
  auto flush = [&] {
    if (cur.find_first_not_of(" \t\r\n") != std::string::npos) docs.push_back(cur);
    cur.clear();
  };
  while (std::getline(in, line)) {
    if (line == "<|doc|>") {
      flush();
      continue;
    }
    cur += line;
    cur += '\n';
  }
  flush();
  KAKEYA_CHECK(!docs.empty(), path << ": no documents (expected text with '<|doc|>' separator lines)");
  return docs;
}

// Documents in a seeded order, tokens concatenated (a blank line between documents), cut into
// BOS + (seq_len - 1) tokens. Stops once max_tokens text tokens are packed (0: never).
std::vector<std::vector<int64_t>> pack(const Tokenizer& tok, std::vector<std::string> docs, int64_t seq_len,
                                       uint64_t seed, int64_t max_tokens, int64_t max_seqs) {
  std::mt19937_64 rng(seed);
  std::shuffle(docs.begin(), docs.end(), rng);
  const int32_t bos = tok.bos_id();
  const int64_t body = bos >= 0 ? seq_len - 1 : seq_len;
  const std::vector<int32_t> sep = tok.encode("\n\n", false);
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> buf;
  int64_t packed = 0;
  for (const auto& d : docs) {
    std::vector<int32_t> ids = tok.encode(d, false);
    buf.insert(buf.end(), ids.begin(), ids.end());
    buf.insert(buf.end(), sep.begin(), sep.end());
    size_t at = 0;
    while (buf.size() - at >= (size_t)body) {
      std::vector<int64_t> s;
      s.reserve(seq_len);
      if (bos >= 0) s.push_back(bos);
      s.insert(s.end(), buf.begin() + at, buf.begin() + at + body);
      out.push_back(std::move(s));
      at += body;
      packed += body;
      if ((max_tokens > 0 && packed >= max_tokens) || (max_seqs > 0 && (int64_t)out.size() >= max_seqs)) return out;
    }
    buf.erase(buf.begin(), buf.begin() + at);
  }
  return out;
}

int64_t file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  return in ? (int64_t)in.tellg() : -1;
}

}  // namespace

std::vector<std::vector<int64_t>> pack_corpus_file(const Tokenizer& tok, const std::string& path, int64_t seq_len,
                                                   uint64_t seed, int64_t max_seqs) {
  return pack(tok, read_documents(path), seq_len, seed, 0, max_seqs);
}

OnlineCorpus load_online_corpus(const Tokenizer& tok, const OnlineCorpusOptions& o) {
  KAKEYA_CHECK(o.seq_len >= 128, "--seq-len expected >= 128, got " << o.seq_len);
  KAKEYA_CHECK(o.heldout >= 1, "--heldout expected >= 1, got " << o.heldout);
  KAKEYA_CHECK(o.synthetic_every == 0 || o.synthetic_every >= 2,
               "--synthetic-every expected 0 (none) or >= 2, got " << o.synthetic_every);
  const std::string train_path = o.dir + "/train.txt", held_path = o.dir + "/heldout.txt";
  OnlineCorpus c;
  c.text = pack(tok, read_documents(train_path), o.seq_len, o.seed, o.max_train_tokens, 0);
  c.heldout = pack(tok, read_documents(held_path), o.seq_len, o.seed + 1, 0, o.heldout);
  KAKEYA_CHECK(!c.text.empty(), train_path << ": too little text for one sequence of " << o.seq_len << " tokens");
  KAKEYA_CHECK((int64_t)c.heldout.size() == o.heldout,
               held_path << ": " << c.heldout.size() << " sequences of " << o.seq_len << " tokens, --heldout asks for "
                         << o.heldout);
  const int64_t n = (int64_t)c.text.size();
  // Slot i is synthetic when i % every == every - 1: n text slots need n / (every - 1) synthetic ones between them.
  c.n_train = o.synthetic_every > 0 ? n + n / (o.synthetic_every - 1) : n;
  json manifest = nullptr;
  if (fs::exists(o.dir + "/manifest.json")) manifest = fs::read_json(o.dir + "/manifest.json", "a corpus manifest.json");
  c.describe = {{"dir", o.dir},
                {"train_bytes", file_bytes(train_path)},
                {"heldout_bytes", file_bytes(held_path)},
                {"text_sequences", n},
                {"text_tokens", n * o.seq_len},
                {"heldout_sequences", (int64_t)c.heldout.size()},
                {"synthetic_sequences", c.n_train - n},
                {"synthetic_tasks", data::long_task_names()},
                {"synthetic_split", "train"},
                {"seq_len", o.seq_len},
                {"seed", o.seed},
                {"corpus_manifest", manifest}};
  return c;
}

std::vector<int64_t> online_tokens(const Tokenizer& tok, const OnlineCorpus& c, const OnlineCorpusOptions& o,
                                   int64_t i) {
  KAKEYA_CHECK(i >= 0 && i < c.n_train, "online corpus: sequence " << i << " of " << c.n_train);
  const int64_t every = o.synthetic_every;
  if (every > 0 && i % every == every - 1) {
    static const std::vector<std::string> tasks = data::long_task_names();
    data::LongTaskOptions lo;
    lo.split = data::LongSplit::Train;
    lo.task = tasks[(i / every) % tasks.size()];
    lo.seed = (uint64_t)i;
    lo.context_tokens = o.seq_len;
    lo.chat = data::detect_chat_format(tok);
    lo.source_dir = o.synthetic_source_dir;
    return data::make_long_sample(tok, lo).prompt_ids;
  }
  const int64_t text_i = every > 0 ? i - i / every : i;
  return c.text[text_i % c.text.size()];
}

FThetaSequence online_sequence(const Model& verifier, const Drafter& drafter, const FThetaConfig& fc,
                               const std::vector<int64_t>& tokens) {
  at::NoGradGuard no_grad;
  data::CaptureSequence cs = data::capture_sequence(verifier, drafter, tokens, /*on_device=*/true);
  auto keep = [](const at::Tensor& t) { return t.to(at::kBFloat16); };
  FThetaSequence s;
  if (fc.reads_features()) {
    s.feats = keep(cs.feats);
  } else {
    s.dk = keep(cs.dk);
    s.dv = keep(cs.dv);
  }
  for (size_t l = 0; l < cs.k.size(); ++l) {
    s.q.push_back(keep(cs.q[l]));
    s.k.push_back(keep(cs.k[l]));
    s.v.push_back(keep(cs.v[l]));
    s.o.push_back(keep(cs.o[l]));
  }
  return s;
}

}  // namespace kakeya::train

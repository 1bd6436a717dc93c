// kakeya draft-vocab: the FR-Spec draft vocabulary of a drafter (train/draft_vocab.h).
// Counts tokens over the training split of train-drafter's code and prose sources, keeps
// the --size most frequent ids and writes them where Drafter::load finds them
// (<drafter>/draft_vocab.safetensors), with the held-out coverage of several sizes, so
// a user sees what a size costs before choosing it.
#include <algorithm>
#include <cstdio>

#include "core/model/drafter.h"
#include "core/error.h"
#include "core/io/fs.h"
#include "core/io/safetensors.h"
#include "train/draft_vocab.h"
#include "tools/cli_common.h"

namespace kakeya::cli {
using json = nlohmann::json;
using namespace kakeya::train;

void register_draft_vocab(CLI::App& app) {
  struct Opts {
    std::string model = "checkpoints/models/gemma3-270m", out, json_out;
    std::vector<std::string> code, prose;
    int heldout_percent = 10;
    int64_t size = 32768;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("draft-vocab",
                               "FR-Spec draft vocabulary: the most frequent tokens of the drafter's training sources "
                               "(drafts come from these only; the verifier's output is unchanged)");
  c->add_option("--model", o->model, "target HF model directory (its tokenizer)")->capture_default_str();
  c->add_option("--code", o->code, "code sources, as train-drafter's --code")->required();
  c->add_option("--prose", o->prose, "prose sources, as train-drafter's --prose")->required();
  c->add_option("--heldout-percent", o->heldout_percent, "files held out, as train-drafter's (not counted)")
      ->capture_default_str();
  c->add_option("--size", o->size, "tokens kept (K)")->capture_default_str()->check(positive());
  c->add_option("--out", o->out, "drafter directory to write draft_vocab.safetensors into")->required();
  c->add_option("--json", o->json_out, "also write the coverage report here");
  c->callback([o] {
    KAKEYA_CHECK(fs::is_directory(o->out), o->out << ": not a directory (give the drafter's directory)");
    auto tok = load_tokenizer(o->model);
    json report{{"command", command_line()}, {"commit", git_commit()}, {"model", o->model}, {"size", o->size},
                {"heldout_percent", o->heldout_percent}, {"domains", json::object()}};
    VocabCounts all;
    std::vector<std::pair<std::string, VocabCounts>> per;
    for (Domain d : {Domain::Code, Domain::Prose}) {
      auto files = list_corpus(d == Domain::Code ? o->code : o->prose, d, o->heldout_percent);
      KAKEYA_CHECK(!files.empty(), "draft-vocab: no " << domain_name(d) << " files under the given sources");
      VocabCounts vc;
      Progress bar(std::string("[draft-vocab] ") + domain_name(d), (int64_t)files.size(), "files");
      for (size_t i = 0; i < files.size(); ++i) {
        count_tokens(tok, {files[i]}, d, vc);
        bar.update(i + 1);
      }
      bar.finish();
      per.emplace_back(domain_name(d), vc);
    }
    // The counts of both domains together pick the ids; coverage is reported per domain.
    all.train.assign(tok.vocab_size(), 0);
    for (const auto& [name, vc] : per)
      for (size_t i = 0; i < vc.train.size(); ++i) all.train[i] += vc.train[i];
    at::Tensor ids = top_ids(all.train, o->size);
    std::printf("%-8s %8s %8s", "domain", "train", "heldout");
    std::vector<int64_t> sizes{4096, 8192, 16384, 32768, 65536};
    if (std::find(sizes.begin(), sizes.end(), o->size) == sizes.end()) sizes.push_back(o->size);
    std::sort(sizes.begin(), sizes.end());
    for (int64_t k : sizes) std::printf("  K=%-7lld", (long long)k);
    std::printf("   (held-out token coverage)\n");
    for (const auto& [name, vc] : per) {
      int64_t ntr = 0, nho = 0;
      for (int64_t x : vc.train) ntr += x;
      for (int64_t x : vc.heldout) nho += x;
      std::printf("%-8s %8lld %8lld", name.c_str(), (long long)ntr, (long long)nho);
      json cov = json::object();
      for (int64_t k : sizes) {
        if (k > tok.vocab_size()) continue;
        const double v = coverage(vc.heldout, top_ids(all.train, k));
        cov[std::to_string(k)] = v;
        std::printf("  %8.4f ", v);
      }
      std::printf("\n");
      report["domains"][name] = {{"train_files", vc.train_files},   {"heldout_files", vc.heldout_files},
                                 {"train_tokens", ntr},             {"heldout_tokens", nho},
                                 {"heldout_coverage_by_size", cov}, {"train_coverage", coverage(vc.train, ids)}};
    }
    const std::string path = o->out + "/" + Drafter::kDraftVocabFile;
    save_safetensors(path, {{"ids", ids}}, {{"report", report.dump()}});
    std::printf("-> %s (%lld ids)\n", path.c_str(), (long long)o->size);
    if (!o->json_out.empty()) write_json(o->json_out, report);
  });
}

}  // namespace kakeya::cli

// kakeya score: perplexity of a text (or token ids) under a model; the tool
// every later change (codec, restoration) is judged with.
#include <cstdio>
#include <iostream>

#include "core/error.h"
#include "infer/score.h"
#include "tools/cli_common.h"

namespace kakeya::cli {

void register_score(CLI::App& app) {
  struct Opts {
    std::string model = "checkpoints/models/gemma3-270m";
    std::string text, ids, json;
    int64_t context = 0;
    DeviceFlags df;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("score", "Perplexity and per-token log-probs of a text");
  c->add_option("--model", o->model, "HF model directory")->capture_default_str();
  auto* t = c->add_option("--text", o->text, "UTF-8 text file")->check(CLI::ExistingFile);
  auto* i = c->add_option("--ids", o->ids, "JSON file: an array of token ids (or {\"ids\": [...]})")->check(CLI::ExistingFile);
  t->excludes(i);
  c->add_option("--context", o->context, "window length in tokens (0: whole text, one window)")->capture_default_str();
  c->add_option("--json", o->json, "write mean NLL, perplexity and per-token log-probs here");
  o->df.add(c);
  c->callback([o] {
    KAKEYA_CHECK(!o->text.empty() || !o->ids.empty(), "score: give --text FILE or --ids FILE.json");
    auto tok = load_tokenizer(o->model);
    auto cfg = ModelConfig::from_file(o->model + "/config.json");
    std::vector<int64_t> ids;
    if (!o->text.empty()) {
      ids = encode(tok, read_file(o->text));
    } else {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(read_file(o->ids));
      } catch (const nlohmann::json::exception& e) {
        KAKEYA_FAIL(o->ids << ": not valid JSON: " << e.what());
      }
      const auto& arr = j.is_object() && j.contains("ids") ? j["ids"] : j;
      KAKEYA_CHECK(arr.is_array(), o->ids << ": expected an array of token ids or {\"ids\": [...]}");
      for (const auto& x : arr) {
        KAKEYA_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < cfg.vocab_size,
                     o->ids << ": token id " << x.dump() << " outside [0, " << cfg.vocab_size << ")");
        ids.push_back(x.get<int64_t>());
      }
    }
    auto model = load_model(o->model, o->df, (o->context > 0 ? o->context : (int64_t)ids.size()) + 2);
    ScoreOptions so;
    so.context = o->context;
    so.bos_id = model.config().bos_token_id;
    Progress prog("[score]", ids.size());
    so.on_progress = [&](int64_t d, int64_t) { prog.update(d); };
    auto r = score(model, ids, so);
    prog.finish();
    std::printf("tokens scored: %zu\nmean NLL: %.6f\nperplexity: %.4f\ntop-1 (argmax = next token): %.4f\n",
                r.logprobs.size(), r.mean_nll(), r.perplexity(), r.top1_rate());
    if (!o->json.empty())
      write_json(o->json, {{"model", o->model},
                           {"device", o->df.device},
                           {"dtype", c10::toString(model.dtype())},
                           {"context", o->context},
                           {"n_tokens", r.logprobs.size()},
                           {"mean_nll", r.mean_nll()},
                           {"perplexity", r.perplexity()},
                           {"top1", r.top1_rate()},
                           {"targets", r.targets},
                           {"logprobs", r.logprobs}});
  });
}

}  // namespace kakeya::cli

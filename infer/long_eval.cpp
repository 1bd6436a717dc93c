#include "infer/long_eval.h"

#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/io/fs.h"
#include "infer/decoder.h"
#include "infer/loop_util.h"
#include "infer/score.h"

namespace kakeya {
namespace {

constexpr const char* kConfigForms =
    "oracle | evict:W | restored:W | restored-all:W | restored-codec:W (W: the exact window, a positive integer)";

double mean(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v;
  return x.empty() ? 0.0 : s / x.size();
}

double sample_sd(const std::vector<double>& x) {
  const double m = mean(x);
  double ss = 0;
  for (double v : x) ss += (v - m) * (v - m);
  return std::sqrt(ss / (x.size() - 1));
}

// JSON object keys are strings: contexts are keyed by their decimal form.
std::string key(int64_t context) { return std::to_string(context); }

// *.txt of `dir`, by name (opendir, not std::filesystem: see core/io/fs.h).
std::vector<std::string> text_files(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  KAKEYA_CHECK(d, "eval-long: --ppl-dir " << dir << ": cannot open the directory (held-out documents *.txt; "
                                          "--ppl-docs 0 skips perplexity)");
  std::vector<std::string> out;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".txt") == 0) out.push_back(dir + "/" + name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KAKEYA_CHECK(f.good(), "eval-long: " << path << ": cannot open the document");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Positions context c of the plan needs: its prompts + their new tokens, a scored document + 1
// (score() keeps one cache slot past the window).
int64_t positions_at(const LongEvalPlan& plan, size_t c) {
  int64_t need = plan.docs.empty() ? 0 : plan.contexts[c] + 1;
  for (const auto& per_task : plan.samples)
    for (const auto& s : per_task[c]) need = std::max<int64_t>(need, s.prompt_ids.size() + s.max_new_tokens);
  return need;
}

nlohmann::json interval(std::pair<double, double> ci) {
  if (std::isnan(ci.first)) return nullptr;
  return {ci.first, ci.second};
}

// One config's state for the whole run.
struct ConfigRun {
  const LongEvalConfig* config = nullptr;
  RestoreOptions restore;              // config's, with the codec filled in
  const Drafter* drafter = nullptr;    // null where nothing reads restored positions through f_θ
  const FTheta* ftheta = nullptr;
  DecodeOptions decode;
  std::unique_ptr<Decoder> decoder;
  // scores[t][c] and per_sample[t][c]: task t, context c of the plan.
  std::vector<std::vector<std::vector<double>>> scores;
  std::vector<std::vector<nlohmann::json>> per_sample;
  std::vector<std::vector<double>> nll;  // [c][doc]
  double seconds = 0;
};

nlohmann::json summary(const ConfigRun& run, const ConfigRun* oracle, const LongEvalOptions& opt,
                       const LongEvalPlan& plan) {
  std::vector<double> cells;
  std::vector<std::string> families;
  for (const auto& t : opt.tasks)
    if (std::find(families.begin(), families.end(), long_task_family(t)) == families.end())
      families.push_back(long_task_family(t));
  nlohmann::json fam = nlohmann::json::object();
  for (const auto& f : families) {
    std::vector<double> all;
    nlohmann::json by_context = nlohmann::json::object();
    for (size_t c = 0; c < plan.contexts.size(); ++c) {
      std::vector<double> here;
      for (size_t t = 0; t < opt.tasks.size(); ++t)
        if (long_task_family(opt.tasks[t]) == f && !run.scores[t][c].empty()) here.push_back(mean(run.scores[t][c]));
      if (here.empty()) continue;
      by_context[key(plan.contexts[c])] = mean(here);
      all.insert(all.end(), here.begin(), here.end());
    }
    if (!all.empty()) fam[f] = {{"mean", mean(all)}, {"by_context", by_context}};
  }
  for (size_t t = 0; t < opt.tasks.size(); ++t)
    for (size_t c = 0; c < plan.contexts.size(); ++c)
      if (!run.scores[t][c].empty()) cells.push_back(mean(run.scores[t][c]));
  nlohmann::json s{{"mean_score", cells.empty() ? nlohmann::json(nullptr) : nlohmann::json(mean(cells))},
                   {"families", fam}};
  if (!oracle || oracle == &run) return s;
  nlohmann::json delta = nlohmann::json::object(), ratio = nlohmann::json::object();
  std::vector<double> deltas;
  for (size_t t = 0; t < opt.tasks.size(); ++t)
    for (size_t c = 0; c < plan.contexts.size(); ++c) {
      const auto &mine = run.scores[t][c], &theirs = oracle->scores[t][c];
      if (mine.empty() || theirs.empty()) continue;
      const double d = 100 * (mean(mine) - mean(theirs));
      delta[opt.tasks[t]][key(plan.contexts[c])] = d;
      deltas.push_back(d);
    }
  for (size_t c = 0; c < plan.contexts.size(); ++c)
    if (!run.nll[c].empty() && !oracle->nll[c].empty())
      ratio[key(plan.contexts[c])] = std::exp(mean(run.nll[c])) / std::exp(mean(oracle->nll[c]));
  s["vs_oracle"] = {{"config", oracle->config->name},
                    {"delta_pp", delta},
                    {"mean_delta_pp", deltas.empty() ? nlohmann::json(nullptr) : nlohmann::json(mean(deltas))},
                    {"ppl_ratio", ratio}};
  return s;
}

nlohmann::json config_report(const ConfigRun& run, const ConfigRun* oracle, const LongEvalOptions& opt,
                             const LongEvalPlan& plan) {
  nlohmann::json tasks = nlohmann::json::object(), ppl = nlohmann::json::object();
  for (size_t t = 0; t < opt.tasks.size(); ++t)
    for (size_t c = 0; c < plan.contexts.size(); ++c) {
      const auto& x = run.scores[t][c];
      if (x.empty()) continue;  // a partial run never reached it
      const auto ci = score_ci95(x);
      tasks[opt.tasks[t]][key(plan.contexts[c])] = {
          {"score", mean(x)}, {"ci95", {ci.first, ci.second}}, {"n", x.size()}, {"per_sample", run.per_sample[t][c]}};
    }
  for (size_t c = 0; c < plan.contexts.size(); ++c) {
    const auto& x = run.nll[c];
    if (x.empty()) continue;
    ppl[key(plan.contexts[c])] = {
        {"nll", mean(x)}, {"ppl", std::exp(mean(x))}, {"ci95_nll", interval(mean_ci95(x))}, {"n", x.size()}, {"per_doc", x}};
  }
  nlohmann::json restore = nullptr;
  if (!run.config->oracle()) {
    restore = run.restore.to_json();
    restore["layers"] = run.restore.layers;
  }
  return {{"name", run.config->name},
          {"mode", decode_mode_name(run.config->mode)},
          {"restore", restore},
          {"tasks", tasks},
          {"ppl", ppl},
          {"seconds", run.seconds},
          {"summary", summary(run, oracle, opt, plan)}};
}

}  // namespace

// ---------------------------------------------------------------- configs

LongEvalConfig parse_long_eval_config(const std::string& spec, const RestoreOptions& base) {
  LongEvalConfig c;
  c.name = spec;
  c.restore = base;
  if (spec == "oracle") return c;
  const size_t colon = spec.find(':');
  KAKEYA_CHECK(colon != std::string::npos, "--configs: bad spec '" << spec << "': expected " << kConfigForms);
  const std::string kind = spec.substr(0, colon), w = spec.substr(colon + 1);
  const bool digits = !w.empty() && w.size() <= 9 && std::all_of(w.begin(), w.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  KAKEYA_CHECK(digits && std::stoll(w) > 0,
               "--configs: bad spec '" << spec << "': window '" << w << "' is not a positive integer; expected " << kConfigForms);
  c.mode = DecodeMode::Restored;
  c.restore.window = std::stoll(w);
  if (kind == "evict") c.restore.layers = "none";
  else if (kind == "restored-all") c.restore.layers = "all";
  else if (kind == "restored-codec") c.restore.full_attn = FullAttn::Codec;
  else KAKEYA_CHECK(kind == "restored", "--configs: bad spec '" << spec << "': unknown kind '" << kind << "'; expected " << kConfigForms);
  return c;
}

std::vector<LongEvalConfig> parse_long_eval_configs(const std::string& specs, const RestoreOptions& base) {
  std::vector<LongEvalConfig> out;
  std::stringstream ss(specs);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    for (const auto& c : out)
      KAKEYA_CHECK(c.name != item, "--configs: '" << item << "' is listed twice");
    out.push_back(parse_long_eval_config(item, base));
  }
  KAKEYA_CHECK(!out.empty(), "--configs: expected a comma-separated list of " << kConfigForms << ", got '" << specs << "'");
  return out;
}

// ---------------------------------------------------------------- statistics

std::pair<double, double> score_ci95(const std::vector<double>& x) {
  KAKEYA_CHECK(!x.empty(), "score_ci95: no scores");
  constexpr double z = 1.96;
  const double n = x.size(), p = mean(x);
  const bool binary = std::all_of(x.begin(), x.end(), [](double v) { return v == 0.0 || v == 1.0; });
  if (binary || x.size() == 1) {
    const double denom = 1 + z * z / n;
    const double centre = (p + z * z / (2 * n)) / denom;
    const double half = z / denom * std::sqrt(p * (1 - p) / n + z * z / (4 * n * n));
    return {std::max(0.0, centre - half), std::min(1.0, centre + half)};
  }
  const double half = z * sample_sd(x) / std::sqrt(n);
  return {std::max(0.0, p - half), std::min(1.0, p + half)};
}

std::pair<double, double> mean_ci95(const std::vector<double>& x) {
  if (x.size() < 2) return {std::nan(""), std::nan("")};
  const double m = mean(x), half = 1.96 * sample_sd(x) / std::sqrt((double)x.size());
  return {m - half, m + half};
}

std::string long_task_family(const std::string& task) { return task.substr(0, task.find('_')); }

// ---------------------------------------------------------------- plan

LongEvalPlan plan_long_eval(const Tokenizer& tok, const ModelConfig& cfg, const LongEvalOptions& opt) {
  KAKEYA_CHECK(!opt.tasks.empty(), "eval-long: no tasks (--tasks)");
  std::set<std::string> seen;
  for (const auto& t : opt.tasks) {
    data::check_long_task(t);
    KAKEYA_CHECK(seen.insert(t).second, "eval-long: task '" << t << "' is listed twice");
  }
  KAKEYA_CHECK(!opt.contexts.empty(), "eval-long: no contexts (--contexts)");
  KAKEYA_CHECK(opt.samples >= 1, "eval-long: --samples expected >= 1, got " << opt.samples);
  KAKEYA_CHECK(opt.ppl_docs >= 0, "eval-long: --ppl-docs expected >= 0, got " << opt.ppl_docs);
  LongEvalPlan plan;
  plan.contexts = opt.contexts;
  std::sort(plan.contexts.begin(), plan.contexts.end());
  plan.contexts.erase(std::unique(plan.contexts.begin(), plan.contexts.end()), plan.contexts.end());
  const int64_t limit = cfg.max_position_embeddings;
  for (int64_t c : plan.contexts) {
    KAKEYA_CHECK(c >= 2, "eval-long: context " << c << " tokens: expected >= 2");
    KAKEYA_CHECK(limit <= 0 || c <= limit, "eval-long: context " << c << " exceeds the model's limit of " << limit
                                                                   << " positions (max_position_embeddings)");
  }
  const int64_t longest = plan.contexts.back();
  if (opt.ppl_docs > 0) {
    KAKEYA_CHECK(opt.ppl_tail >= 1 && opt.ppl_tail < plan.contexts.front(),
                 "eval-long: --ppl-tail " << opt.ppl_tail << " must be in [1, " << plan.contexts.front() - 1
                                          << "]: a prefix of the smallest context (" << plan.contexts.front()
                                          << " tokens) scores that many");
    const auto files = text_files(opt.ppl_dir);
    KAKEYA_CHECK((int64_t)files.size() >= opt.ppl_docs, "eval-long: --ppl-dir " << opt.ppl_dir << " holds " << files.size()
                                                                                << " *.txt documents, --ppl-docs asks for "
                                                                                << opt.ppl_docs);
    for (int64_t d = 0; d < opt.ppl_docs; ++d) {
      LongEvalDoc doc;
      doc.path = files[d];
      if (cfg.bos_token_id >= 0) doc.ids.push_back(cfg.bos_token_id);
      const auto ids = tok.encode(slurp(doc.path), false);
      const int64_t want = longest - (int64_t)doc.ids.size();
      KAKEYA_CHECK((int64_t)ids.size() >= want, "eval-long: " << doc.path << " has " << ids.size() << " tokens; context "
                                                             << longest << " needs " << want << " (use longer documents "
                                                                                               "or smaller --contexts)");
      doc.ids.insert(doc.ids.end(), ids.begin(), ids.begin() + want);
      plan.docs.push_back(std::move(doc));
    }
    plan.positions = longest + 1;
  }
  plan.samples.resize(opt.tasks.size());
  for (size_t t = 0; t < opt.tasks.size(); ++t) {
    plan.samples[t].resize(plan.contexts.size());
    for (size_t c = 0; c < plan.contexts.size(); ++c)
      for (int64_t s = 0; s < opt.samples; ++s) {
        data::LongTaskOptions lo;
        lo.split = data::LongSplit::Eval;
        lo.task = opt.tasks[t];
        lo.seed = opt.seed + s;
        lo.context_tokens = plan.contexts[c];
        lo.chat = opt.chat;
        if (!opt.source_dir.empty()) lo.source_dir = opt.source_dir;
        auto sample = data::make_long_sample(tok, lo);
        const int64_t need = sample.prompt_ids.size() + sample.max_new_tokens;
        KAKEYA_CHECK(limit <= 0 || need <= limit,
                     "eval-long: context " << plan.contexts[c] << ": task " << opt.tasks[t] << "'s prompt ("
                                           << sample.prompt_ids.size() << " tokens) + " << sample.max_new_tokens
                                           << " new tokens exceed the model's limit of " << limit
                                           << " positions (max_position_embeddings)");
        plan.decode_capacity = std::max(plan.decode_capacity, need);
        plan.samples[t][c].push_back(std::move(sample));
      }
  }
  plan.positions = std::max(plan.positions, plan.decode_capacity);
  return plan;
}

// ---------------------------------------------------------------- run

nlohmann::json run_long_eval(const Model& v, const Drafter* drafter, const FTheta* ftheta, const KVCodec* codec,
                             const Tokenizer& tok, const std::vector<LongEvalConfig>& configs,
                             const LongEvalOptions& opt, const LongEvalPlan& plan, const LongEvalProgress& progress) {
  const auto t0 = Clock::now();
  KAKEYA_CHECK(!configs.empty(), "eval-long: no configs (--configs)");
  KAKEYA_CHECK(plan.samples.size() == opt.tasks.size() && (plan.docs.empty() == (opt.ppl_docs == 0)),
               "eval-long: the plan was made for other options (plan_long_eval with these)");
  for (size_t i = 0; i < configs.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      KAKEYA_CHECK(configs[i].name != configs[j].name, "eval-long: config '" << configs[i].name << "' is listed twice");
  const int64_t rope = v.options().max_positions;
  for (size_t c = 0; c < plan.contexts.size(); ++c) {
    const int64_t need = positions_at(plan, c);
    KAKEYA_CHECK(need <= rope, "eval-long: context " << plan.contexts[c] << " needs " << need
                                                     << " positions (prompt + new tokens, or a scored document + 1), "
                                                        "beyond the loaded RoPE table of "
                                                     << rope << " positions (ModelOptions::max_positions)");
  }

  std::vector<int64_t> stop_ids = v.config().eos_token_ids;
  if (const int32_t eot = tok.token_id("<end_of_turn>"); eot >= 0 && std::count(stop_ids.begin(), stop_ids.end(), eot) == 0)
    stop_ids.push_back(eot);

  const size_t T = opt.tasks.size(), C = plan.contexts.size();
  std::vector<ConfigRun> runs(configs.size());
  const ConfigRun* oracle = nullptr;
  for (size_t k = 0; k < configs.size(); ++k) {
    ConfigRun& r = runs[k];
    r.config = &configs[k];
    r.restore = configs[k].restore;
    if (r.restore.full_attn == FullAttn::Codec) r.restore.codec = codec;
    if (configs[k].oracle()) {
      if (!oracle) oracle = &r;
    } else {
      if (r.restore.needs_ftheta()) {
        r.drafter = drafter;
        r.ftheta = ftheta;
      }
      // Every prompt and every scored prefix, before anything runs: a bad config fails in
      // seconds, not after the configs before it decoded for an hour.
      try {
        for (const auto& per_task : plan.samples)
          for (const auto& per_ctx : per_task)
            for (const auto& s : per_ctx) {
              validate_restore(v, r.drafter, r.ftheta, r.restore, s.prompt_ids.size(), s.max_new_tokens);
              check_restores_something(r.restore, s.prompt_ids.size(), s.max_new_tokens);
            }
        if (!plan.docs.empty())
          for (int64_t c : plan.contexts) {
            validate_restore(v, r.drafter, r.ftheta, r.restore, c, 1);
            check_restores_something(r.restore, c, 1);
          }
      } catch (const Error& e) {
        KAKEYA_FAIL("eval-long: config '" << configs[k].name << "': " << e.what());
      }
    }
    r.decode.mode = configs[k].mode;
    r.decode.restore = r.restore;
    r.decode.stop_ids = stop_ids;
    r.decode.stream = false;  // stops are found in batches: no host sync per token
    r.scores.assign(T, std::vector<std::vector<double>>(C));
    r.per_sample.assign(T, std::vector<nlohmann::json>(C, nlohmann::json::array()));
    r.nll.assign(C, {});
  }
  for (auto& r : runs) r.decoder = make_decoder(v, r.drafter, r.ftheta, r.decode, plan.decode_capacity);

  // Progress and the deadline count tokens through the verifier, every config included.
  const int64_t K = configs.size();
  int64_t total = 0, done = 0;
  for (size_t c = 0; c < C; ++c) {
    for (const auto& per_task : plan.samples)
      for (const auto& s : per_task[c]) total += K * (s.prompt_ids.size() + s.max_new_tokens);
    total += K * plan.contexts[c] * (int64_t)plan.docs.size();
  }
  bool partial = false;
  // True when the next group of `tokens` (per config) would likely end past the deadline.
  auto stop_due = [&](int64_t tokens) {
    if (!opt.deadline) return false;
    const double estimate = done > 0 ? seconds_since(t0, v.device()) / done * tokens * K : 0.0;
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(estimate)) >
           *opt.deadline;
  };
  auto advance = [&](int64_t tokens) {
    done += tokens * K;
    if (progress) progress(done, total);
  };

  nlohmann::json prompts = nlohmann::json::object();
  for (size_t c = 0; c < C && !partial; ++c) {
    for (size_t t = 0; t < T && !partial; ++t)
      for (const auto& s : plan.samples[t][c]) {
        const int64_t tokens = s.prompt_ids.size() + s.max_new_tokens;
        if ((partial = stop_due(tokens))) break;
        prompts[opt.tasks[t]][key(plan.contexts[c])].push_back({{"seed", s.rng_seed},
                                                                 {"prompt_tokens", s.prompt_ids.size()},
                                                                 {"max_new_tokens", s.max_new_tokens},
                                                                 {"answers", s.answers}});
        for (auto& r : runs) {
          DecodeOptions d = r.decode;
          d.max_new_tokens = s.max_new_tokens;
          const auto ts = Clock::now();
          const DecodeResult res = r.decoder->run(s.prompt_ids, d);
          r.seconds += seconds_since(ts, v.device());
          const std::string text = tok.decode(std::vector<int32_t>(res.tokens.begin(), res.tokens.end()), true);
          const double score = data::long_task_score(s.answers, text);
          r.scores[t][c].push_back(score);
          r.per_sample[t][c].push_back(
              {{"seed", s.rng_seed}, {"score", score}, {"text", text}, {"new_tokens", res.tokens.size()}});
        }
        advance(tokens);
      }
    for (size_t d = 0; d < plan.docs.size() && !partial; ++d) {
      const int64_t n = plan.contexts[c];
      if ((partial = stop_due(n))) break;
      const std::vector<int64_t> ids(plan.docs[d].ids.begin(), plan.docs[d].ids.begin() + n);
      for (auto& r : runs) {
        const auto ts = Clock::now();
        ScoreResult sr;
        if (r.config->oracle()) {
          ScoreOptions so;  // one window: the whole prefix
          so.chunk = 256;
          sr = score(v, ids, so);
        } else {
          sr = score_restored(v, r.drafter, r.ftheta, ids, r.restore);
        }
        r.seconds += seconds_since(ts, v.device());
        // sr.logprobs: the n - 1 next-token log-probs of the prefix; the last ppl_tail are scored.
        double nll = 0;
        for (auto it = sr.logprobs.end() - opt.ppl_tail; it != sr.logprobs.end(); ++it) nll -= *it;
        r.nll[c].push_back(nll / opt.ppl_tail);
      }
      advance(n);
    }
  }

  nlohmann::json reports = nlohmann::json::array();
  for (const auto& r : runs) reports.push_back(config_report(r, oracle, opt, plan));
  std::vector<std::string> docs;
  for (const auto& d : plan.docs) docs.push_back(d.path);
  return {{"configs", reports},
          {"tasks", opt.tasks},
          {"contexts", plan.contexts},
          {"samples", opt.samples},
          {"seed", opt.seed},
          {"chat", data::chat_format_name(opt.chat)},
          {"oracle", oracle ? nlohmann::json(oracle->config->name) : nlohmann::json(nullptr)},
          {"ppl_docs", docs},
          {"ppl_tail", opt.ppl_tail},
          {"prompts", prompts},
          {"partial", partial},
          {"seconds", seconds_since(t0, v.device())}};
}

nlohmann::json run_long_eval(const Model& v, const Drafter* drafter, const FTheta* ftheta, const KVCodec* codec,
                             const Tokenizer& tok, const std::vector<LongEvalConfig>& configs,
                             const LongEvalOptions& opt, const LongEvalProgress& progress) {
  return run_long_eval(v, drafter, ftheta, codec, tok, configs, opt, plan_long_eval(tok, v.config(), opt), progress);
}

}  // namespace kakeya

#include "infer/long_eval.h"

#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "core/io/fs.h"
#include "infer/decoder.h"
#include "infer/loop_util.h"
#include "infer/score.h"

namespace kakeya {
namespace {

std::string config_forms() {
  return "oracle | evict:W | restored[-all][-token|-learned][-CODE][-codec[-CODE]]:W | exact[-CODE][-codec[-CODE]]:W, e.g. "
         "restored:W, restored-learned:W, restored-int4:W, restored-codec-lm3:W, exact-int8:W (exact: the region holds the "
         "exact K/V, --mix-alpha 1; token / learned: the first layer restored from its token / by f_θ, --token-layers; "
         "W: the exact window, a positive integer; CODE: " + ops::row_code_names() +
         ", or a rotated one + vC for V rows in C bits, e.g. pw5v3; the codec's CODE may give full-attention layers "
         "their own, +L=CODE: exact-int6-codec-pw4+17=pw5v4:64)";
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

// A config's restore options as its report writes them (null for the oracle); --resume compares them.
nlohmann::json restore_json(const ConfigRun& run) {
  if (run.config->oracle()) return nullptr;
  return run.restore.to_json();
}

// Paired mean difference × scale with its 95% interval (null below 2 pairs) and the pair count.
nlohmann::json paired_cell(const std::vector<double>& diffs, double scale) {
  const auto ci = mean_ci95(diffs);
  return {{"delta", scale * mean(diffs)}, {"ci95", interval({scale * ci.first, scale * ci.second})}, {"n", diffs.size()}};
}

// Prompt by prompt and document by document against `other`: both saw the same inputs, so the
// differences carry no prompt-to-prompt variance.
nlohmann::json versus(const ConfigRun& run, const ConfigRun& other, const std::vector<std::string>& families,
                      const LongEvalOptions& opt, const LongEvalPlan& plan) {
  nlohmann::json delta = nlohmann::json::object(), by_family = nlohmann::json::object(),
                 ratio = nlohmann::json::object(), ratio_ci = nlohmann::json::object();
  std::vector<double> deltas;
  int64_t same = 0, compared = 0;
  for (const auto& f : families)
    for (size_t c = 0; c < plan.contexts.size(); ++c) {
      std::vector<double> diffs;
      for (size_t t = 0; t < opt.tasks.size(); ++t) {
        if (long_task_family(opt.tasks[t]) != f) continue;
        const auto d = paired_differences(run.scores[t][c], other.scores[t][c]);
        diffs.insert(diffs.end(), d.begin(), d.end());
        if (!d.empty()) {
          delta[opt.tasks[t]][key(plan.contexts[c])] = 100 * mean(d);
          deltas.push_back(100 * mean(d));
        }
        for (size_t i = 0; i < d.size(); ++i, ++compared)
          same += run.per_sample[t][c][i]["text"] == other.per_sample[t][c][i]["text"];
      }
      if (!diffs.empty()) by_family[f][key(plan.contexts[c])] = paired_cell(diffs, 100);
    }
  for (size_t c = 0; c < plan.contexts.size(); ++c) {
    const auto d = paired_differences(run.nll[c], other.nll[c]);
    if (d.empty()) continue;
    ratio[key(plan.contexts[c])] = std::exp(mean(d));
    const auto ci = mean_ci95(d);
    ratio_ci[key(plan.contexts[c])] = interval({std::exp(ci.first), std::exp(ci.second)});
  }
  return {{"config", other.config->name},
          {"delta_pp", delta},
          {"mean_delta_pp", deltas.empty() ? nlohmann::json(nullptr) : nlohmann::json(mean(deltas))},
          {"family_delta_pp", by_family},
          {"same_text", compared ? nlohmann::json((double)same / compared) : nlohmann::json(nullptr)},
          {"ppl_ratio", ratio},
          {"ppl_ratio_ci95", ratio_ci}};
}

nlohmann::json summary(const ConfigRun& run, const ConfigRun* oracle, const ConfigRun* reference,
                       const LongEvalOptions& opt, const LongEvalPlan& plan) {
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
  if (oracle && oracle != &run) s["vs_oracle"] = versus(run, *oracle, families, opt, plan);
  if (reference && reference != &run) s["vs_reference"] = versus(run, *reference, families, opt, plan);
  return s;
}

nlohmann::json config_report(const ConfigRun& run, const ConfigRun* oracle, const ConfigRun* reference,
                             const LongEvalOptions& opt, const LongEvalPlan& plan) {
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
  return {{"name", run.config->name},
          {"mode", decode_mode_name(run.config->mode)},
          {"restore", restore_json(run)},
          {"tasks", tasks},
          {"ppl", ppl},
          {"seconds", run.seconds},
          {"summary", summary(run, oracle, reference, opt, plan)}};
}

// Fills `runs` with what `prev` (an earlier report of this suite) holds; returns how many prompts
// and documents (summed over configs) it supplied. Configs are matched by name; prompts and
// documents only where they are exactly this plan's.
int64_t take_resumed(const nlohmann::json& prev, const LongEvalOptions& opt, const LongEvalPlan& plan,
                     std::vector<ConfigRun>& runs) {
  auto field = [&](const char* name) -> const nlohmann::json& {
    KAKEYA_CHECK(prev.is_object() && prev.contains(name),
                 "eval-long --resume: the report has no field '" << name << "' (expected an eval-long --json report)");
    return prev[name];
  };
  auto same = [&](const char* name, const nlohmann::json& mine) {
    KAKEYA_CHECK(field(name) == mine, "eval-long --resume: the report's field '" << name << "' is " << field(name).dump()
                                                                                 << ", this run's " << mine.dump()
                                                                                 << ": not the same suite");
  };
  same("tasks", opt.tasks);
  same("contexts", plan.contexts);
  same("seed", opt.seed);
  same("chat", data::chat_format_name(opt.chat));
  same("ppl_tail", opt.ppl_tail);
  const auto& docs = field("ppl_docs");
  for (size_t d = 0; d < docs.size() && d < plan.docs.size(); ++d)
    KAKEYA_CHECK(docs[d] == plan.docs[d].path, "eval-long --resume: the report's document " << d << " is " << docs[d]
                                                                                             << ", this run's "
                                                                                             << plan.docs[d].path);
  int64_t taken = 0;
  for (const auto& pc : field("configs")) {
    auto it = std::find_if(runs.begin(), runs.end(), [&](const ConfigRun& r) { return pc["name"] == r.config->name; });
    if (it == runs.end()) continue;  // a config this run does not have: left out
    ConfigRun& r = *it;
    const std::string& name = r.config->name;
    const nlohmann::json restore = restore_json(r);
    KAKEYA_CHECK(pc["restore"] == restore, "eval-long --resume: config '" << name << "' had restore options "
                                                                          << pc["restore"].dump() << ", this run's "
                                                                          << restore.dump());
    for (size_t t = 0; t < opt.tasks.size(); ++t)
      for (size_t c = 0; c < plan.contexts.size(); ++c) {
        const auto& tasks = pc["tasks"];
        const std::string k = key(plan.contexts[c]);
        if (!tasks.contains(opt.tasks[t]) || !tasks[opt.tasks[t]].contains(k)) continue;
        const auto& prev_samples = tasks[opt.tasks[t]][k]["per_sample"];
        for (size_t i = 0; i < prev_samples.size() && i < plan.samples[t][c].size(); ++i) {
          KAKEYA_CHECK(prev_samples[i]["seed"] == plan.samples[t][c][i].rng_seed,
                       "eval-long --resume: config '" << name << "', " << opt.tasks[t] << " at " << k << ": sample " << i
                                                      << " has seed " << prev_samples[i]["seed"] << ", this run's "
                                                      << plan.samples[t][c][i].rng_seed);
          r.scores[t][c].push_back(prev_samples[i]["score"].get<double>());
          r.per_sample[t][c].push_back(prev_samples[i]);
          ++taken;
        }
      }
    for (size_t c = 0; c < plan.contexts.size(); ++c) {
      const std::string k = key(plan.contexts[c]);
      if (!pc["ppl"].contains(k)) continue;
      const auto& per_doc = pc["ppl"][k]["per_doc"];
      for (size_t d = 0; d < per_doc.size() && d < plan.docs.size(); ++d, ++taken)
        r.nll[c].push_back(per_doc[d].get<double>());
    }
    r.seconds += pc["seconds"].get<double>();
  }
  return taken;
}

}  // namespace

// ---------------------------------------------------------------- configs

LongEvalConfig parse_long_eval_config(const std::string& spec, const RestoreOptions& base) {
  LongEvalConfig c;
  c.name = spec;
  c.restore = base;
  if (spec == "oracle") return c;
  const size_t colon = spec.find(':');
  KAKEYA_CHECK(colon != std::string::npos, "--configs: bad spec '" << spec << "': expected " << config_forms());
  const std::string kind = spec.substr(0, colon), w = spec.substr(colon + 1);
  const bool digits = !w.empty() && w.size() <= 9 && std::all_of(w.begin(), w.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  KAKEYA_CHECK(digits && std::stoll(w) > 0,
               "--configs: bad spec '" << spec << "': window '" << w << "' is not a positive integer; expected " << config_forms());
  c.mode = DecodeMode::Restored;
  c.restore.window = std::stoll(w);
  if (kind == "evict") {
    c.restore.layers = "none";
    return c;
  }
  // restored or exact, then modifiers: all | CODE (the restored regions) | codec [CODE] (the full-attention
  // layers). exact: every covered layer's region holds its exact K/V (a = 1), f_θ's baseline at equal bytes.
  std::vector<std::string> parts;
  std::stringstream ks(kind);
  for (std::string p; std::getline(ks, p, '-');) parts.push_back(p);
  auto bad = [&](const std::string& why) {
    KAKEYA_FAIL("--configs: bad spec '" << spec << "': " << why << "; expected " << config_forms());
  };
  if (parts.empty() || (parts[0] != "restored" && parts[0] != "exact")) bad("unknown kind '" + kind + "'");
  const bool exact = parts[0] == "exact";
  if (exact) {
    c.restore.mix_alpha = 1.0;
    c.restore.layers = "all";
  }
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i] == "all" && !exact) {
      c.restore.layers = "all";
    } else if ((parts[i] == "token" || parts[i] == "learned") && !exact) {
      c.restore.token_layers = parts[i] == "token";  // the first layer from its token, or from f_θ
    } else if (parts[i] == "codec") {
      c.restore.full_attn = FullAttn::Codec;
      // Its code, when one follows (a full-attention layer's own after '+': codec-pw4+17=pw5v4).
      if (i + 1 < parts.size() && ops::is_row_code_name(parts[i + 1].substr(0, parts[i + 1].find('+'))))
        std::tie(c.restore.full_code, c.restore.full_code_layers) = ops::parse_layer_codes(parts[++i], "--configs");
    } else if (ops::is_row_code_name(parts[i])) {
      c.restore.region_code = ops::parse_row_code(parts[i], "--configs");
      // Refused here, not only when a decoder is built: bench memory plans configs without one.
      check_region_code(c.restore.region_code, "--configs '" + spec + "', code");
    } else {
      bad("unknown modifier '" + parts[i] + "' in '" + kind + "'");
    }
  }
  return c;
}

bool configs_need_ftheta(const std::vector<LongEvalConfig>& configs) {
  return std::any_of(configs.begin(), configs.end(),
                     [](const LongEvalConfig& c) { return !c.oracle() && c.restore.needs_ftheta(); });
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
  KAKEYA_CHECK(!out.empty(), "--configs: expected a comma-separated list of " << config_forms() << ", got '" << specs << "'");
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

double mean(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v;
  return x.empty() ? 0.0 : s / x.size();
}

double tail_nll(const ScoreResult& sr, int64_t tail) {
  KAKEYA_CHECK(tail >= 1 && tail <= (int64_t)sr.logprobs.size(),
               "tail_nll: " << tail << " tokens asked of " << sr.logprobs.size() << " scored");
  double nll = 0;
  for (auto it = sr.logprobs.end() - tail; it != sr.logprobs.end(); ++it) nll -= *it;
  return nll / tail;
}

std::pair<double, double> mean_ci95(const std::vector<double>& x) {
  if (x.size() < 2) return {std::nan(""), std::nan("")};
  const double m = mean(x), half = 1.96 * sample_sd(x) / std::sqrt((double)x.size());
  return {m - half, m + half};
}

std::vector<double> paired_differences(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> d(std::min(a.size(), b.size()));
  for (size_t i = 0; i < d.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

std::string long_task_family(const std::string& task) { return task.substr(0, task.find('_')); }

// ---------------------------------------------------------------- plan

LongEvalPlan plan_long_eval(const Tokenizer& tok, const ModelConfig& cfg, const LongEvalOptions& opt) {
  KAKEYA_CHECK(!opt.tasks.empty() || opt.ppl_docs > 0,
               "eval-long: nothing to evaluate: no tasks (--tasks none) and no documents (--ppl-docs 0)");
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
        plan.samples[t][c].push_back(std::move(sample));
      }
  }
  // The decoders' capacity follows the longest context alone, never the tasks or sample count of
  // the run: in bf16 a restored decoder's outputs depend on its capacity (its prefill chunks attend
  // over every slot of the full-attention caches, whose GEMMs reduce in an order that follows the
  // slot count; measured on the H200: 12 of 40 fwe answers at 16k changed between capacities
  // 16,434 and 16,504), so fwe alone must answer each prompt as a run of every task does. Every
  // prompt fits: it is exactly its context long, and its need was checked against the limit above.
  if (!opt.tasks.empty()) {
    plan.decode_capacity = longest + data::long_task_max_new_tokens();
    if (limit > 0) plan.decode_capacity = std::min(plan.decode_capacity, limit);
  }
  plan.positions = std::max(plan.positions, plan.decode_capacity);
  return plan;
}

// ---------------------------------------------------------------- run

nlohmann::json run_long_eval(const Model& v, const Drafter* drafter, const FTheta* ftheta, const Tokenizer& tok,
                             const std::vector<LongEvalConfig>& configs, const LongEvalOptions& opt,
                             const LongEvalPlan& plan, const LongEvalProgress& progress) {
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
  const ConfigRun* reference = nullptr;
  if (!opt.reference.empty()) {
    std::string names;
    for (const auto& r : runs) {
      if (r.config->name == opt.reference) reference = &r;
      names += (names.empty() ? "" : ", ") + r.config->name;
    }
    KAKEYA_CHECK(reference, "eval-long: --reference '" << opt.reference << "' is none of the configs (" << names << ")");
  }
  const int64_t resumed = opt.resume.is_null() ? 0 : take_resumed(opt.resume, opt, plan, runs);
  // Decoders for the prompts (none to build when only documents are scored).
  if (plan.decode_capacity > 0)
    for (auto& r : runs) r.decoder = make_decoder(v, r.drafter, r.ftheta, r.decode, plan.decode_capacity);

  // Progress and the deadline count tokens through the verifier: a prompt's tokens once for every
  // config that still has to answer it.
  auto todo_prompt = [&](size_t t, size_t c, size_t s) {
    int64_t m = 0;
    for (const auto& r : runs) m += r.scores[t][c].size() <= s;
    return m;
  };
  auto todo_doc = [&](size_t c, size_t d) {
    int64_t m = 0;
    for (const auto& r : runs) m += r.nll[c].size() <= d;
    return m;
  };
  int64_t total = 0, done = 0;
  for (size_t c = 0; c < C; ++c) {
    for (size_t t = 0; t < T; ++t)
      for (size_t s = 0; s < plan.samples[t][c].size(); ++s) {
        const auto& smp = plan.samples[t][c][s];
        total += todo_prompt(t, c, s) * (int64_t)(smp.prompt_ids.size() + smp.max_new_tokens);
      }
    for (size_t d = 0; d < plan.docs.size(); ++d) total += todo_doc(c, d) * plan.contexts[c];
  }
  bool partial = false;
  // True when the next group of `work` tokens would likely end past the deadline.
  auto stop_due = [&](int64_t work) {
    if (!opt.deadline) return false;
    const double estimate = done > 0 ? seconds_since(t0, v.device()) / done * work : 0.0;
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(estimate)) >
           *opt.deadline;
  };
  auto report = [&](bool is_partial) {
    nlohmann::json reports = nlohmann::json::array();
    for (const auto& r : runs) reports.push_back(config_report(r, oracle, reference, opt, plan));
    // The prompts any config answered (every config answers them in the same order).
    nlohmann::json prompts = nlohmann::json::object();
    for (size_t c = 0; c < C; ++c)
      for (size_t t = 0; t < T; ++t) {
        size_t answered = 0;
        for (const auto& r : runs) answered = std::max(answered, r.scores[t][c].size());
        for (size_t i = 0; i < answered; ++i) {
          const auto& smp = plan.samples[t][c][i];
          prompts[opt.tasks[t]][key(plan.contexts[c])].push_back({{"seed", smp.rng_seed},
                                                                  {"prompt_tokens", smp.prompt_ids.size()},
                                                                  {"max_new_tokens", smp.max_new_tokens},
                                                                  {"answers", smp.answers}});
        }
      }
    std::vector<std::string> docs;
    for (const auto& d : plan.docs) docs.push_back(d.path);
    return nlohmann::json{{"configs", reports},
                          {"tasks", opt.tasks},
                          {"contexts", plan.contexts},
                          {"samples", opt.samples},
                          {"seed", opt.seed},
                          {"chat", data::chat_format_name(opt.chat)},
                          {"oracle", oracle ? nlohmann::json(oracle->config->name) : nlohmann::json(nullptr)},
                          {"reference", reference ? nlohmann::json(reference->config->name) : nlohmann::json(nullptr)},
                          {"ppl_docs", docs},
                          {"ppl_tail", opt.ppl_tail},
                          {"prompts", prompts},
                          {"partial", is_partial},
                          {"resumed", resumed},
                          {"seconds", seconds_since(t0, v.device())}};
  };
  auto last_checkpoint = Clock::now();
  auto advance = [&](int64_t work) {
    done += work;
    if (progress) progress(done, total);
    if (opt.checkpoint &&
        std::chrono::duration<double>(Clock::now() - last_checkpoint).count() >= opt.checkpoint_seconds) {
      opt.checkpoint(report(true));
      last_checkpoint = Clock::now();
    }
  };

  for (size_t c = 0; c < C && !partial; ++c) {
    for (size_t t = 0; t < T && !partial; ++t)
      for (size_t i = 0; i < plan.samples[t][c].size(); ++i) {
        const auto& s = plan.samples[t][c][i];
        const int64_t m = todo_prompt(t, c, i), work = m * (int64_t)(s.prompt_ids.size() + s.max_new_tokens);
        if (m == 0) continue;
        if ((partial = stop_due(work))) break;
        for (auto& r : runs) {
          if (r.scores[t][c].size() > i) continue;  // answered in the resumed run
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
        advance(work);
      }
    for (size_t d = 0; d < plan.docs.size() && !partial; ++d) {
      const int64_t n = plan.contexts[c], m = todo_doc(c, d);
      if (m == 0) continue;
      if ((partial = stop_due(m * n))) break;
      const std::vector<int64_t> ids(plan.docs[d].ids.begin(), plan.docs[d].ids.begin() + n);
      for (auto& r : runs) {
        if (r.nll[c].size() > d) continue;
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
        r.nll[c].push_back(tail_nll(sr, opt.ppl_tail));  // of the prefix's n - 1 next-token log-probs
      }
      advance(m * n);
    }
  }
  return report(partial);
}

nlohmann::json run_long_eval(const Model& v, const Drafter* drafter, const FTheta* ftheta, const Tokenizer& tok,
                             const std::vector<LongEvalConfig>& configs, const LongEvalOptions& opt,
                             const LongEvalProgress& progress) {
  return run_long_eval(v, drafter, ftheta, tok, configs, opt, plan_long_eval(tok, v.config(), opt), progress);
}

}  // namespace kakeya

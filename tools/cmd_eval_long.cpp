// kakeya eval-long: the long-context suite (infer/long_eval.h) over decoder configs side by side
// (the full-KV oracle, evict-only, restored, ...): task scores per context and the perplexity of
// held-out documents' last tokens; a table per config with the difference to the oracle, JSON,
// and with --plot the heat maps and perplexity ratios (tools/plot_eval_long.py).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "core/error.h"
#include "core/io/fs.h"
#include "infer/long_eval.h"
#include "tools/cli_common.h"
#include "tools/restored_flags.h"

namespace kakeya::cli {
namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<int64_t> parse_contexts(const std::string& s) {
  std::vector<int64_t> out;
  for (const auto& item : split(s)) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    KAKEYA_CHECK(used == item.size() && v > 0, "--contexts: '" << item << "' is not a positive token count");
    out.push_back(v);
  }
  KAKEYA_CHECK(!out.empty(), "--contexts: expected a comma-separated list of token counts");
  return out;
}

template <class... A>
std::string fmt(const char* f, A... a) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, a...);
  return buf;
}

// Rows = tasks (+ mean, ppl), columns = contexts, one block per config; cells of configs other
// than the oracle carry the difference to it (points for scores, a ratio for perplexity).
std::string table(const nlohmann::json& rep) {
  const auto& contexts = rep["contexts"];
  const nlohmann::json* oracle = nullptr;
  for (const auto& c : rep["configs"])
    if (!rep["oracle"].is_null() && c["name"] == rep["oracle"]) oracle = &c;
  std::string out;
  char buf[512];
  auto interval = [](const nlohmann::json& ci, const char* f) {
    return ci.is_null() ? std::string("[n<2]") : "[" + fmt(f, ci[0].get<double>()) + "," + fmt(f, ci[1].get<double>()) + "]";
  };
  for (const auto& cfg : rep["configs"]) {
    const bool vs = oracle && oracle != &cfg;
    std::string what = cfg["mode"].get<std::string>();
    if (!cfg["restore"].is_null()) {
      const auto& r = cfg["restore"];
      std::snprintf(buf, sizeof buf, "; sink %lld, window %lld, full attn %s, layers %s", (long long)r["sink"].get<int64_t>(),
                    (long long)r["window"].get<int64_t>(), r["full_attn"].get<std::string>().c_str(),
                    r["layers"].get<std::string>().c_str());
      what += buf;
    }
    std::snprintf(buf, sizeof buf, "\n== %s (%s), %.1f s%s ==\n", cfg["name"].get<std::string>().c_str(), what.c_str(),
                  cfg["seconds"].get<double>(), vs ? "; cells: value (vs oracle)" : "");
    out += buf;
    std::snprintf(buf, sizeof buf, "%-22s", "task");
    out += buf;
    for (const auto& c : contexts) {
      std::snprintf(buf, sizeof buf, "%20lld", (long long)c.get<int64_t>());
      out += buf;
    }
    out += "\n";
    auto row = [&](const std::string& label, auto&& cell) {
      std::snprintf(buf, sizeof buf, "%-22s", label.c_str());
      out += buf;
      for (const auto& c : contexts) {
        std::snprintf(buf, sizeof buf, "%20s", cell(std::to_string(c.get<int64_t>())).c_str());
        out += buf;
      }
      out += "\n";
    };
    for (const auto& t : rep["tasks"]) {
      const std::string task = t.get<std::string>();
      row(task, [&](const std::string& k) -> std::string {
        const auto& tasks = cfg["tasks"];
        if (!tasks.contains(task) || !tasks[task].contains(k)) return "-";
        const double v = tasks[task][k]["score"];
        if (!vs || !(*oracle)["tasks"].contains(task) || !(*oracle)["tasks"][task].contains(k)) return fmt("%.3f", v);
        return fmt("%.3f (%+.1f)", v, 100 * (v - (*oracle)["tasks"][task][k]["score"].get<double>()));
      });
    }
    const auto& s = cfg["summary"];
    if (!cfg["ppl"].empty())
      row("ppl", [&](const std::string& k) -> std::string {
        if (!cfg["ppl"].contains(k)) return "-";
        const double p = cfg["ppl"][k]["ppl"];
        if (!vs || !s["vs_oracle"]["ppl_ratio"].contains(k)) return fmt("%.3f", p);
        return fmt("%.3f (%.3fx)", p, s["vs_oracle"]["ppl_ratio"][k].get<double>());
      });
    // A paired comparison (same prompts, same documents): the perplexity ratio and the points per
    // task family, each with its 95% interval.
    auto paired = [&](const nlohmann::json& v, const std::string& indent) {
      if (!v["ppl_ratio"].empty())
        row(indent + "ppl ratio, 95% CI", [&](const std::string& k) -> std::string {
          if (!v["ppl_ratio"].contains(k)) return "-";
          return fmt("%.3f ", v["ppl_ratio"][k].get<double>()) + interval(v["ppl_ratio_ci95"][k], "%.3f");
        });
      for (const auto& f : v["family_delta_pp"].items())
        row(indent + f.key() + " pp, 95% CI", [&](const std::string& k) -> std::string {
          if (!f.value().contains(k)) return "-";
          const auto& cell = f.value()[k];
          return fmt("%+.1f", cell["delta"].get<double>()) + interval(cell["ci95"], "%+.0f");
        });
    };
    if (vs) paired(s["vs_oracle"], "  ");
    if (s.contains("vs_reference")) {
      out += "  vs " + s["vs_reference"]["config"].get<std::string>() + ":\n";
      paired(s["vs_reference"], "    ");
    }
    if (!s["mean_score"].is_null()) {
      std::snprintf(buf, sizeof buf, "mean score %.3f", s["mean_score"].get<double>());
      out += buf;
      if (s.contains("vs_oracle") && !s["vs_oracle"]["mean_delta_pp"].is_null())
        out += fmt(" (%+.1f points vs oracle, ", s["vs_oracle"]["mean_delta_pp"].get<double>()) +
               fmt("%.0f%% of outputs identical)", 100 * s["vs_oracle"]["same_text"].get<double>());
      out += "; by family:";
      for (const auto& f : s["families"].items()) out += " " + f.key() + fmt(" %.3f", f.value()["mean"].get<double>());
      out += "\n";
    }
  }
  if (rep["partial"].get<bool>()) out += "\nPARTIAL: the deadline stopped the run; missing cells show '-' (--resume continues it)\n";
  return out;
}

}  // namespace

void register_eval_long(CLI::App& app) {
  struct Opts {
    RestoreFlags rf;
    // The default compares the default window's restoration with dropping the same positions.
    std::string configs = "oracle,evict:" + std::to_string(RestoreOptions{}.window) + ",restored:" +
                          std::to_string(RestoreOptions{}.window),
                tasks = "all", contexts = "1024,2048,4096,8192,16384";
    int64_t samples = 3, ppl_docs = 4, ppl_tail = 512;
    uint64_t seed = 0;
    std::string ppl_dir = "data/longeval/docs", source_dir, chat = "auto", json, png, python, reference;
    double budget = 0;
    bool resume = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("eval-long", "Long-context suite (NIAH variants, variable tracking, word counts, "
                                            "perplexity) over decoder configs side by side");
  o->rf.add(c);
  c->add_option("--configs", o->configs,
                "decoder configs: oracle | evict:W | restored[-all][-CODE][-codec[-CODE]]:W | exact[-CODE][-codec[-CODE]]:W, "
                "e.g. restored-int4:W, restored-codec-lm4:W, exact-int6-codec-pw4+17=pw5v4:W (W: exact window; CODE: " +
                    ops::row_code_names() + "; +L=CODE: a full-attention layer's own code; the other restore options "
                    "come from the flags above)")
      ->capture_default_str();
  c->add_option("--tasks", o->tasks, "all | none (perplexity only) | comma list of data/longeval.h tasks")
      ->capture_default_str();
  c->add_option("--contexts", o->contexts, "prompt lengths in tokens")->capture_default_str();
  c->add_option("--samples", o->samples, "prompts per (task, context)")->capture_default_str()->check(positive());
  c->add_option("--seed", o->seed, "first sample seed")->capture_default_str();
  c->add_option("--ppl-docs", o->ppl_docs, "held-out documents scored per context (0: no perplexity)")
      ->capture_default_str()
      ->check(non_negative());
  c->add_option("--ppl-tail", o->ppl_tail, "last tokens of each context-long prefix scored")->capture_default_str();
  c->add_option("--ppl-dir", o->ppl_dir, "held-out documents (*.txt, name order)")->capture_default_str();
  c->add_option("--source-dir", o->source_dir, "the tasks' text sources (default: data/longeval.h's)");
  c->add_option("--chat", o->chat, "auto | none | gemma | chatml")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "none", "gemma", "chatml"}));
  c->add_option("--budget", o->budget,
                "seconds from the start: the run ends before a prompt that would pass it and reports what is done "
                "as partial (0: no limit)")
      ->capture_default_str()
      ->check(non_negative());
  c->add_option("--reference", o->reference,
                "a config name: every other config is also compared with it, paired (e.g. compact restored modes "
                "against restored:W)");
  c->add_option("--json", o->json, "write the report here (also every 30 s while the run goes on)");
  c->add_flag("--resume", o->resume,
              "continue the report at --json when it exists: its prompts and documents are not run again (a run "
              "stopped by --budget goes on; more --samples / --ppl-docs or another config add to it)");
  c->add_option("--plot", o->png, "write the heat maps here and the perplexity plot beside it (-ppl.png; needs --json)");
  c->add_option("--python", o->python, "python for the plot (default: $KAKEYA_PYTHON, .venv/bin/python, python3)");
  c->callback([o] {
    const auto start = std::chrono::steady_clock::now();
    KAKEYA_CHECK(o->png.empty() || !o->json.empty(), "eval-long: --plot needs --json (the plot is drawn from it)");
    LongEvalOptions lo;
    KAKEYA_CHECK(!o->resume || !o->json.empty(), "eval-long: --resume needs --json (the report it continues)");
    lo.tasks = o->tasks == "all" ? data::long_task_names() : o->tasks == "none" ? std::vector<std::string>{} : split(o->tasks);
    lo.contexts = parse_contexts(o->contexts);
    lo.samples = o->samples;
    lo.seed = o->seed;
    lo.ppl_docs = o->ppl_docs;
    lo.ppl_tail = o->ppl_tail;
    lo.ppl_dir = o->ppl_dir;
    lo.source_dir = o->source_dir;
    lo.reference = o->reference;
    if (o->budget > 0)
      lo.deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(o->budget));
    const auto configs = parse_long_eval_configs(o->configs, o->rf.options());
    if (o->resume && fs::exists(o->json)) {
      lo.resume = fs::read_json(o->json, "an eval-long --json report");
      KAKEYA_CHECK(lo.resume.contains("models") && lo.resume["models"] == o->rf.to_json(),
                   "eval-long --resume: " << o->json << " was made with other models (field 'models': "
                                          << (lo.resume.contains("models") ? lo.resume["models"].dump() : "missing")
                                          << ", this run's " << o->rf.to_json().dump() << ")");
      std::fprintf(stderr, "[eval-long] resuming %s\n", o->json.c_str());
    }

    // The prompts first (tokenizer only): the model's RoPE table is sized to what they need.
    DecodeStack st;
    st.tok = std::make_unique<Tokenizer>(load_tokenizer(o->rf.verifier));
    lo.chat = o->chat == "auto" ? data::detect_chat_format(*st.tok) : data::parse_chat_format(o->chat);
    const auto plan = plan_long_eval(*st.tok, ModelConfig::from_file(o->rf.verifier + "/config.json"), lo);
    st.model = std::make_unique<Model>(load_model(o->rf.verifier, o->rf.df, plan.positions));
    if (configs_need_ftheta(configs)) load_restoration(o->rf, *st.model, *st.tok, st);

    // The report so far, with what identifies the run, where --resume finds it.
    auto stamp = [&](nlohmann::json& rep) {
      rep["command"] = command_line();
      rep["commit"] = git_commit();
      rep["device"] = device_description(st.model->device());
      rep["dtype"] = c10::toString(st.model->dtype());
      rep["models"] = o->rf.to_json();
      if (!lo.resume.is_null()) {  // the runs this report continues, oldest first
        auto from = lo.resume.value("resumed_from", nlohmann::json::array());
        from.push_back({{"commit", lo.resume.value("commit", "")}, {"command", lo.resume.value("command", "")}});
        rep["resumed_from"] = from;
      }
    };
    if (!o->json.empty())
      lo.checkpoint = [&](const nlohmann::json& partial) {
        auto rep = partial;
        stamp(rep);
        write_json(o->json, rep);
      };
    std::unique_ptr<Progress> bar;
    auto rep = run_long_eval(*st.model, st.d(), st.f(), *st.tok, configs, lo, plan,
                             [&](int64_t done, int64_t total) {
                               if (!bar) bar = std::make_unique<Progress>("[eval-long]", total, "tok");
                               bar->update(done);
                             });
    if (bar) bar->finish();
    stamp(rep);
    std::fputs(table(rep).c_str(), stdout);
    std::fflush(stdout);
    if (!o->json.empty()) {
      write_json(o->json, rep);
      std::fprintf(stderr, "-> %s\n", o->json.c_str());
      if (!o->png.empty()) run_plot(o->python, "tools/plot_eval_long.py '" + o->json + "' '" + o->png + "'");
    }
  });
}

}  // namespace kakeya::cli

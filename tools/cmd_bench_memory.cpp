// kakeya bench memory: for fixed KV budgets, the longest context one session fits and how many
// sessions of --context positions fit side by side, per decoder config (infer/bench_memory.h);
// with --speed, every config's decode tok/s at --context next to AR's, in the same run; with --plot,
// K/V bytes against the context per config (tools/plot_bench_memory.py).
#include <cstdio>

#include "core/error.h"
#include "infer/bench_memory.h"
#include "infer/long_eval.h"
#include "tools/cli_common.h"
#include "tools/restored_flags.h"

namespace kakeya::cli {

void register_bench_memory(CLI::App& bench) {
  struct Opts {
    RestoreFlags rf;  // the models, and the options the configs start from (sink, chunk, …)
    std::vector<int64_t> budget_mb{64, 256};
    bool speed = false;
    std::string json, png, python;
    std::string random_init;  // a config.json: bytes of that shape, no weights
    BenchMemoryOptions b;
  };
  auto o = std::make_shared<Opts>();
  auto* c = bench.add_subcommand("memory", "What a KV budget fits per decoder config: longest context, sessions, decode speed");
  o->rf.add(c, false);
  c->add_option("--configs", o->b.configs,
                "comma-separated configs: oracle | evict:W | restored[-all][-CODE][-codec[-CODE]]:W (as eval-long's)")
      ->capture_default_str();
  c->add_option("--budget-mb", o->budget_mb, "KV budgets in MiB, comma-separated")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  c->add_option("--context", o->b.context, "positions per session for the session count (and the timing)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  c->add_option("--max-context", o->b.max_context, "longest context considered (0: the model's limit)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  c->add_flag("--speed", o->speed, "also time every config's decoding at --context against AR (greedy, no stop)");
  c->add_option("--new-tokens", o->b.new_tokens, "--speed: generated tokens per run")->capture_default_str()->check(CLI::Range(2, 1 << 20));
  c->add_option("--repeats", o->b.repeats, "--speed: timed runs per config (median)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  c->add_option("--random-init", o->random_init,
                "HF config.json: the plans of that shape instead of --verifier's (bytes only, no weights; "
                "--drafter/--ftheta: directories or random)")
      ->check(CLI::ExistingFile);
  c->add_option("--json", o->json, "write the results here");
  c->add_option("--plot", o->png, "draw K/V bytes against the context per config, with the budgets (needs --json)");
  c->add_option("--python", o->python, "python for the plot (default: $KAKEYA_PYTHON, .venv/bin/python, python3)");
  c->callback([o] {
    KAKEYA_CHECK(o->png.empty() || !o->json.empty(), "bench memory: --plot needs --json (the plot is drawn from it)");
    BenchMemoryOptions b = o->b;
    KAKEYA_CHECK(!o->speed || b.new_tokens < b.context, "--new-tokens " << b.new_tokens << " must be below --context " << b.context);
    b.budgets.clear();
    for (int64_t mb : o->budget_mb) b.budgets.push_back(mb << 20);
    // The models: for the configs' shapes (and the timing).
    b.restore = o->rf.options();
    nlohmann::json report;
    if (!o->random_init.empty()) {
      KAKEYA_CHECK(!o->speed, "bench memory --random-init: bytes only (--speed times trained models)");
      const auto cfg = ModelConfig::from_file(o->random_init);
      const auto [d, f] = restoration_configs(o->rf, cfg);
      report = bench_memory(cfg, o->rf.df.torch_dtype(), &d, &f, b);
      report["verifier_config"] = o->random_init;
      report["device"] = "plans only: " + o->random_init;
      report["dtype"] = c10::toString(o->rf.df.torch_dtype());
    } else {
      // The drafter and f_θ only where a config restores through them (exact and evict-only ones do not).
      DecodeStack st = load_decode_stack(o->rf, b.context, configs_need_ftheta(parse_long_eval_configs(b.configs, b.restore)));
      BenchMemoryModels m;
      if (o->speed) m = {st.model.get(), st.d(), st.f(), bench_prompt(*st.tok, b.context - b.new_tokens)};
      report = bench_memory(st.model->config(), st.model->dtype(), st.d() ? &st.d()->config() : nullptr,
                            st.f() ? &st.f()->config() : nullptr, b, m);
      report["device"] = device_description(st.model->device());
      report["dtype"] = c10::toString(st.model->dtype());
    }
    report["commit"] = git_commit();
    report["command"] = command_line();
    report["models"] = o->rf.to_json();
    std::printf("%s", bench_memory_table(report).c_str());
    if (!o->json.empty()) write_json(o->json, report);
    if (!o->png.empty()) run_plot(o->python, "tools/plot_bench_memory.py '" + o->json + "' '" + o->png + "'");
  });
}

}  // namespace kakeya::cli

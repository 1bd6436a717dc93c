// kakeya niah: needle-in-a-haystack ladder of the restored decoder against the
// full-KV oracle (`ar`) on the same samples (data/niah.h prompts).
// kakeya sweep-alpha: per mixing alpha, NIAH recall, relative error of the
// restored K/V by layer type, and perplexity (infer/score.h logic through the
// restored cache).
// Both write JSON and, with --plot, a PNG (tools/plot_restored.py).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "core/error.h"
#include "core/io/fs.h"
#include "data/niah.h"
#include "infer/decoder.h"
#include "infer/restored.h"
#include "tools/cli_common.h"
#include "tools/restored_flags.h"

namespace kakeya::cli {
namespace {

std::vector<double> parse_doubles(const std::string& s, const char* flag) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    KAKEYA_CHECK(used == item.size(), flag << ": '" << item << "' is not a number");
    out.push_back(v);
  }
  KAKEYA_CHECK(!out.empty(), flag << ": expected a comma-separated list");
  return out;
}

std::vector<int64_t> parse_contexts(const std::string& s) {
  std::vector<int64_t> out;
  for (double v : parse_doubles(s, "--contexts")) {
    KAKEYA_CHECK(v >= 16 && v == std::floor(v), "--contexts: expected token counts >= 16, got " << v);
    out.push_back((int64_t)v);
  }
  return out;
}

struct NiahFlags {
  std::string contexts = "1024,2048,4096,8192,16384";
  std::string depths = "0.1,0.3,0.5,0.7,0.9";
  int64_t samples = 2;      // per depth and rung
  int64_t max_new = 12;
  uint64_t seed = 0;
  std::string chat = "auto", split = "eval", source_dir = "data/codec", haystack;
  void add(CLI::App* c) {
    c->add_option("--contexts", contexts, "prompt lengths in tokens (ladder rungs)")->capture_default_str();
    c->add_option("--depths", depths, "needle depths in [0, 1], one prompt each")->capture_default_str();
    c->add_option("--samples", samples, "prompts per depth and rung (different needles and haystack)")
        ->capture_default_str()
        ->check(positive());
    c->add_option("--max-new-tokens", max_new, "tokens generated per prompt")->capture_default_str()->check(positive());
    c->add_option("--seed", seed, "first sample number of the split")->capture_default_str();
    c->add_option("--chat", chat, "auto | none | gemma | chatml")->capture_default_str();
    c->add_option("--split", split, "eval | train haystack and keys")->capture_default_str()->check(CLI::IsMember({"eval", "train"}));
    c->add_option("--source-dir", source_dir, "where the default haystack files live")->capture_default_str();
    c->add_option("--haystack", haystack, "haystack text file (default: the split's file under --source-dir)");
  }
};

struct NiahRun {
  double recall = 0, oracle_recall = -1;
  double fraction_sliding = 1, fraction_full = 1;  // min over samples (-1 = no such layers)
  double tok_s = 0, oracle_tok_s = 0;
  MemoryReport memory;
  RestoreStats stats;
  nlohmann::json samples = nlohmann::json::array();
};

// One rung: every depth × sample, restored decoder (and the oracle unless skipped) on the same prompts.
NiahRun run_rung(const DecodeStack& st, const NiahFlags& nf, int64_t context, const DecodeOptions& base, bool oracle,
                 const std::vector<double>& depths) {
  NiahRun run;
  const Model& model = *st.model;
  data::NiahOptions no;
  no.split = nf.split == "train" ? data::NiahSplit::Train : data::NiahSplit::Eval;
  no.context_tokens = context;
  no.chat = nf.chat == "auto" ? data::detect_chat_format((*st.tok)) : data::parse_chat_format(nf.chat);
  no.source_dir = nf.source_dir;
  no.haystack_file = nf.haystack;
  int64_t n = 0;
  double fs = 2, ff = 2;
  for (int64_t s = 0; s < nf.samples; ++s)
    for (size_t di = 0; di < depths.size(); ++di) {
      no.seed = nf.seed + (uint64_t)(s * depths.size() + di);
      no.depths = {depths[di]};
      auto sample = data::make_niah((*st.tok), no);
      DecodeOptions d = base;
      d.max_new_tokens = nf.max_new;
      d.stop_ids = model.config().eos_token_ids;
      auto r = decode(model, st.d(), st.f(), sample.prompt_ids, d);
      std::vector<int32_t> gen(r.tokens.begin(), r.tokens.end());
      const std::string text = (*st.tok).decode(gen, true);
      const double rec = data::niah_recall(sample.answers, text);
      nlohmann::json sj{{"seed", no.seed},          {"depth", depths[di]},      {"answers", sample.answers},
                        {"needle_positions", sample.needle_positions}, {"text", text}, {"recall", rec},
                        {"decode_tokens_per_second", r.decode_tokens_per_second()}};
      run.recall += rec;
      run.tok_s += r.decode_tokens_per_second();
      if (d.mode != DecodeMode::Ar) {
        fs = std::min(fs, r.attention_fraction_sliding);
        ff = std::min(ff, r.attention_fraction_full);
        run.stats += r.stats;
      }
      if (n == 0) run.memory = r.memory;
      if (oracle) {
        DecodeOptions a = d;
        a.mode = DecodeMode::Ar;
        auto ar = decode(model, nullptr, nullptr, sample.prompt_ids, a);
        std::vector<int32_t> ag(ar.tokens.begin(), ar.tokens.end());
        const std::string at = (*st.tok).decode(ag, true);
        const double orec = data::niah_recall(sample.answers, at);
        sj["oracle_text"] = at;
        sj["oracle_recall"] = orec;
        run.oracle_recall = (run.oracle_recall < 0 ? 0 : run.oracle_recall) + orec;
        run.oracle_tok_s += ar.decode_tokens_per_second();
      }
      run.samples.push_back(sj);
      ++n;
      std::fprintf(stderr, "\r  ctx %lld: %lld/%lld samples", (long long)context, (long long)n,
                   (long long)(nf.samples * depths.size()));
    }
  std::fprintf(stderr, "\n");
  run.recall /= n;
  run.tok_s /= n;
  if (oracle) {
    run.oracle_recall /= n;
    run.oracle_tok_s /= n;
  }
  if (base.mode != DecodeMode::Ar) {
    run.fraction_sliding = fs > 1.5 ? -1 : fs;
    run.fraction_full = ff > 1.5 ? -1 : ff;
  }
  return run;
}

void plot(const std::string& kind, const std::string& json, const std::string& png, const std::string& python) {
  if (png.empty()) return;
  if (run_plot(python, "tools/plot_restored.py " + kind + " '" + json + "' '" + png + "'"))
    std::fprintf(stderr, "-> %s\n", png.c_str());
}

std::string pct(double v) {
  char b[32];
  if (v < 0) return "-";
  std::snprintf(b, sizeof b, "%.1f%%", 100 * v);
  return b;
}

}  // namespace

void register_niah(CLI::App& app) {
  struct Opts {
    RestoreFlags rf;
    NiahFlags nf;
    std::string mode = "restored", json, png, python;
    bool no_oracle = false;
    double max_delta_pp = 5.0;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("niah", "NIAH recall ladder: restored decoder vs the full-KV oracle on the same samples");
  o->rf.add(c);
  o->nf.add(c);
  c->add_option("--mode", o->mode, "restored | restored-reforward (the decoder under test)")
      ->capture_default_str()
      ->check(CLI::IsMember({"restored", "restored-reforward"}));
  c->add_flag("--no-oracle", o->no_oracle, "skip the full-KV oracle (forfeits the delta gate)");
  c->add_option("--max-delta-pp", o->max_delta_pp, "gate: |recall - oracle recall| in percentage points")->capture_default_str();
  c->add_option("--json", o->json, "write the ladder here");
  c->add_option("--plot", o->png, "write the ladder PNG here (needs --json)");
  c->add_option("--python", o->python, "python for the plot (default: $KAKEYA_PYTHON, .venv/bin/python, python3)");
  c->callback([o] {
    KAKEYA_CHECK(o->png.empty() || !o->json.empty(), "niah: --plot needs --json (the plot is drawn from it)");
    const auto contexts = parse_contexts(o->nf.contexts);
    const auto depths = parse_doubles(o->nf.depths, "--depths");
    for (double d : depths) KAKEYA_CHECK(d >= 0 && d <= 1, "--depths: " << d << " outside [0, 1]");
    int64_t longest = 0;
    for (int64_t c : contexts) longest = std::max(longest, c + o->nf.max_new);
    RestoreOptions ro = o->rf.options();
    auto st = load_decode_stack(o->rf, longest, ro.needs_ftheta());
    const Model& model = *st.model;
    DecodeOptions base;
    base.mode = parse_decode_mode(o->mode);
    base.restore = ro;
    nlohmann::json rungs = nlohmann::json::array();
    bool delta_ok = !o->no_oracle, fraction_ok = true;
    std::vector<int64_t> bounded;
    std::fprintf(stderr, "%8s %8s %8s %8s %10s %10s %9s %9s %9s\n", "context", "recall", "oracle", "delta",
                 "KV MiB", "vs full", "vs native", "frac sl", "frac full");
    std::string table;
    for (int64_t ctx : contexts) {
      auto r = run_rung(st, o->nf, ctx, base, !o->no_oracle, depths);
      const double delta = r.oracle_recall >= 0 ? 100 * (r.recall - r.oracle_recall) : 0.0;
      if (!o->no_oracle && std::abs(delta) > o->max_delta_pp) delta_ok = false;
      for (double f : {r.fraction_sliding, r.fraction_full})
        if (f >= 0 && f != 1.0) fraction_ok = false;
      if (ctx >= model.config().sliding_window) bounded.push_back(r.memory.bounded_bytes());
      const auto& m = r.memory;
      char line[256];
      std::snprintf(line, sizeof line, "%8lld %8s %8s %+7.1fpp %10.2f %9.3fx %9.3fx %9.3f %9.3f\n", (long long)ctx,
                    pct(r.recall).c_str(), pct(r.oracle_recall).c_str(), delta, m.kv_bytes() / 1048576.0,
                    (double)m.kv_bytes() / m.full_kv_bytes, (double)m.kv_bytes() / m.native_kv_bytes,
                    r.fraction_sliding, r.fraction_full);
      std::fputs(line, stderr);
      table += line;
      rungs.push_back({{"context", ctx},
                       {"samples", r.samples.size()},
                       {"recall", r.recall},
                       {"oracle_recall", r.oracle_recall},
                       {"delta_pp", delta},
                       {"effective_attention_fraction", {{"sliding", r.fraction_sliding}, {"full", r.fraction_full}}},
                       {"memory", m.to_json()},
                       {"decode_tokens_per_second", r.tok_s},
                       {"oracle_decode_tokens_per_second", r.oracle_tok_s},
                       {"per_sample", r.samples}});
    }
    // Needs two rungs past the sliding window to say anything.
    const bool bounded_checked = bounded.size() >= 2;
    bool bounded_ok = true;
    for (int64_t b : bounded) bounded_ok &= b == bounded.front();
    // Target of the issue: total K/V at 8k <= 1/5 of full KV (reported where an 8k rung ran).
    nlohmann::json target = nullptr;
    for (const auto& rg : rungs)
      if (rg["context"] == 8192) {
        double ratio = rg["memory"]["ratio_vs_full_kv"];
        target = {{"context", 8192}, {"ratio_vs_full_kv", ratio}, {"pass", ratio <= 0.2}};
      }
    nlohmann::json gates{
        {"delta_recall", {{"max_pp", o->max_delta_pp}, {"pass", delta_ok}, {"checked", !o->no_oracle}}},
        {"effective_attention_fraction", {{"required", 1.0}, {"pass", fraction_ok}}},
        {"memory_bounded",
         {{"pass", bounded_ok},
          {"checked", bounded_checked},
          {"meaning", "every K/V term except those marked grows_with_context (exact full-attention K/V under "
                      "--full-attn exact, restored full-attention K/V under --full-attn restored, coded full-attention K/V "
                      "under --full-attn codec) is the same at "
                      "every rung >= the sliding window"}}},
        {"kv_at_8k_le_fifth_of_full_kv", target}};
    std::fprintf(stderr, "gates: |delta| <= %.1fpp %s, attention fraction = 1.0 %s, memory bounded %s\n",
                 o->max_delta_pp, o->no_oracle ? "NOT CHECKED" : delta_ok ? "PASS" : "FAIL",
                 fraction_ok ? "PASS" : "FAIL",
                 !bounded_checked ? "NOT CHECKED (needs two rungs >= the sliding window)" : bounded_ok ? "PASS" : "FAIL");
    if (!o->json.empty()) {
      write_json(o->json, {{"command", command_line()},
                           {"mode", o->mode},
                           {"device", device_description(model.device())},
                           {"dtype", c10::toString(model.dtype())},
                           {"models", o->rf.to_json()},
                           {"restore", ro.to_json()},
                           {"depths", depths},
                           {"samples_per_depth", o->nf.samples},
                           {"max_new_tokens", o->nf.max_new},
                           {"chat", o->nf.chat},
                           {"rungs", rungs},
                           {"gates", gates}});
      std::fprintf(stderr, "-> %s\n", o->json.c_str());
      plot("niah", o->json, o->png, o->python);
    }
  });
}

void register_sweep_alpha(CLI::App& app) {
  struct Opts {
    RestoreFlags rf;
    NiahFlags nf;
    std::string alphas = "0,0.25,0.5,0.75,1", ppl_text = "data/codec/eval.txt", json, png, python;
    int64_t ppl_tokens = 1024;
  };
  auto o = std::make_shared<Opts>();
  o->nf.contexts = "1024";
  auto* c = app.add_subcommand("sweep-alpha", "Per mixing alpha: NIAH recall, relative error of restored K/V by "
                                              "layer type, perplexity through the restored cache");
  o->rf.add(c, false);
  o->nf.add(c);
  c->add_option("--alphas", o->alphas, "a in [0, 1]: restored raw K/V = a·true + (1-a)·f_θ")->capture_default_str();
  c->add_option("--ppl-text", o->ppl_text, "text scored for perplexity")->capture_default_str();
  c->add_option("--ppl-tokens", o->ppl_tokens, "tokens of it scored (one window)")->capture_default_str()->check(positive());
  c->add_option("--json", o->json, "write the sweep here");
  c->add_option("--plot", o->png, "write the sweep PNG here (needs --json)");
  c->add_option("--python", o->python, "python for the plot (default: $KAKEYA_PYTHON, .venv/bin/python, python3)");
  c->callback([o] {
    KAKEYA_CHECK(o->png.empty() || !o->json.empty(), "sweep-alpha: --plot needs --json (the plot is drawn from it)");
    const auto alphas = parse_doubles(o->alphas, "--alphas");
    for (double a : alphas) KAKEYA_CHECK(a >= 0 && a <= 1, "--alphas: " << a << " outside [0, 1]");
    const auto contexts = parse_contexts(o->nf.contexts);
    const auto depths = parse_doubles(o->nf.depths, "--depths");
    int64_t longest = o->ppl_tokens + 1;
    for (int64_t c : contexts) longest = std::max(longest, c + o->nf.max_new);
    auto st = load_decode_stack(o->rf, longest, true);
    const Model& model = *st.model;
    auto ppl_ids = encode((*st.tok), read_file(o->ppl_text));
    KAKEYA_CHECK((int64_t)ppl_ids.size() >= o->ppl_tokens,
                 o->ppl_text << ": " << ppl_ids.size() << " tokens, fewer than --ppl-tokens " << o->ppl_tokens);
    ppl_ids.resize(o->ppl_tokens);
    // The oracle once: full-KV recall on the same samples and full-KV perplexity.
    DecodeOptions ar;
    ar.mode = DecodeMode::Ar;
    double oracle_recall = 0;
    for (int64_t ctx : contexts) oracle_recall += run_rung(st, o->nf, ctx, ar, false, depths).recall / contexts.size();
    ScoreOptions so;
    const double oracle_ppl = score(model, ppl_ids, so).perplexity();
    std::fprintf(stderr, "oracle (full KV): recall %s, perplexity %.3f\n", pct(oracle_recall).c_str(), oracle_ppl);
    std::fprintf(stderr, "%6s %8s %10s %12s %12s %12s %12s\n", "alpha", "recall", "ppl", "slid K err", "slid V err",
                 "full K err", "full V err");
    nlohmann::json rows = nlohmann::json::array();
    for (double a : alphas) {
      DecodeOptions d;
      d.mode = DecodeMode::Restored;
      d.restore = o->rf.options();
      d.restore.mix_alpha = a;
      d.restore.stats = true;
      double recall = 0;
      RestoreStats stats;
      for (int64_t ctx : contexts) {
        auto r = run_rung(st, o->nf, ctx, d, false, depths);
        recall += r.recall / contexts.size();
        stats += r.stats;
      }
      RestoreStats pst;
      const double ppl = score_restored(model, st.d(), st.f(), ppl_ids, d.restore, &pst).perplexity();
      std::fprintf(stderr, "%6.2f %8s %10.3f %12.4f %12.4f %12.4f %12.4f\n", a, pct(recall).c_str(), ppl,
                   stats.rel(false, false, true), stats.rel(false, true, true), stats.rel(true, false, true),
                   stats.rel(true, true, true));
      rows.push_back({{"alpha", a},
                      {"recall", recall},
                      {"perplexity", ppl},
                      {"restore_error_niah", stats.to_json()},
                      {"restore_error_ppl_text", pst.to_json()}});
    }
    if (!o->json.empty()) {
      write_json(o->json, {{"command", command_line()},
                           {"device", device_description(model.device())},
                           {"dtype", c10::toString(model.dtype())},
                           {"models", o->rf.to_json()},
                           {"restore", o->rf.options().to_json()},
                           {"contexts", contexts},
                           {"depths", depths},
                           {"samples_per_depth", o->nf.samples},
                           {"ppl_text", o->ppl_text},
                           {"ppl_tokens", o->ppl_tokens},
                           {"oracle", {{"recall", oracle_recall}, {"perplexity", oracle_ppl}}},
                           {"rows", rows},
                           {"error_metric", "sqrt(sum |restored - true|^2 / sum |true|^2) over restored positions "
                                            "and layers of a type; raw = f_θ space (pre-norm), cache = after "
                                            "k_norm/v_norm + RoPE (what attention reads)"}});
      std::fprintf(stderr, "-> %s\n", o->json.c_str());
      plot("sweep", o->json, o->png, o->python);
    }
  });
}

}  // namespace kakeya::cli

// kakeya codec-eval: Scenario A (calib/codec_eval.h) for a list of codecs on the
// same passages; prints one table (codec, bits/value, ratio vs bf16, Δppl, top-1,
// KL), writes JSON and a Pareto plot (tools/plot_codec_eval.py).
//
// Evaluation text (default data/codec/eval.txt): CPython's Language Reference
// prose (pydoc_data/topics.py), the topics disjoint from the calibration text
// data/codec/calib.txt (split rule in tools/codec_corpus.py). Passages are
// consecutive, non-overlapping slices of context + n-eval tokens, each after BOS.
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "calib/codec_eval.h"
#include "calib/codec/calib_bundle.h"
#include "calib/codec/codec.h"
#include "core/error.h"
#include "core/io/fs.h"
#include "tools/cli_common.h"

namespace kakeya::cli {

namespace {
const char* kDefaultCodecs =
    "exact;"
    "ours=kakeya:sink=1,kbasis=calib,kalloc=3.3,vbasis=calib,valloc=3;"
    "turbo:kb=4,vb=4;turbo:kb=4,vb=3;turbo:kb=3,vb=3;int4;int8;fp8";

std::vector<std::string> split_codecs(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ';') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  std::vector<std::string> kept;
  for (auto& x : out) {
    size_t a = x.find_first_not_of(" \t\n"), b = x.find_last_not_of(" \t\n");
    if (a != std::string::npos) kept.push_back(x.substr(a, b - a + 1));
  }
  return kept;
}
}  // namespace

void register_codec_eval(CLI::App& app) {
  struct Opts {
    std::string model = "checkpoints/models/gemma3-270m";
    std::string text = "data/codec/eval.txt", ids, json, plot, plot_script = "tools/plot_codec_eval.py", python;
    std::string bundle, codecs = kDefaultCodecs;
    int64_t passages = 2, offset = 0;
    calib::CodecEvalOptions ev;
    DeviceFlags df;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("codec-eval", "Scenario A: codecs applied once to a prefilled KV cache, judged by Δppl/top-1/KL");
  c->add_option("--model", o->model, "HF model directory")->capture_default_str();
  auto* t = c->add_option("--text", o->text, "evaluation text (UTF-8)")->capture_default_str();
  auto* i = c->add_option("--ids", o->ids, "JSON array of token ids instead of --text")->check(CLI::ExistingFile);
  t->excludes(i);
  c->add_option("--context", o->ev.context, "prefill tokens (the coded cache)")->capture_default_str();
  c->add_option("--n-eval", o->ev.n_eval, "teacher-forced tokens scored after the coded cache")->capture_default_str();
  c->add_option("--passages", o->passages, "passages (consecutive slices of context + n-eval tokens)")->capture_default_str();
  c->add_option("--offset", o->offset, "token offset of the first passage in the text")->capture_default_str();
  c->add_option("--chunk", o->ev.chunk, "tokens per evaluation forward")->capture_default_str();
  c->add_option("--streams", o->ev.streams, "streams the codecs code: k | v | kv (the other stays exact)")
      ->check(CLI::IsMember({"k", "v", "kv"}))
      ->capture_default_str();
  c->add_option("--bundle", o->bundle, "calibration bundle directory (Σ_q, bases, codebooks)");
  c->add_option("--codecs", o->codecs,
                "';'-separated codec specs, each [LABEL=]NAME[:key=value,...] (see calib/codec/codec.h)")
      ->capture_default_str();
  c->add_option("--json", o->json, "write the table, per-passage scores and byte breakdowns here");
  c->add_option("--plot", o->plot, "write a Pareto plot (Δppl vs compression ratio) PNG here (needs --json)");
  c->add_option("--plot-script", o->plot_script, "plot script")->capture_default_str();
  c->add_option("--python", o->python, "python for the plot (default: $KAKEYA_PYTHON, .venv/bin/python, python3)");
  o->df.add(c);
  c->callback([o] {
    KAKEYA_CHECK(o->passages >= 1, "codec-eval: --passages must be >= 1");
    KAKEYA_CHECK(o->plot.empty() || !o->json.empty(), "codec-eval: --plot needs --json (the plot is drawn from it)");
    auto cfg = ModelConfig::from_file(o->model + "/config.json");
    // Codecs first: a bad spec fails before any model work.
    std::vector<CodecOptions> codecs;
    for (const auto& s : split_codecs(o->codecs)) {
      // "label=spec": a label has no ':' or ',' before its '='.
      auto eq = s.find('='), colon = s.find(':');
      bool labelled = eq != std::string::npos && (colon == std::string::npos || eq < colon) && s.find(',') > eq;
      auto co = CodecOptions::parse(labelled ? s.substr(eq + 1) : s);
      if (labelled) co.label = s.substr(0, eq);
      codecs.push_back(co);
    }
    KAKEYA_CHECK(!codecs.empty(), "codec-eval: --codecs is empty");
    std::unique_ptr<CalibBundle> bundle;
    if (!o->bundle.empty()) bundle = std::make_unique<CalibBundle>(CalibBundle::load(o->bundle, cfg));

    std::vector<int64_t> body;
    if (!o->ids.empty()) {
      for (const auto& x : nlohmann::json::parse(read_file(o->ids))) {
        KAKEYA_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < cfg.vocab_size,
                     o->ids << ": token id " << x.dump() << " outside [0, " << cfg.vocab_size << ")");
        body.push_back(x.get<int64_t>());
      }
    } else {
      body = encode(load_tokenizer(o->model), read_file(o->text), /*add_special=*/false);
    }
    const int64_t need = o->ev.context + o->ev.n_eval;  // + BOS = context + n_eval + 1
    std::vector<std::vector<int64_t>> passages;
    for (int64_t p = 0; p < o->passages; ++p) {
      const int64_t s = o->offset + p * need;
      KAKEYA_CHECK(s + need <= (int64_t)body.size(), "codec-eval: the text has " << body.size() << " tokens, passage "
                                                                                   << p + 1 << " needs tokens [" << s << ", "
                                                                                   << s + need << ")");
      std::vector<int64_t> ps;
      if (cfg.bos_token_id >= 0) ps.push_back(cfg.bos_token_id);
      ps.insert(ps.end(), body.begin() + s, body.begin() + s + need);
      if (cfg.bos_token_id < 0) ps.push_back(body[s + need]);  // no BOS: one more text token
      passages.push_back(ps);
    }
    auto model = load_model(o->model, o->df, need + 2);
    o->ev.log = [](const std::string& s) { std::fprintf(stderr, "%s\n", s.c_str()); };
    auto res = calib::codec_eval(model, passages, codecs, bundle.get(), o->ev);

    double ppl = 0;
    for (double x : res.ppl_ref) ppl += x;
    std::printf("\nScenario A: %s, %s %s, context %lld, n-eval %lld, %lld passage(s), streams %s; uncoded ppl %.4f "
                "(mean over passages); rebuild check %.2e\n",
                o->model.c_str(), device_description(model.device()).c_str(), c10::toString(model.dtype()),
                (long long)o->ev.context, (long long)o->ev.n_eval, (long long)o->passages, o->ev.streams.c_str(),
                ppl / res.ppl_ref.size(), res.rebuild_max_abs_logit_diff);
    size_t w = 5;
    for (const auto& r : res.rows) w = std::max(w, r.label.size());
    std::printf("%-*s  %9s  %6s  %9s  %7s  %8s  %s\n", (int)w, "codec", "bits/val", "ratio", "dppl", "top-1", "KL",
                "dppl per passage");
    for (const auto& r : res.rows) {
      auto p = r.pooled();
      std::ostringstream pp;
      for (const auto& s : r.passages) pp << (pp.str().empty() ? "" : " ") << std::showpos << std::fixed
                                          << std::setprecision(2) << 100 * s.dppl() << "%";
      std::printf("%-*s  %9.3f  %5.2fx  %+8.2f%%  %6.2f%%  %8.5f  %s\n", (int)w, r.label.c_str(), r.bits_per_value(),
                  r.ratio(), 100 * p.dppl(), 100 * p.top1, p.kl, pp.str().c_str());
    }
    if (!o->json.empty()) {
      auto j = res.to_json();
      j["model"] = o->model;
      j["device"] = device_description(model.device());
      j["dtype"] = c10::toString(model.dtype());
      j["context"] = o->ev.context;
      j["n_eval"] = o->ev.n_eval;
      j["passages"] = o->passages;
      j["offset"] = o->offset;
      j["streams"] = o->ev.streams;
      j["text"] = o->ids.empty() ? o->text : o->ids;
      j["bundle"] = o->bundle;
      j["command"] = command_line();
      write_json(o->json, j);
      std::printf("-> %s\n", o->json.c_str());
    }
    if (!o->plot.empty()) {
      std::string py = o->python;
      if (py.empty() && std::getenv("KAKEYA_PYTHON")) py = std::getenv("KAKEYA_PYTHON");
      if (py.empty()) py = fs::exists(".venv/bin/python") ? ".venv/bin/python" : "python3";
      const std::string cmd = py + " '" + o->plot_script + "' '" + o->json + "' '" + o->plot + "'";
      int rc = std::system(cmd.c_str());
      if (rc == 0) std::printf("-> %s\n", o->plot.c_str());
      else std::fprintf(stderr, "warning: plot failed (exit %d; matplotlib missing?); rerun: %s\n", rc, cmd.c_str());
    }
  });
}

}  // namespace kakeya::cli

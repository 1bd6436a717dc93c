// The long-context suite (infer/long_eval.h) on the real default model (Gemma 3 270M, CPU f32)
// with the shipped drafter and f_θ: one smoke run at 1k over oracle, evict:64 and restored:64
// (two single-answer NIAH tasks, one sample, one document with 128 scored tokens) whose report
// has every cell, the same prompts for every config and an evict-only perplexity that differs
// from the oracle's, paired differences that agree with the cells, a resumed run that runs only
// what its report lacks, and comparisons with a named reference config; perplexity alone; a run
// past its deadline reports partial; bad input fails before anything decodes, naming what is
// wrong; the interval helpers on known values. The layer-code choice (infer/layer_codes.h) on
// calibration text: its scores against eval-long's scoring, the choice, the bundle entry, bad input.
#include <ATen/ATen.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <iterator>
#include <string>

#include "core/model/drafter.h"
#include "core/error.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "data/longeval.h"
#include "calib/codec/calib_bundle.h"
#include "infer/layer_codes.h"
#include "infer/long_eval.h"
#include "tests/test_util.h"

using namespace kakeya;
using test::expect_error;

namespace {

// RoPE for 2048 positions: the 1k prompts + their answers and a 1k document + 1, with room to
// spare; 4096 is the context the RoPE check refuses.
const Model& model() {
  static Model m = [] {
    ModelOptions mo;
    mo.max_positions = 2048;
    return Model::load(test::real_model_dir(), mo);
  }();
  return m;
}
const Tokenizer& tokenizer() { return test::real_tokenizer(); }
const Drafter& drafter() {
  static Drafter d = Drafter::load(test::shipped_dir("drafter"), model());
  return d;
}
const FTheta& ftheta() {
  static FTheta f = FTheta::load(test::shipped_dir("ftheta"), at::kFloat, at::kCPU);
  return f;
}

// Short answers (7 digits, one key of several): generation stays a few tokens long on the CPU.
LongEvalOptions options() {
  const std::string src = test::env_or_fail("KAKEYA_SOURCE_DIR");
  LongEvalOptions o;
  o.tasks = {"niah_single_digits", "niah_multikey"};
  o.contexts = {1024};
  o.samples = 1;
  o.seed = 3;
  o.chat = data::detect_chat_format(tokenizer());
  o.source_dir = src + "/data";
  o.ppl_docs = 1;
  o.ppl_tail = 128;
  o.ppl_dir = src + "/data/longeval/docs";
  return o;
}

std::vector<LongEvalConfig> configs(const std::string& specs = "oracle,evict:64,restored:64") {
  return parse_long_eval_configs(specs, RestoreOptions{});
}

nlohmann::json run(const LongEvalOptions& o, const std::vector<LongEvalConfig>& c) {
  return run_long_eval(model(), &drafter(), &ftheta(), tokenizer(), c, o);
}

}  // namespace

TEST(LongEval, SmokeAt1kOracleEvictRestored) {
  const auto o = options();
  const auto rep = run(o, configs());
  ASSERT_EQ(rep["configs"].size(), 3u);
  EXPECT_FALSE(rep["partial"].get<bool>());
  EXPECT_EQ(rep["oracle"], "oracle");
  EXPECT_EQ(rep["contexts"], nlohmann::json({1024}));
  const auto& oracle = rep["configs"][0];
  EXPECT_EQ(oracle["mode"], "ar");
  EXPECT_TRUE(oracle["restore"].is_null());
  EXPECT_EQ(rep["configs"][1]["restore"]["layers"], "none");
  EXPECT_EQ(rep["configs"][2]["restore"]["layers"], "auto");
  for (const auto& cfg : rep["configs"]) {
    SCOPED_TRACE(cfg["name"].get<std::string>());
    for (const auto& task : o.tasks) {
      SCOPED_TRACE(task);
      ASSERT_TRUE(cfg["tasks"].contains(task) && cfg["tasks"][task].contains("1024")) << cfg["tasks"].dump();
      const auto& cell = cfg["tasks"][task]["1024"];
      const double s = cell["score"];
      EXPECT_GE(s, 0.0);
      EXPECT_LE(s, 1.0);
      EXPECT_EQ(cell["n"], 1);
      EXPECT_LE(cell["ci95"][0].get<double>(), s);
      EXPECT_GE(cell["ci95"][1].get<double>(), s);
      ASSERT_EQ(cell["per_sample"].size(), 1u);
      // Every config answered the same prompt.
      EXPECT_EQ(cell["per_sample"][0]["seed"], oracle["tasks"][task]["1024"]["per_sample"][0]["seed"]);
      EXPECT_EQ(cell["per_sample"][0]["seed"], rep["prompts"][task]["1024"][0]["seed"]);
    }
    ASSERT_TRUE(cfg["ppl"].contains("1024")) << cfg["ppl"].dump();
    const auto& p = cfg["ppl"]["1024"];
    EXPECT_EQ(p["n"], 1);
    ASSERT_EQ(p["per_doc"].size(), 1u);
    EXPECT_TRUE(std::isfinite(p["ppl"].get<double>()));
    EXPECT_NEAR(std::exp(p["nll"].get<double>()), p["ppl"].get<double>(), 1e-9);
    EXPECT_TRUE(p["ci95_nll"].is_null());  // one document: no spread to measure
    EXPECT_GT(cfg["seconds"].get<double>(), 0.0);
    EXPECT_FALSE(cfg["summary"]["mean_score"].is_null());
    EXPECT_TRUE(cfg["summary"]["families"].contains("niah"));
  }
  const double oracle_nll = oracle["ppl"]["1024"]["nll"];
  EXPECT_GT(std::exp(oracle_nll), 1.0);
  // Evict-only drops every position between the sinks and the window on sliding layers.
  EXPECT_GT(std::abs(rep["configs"][1]["ppl"]["1024"]["nll"].get<double>() - oracle_nll), 1e-4);
  for (int k : {1, 2}) {
    const auto& vs = rep["configs"][k]["summary"]["vs_oracle"];
    EXPECT_EQ(vs["config"], "oracle");
    for (const auto& task : o.tasks) EXPECT_TRUE(vs["delta_pp"][task].contains("1024")) << vs.dump();
    EXPECT_TRUE(vs["ppl_ratio"].contains("1024"));
  }
  EXPECT_FALSE(oracle["summary"].contains("vs_oracle"));
  // Paired against the oracle: one family (two NIAH tasks, one sample each) and one document.
  const auto& vs = rep["configs"][1]["summary"]["vs_oracle"];
  ASSERT_TRUE(vs["family_delta_pp"].contains("niah")) << vs.dump();
  const auto& fam = vs["family_delta_pp"]["niah"]["1024"];
  EXPECT_EQ(fam["n"], 2);
  double sum = 0;
  for (const auto& task : o.tasks) sum += vs["delta_pp"][task]["1024"].get<double>();
  EXPECT_NEAR(fam["delta"].get<double>(), sum / 2, 1e-9);
  EXPECT_GE(vs["same_text"].get<double>(), 0.0);
  EXPECT_LE(vs["same_text"].get<double>(), 1.0);
  EXPECT_NEAR(vs["ppl_ratio"]["1024"].get<double>(),
              rep["configs"][1]["ppl"]["1024"]["ppl"].get<double>() / oracle["ppl"]["1024"]["ppl"].get<double>(), 1e-9);
  EXPECT_TRUE(vs["ppl_ratio_ci95"]["1024"].is_null());  // one document

  // Resuming a finished report runs nothing and reports the same cells.
  auto ro = o;
  ro.resume = rep;
  const auto again = run(ro, configs());
  EXPECT_EQ(again["resumed"], 3 * (2 + 1));  // per config: two prompts and one document
  for (size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(again["configs"][k]["tasks"], rep["configs"][k]["tasks"]);
    EXPECT_EQ(again["configs"][k]["ppl"], rep["configs"][k]["ppl"]);
  }
  EXPECT_TRUE(again["reference"].is_null());
  // A reference config: every other one is compared with it as with the oracle (paired), and the
  // comparison agrees with the cells; the reference itself carries none. Nothing decodes again.
  ro.reference = "evict:64";
  const auto ref = run(ro, configs());
  EXPECT_EQ(ref["reference"], "evict:64");
  EXPECT_FALSE(ref["configs"][1]["summary"].contains("vs_reference"));
  for (int k : {0, 2}) {
    const auto& vr = ref["configs"][k]["summary"]["vs_reference"];
    EXPECT_EQ(vr["config"], "evict:64");
    EXPECT_NEAR(vr["ppl_ratio"]["1024"].get<double>(),
                rep["configs"][k]["ppl"]["1024"]["ppl"].get<double>() / rep["configs"][1]["ppl"]["1024"]["ppl"].get<double>(),
                1e-9);
    for (const auto& task : o.tasks)
      EXPECT_NEAR(vr["delta_pp"][task]["1024"].get<double>(),
                  100 * (rep["configs"][k]["tasks"][task]["1024"]["score"].get<double>() -
                         rep["configs"][1]["tasks"][task]["1024"]["score"].get<double>()),
                  1e-9);
  }
  EXPECT_EQ(ref["configs"][2]["summary"]["vs_oracle"], rep["configs"][2]["summary"]["vs_oracle"]);
  ro.reference = "restored:128";
  expect_error([&] { run(ro, configs()); }, "--reference 'restored:128' is none of the configs (oracle, evict:64, restored:64)");
  ro.reference.clear();
  // A report that lacks the evict-only document: only that one runs, to the same value.
  auto cut = rep;
  cut["configs"][1]["ppl"] = nlohmann::json::object();
  ro.resume = cut;
  const auto rest = run(ro, configs());
  EXPECT_EQ(rest["resumed"], 3 * 2 + 2);
  EXPECT_EQ(rest["configs"][1]["ppl"]["1024"]["per_doc"].size(), 1u);
  EXPECT_NEAR(rest["configs"][1]["ppl"]["1024"]["nll"].get<double>(),
              rep["configs"][1]["ppl"]["1024"]["nll"].get<double>(), 1e-6);
  // Another suite is refused by the field that differs.
  ro.seed = o.seed + 1;
  expect_error([&] { run(ro, configs()); }, "field 'seed'");
  ro = o;
  ro.resume = rep;
  RestoreOptions other;
  other.sink = 8;
  expect_error([&] { run_long_eval(model(), &drafter(), &ftheta(), tokenizer(),
                                   parse_long_eval_configs("oracle,evict:64", other), ro); },
               "config 'evict:64' had restore options");
}

// The decoders' capacity depends on the contexts alone: a run of one task answers its prompts
// with decoders of the capacity a run of every task has (bf16 restored outputs depend on it).
TEST(LongEval, DecoderCapacityFollowsTheContextsOnly) {
  auto o = options();
  o.ppl_docs = 0;
  o.tasks = {"niah_single_digits"};
  const auto one = plan_long_eval(tokenizer(), model().config(), o);
  o.tasks = data::long_task_names();
  o.samples = 2;
  const auto all = plan_long_eval(tokenizer(), model().config(), o);
  EXPECT_EQ(one.decode_capacity, all.decode_capacity);
  EXPECT_EQ(one.decode_capacity, 1024 + data::long_task_max_new_tokens());
  for (const auto& task : all.samples)
    for (const auto& ctx : task)
      for (const auto& s : ctx) EXPECT_LE((int64_t)s.prompt_ids.size() + s.max_new_tokens, all.decode_capacity);
  o.tasks = {"niah_single_digits"};
  o.contexts = {512, 1024};
  EXPECT_EQ(plan_long_eval(tokenizer(), model().config(), o).decode_capacity, all.decode_capacity);
}

// Perplexity alone (no tasks) and nothing at all.
TEST(LongEval, PerplexityOnly) {
  auto o = options();
  o.tasks = {};
  o.ppl_tail = 64;
  o.contexts = {256};
  const auto rep = run(o, configs("oracle,evict:64"));
  EXPECT_TRUE(rep["tasks"].empty());
  EXPECT_TRUE(rep["prompts"].empty());
  for (const auto& cfg : rep["configs"]) EXPECT_EQ(cfg["ppl"]["256"]["n"], 1) << cfg.dump();
  EXPECT_TRUE(rep["configs"][0]["summary"]["mean_score"].is_null());
  o.ppl_docs = 0;
  expect_error([&] { run(o, configs()); }, "nothing to evaluate");
}

// A deadline already passed: nothing runs, and the report says so (every config still listed).
TEST(LongEval, DeadlinePassedReportsPartial) {
  auto o = options();
  o.ppl_docs = 0;
  o.deadline = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  const auto rep = run(o, configs("oracle,evict:64"));
  EXPECT_TRUE(rep["partial"].get<bool>());
  ASSERT_EQ(rep["configs"].size(), 2u);
  for (const auto& cfg : rep["configs"]) EXPECT_TRUE(cfg["tasks"].empty()) << cfg["tasks"].dump();
}

TEST(LongEval, BadInput) {
  auto o = options();
  o.tasks = {"niah_single_digits", "niah_bogus"};
  expect_error([&] { run(o, configs()); }, "niah_bogus");
  o = options();
  o.contexts = {1024, 1000000};
  expect_error([&] { run(o, configs()); },
               "limit of " + std::to_string(model().config().max_position_embeddings) + " positions");
  o = options();
  o.ppl_docs = 0;
  o.contexts = {4096};
  expect_error([&] { run(o, configs()); }, "RoPE table of 2048");
  o = options();
  o.ppl_tail = 1024;
  expect_error([&] { run(o, configs()); }, "--ppl-tail 1024");
  o = options();
  o.ppl_docs = 0;
  expect_error([&] { run(o, configs("oracle,restored:600")); }, "config 'restored:600'");
  for (const char* bad : {"restored:x", "restored:0", "stream:64", "evict", "oracle,oracle", "restored-lm6:64",
                          "restored-codec-all-foo:64"})
    expect_error([&] { configs(bad); }, "--configs");
  expect_error([&] { configs("restored:x"); }, "'restored:x'");
  expect_error([&] { configs("stream:64"); }, "evict:W");
}

TEST(LongEval, ConfigSpecs) {
  RestoreOptions base;
  base.sink = 2;
  base.layers = "3,5";
  const auto c = parse_long_eval_configs(
      "oracle,evict:32,restored:48,restored-all:16,restored-codec:64,restored-int4-codec-lm3:64,restored-lm4:64", base);
  ASSERT_EQ(c.size(), 7u);
  EXPECT_TRUE(c[0].oracle());
  EXPECT_EQ(c[1].mode, DecodeMode::Restored);
  EXPECT_EQ(c[1].restore.window, 32);
  EXPECT_EQ(c[1].restore.layers, "none");
  EXPECT_EQ(c[1].restore.sink, 2);
  EXPECT_EQ(c[2].restore.layers, "3,5");
  EXPECT_EQ(c[3].restore.layers, "all");
  EXPECT_EQ(c[4].restore.full_attn, FullAttn::Codec);
  EXPECT_EQ(c[4].name, "restored-codec:64");
  EXPECT_EQ(c[4].restore.full_code, base.full_code);
  EXPECT_FALSE(c[4].restore.region_code.defined());
  EXPECT_EQ(c[5].restore.full_attn, FullAttn::Codec);
  EXPECT_EQ(c[5].restore.full_code, (ops::RowCode{ops::RowKind::Rotated, 3}));
  EXPECT_EQ(c[5].restore.region_code, (ops::RowCode{ops::RowKind::Affine, 4}));
  EXPECT_EQ(c[6].restore.full_attn, FullAttn::Exact);
  EXPECT_EQ(c[6].restore.region_code, (ops::RowCode{ops::RowKind::Rotated, 4}));
  // A weighted code names full-attention rows only: refused while parsing (bench memory plans
  // configs without building a decoder, so it would otherwise report bytes for one that cannot run).
  expect_error([&] { parse_long_eval_configs("oracle,restored-pw4:64", base); },
               "--configs 'restored-pw4:64', code pw4: weighted codes are for full-attention rows");
  EXPECT_NO_THROW(parse_long_eval_configs("restored-lm5-codec-pw4:64", base));
  // exact: the region holds the exact K/V (a = 1) on every covered layer, coded as asked.
  const auto e = parse_long_eval_configs("exact:64,exact-int8-codec-pw4:32", base);
  EXPECT_EQ(e[0].restore.mix_alpha, 1.0);
  EXPECT_EQ(e[0].restore.layers, "all");
  EXPECT_FALSE(e[0].restore.needs_ftheta());
  EXPECT_FALSE(e[0].restore.needs_true_raw());
  EXPECT_EQ(e[1].restore.region_code, (ops::RowCode{ops::RowKind::Affine, 8}));
  EXPECT_EQ(e[1].restore.full_attn, FullAttn::Codec);
  EXPECT_EQ(c[2].restore.mix_alpha, 0.0);
  expect_error([&] { parse_long_eval_configs("exact-all:64", base); }, "unknown modifier 'all'");
  // The first layer restored from its token (the default) or by f_θ; exact restoration copies every layer anyway.
  EXPECT_TRUE(c[2].restore.token_layers);
  RestoreOptions learned_base = base;
  learned_base.token_layers = false;
  const auto t = parse_long_eval_configs("restored-learned:64,restored-all-token:64,restored:64", learned_base);
  EXPECT_FALSE(t[0].restore.token_layers);
  EXPECT_TRUE(t[1].restore.token_layers);
  EXPECT_EQ(t[1].restore.layers, "all");
  EXPECT_FALSE(t[2].restore.token_layers);
  expect_error([&] { parse_long_eval_configs("exact-learned:64", base); }, "unknown modifier 'learned'");
  EXPECT_EQ(ops::row_code_name(parse_long_eval_configs("restored-ru5-codec-pw5v3:64", base)[0].restore.full_code), "pw5v3");
  // Only configs restoring through f_θ need the drafter and f_θ loaded (eval-long, bench memory).
  EXPECT_FALSE(configs_need_ftheta(parse_long_eval_configs("oracle,evict:64,exact-int6-codec-pw4:64,exact:32", base)));
  EXPECT_TRUE(configs_need_ftheta(parse_long_eval_configs("oracle,exact:64,restored-int8:64", base)));
  // A full-attention layer's own code after the codec's.
  const auto layered = parse_long_eval_configs("exact-int6-codec-pw4+17=pw5v4:64", base)[0].restore;
  EXPECT_EQ(ops::layer_codes_name(layered.full_code, layered.full_code_layers), "pw4+17=pw5v4");
  EXPECT_EQ(ops::row_code_name(layered.region_code), "int6");
  expect_error([&] { parse_long_eval_configs("exact-codec-pw4+17:64", base); },
               "--configs: '17' in 'pw4+17': expected LAYER=CODE");
}

TEST(LongEval, Intervals) {
  // Wilson for 0/1 scores: 3 of 3 -> [0.4385, 1].
  auto w = score_ci95({1, 1, 1});
  EXPECT_NEAR(w.first, 0.43850, 1e-4);
  EXPECT_NEAR(w.second, 1.0, 1e-12);
  // Fractional scores: the normal approximation, mean 0.5 ± 1.96·sd/√2 with sd = √0.125.
  auto n = score_ci95({0.25, 0.75});
  EXPECT_NEAR(n.first, 0.5 - 1.96 * std::sqrt(0.125) / std::sqrt(2.0), 1e-12);
  EXPECT_NEAR(n.second, 0.5 + 1.96 * std::sqrt(0.125) / std::sqrt(2.0), 1e-12);
  auto m = mean_ci95({2.0, 4.0});
  EXPECT_NEAR(m.first, 3.0 - 1.96 * std::sqrt(2.0) / std::sqrt(2.0), 1e-12);
  EXPECT_TRUE(std::isnan(mean_ci95({2.0}).first));
  EXPECT_EQ(paired_differences({1.0, 0.5, 0.25}, {0.5, 0.5}), (std::vector<double>{0.5, 0.0}));
  EXPECT_EQ(long_task_family("niah_multikey"), "niah");
  EXPECT_EQ(long_task_family("vt"), "vt");
}

// Which full-attention layer a richer code serves best, chosen on calibration text (infer/layer_codes.h):
// two windows of 256 tokens of data/codec/calib.txt, exact restoration at window 64, int6 regions, pw4 on
// every full-attention layer and pw5v4 as the upgrade (the shipped bundle's K weights).
TEST(LayerCodes, ChoosesTheLargestGainOnCalibrationText) {
  const std::string src = test::env_or_fail("KAKEYA_SOURCE_DIR");
  std::ifstream f(src + "/data/codec/calib.txt");
  const std::string calib_text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto text = tokenizer().encode(calib_text, false);
  ASSERT_GE(text.size(), 2000u);
  const std::vector<int64_t> ids(text.begin(), text.begin() + 2000);
  LayerCodeOptions o;
  o.decoder.window = 64;
  o.decoder.mix_alpha = 1.0;
  o.decoder.full_attn = FullAttn::Codec;
  o.decoder.full_code = ops::parse_row_code("pw4", "test");
  o.decoder.region_code = ops::parse_row_code("int6", "test");
  o.decoder.calib = test::shipped_dir("calib");
  o.rich = ops::parse_row_code("pw5v4", "test");
  o.context = 256;
  o.tail = 48;
  o.windows = 2;
  int64_t last = -1, total = 0;
  const auto r = select_layer_codes(model(), ids, o, [&](int64_t d, int64_t t) {
    EXPECT_GT(d, last);
    last = d;
    total = t;
  });
  EXPECT_EQ(last, total);
  EXPECT_EQ(total, 2 * 5 * 256);  // 2 windows × (exact, pw4, pw4 with each of the 3 layers upgraded)
  EXPECT_EQ(r["windows"], 2);

  // The base code's NLL is what eval-long's scoring gives the same windows: [BOS] + the text, back to back.
  const auto& cfg = model().config();
  double base = 0, exact = 0;
  for (int w = 0; w < 2; ++w) {
    std::vector<int64_t> win{cfg.bos_token_id};
    win.insert(win.end(), ids.begin() + w * 255, ids.begin() + (w + 1) * 255);
    auto tail_nll = [&](const RestoreOptions& ro) {
      const auto sr = score_restored(model(), nullptr, nullptr, win, ro);
      double s = 0;
      for (auto it = sr.logprobs.end() - 48; it != sr.logprobs.end(); ++it) s -= *it;
      return s / 48;
    };
    base += tail_nll(o.decoder) / 2;
    RestoreOptions ex = o.decoder;
    ex.full_attn = FullAttn::Exact;
    exact += tail_nll(ex) / 2;
  }
  EXPECT_NEAR(r["base_nll"].get<double>(), base, 1e-9);
  EXPECT_NEAR(r["exact_nll"].get<double>(), exact, 1e-9);
  EXPECT_NE(r["base_nll"].get<double>(), r["exact_nll"].get<double>());  // the code costs something

  // Gemma 3 270M's full-attention layers; each upgrade's gain is the base NLL less its own, and
  // pw5v4 costs 32 bytes a position over pw4 (K 160 + 4, V 128 + 4 against 128 + 4 twice; one KV head).
  ASSERT_EQ(r["per_layer"].size(), 3u);
  double best = 0;
  int64_t best_layer = -1;
  for (size_t i = 0; i < 3; ++i) {
    const auto& e = r["per_layer"][i];
    const int64_t full_layers[] = {5, 11, 17};
    EXPECT_EQ(e["layer"], full_layers[i]);
    EXPECT_NEAR(e["gain"].get<double>(), r["base_nll"].get<double>() - e["nll"].get<double>(), 1e-12);
    EXPECT_EQ(e["extra_bytes"], 32);
    if (e["gain"].get<double>() > best) best = e["gain"].get<double>(), best_layer = e["layer"].get<int64_t>();
  }
  // The choice: the largest gain (if any layer gains), as a code --full-code parses.
  const std::string want = best_layer < 0 ? "pw4" : "pw4+" + std::to_string(best_layer) + "=pw5v4";
  EXPECT_EQ(r["code"], want);
  EXPECT_EQ(r["chosen"], best_layer < 0 ? nlohmann::json::array() : nlohmann::json({best_layer}));
  const auto [b, layers] = ops::parse_layer_codes(r["code"].get<std::string>(), "test");
  EXPECT_EQ(ops::row_code_name(b), "pw4");
  if (best_layer >= 0) EXPECT_EQ(ops::row_code_name(ops::layer_code(b, layers, best_layer)), "pw5v4");

  // The bundle entry --full-code auto reads: written for this model, read back, refused when absent.
  // (POSIX calls: std::filesystem resolves to LibTorch's copy of it, of another ABI.)
  const std::string dir = fs::temp_dir() + "/kakeya_layer_codes_" + std::to_string(::getpid());
  ::unlink((dir + "/manifest.json").c_str());
  CalibBundle::prepare_dir(dir, cfg);
  expect_error([&] { CalibBundle::layer_codes(dir, cfg); }, "manifest.json: no entry 'layer_codes.code' (run `kakeya calibrate layer-codes");
  CalibBundle::update_manifest(dir, cfg, "layer_codes", r);
  EXPECT_EQ(CalibBundle::layer_codes(dir, cfg), want);
  ::unlink((dir + "/manifest.json").c_str());
  ::rmdir(dir.c_str());

  // No layer may take it: the base code alone.
  LayerCodeOptions none = o;
  none.layers = 0;
  none.windows = 1;
  EXPECT_EQ(select_layer_codes(model(), ids, none)["code"], "pw4");
}

TEST(LayerCodes, BadInput) {
  LayerCodeOptions o;
  o.decoder.mix_alpha = 1.0;
  o.decoder.window = 64;
  o.decoder.full_attn = FullAttn::Codec;
  o.decoder.full_code = ops::parse_row_code("lm4", "test");
  o.rich = ops::parse_row_code("lm5", "test");
  o.context = 384;
  o.tail = 64;
  const std::vector<int64_t> ids(1000, 100);
  auto with = [&](const std::function<void(LayerCodeOptions&)>& f) {
    LayerCodeOptions x = o;
    f(x);
    return [x, &ids] { select_layer_codes(model(), ids, x); };
  };
  expect_error(with([](LayerCodeOptions& x) { x.decoder.full_attn = FullAttn::Exact; }), "one base code");
  expect_error(with([](LayerCodeOptions& x) { std::tie(x.decoder.full_code, x.decoder.full_code_layers) =
                                                   ops::parse_layer_codes("lm4+11=lm5", "test"); }),
               "(--full-code CODE, no +L=CODE), got lm4+11=lm5");
  expect_error(with([](LayerCodeOptions& x) { x.decoder.mix_alpha = 0; }), "restore exactly (mix_alpha 1)");
  expect_error(with([](LayerCodeOptions& x) { x.rich = x.decoder.full_code; }), "--rich must be a code other than");
  expect_error(with([](LayerCodeOptions& x) { x.layers = 4; }), "--layers 4 must be in [0, 3]");
  expect_error(with([](LayerCodeOptions& x) { x.tail = 384; }), "--tail 384 must be in [1, 383]");
  expect_error(with([](LayerCodeOptions& x) { x.context = 40000; }),
               "--context 40000 exceeds the model's limit of 32768 positions");
  expect_error(with([](LayerCodeOptions& x) { x.decoder.window = 380; }), "--sink 4 + --window 380 must be below --context 384");
  expect_error(with([](LayerCodeOptions& x) { x.context = 4000; }),
               "the text holds 1000 tokens, one window of --context 4000 needs 3999");
}

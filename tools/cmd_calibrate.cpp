// kakeya calibrate sigma-q | codebook | k-weights | layer-codes: the KV codec's calibration jobs,
// writing a bundle directory (calib/codec/calib_bundle.h) that codec-eval and the decoder load.
//
// Calibration text (default data/codec/calib.txt) is disjoint from the
// evaluation text (data/codec/eval.txt): both come from CPython's
// pydoc_data/topics.py, split by topic (tools/codec_corpus.py documents the rule).
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <sstream>

#include "calib/calibrate.h"
#include "calib/codec/calib_bundle.h"
#include "calib/codec/codec.h"
#include "core/error.h"
#include "infer/layer_codes.h"
#include "infer/restorer.h"
#include "tools/cli_common.h"

namespace kakeya::cli {

namespace {
std::string g_command_line;

// The recipe codec-eval calls "ours" by default; codebooks are fitted to its residuals.
const char* kDefaultCodec = "kakeya:sink=1,kbasis=calib,kalloc=3.3,vbasis=calib,valloc=3";

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Waits for queued device work, so the timings of --bench are real.
void sync(const at::Device& d) {
  if (d.is_cuda()) at::zeros({1}, at::TensorOptions().device(d)).cpu();
}

struct Corpus {
  std::string text = "data/codec/calib.txt", ids;
  int64_t tokens = 65536, context = 2048;
  void add(CLI::App* c) {
    auto* t = c->add_option("--text", text, "calibration text (UTF-8; disjoint from the evaluation text)")->capture_default_str();
    auto* i = c->add_option("--ids", ids, "JSON array of token ids instead of --text")->check(CLI::ExistingFile);
    t->excludes(i);
    c->add_option("--tokens", tokens, "calibration tokens to run (at most)")->capture_default_str();
    c->add_option("--context", context, "tokens per forward window (fresh cache each)")->capture_default_str();
  }
  // Token ids and a description of the data for the manifest.
  std::vector<int64_t> load(const std::string& model_dir, const ModelConfig& cfg, nlohmann::json& data) const {
    std::vector<int64_t> v;
    if (!ids.empty()) {
      auto j = nlohmann::json::parse(read_file(ids));
      for (const auto& x : j) {
        KAKEYA_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < cfg.vocab_size,
                     ids << ": token id " << x.dump() << " outside [0, " << cfg.vocab_size << ")");
        v.push_back(x.get<int64_t>());
      }
      data = {{"ids", ids}};
    } else {
      const std::string s = read_file(text);
      auto tok = load_tokenizer(model_dir);
      v = encode(tok, s);
      char h[32];
      std::snprintf(h, sizeof h, "%016llx", (unsigned long long)fnv1a(s));
      data = {{"text", text}, {"text_fnv1a64", h}, {"text_bytes", s.size()}, {"text_tokens", v.size()}};
    }
    data["context"] = context;
    return v;
  }
};

struct Common {
  std::string model = "checkpoints/models/gemma3-270m";
  std::string out = "checkpoints/gemma3-270m/calib";
  bool bench = false;
  Corpus corpus;
  DeviceFlags df;
  void add(CLI::App* c) {
    c->add_option("--model", model, "HF model directory")->capture_default_str();
    c->add_option("--out", out, "calibration bundle directory (created; refuses another model's bundle)")->capture_default_str();
    c->add_flag("--bench", bench, "print a timing line (tokens, seconds, tok/s per phase)");
    corpus.add(c);
    df.add(c);
  }
};

}  // namespace

void set_command_line(int argc, char** argv) {
  std::ostringstream os;
  for (int i = 0; i < argc; ++i) os << (i ? " " : "") << argv[i];
  g_command_line = os.str();
}
const std::string& command_line() { return g_command_line; }

void register_calibrate(CLI::App& app) {
  auto* cal = app.add_subcommand("calibrate", "KV codec calibration: Σ_q, PCA bases, Lloyd-Max codebooks");
  cal->require_subcommand(1);

  // ---- sigma-q
  {
    struct Opts : Common {
      double ridge = 1e-3;
      int64_t rope_offsets = 0;
    };
    auto o = std::make_shared<Opts>();
    auto* c = cal->add_subcommand("sigma-q", "Σ_q per layer and KV head from pre-RoPE queries (Tap::QNorm), with ridge");
    o->add(c);
    c->add_option("--ridge", o->ridge, "ridge relative to the mean eigenvalue: Σ + ridge·tr(Σ)/D·I")->capture_default_str();
    c->add_option("--rope-offsets", o->rope_offsets,
                  "factor E_Δ[R_Δ Σ_q R_Δᵀ] over query-key offsets Δ < N instead of Σ_q (0: plain pre-RoPE Σ_q)")
        ->capture_default_str();
    c->callback([o] {
      const double t0 = now_s();
      auto cfg = ModelConfig::from_file(o->model + "/config.json");
      CalibBundle::prepare_dir(o->out, cfg);  // refuse another model's bundle before any work
      nlohmann::json data;
      auto ids = o->corpus.load(o->model, cfg, data);
      const double t_tok = now_s();
      auto model = load_model(o->model, o->df, o->corpus.context + 1);
      const double t_load = now_s();
      calib::SigmaQAccumulator acc(model.config(), model.device());
      Taps taps;
      taps.subscribe(&acc);
      Progress prog("[sigma-q]", std::min<int64_t>(o->corpus.tokens, ids.size()));
      int64_t n = calib::run_windows(model, ids, o->corpus.context, o->corpus.tokens, model.config().bos_token_id, taps,
                                     [&](int64_t d, int64_t) { prog.update(d); });
      sync(model.device());
      prog.finish();
      const double t_fwd = now_s();
      calib::SigmaQOptions so;
      so.ridge = o->ridge;
      so.rope_offsets = o->rope_offsets;
      auto r = calib::finish_sigma_q(acc, model.config(), so);
      const double t_lin = now_s();
      data["tokens"] = n;
      calib::save_sigma_q(o->out, model.config(), r,
                          {{"command", command_line()}, {"data", data}, {"device", device_description(model.device())},
                           {"dtype", c10::toString(model.dtype())}});
      const double t_end = now_s();
      std::printf("sigma-q: %lld tokens, %lld layers; cond(Σ_q + ridge) median %.3g, max %.3g -> %s/q_calib.safetensors\n",
                  (long long)n, (long long)cfg.num_layers, r.diagnostics["cond_ridged_median"].get<double>(),
                  r.diagnostics["cond_ridged_max"].get<double>(), o->out.c_str());
      if (o->bench)
        std::printf("bench: calibrate sigma-q on %s: %lld tokens in %.2f s (tokenize %.2f s, load %.2f s, forward+accumulate "
                    "%.2f s = %.0f tok/s, linalg %.2f s, write %.2f s)\n",
                    device_description(model.device()).c_str(), (long long)n, t_end - t0, t_tok - t0, t_load - t_tok,
                    t_fwd - t_load, n / std::max(t_fwd - t_load, 1e-9), t_lin - t_fwd, t_end - t_lin);
    });
  }

  // ---- k-weights
  {
    struct Opts : Common {
      double power = 0.75;
      int64_t sink = 4;
    };
    auto o = std::make_shared<Opts>();
    auto* c = cal->add_subcommand(
        "k-weights", "K weights of weighted row codes (--full-code pwB): query / key energy per RoPE pair, full-attention layers");
    o->add(c);
    c->add_option("--power", o->power, "w² = (E|q|² / E|k - mean|²)^(power/2) per RoPE pair (1: least mean squared score error)")
        ->capture_default_str();
    c->add_option("--sink", o->sink, "positions left out of the keys' means and energy (the decoder's exact sinks)")
        ->capture_default_str()
        ->check(non_negative());
    c->callback([o] {
      auto cfg = ModelConfig::from_file(o->model + "/config.json");
      CalibBundle::prepare_dir(o->out, cfg);
      nlohmann::json data;
      auto ids = o->corpus.load(o->model, cfg, data);
      auto model = load_model(o->model, o->df, o->corpus.context + 1);
      calib::KWeightAccumulator acc(model, o->sink);
      Taps taps;
      taps.subscribe(&acc);
      Progress prog("[k-weights]", std::min<int64_t>(o->corpus.tokens, ids.size()));
      int64_t n = calib::run_windows(model, ids, o->corpus.context, o->corpus.tokens, model.config().bos_token_id, taps,
                                     [&](int64_t d, int64_t) { prog.update(d); });
      prog.finish();
      auto r = calib::finish_k_weights(acc, model.config(), o->power);
      data["tokens"] = n;
      calib::save_k_weights(o->out, model.config(), r,
                            {{"command", command_line()}, {"data", data}, {"sink", o->sink},
                             {"device", device_description(model.device())}, {"dtype", c10::toString(model.dtype())}});
      for (const auto& e : r.diagnostics["layers"])
        std::printf("k-weights: layer %lld: distortion gain over the unweighted code at power 1: %s\n",
                    (long long)e["layer"].get<int64_t>(), e["optimal_gain"].dump().c_str());
      std::printf("k-weights: %lld tokens -> %s/k_weights.safetensors\n", (long long)n, o->out.c_str());
    });
  }

  // ---- codebook (and the PCA bases it needs)
  {
    struct Opts : Common {
      std::string codec = kDefaultCodec;
      std::string bits = "1,2,3,4";
      std::string scope = "layer";
      int64_t max_samples = int64_t(1) << 21;
    };
    auto o = std::make_shared<Opts>();
    auto* c = cal->add_subcommand(
        "codebook", "PCA bases of K, whitened K and V, then Lloyd-Max tables fitted to the codec's own residuals");
    o->add(c);
    c->add_option("--codec", o->codec, "codec spec whose residuals the tables are fitted to")->capture_default_str();
    c->add_option("--bits", o->bits, "comma-separated table sizes in bits (1..4)")->capture_default_str();
    c->add_option("--scope", o->scope, "layer: one table per layer | pooled: one per stream")
        ->check(CLI::IsMember({"layer", "pooled"}))
        ->capture_default_str();
    c->add_option("--max-samples", o->max_samples, "residual samples kept per layer and stream")->capture_default_str();
    c->callback([o] {
      const double t0 = now_s();
      auto cfg = ModelConfig::from_file(o->model + "/config.json");
      CalibBundle::prepare_dir(o->out, cfg);
      auto copt = CodecOptions::parse(o->codec);
      KAKEYA_CHECK(copt.kind == CodecKind::Kakeya || copt.kind == CodecKind::Turbo,
                   "calibrate codebook: --codec must be a kakeya or turbo spec (Lloyd-Max codecs), got '" << o->codec << "'");
      calib::CodebookOptions cbo;
      cbo.per_layer = o->scope == "layer";
      cbo.max_samples = o->max_samples;
      cbo.bits.clear();
      for (const auto& b : [&] {
             std::vector<std::string> v;
             std::stringstream ss(o->bits);
             std::string x;
             while (std::getline(ss, x, ',')) v.push_back(x);
             return v;
           }()) {
        int bits = 0;
        try {
          bits = std::stoi(b);
        } catch (...) {
          KAKEYA_FAIL("calibrate codebook: --bits expects integers in 1..4, got '" << b << "'");
        }
        KAKEYA_CHECK(bits >= 1 && bits <= 4, "calibrate codebook: --bits must be in 1..4, got " << bits);
        cbo.bits.push_back(bits);
      }
      nlohmann::json data;
      auto ids = o->corpus.load(o->model, cfg, data);
      const double t_tok = now_s();
      auto model = load_model(o->model, o->df, o->corpus.context + 1);
      const double t_load = now_s();
      calib::KVCapture cap(model.config());
      Taps taps;
      taps.subscribe(&cap);
      Progress prog("[capture]", std::min<int64_t>(o->corpus.tokens, ids.size()));
      int64_t n = calib::run_windows(model, ids, o->corpus.context, o->corpus.tokens, model.config().bos_token_id, taps,
                                     [&](int64_t d, int64_t) { prog.update(d); });
      sync(model.device());
      prog.finish();
      const double t_fwd = now_s();
      data["tokens"] = n;
      nlohmann::json entry = {{"command", command_line()}, {"data", data}, {"device", device_description(model.device())},
                              {"dtype", c10::toString(model.dtype())}};
      // Bases first (whitened K needs Σ_q if the bundle has it), then reload so the codec sees them.
      auto b0 = CalibBundle::load(o->out, model.config());
      calib::BasisOptions bo;
      bo.block = copt.block;
      calib::fit_bases(o->out, model.config(), cap, b0, bo, entry);
      sync(model.device());
      const double t_basis = now_s();
      auto bundle = CalibBundle::load(o->out, model.config());
      // Residuals do not depend on the tables, so fit with Gaussian ones in place.
      copt.k.calibrated = copt.v.calibrated = false;
      KVCodec codec(copt, model.config(), &bundle, model.device());
      auto summary = calib::fit_codebooks(o->out, model.config(), cap, codec, cbo, entry);
      sync(model.device());
      const double t_end = now_s();
      for (const auto& s : summary["streams"].items()) {
        std::printf("codebook %s: %lld residual samples, kurtosis %.2f, |u|>3: %.4f%%\n", s.key().c_str(),
                    (long long)s.value()["samples"].get<int64_t>(), s.value()["kurtosis"].get<double>(),
                    100 * s.value()["frac_abs_gt_3"].get<double>());
        for (int b : cbo.bits) {
          const auto& bj = s.value()["b" + std::to_string(b)];
          std::printf("  %d bits: MSE fitted %.5f vs Gaussian table %.5f (gain %.3fx; N(0,1)-optimal %.5f)\n", b,
                      bj["mse_fitted_mean"].get<double>(), bj["mse_gaussian_table_mean"].get<double>(),
                      bj["gain_mean"].get<double>(), bj["gaussian_optimal_mse_N01"].get<double>());
        }
      }
      std::printf("-> %s (pca_basis.safetensors, codebook_*.f32, codebook_summary.json)\n", o->out.c_str());
      if (o->bench)
        std::printf("bench: calibrate codebook on %s: %lld tokens in %.2f s (tokenize %.2f s, load %.2f s, forward+capture "
                    "%.2f s = %.0f tok/s, bases %.2f s, residuals+Lloyd-Max %.2f s)\n",
                    device_description(model.device()).c_str(), (long long)n, t_end - t0, t_tok - t0, t_load - t_tok,
                    t_fwd - t_load, n / std::max(t_fwd - t_load, 1e-9), t_basis - t_fwd, t_end - t_basis);
    });
  }

  // ---- layer-codes (what --full-code auto reads)
  {
    struct Opts : Common {
      std::string base = "pw4", rich = "pw5v4", region_code = "int6";
      int64_t layers = 1, tail = 512, sink = 4, window = 64;
    };
    auto o = std::make_shared<Opts>();
    o->corpus.context = 16384;  // the error a coded history costs grows with it: choose where it shows
    o->corpus.tokens = 65536;
    auto* c = cal->add_subcommand("layer-codes",
                                  "which full-attention layers get a richer row code (--full-code auto): each layer's "
                                  "upgrade scored in perplexity on calibration text, exact restoration");
    o->add(c);
    c->add_option("--base", o->base, "every full-attention layer's code (pwB needs the bundle's K weights)")->capture_default_str();
    c->add_option("--rich", o->rich, "the code a chosen layer gets")->capture_default_str();
    c->add_option("--layers", o->layers, "at most this many layers get --rich (only those it helps)")
        ->capture_default_str()
        ->check(non_negative());
    c->add_option("--tail", o->tail, "last tokens of each --context window scored")->capture_default_str();
    c->add_option("--sink", o->sink, "the decoder's sink positions")->capture_default_str()->check(non_negative());
    c->add_option("--window", o->window, "the decoder's exact window")->capture_default_str()->check(CLI::PositiveNumber);
    c->add_option("--restored-code", o->region_code, "the decoder's restored regions: none | " + region_code_names())
        ->capture_default_str();
    c->callback([o] {
      auto cfg = ModelConfig::from_file(o->model + "/config.json");
      CalibBundle::check_manifest(o->out, cfg);  // the bundle this writes into, made for this model
      LayerCodeOptions lo;
      lo.decoder.sink = o->sink;
      lo.decoder.window = o->window;
      lo.decoder.mix_alpha = 1.0;
      lo.decoder.full_attn = FullAttn::Codec;
      lo.decoder.full_code = ops::parse_row_code(o->base, "--base");
      lo.decoder.calib = o->out;
      lo.decoder.region_code = ops::parse_row_code(o->region_code, "--restored-code");
      check_region_code(lo.decoder.region_code, "--restored-code");
      lo.rich = ops::parse_row_code(o->rich, "--rich");
      lo.layers = o->layers;
      lo.context = o->corpus.context;
      lo.tail = o->tail;
      lo.windows = std::max<int64_t>(1, o->corpus.tokens / o->corpus.context);
      nlohmann::json data;
      const auto ids = o->corpus.load(o->model, cfg, data);
      auto model = load_model(o->model, o->df, o->corpus.context + 1);
      std::optional<Progress> prog;
      auto r = select_layer_codes(model, ids, lo, [&](int64_t d, int64_t total) {
        if (!prog) prog.emplace("[layer-codes]", total);
        prog->update(d);
      });
      if (prog) prog->finish();
      std::printf("layer-codes: %lld windows of %lld tokens, last %lld scored; NLL exact %.5f, %s everywhere %.5f\n",
                  (long long)r["windows"].get<int64_t>(), (long long)lo.context, (long long)lo.tail,
                  r["exact_nll"].get<double>(), o->base.c_str(), r["base_nll"].get<double>());
      for (const auto& e : r["per_layer"]) {
        auto end = [](const nlohmann::json& x) { return x.is_null() ? std::nan("") : x.get<double>(); };
        std::printf("  layer %3lld in %s: NLL %.5f, gain %+.5f [%+.5f, %+.5f], %+lld bytes a position\n",
                    (long long)e["layer"].get<int64_t>(), o->rich.c_str(), e["nll"].get<double>(), e["gain"].get<double>(),
                    end(e["gain_ci95"][0]), end(e["gain_ci95"][1]), (long long)e["extra_bytes"].get<int64_t>());
      }
      data["tokens"] = r["windows"].get<int64_t>() * lo.context;
      r["command"] = command_line();
      r["data"] = data;
      r["device"] = device_description(model.device());
      r["dtype"] = c10::toString(model.dtype());
      CalibBundle::update_manifest(o->out, cfg, "layer_codes", r);
      std::printf("-> %s/manifest.json: layer_codes %s (--full-code auto)\n", o->out.c_str(),
                  r["code"].get<std::string>().c_str());
    });
  }
}

}  // namespace kakeya::cli

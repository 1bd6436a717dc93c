#include "tools/restored_flags.h"

#include <cstdio>
#include <tuple>

#include "calib/codec/calib_bundle.h"
#include "core/error.h"
#include "core/io/fs.h"
#include "infer/restorer.h"

namespace kakeya::cli {

namespace {

bool random_spec(const std::string& s, uint64_t& seed) {
  if (s.rfind("random", 0) != 0) return false;
  seed = 0;
  if (s.size() > 6) {
    KAKEYA_CHECK(s[6] == ':', "expected random or random:SEED, got '" << s << "'");
    seed = std::stoull(s.substr(7));
  }
  return true;
}

}  // namespace

void RestoreFlags::add_restore(CLI::App* c, const std::string& prefix) {
  c->add_option("--drafter", drafter, prefix + "DFlash drafter directory, or random[:SEED]")->capture_default_str();
  c->add_option("--ftheta", ftheta, prefix + "f_θ directory (kakeya train-ftheta), or random[:SEED]")->capture_default_str();
  c->add_option("--sink", sink, prefix + "attention-sink positions kept exact")
      ->capture_default_str()
      ->check(non_negative());
  c->add_option("--window", window, prefix + "exact recent positions per query on restored layers")
      ->capture_default_str()
      ->check(positive());
  c->add_option("--chunk", chunk,
                prefix + "prefill tokens per forward, 1..window (0: window); longer with --mix-alpha 1 and --full-attn "
                         "exact or codec (exact restoration: a chunk reads its own positions exactly; 0 then means " +
                    std::to_string(RestoreOptions::kLongChunk) + ")")
      ->capture_default_str();
  c->add_option("--full-attn", full_attn, prefix + "full-attention layers: exact | restored | codec")
      ->capture_default_str()
      ->check(CLI::IsMember({"exact", "restored", "codec"}));
  c->add_option("--restored-code", region_code,
                prefix + "restored regions stored as: none (the model dtype) | " + region_code_names() +
                    " (intB: affine, groups of 32; lmB: rotated rows, Lloyd-Max levels; ruB: rotated rows, evenly spaced levels; a rotated "
                    "code + vC: V rows in C bits, e.g. ru5v3; core/kernels/ops.h)")
      ->capture_default_str();
  c->add_option("--full-code", full_code,
                prefix + "--full-attn codec: full-attention K/V stored as " + ops::row_code_names() +
                    " rows (pwB: lmB with calibrated K weights from --calib; a rotated code + vC: V rows in C bits, e.g. pw5v3; "
                    "+L=CODE gives full-attention layer L its own code, e.g. pw4+17=pw5v4; auto: the codes --calib's bundle "
                    "chose, kakeya calibrate layer-codes)")
      ->capture_default_str();
  c->add_option("--calib", calib, prefix + "--full-code pwB: calibration bundle holding K weights (kakeya calibrate k-weights)")
      ->capture_default_str();
  c->add_option("--restore-layers", layers,
                prefix + "layers that read restored positions: auto (f_θ's measured list; evict-only when it kept none) | all | none (evict-only) | L1,L2,...")
      ->capture_default_str();
  c->add_option("--token-layers", token_layers,
                prefix + "on: layers whose K/V depend on the token alone (the first) restored from the token, exactly; "
                         "off: f_θ restores them too")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
}

void RestoreFlags::add(CLI::App* c, bool with_alpha) {
  c->add_option("--verifier", verifier, "verifier model directory (HF layout)")->capture_default_str();
  add_restore(c);
  if (with_alpha)
    c->add_option("--mix-alpha", mix_alpha,
                  "restored raw K/V = a·true + (1-a)·f_θ: 0 f_θ alone; 1 exact restoration (each position's own K/V "
                  "kept in the region, coded by --restored-code; no drafter or f_θ needed); between: research mode "
                  "(keeps the true raw K/V)")
        ->capture_default_str();
  df.add(c);
}

RestoreOptions RestoreFlags::options() const {
  RestoreOptions o;
  o.sink = sink;
  o.window = window;
  o.chunk = chunk;
  o.full_attn = parse_full_attn(full_attn);
  o.mix_alpha = mix_alpha;
  o.layers = layers;
  o.token_layers = token_layers == "on";
  o.region_code = ops::parse_row_code(region_code, "--restored-code");
  check_region_code(o.region_code, "--restored-code");
  if (full_code == "auto") {  // the codes chosen for this model on calibration text (its identity checked)
    const std::string chosen = CalibBundle::layer_codes(calib, ModelConfig::from_file(verifier + "/config.json"));
    std::tie(o.full_code, o.full_code_layers) =
        ops::parse_layer_codes(chosen, "--full-code auto (" + calib + "/manifest.json)");
  } else {
    std::tie(o.full_code, o.full_code_layers) = ops::parse_layer_codes(full_code, "--full-code");
  }
  o.calib = calib;
  // auto reads f_θ's measured list: when its measurement kept no layer, decode evict-only and say so.
  uint64_t seed = 0;
  const std::string fc = ftheta + "/f_theta_config.json";
  if (o.layers == "auto" && o.needs_ftheta() && !random_spec(ftheta, seed) && fs::exists(fc) &&
      settle_auto_layers(o, FThetaConfig::from_file(fc)))
    std::fprintf(stderr, "[restore] %s: its per-layer measurement kept no layer (none beat evict-only there), so "
                         "--restore-layers auto decodes evict-only (no drafter or f_θ loaded)\n", fc.c_str());
  return o;
}

nlohmann::json RestoreFlags::to_json() const {
  return {{"verifier", verifier}, {"drafter", drafter}, {"ftheta", ftheta}};
}

namespace {

// What `random` stands for: a small drafter of the shipped geometry's kind (1 KV head), and an
// f_θ of rank 64 for the pair.
DrafterConfig random_drafter_config(const ModelConfig& verifier, int64_t mask_token_id) {
  return DrafterConfig::for_target(verifier, 2, 4, 1, 64, 512, 16, mask_token_id);
}
FThetaConfig random_ftheta_config(const ModelConfig& verifier, const DrafterConfig& drafter) {
  return FThetaConfig::for_pair(verifier, drafter, 64);
}

}  // namespace

DecodeStack load_decode_stack(const RestoreFlags& f, int64_t max_positions, bool need_restore) {
  DecodeStack s;
  s.tok = std::make_unique<Tokenizer>(load_tokenizer(f.verifier));
  s.model = std::make_unique<Model>(load_model(f.verifier, f.df, max_positions));
  if (need_restore) load_restoration(f, *s.model, *s.tok, s);
  return s;
}

std::pair<DrafterConfig, FThetaConfig> restoration_configs(const RestoreFlags& f, const ModelConfig& verifier) {
  uint64_t seed = 0;
  DrafterConfig d = random_spec(f.drafter, seed) ? random_drafter_config(verifier, 0)
                                                 : DrafterConfig::from_file(f.drafter + "/config.json");
  d.check_target(verifier);
  if (random_spec(f.ftheta, seed)) return {d, random_ftheta_config(verifier, d)};
  const std::string file = f.ftheta + "/f_theta_config.json";
  auto t = FThetaConfig::from_file(file);
  t.check(verifier, d, file);
  return {d, t};
}

void load_restoration(const RestoreFlags& f, const Model& model, const Tokenizer& tok, DecodeStack& s) {
  uint64_t seed = 0;
  if (random_spec(f.drafter, seed)) {
    s.drafter = std::make_unique<Drafter>(
        Drafter::random(random_drafter_config(model.config(), tok.token_id("<mask>")), model, seed));
  } else {
    s.drafter = std::make_unique<Drafter>(Drafter::load(f.drafter, model));
  }
  if (random_spec(f.ftheta, seed)) {
    s.ftheta = std::make_unique<FTheta>(FTheta::random(random_ftheta_config(model.config(), s.drafter->config()), seed,
                                                       model.dtype(), model.device()));
    s.ftheta_origin = f.ftheta;
  } else {
    KAKEYA_CHECK(fs::exists(f.ftheta + "/f_theta_config.json"),
                 f.ftheta << ": no f_theta_config.json (train one with kakeya train-ftheta, or pass --ftheta random)");
    s.ftheta = std::make_unique<FTheta>(FTheta::load(f.ftheta, model.dtype(), model.device()));
    s.ftheta_origin = f.ftheta + "/f_theta_config.json";
  }
  s.ftheta->config().check(model.config(), s.drafter->config(), s.ftheta_origin);
}

}  // namespace kakeya::cli

#include "tools/restored_flags.h"

#include "core/error.h"
#include "core/io/fs.h"

namespace kakeya::cli {

void RestoreFlags::add(CLI::App* c, bool with_alpha) {
  c->add_option("--verifier", verifier, "verifier model directory (HF layout)")->capture_default_str();
  c->add_option("--drafter", drafter, "DFlash drafter directory, or random[:SEED]")->capture_default_str();
  c->add_option("--ftheta", ftheta, "f_θ directory (kakeya train-ftheta), or random[:SEED]")->capture_default_str();
  c->add_option("--calib", calib, "calibration bundle directory (kakeya calibrate; --full-attn codec)");
  c->add_option("--codec", codec, "--full-attn codec: codec spec (calib/codec/codec.h); default: the bundle's release recipe");
  c->add_option("--sink", sink, "attention-sink positions kept exact")->capture_default_str()->check(CLI::NonNegativeNumber);
  c->add_option("--window", window, "exact recent positions per query on restored layers")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  c->add_option("--chunk", chunk, "prefill tokens per forward, 1..window (0: window)")->capture_default_str();
  c->add_option("--full-attn", full_attn, "full-attention layers: exact | restored | codec")
      ->capture_default_str()
      ->check(CLI::IsMember({"exact", "restored", "codec"}));
  c->add_option("--restored-code", region_code,
                "restored regions stored as: none (the model dtype) | int8 | int4 (coded rows, groups of 32)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "int8", "int4"}));
  c->add_option("--restore-layers", layers,
                "layers that read restored positions: auto (f_θ's measured list) | all | none (evict-only) | L1,L2,...")
      ->capture_default_str();
  if (with_alpha)
    c->add_option("--mix-alpha", mix_alpha,
                  "research mode: restored raw K/V = a·true + (1-a)·f_θ (a > 0 keeps the true K/V)")
        ->capture_default_str();
  df.add(c);
}

RestoreOptions RestoreFlags::options(const KVCodec* c) const {
  RestoreOptions o;
  o.codec = c;
  o.sink = sink;
  o.window = window;
  o.chunk = chunk;
  o.full_attn = parse_full_attn(full_attn);
  o.mix_alpha = mix_alpha;
  o.layers = layers;
  o.region_bits = parse_region_code(region_code);
  return o;
}

nlohmann::json RestoreFlags::to_json() const {
  return {{"verifier", verifier}, {"drafter", drafter}, {"ftheta", ftheta}, {"calib", calib}, {"codec", codec}};
}

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

DecodeStack load_decode_stack(const RestoreFlags& f, int64_t max_positions, bool need_restore) {
  DecodeStack s;
  s.tok = std::make_unique<Tokenizer>(load_tokenizer(f.verifier));
  s.model = std::make_unique<Model>(load_model(f.verifier, f.df, max_positions));
  if (need_restore) load_restoration(f, *s.model, *s.tok, s);
  else load_codec(f, *s.model, s);
  return s;
}

namespace {

// The spec of the release recipe: manifest.json entries.release.recipe names a label of the
// release evaluation's --codecs list (label=spec;...).
std::string release_codec_spec(const CalibBundle& b) {
  const std::string origin = b.dir() + "/manifest.json";
  const auto& m = b.manifest();
  KAKEYA_CHECK(m.contains("entries") && m["entries"].contains("release") && m["entries"]["release"].contains("recipe") &&
                   m["entries"]["release"].contains("eval") && !m["entries"]["release"]["eval"].empty(),
               origin << ": no entries.release.recipe / eval: pass --codec SPEC");
  const std::string label = m["entries"]["release"]["recipe"].get<std::string>();
  const std::string cmd = m["entries"]["release"]["eval"][0].value("command", "");
  const auto at = cmd.find("--codecs ");
  KAKEYA_CHECK(at != std::string::npos, origin << ": entries.release.eval[0].command has no --codecs list: pass --codec SPEC");
  std::string list = cmd.substr(at + 9);
  list = list.substr(0, list.find(' '));
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(';', start);
    if (end == std::string::npos) end = list.size();
    const std::string item = list.substr(start, end - start);
    if (item.rfind(label + "=", 0) == 0) return item.substr(label.size() + 1);
    start = end + 1;
  }
  KAKEYA_FAIL(origin << ": release recipe '" << label << "' is not in the release --codecs list: pass --codec SPEC");
}

}  // namespace

void load_codec(const RestoreFlags& f, const Model& model, DecodeStack& s) {
  if (parse_full_attn(f.full_attn) != FullAttn::Codec) return;
  KAKEYA_CHECK(!f.calib.empty(), "--full-attn codec needs the calibration bundle (--calib DIR, e.g. "
                                 "checkpoints/gemma3-270m/calib)");
  s.bundle = std::make_unique<CalibBundle>(CalibBundle::load(f.calib, model.config()));
  const std::string spec = f.codec.empty() ? release_codec_spec(*s.bundle) : f.codec;
  s.codec = std::make_unique<KVCodec>(CodecOptions::parse(spec), model.config(), s.bundle.get(), model.device());
}

void load_restoration(const RestoreFlags& f, const Model& model, const Tokenizer& tok, DecodeStack& s) {
  load_codec(f, model, s);
  uint64_t seed = 0;
  if (random_spec(f.drafter, seed)) {
    // A small drafter of the shipped geometry's kind (1 KV head), random weights.
    auto cfg = DrafterConfig::for_target(model.config(), 2, 4, 1, 64, 512, 16, tok.token_id("<mask>"));
    s.drafter = std::make_unique<Drafter>(Drafter::random(cfg, model, seed));
  } else {
    s.drafter = std::make_unique<Drafter>(Drafter::load(f.drafter, model));
  }
  if (random_spec(f.ftheta, seed)) {
    auto cfg = FThetaConfig::for_pair(model.config(), s.drafter->config(), 64);
    s.ftheta = std::make_unique<FTheta>(FTheta::random(cfg, seed, model.dtype(), model.device()));
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

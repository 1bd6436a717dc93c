// kakeya ftheta-layers: which layers an f_θ should restore (train/ftheta_select.h). Measures, on
// held-out text, evict-only against restoring each covered layer alone and together, and saves
// the f_θ with the chosen layers in its config (restore_layers, read by --restore-layers auto),
// plus SAVE/layers.json (every measurement). kakeya ftheta-exact: an f_θ given its exact layers.
#include <cstdio>
#include <memory>

#include "core/error.h"
#include "core/io/fs.h"
#include "tools/cli_common.h"
#include "tools/restored_flags.h"
#include "train/ftheta_online.h"
#include "train/ftheta_select.h"

namespace kakeya::cli {
using json = nlohmann::json;

void register_ftheta_layers(CLI::App& app) {
  struct Opts {
    RestoreFlags rf;
    std::string text, save;
    int64_t seqs = 8, seq_len = 2048;
    double min_gain = 0.0;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("ftheta-layers",
                               "Measure per layer whether restoring beats evict-only on held-out text; save the f_theta "
                               "with the layers that help");
  o->rf.add(c, /*with_alpha=*/false);
  c->add_option("--text", o->text, "held-out corpus file (documents separated by <|doc|> lines, e.g. CORPUS/heldout.txt)")
      ->required();
  c->add_option("--save", o->save, "output f_theta directory (config with restore_layers + weights, layers.json)")
      ->required();
  c->add_option("--seqs", o->seqs, "held-out sequences")->capture_default_str()->check(positive());
  c->add_option("--seq-len", o->seq_len, "tokens per sequence")->capture_default_str()->check(CLI::Range(128, 1 << 20));
  c->add_option("--min-gain", o->min_gain, "nats per token a layer must gain alone to be chosen")->capture_default_str();
  c->callback([o] {
    DecodeStack s = load_decode_stack(o->rf, o->seq_len + 1, /*need_restore=*/true);
    auto seqs = train::pack_corpus_file(*s.tok, o->text, o->seq_len, 0, o->seqs);
    KAKEYA_CHECK((int64_t)seqs.size() == o->seqs, o->text << ": " << seqs.size() << " sequences of " << o->seq_len
                                                          << " tokens, --seqs asks for " << o->seqs);
    train::LayerSelectOptions lo;
    lo.restore = o->rf.options();
    lo.min_gain = o->min_gain;
    std::unique_ptr<Progress> prog;  // the total (configurations x sequences) comes with the first report
    json report = train::select_restore_layers(*s.model, *s.drafter, *s.ftheta, seqs, lo, [&](int64_t done, int64_t total) {
      if (!prog) prog = std::make_unique<Progress>("[ftheta-layers] scoring", total, "seq");
      prog->update(done);
    });
    if (prog) prog->finish();
    report["command"] = command_line();
    report["ftheta"] = o->rf.ftheta;
    report["text"] = o->text;
    report["device"] = device_description(s.model->device());
    s.ftheta->mutable_config().provenance["restore_layers"] = report;
    s.ftheta->save(o->save, s.ftheta->dtype());
    write_json(o->save + "/layers.json", report);
    std::printf("[ftheta-layers] ppl: evict-only %.4f, all restored %.4f, chosen %.4f -> restore_layers %s (%s)\n",
                report["ppl"]["none"].get<double>(), report["ppl"]["all"].get<double>(),
                report["ppl"]["chosen"].get<double>(), report["restore_layers"].dump().c_str(),
                report["why"].get<std::string>().c_str());
    for (const auto& l : report["per_layer"])
      std::printf("  layer %2lld alone: gain %+.5f nats/token\n", (long long)l["layer"].get<int64_t>(),
                  l["gain_nats"].get<double>());
  });
}

void register_ftheta_exact(CLI::App& app) {
  struct Opts {
    std::string verifier = "checkpoints/models/gemma3-270m", drafter, ftheta, save;
    DeviceFlags df;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("ftheta-exact",
                               "Give a target-feature f_theta its exact layers: K/V of every layer fed by a feature layer "
                               "in closed form from the verifier's projections (core/model/ftheta.h); the rest unchanged");
  c->add_option("--verifier", o->verifier, "verifier model directory (HF layout)")->capture_default_str();
  c->add_option("--drafter", o->drafter, "the drafter the f_theta was made for (its target layers are the features)")
      ->required();
  c->add_option("--ftheta", o->ftheta, "input f_theta directory")->required();
  c->add_option("--save", o->save, "output f_theta directory")->required();
  o->df.add(c);
  c->callback([o] {
    Model verifier = load_model(o->verifier, o->df, 1);
    const DrafterConfig dcfg = DrafterConfig::from_file(o->drafter + "/config.json");
    FTheta f = FTheta::load(o->ftheta, verifier.dtype(), verifier.device());
    f.config().check(verifier.config(), dcfg, o->ftheta + "/f_theta_config.json");
    f.add_exact_layers(verifier);
    f.mutable_config().provenance["exact_layers"] = {{"command", command_line()}, {"from", o->ftheta}};
    f.save(o->save, f.dtype());
    std::printf("[ftheta-exact] exact layers %s -> %s (%s)\n", json(f.config().exact_layers).dump().c_str(),
                o->save.c_str(), at::toString(f.dtype()));
  });
}

}  // namespace kakeya::cli

// kakeya train-ftheta: train f_θ (drafter raw K/V or target features -> verifier raw K/V) on a
// capture directory made by `kakeya capture` (--data), or online on a text corpus with the
// verifier in the loop (--online DIR, train/ftheta_online.h) (train/ftheta_train.h).
//   SAVE/checkpoint.safetensors   resumable training state (--resume continues it)
//   SAVE/f_theta_config.json + f_theta.safetensors   the trained f_θ (written when training ends)
//   SAVE/report.json              options, loss components over time, held-out evaluations
//                                 (per layer and per layer type), reduction factor
//   SAVE/loss.png                 curves (tools/plot_ftheta_loss.py, when --plot-python works)
// Under `kakeya launch --nproc N` it trains data-parallel (train/dist.h): each rank makes (online)
// or reads (capture) only the sequences of its rows of each batch; rank 0 writes SAVE.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>

#include "core/model/drafter.h"
#include "core/error.h"
#include "core/io/fs.h"
#include "core/model/ftheta.h"
#include "data/capture.h"
#include "tools/cli_common.h"
#include "train/dist.h"
#include "train/ftheta_online.h"
#include "train/ftheta_train.h"

namespace kakeya::cli {
using json = nlohmann::json;
using namespace kakeya::train;

namespace {

// One captured sequence as training data: bf16 in memory, cropped to max_len
// (the trainer never reads past it), shapes checked against f_θ's config.
FThetaSequence to_training(const data::CaptureSequence& c, const FThetaConfig& fc, int64_t max_len,
                           const std::string& where) {
  const int64_t T = std::min(max_len, c.length());
  auto keep = [&](const at::Tensor& t) { return t.narrow(0, 0, T).to(at::kBFloat16).contiguous(); };
  KAKEYA_CHECK(c.dk.dim() == 4 && c.dk.size(1) == fc.drafter_layers && c.dk.size(2) == fc.drafter_kv_heads &&
                   c.dk.size(3) == fc.drafter_head_dim,
               where << ": drafter K has shape " << c.dk.sizes() << ", f_theta expects [T, " << fc.drafter_layers << ", "
                     << fc.drafter_kv_heads << ", " << fc.drafter_head_dim << "]");
  KAKEYA_CHECK((int64_t)c.k.size() == fc.num_layers(),
               where << ": " << c.k.size() << " verifier layers captured, f_theta has " << fc.num_layers());
  FThetaSequence s;
  s.dk = keep(c.dk);
  s.dv = keep(c.dv);
  for (int64_t l = 0; l < fc.num_layers(); ++l) {
    KAKEYA_CHECK(c.k[l].dim() == 3 && c.k[l].size(1) == fc.kv_heads[l] && c.k[l].size(2) == fc.head_dim[l],
                 where << ": layer " << l << " K has shape " << c.k[l].sizes() << ", f_theta expects [T, "
                       << fc.kv_heads[l] << ", " << fc.head_dim[l] << "]");
    s.q.push_back(keep(c.q[l]));
    s.k.push_back(keep(c.k[l]));
    s.v.push_back(keep(c.v[l]));
    s.o.push_back(keep(c.o[l]));
  }
  return s;
}

// Resume, train, report, save, plot: the same for captured and online data.
// Data-parallel: every rank trains, rank 0 alone writes SAVE.
template <typename Opts>
void finish_training(FThetaTrainer& tr, FTheta& f, const Opts& opt, const Dist& dist, const json& data) {
  const auto* o = &opt;
  tr.distribute(dist);
  const bool root = dist.is_root();
  if (o->resume && !tr.resume() && root)
    std::fprintf(stderr, "[train-ftheta] --resume: no checkpoint yet, starting fresh\n");
  if (root)
    std::fprintf(stderr, "[train-ftheta] f_theta rank %lld%s (%s input), %lld parameters, loss %s, %s, %d rank(s)%s\n",
                 (long long)f.config().rank,
                 f.config().mlp_hidden ? (" + nonlinear branch " + std::to_string(f.config().mlp_hidden)).c_str() : "",
                 ftheta_input_name(f.config().input), (long long)f.num_parameters(),
                 o->loss.c_str(), device_description(dist.device()).c_str(), dist.world(),
                 dist.backend() == "none" ? "" : (" (" + dist.backend() + ")").c_str());
  const bool done = tr.run();
  if (!root) return;
  json report = tr.report();
  report["command"] = command_line();
  report["device"] = device_description(dist.device());
  report["data"] = data;
  write_json(o->save + "/report.json", report);
  if (!done) {
    std::fprintf(stderr, "[train-ftheta] stopped at step %lld; rerun with --resume\n", (long long)tr.step());
    return;
  }
  f.save(o->save);
  if (report.contains("reduction_factor"))
    std::fprintf(stderr, "[train-ftheta] held-out loss %.4g -> %.4g (reduction %.2fx); f_theta in %s\n",
                 report["heldout_loss_initial"].get<double>(), report["heldout_loss_final"].get<double>(),
                 report["reduction_factor"].get<double>(), o->save.c_str());
  if (!o->plot_python.empty()) {
    const std::string cmd = o->plot_python + " tools/plot_ftheta_loss.py '" + o->save + "/report.json' '" + o->save +
                            "/loss.png'";
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "[train-ftheta] plot failed (%s)\n", cmd.c_str());
  }
}

}  // namespace

void register_train_ftheta(CLI::App& app) {
  struct Opts {
    std::string data, online, verifier = "checkpoints/models/gemma3-270m", drafter, save, init_from,
        loss = "attn_distill_hybrid";
    std::string layers = "all", plot_python = "python3", input = "drafter_kv";
    int64_t rank = 256, mlp_hidden = 0, heldout = 4, synthetic_every = 8, max_train_tokens = 0;
    bool resume = false, exact = false;
    FThetaTrainOptions t;
    DeviceFlags df;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("train-ftheta",
                               "Train f_theta (drafter K/V or target features -> verifier K/V) on a capture or online");
  auto* data_opt = c->add_option("--data", o->data, "capture directory (capture.json + shards)");
  c->add_option("--online", o->online,
                "corpus directory (train.txt + heldout.txt, tools/ftheta_corpus.py): sequences of --max-len tokens "
                "made by the verifier in the loop")
      ->excludes(data_opt);
  c->add_option("--input", o->input, "f_theta input: drafter_kv | target_features (ignored with --init-from)")
      ->capture_default_str()
      ->check(CLI::IsMember({"drafter_kv", "target_features"}));
  c->add_option("--synthetic-every", o->synthetic_every,
                "--online: every n-th training sequence is a synthetic long-context task (train split; 0: none)")
      ->capture_default_str();
  c->add_option("--max-train-tokens", o->max_train_tokens, "--online: cap on the corpus text tokens (0: all)")
      ->capture_default_str();
  c->add_option("--verifier", o->verifier, "verifier HF model directory (the capture's)")->capture_default_str();
  c->add_option("--drafter", o->drafter, "drafter directory (the capture's)")->required();
  c->add_option("--save", o->save, "output directory (checkpoint, f_theta, report)")->required();
  c->add_option("--init-from", o->init_from, "start from this f_theta directory (warm start; same models required)");
  c->add_flag("--resume", o->resume, "continue SAVE/checkpoint.safetensors (same options required)");
  c->add_flag("--exact-layers", o->exact,
              "target_features: layers fed by a feature layer get their K/V in closed form from the verifier's own "
              "projections (fixed, not trained; core/model/ftheta.h)");
  c->add_option("--rank", o->rank, "shared encoder width r (ignored with --init-from)")->capture_default_str();
  c->add_option("--mlp-hidden", o->mlp_hidden,
                "width of a nonlinear branch beside the low-rank code, zero-initialised (an --init-from f_theta "
                "without one gets it); 0: none")
      ->capture_default_str()
      ->check(non_negative());
  c->add_option("--loss", o->loss, "mse | cos_mag | combined | attn_distill | attn_distill_hybrid")->capture_default_str();
  c->add_option("--lambda-k-dir", o->t.loss.lambda_k_dir, "hybrid: weight of the post-norm K direction term")->capture_default_str();
  c->add_option("--lambda-v-dir", o->t.loss.lambda_v_dir, "hybrid: weight of the post-norm V direction term")->capture_default_str();
  c->add_option("--lambda-k-mag", o->t.loss.lambda_k_mag, "hybrid: weight of the pre-norm K magnitude term")->capture_default_str();
  c->add_option("--lambda-v-mag", o->t.loss.lambda_v_mag, "hybrid: weight of the pre-norm V magnitude term")->capture_default_str();
  c->add_option("--sink", o->t.loss.layout.sink, "exact sink positions (the decoder's layout)")->capture_default_str();
  c->add_option("--window", o->t.loss.layout.window, "exact recent positions per query")->capture_default_str();
  c->add_option("--layers", o->layers, "verifier layers in the loss: all | sliding | full | restored (sliding but the token layers)")
      ->capture_default_str();
  c->add_option("--steps", o->t.steps, "optimisation steps")->capture_default_str();
  c->add_option("--batch", o->t.batch, "sequences per step")->capture_default_str();
  c->add_option("--max-len", o->t.max_len, "prefix length cap per sequence")->capture_default_str();
  c->add_option("--lr", o->t.lr, "peak learning rate")->capture_default_str();
  c->add_option("--lr-schedule", o->t.lr_schedule, "const | cosine (decays to lr/100)")->capture_default_str();
  c->add_option("--warmup", o->t.warmup_steps, "linear warmup steps")->capture_default_str();
  c->add_option("--weight-decay", o->t.adamw.weight_decay, "AdamW decoupled decay (matrices)")->capture_default_str();
  c->add_option("--grad-clip", o->t.adamw.grad_clip, "global gradient-norm clip")->capture_default_str();
  c->add_option("--heldout", o->heldout, "held-out sequences (the capture's last ones; --online: heldout.txt's first)")
      ->capture_default_str();
  c->add_option("--eval-every", o->t.eval_every, "held-out evaluation period in steps (0: start and end)")->capture_default_str();
  c->add_option("--seed", o->t.seed, "initialisation and batch-order seed")->capture_default_str();
  c->add_option("--deadline", o->t.deadline, "unix time: checkpoint and stop before it (rerun with --resume)");
  c->add_option("--max-steps-this-run", o->t.max_steps_this_run, "stop (with a checkpoint) after this many steps");
  c->add_option("--checkpoint-seconds", o->t.checkpoint_seconds, "checkpoint period")->capture_default_str();
  c->add_flag("!--no-autocast", o->t.autocast, "CUDA: train in f32 without bf16 autocast");
  c->add_option("--plot-python", o->plot_python, "python with matplotlib for SAVE/loss.png ('' to skip)")->capture_default_str();
  o->df.add(c);
  c->callback([o] {
    KAKEYA_CHECK(!o->data.empty() || !o->online.empty(), "train-ftheta: pass --data CAPTURE_DIR or --online CORPUS_DIR");
    const DeviceFlags df = training_device_flags(o->df, "train-ftheta");
    // Under `kakeya launch`: join the ranks first (on CUDA this picks the rank's GPU).
    const Dist dist(dist_env_from_environment(), df.torch_device());
    const at::Device dev = dist.device();
    std::unique_ptr<data::CaptureReader> reader;
    if (!o->data.empty()) {
      reader = std::make_unique<data::CaptureReader>(o->data);
      reader->check_models(o->verifier, o->drafter);  // refuses data captured from other models
    }
    int64_t max_pos = o->t.max_len + 1;
    Model verifier = load_model(o->verifier, df, max_pos);
    DrafterConfig dcfg = DrafterConfig::from_file(o->drafter + "/config.json");
    dcfg.check_target(verifier.config());
    KAKEYA_CHECK(!reader || o->input == "drafter_kv",
                 "train-ftheta: --input target_features needs --online (a capture stores the drafter's K/V, not the features)");
    o->t.loss.type = parse_ftheta_loss(o->loss);
    o->t.loss.layers = parse_ftheta_loss_layers(o->layers, verifier.config());

    FTheta f;
    if (!o->init_from.empty()) {
      f = FTheta::load(o->init_from, at::kFloat, dev);
      f.config().check(verifier.config(), dcfg, o->init_from + "/f_theta_config.json");
    } else {
      f = FTheta::random(FThetaConfig::for_pair(verifier.config(), dcfg, o->rank, parse_ftheta_input(o->input)),
                         o->t.seed, at::kFloat, dev);
    }
    if (o->mlp_hidden > 0 && f.config().mlp_hidden == 0) f.add_mlp(o->mlp_hidden, o->t.seed);
    KAKEYA_CHECK(o->mlp_hidden == 0 || f.config().mlp_hidden == o->mlp_hidden,
                 "--mlp-hidden " << o->mlp_hidden << ": " << o->init_from << " has a nonlinear branch of width "
                                 << f.config().mlp_hidden);
    if (o->exact) f.add_exact_layers(verifier);
    fs::make_dirs(o->save);
    const std::string ckpt = o->save + "/checkpoint.safetensors";
    KAKEYA_CHECK(o->resume || !fs::exists(ckpt),
                 ckpt << " exists: pass --resume to continue it, or choose another --save");
    if (!o->online.empty()) {
      // Online: the verifier (and the drafter, bound to it) make every sequence in the loop.
      Tokenizer tok = load_tokenizer(o->verifier);
      Drafter drafter = Drafter::load(o->drafter, verifier);
      OnlineCorpusOptions co;
      co.dir = o->online;
      co.seq_len = o->t.max_len;
      co.heldout = o->heldout;
      co.synthetic_every = o->synthetic_every;
      co.max_train_tokens = o->max_train_tokens;
      co.seed = o->t.seed;
      std::fprintf(stderr, "[train-ftheta] packing %s into sequences of %lld tokens\n", o->online.c_str(),
                   (long long)co.seq_len);
      OnlineCorpus corpus = load_online_corpus(tok, co);
      std::fprintf(stderr, "[train-ftheta] %lld text + %lld synthetic training sequences, %lld held out\n",
                   (long long)corpus.text.size(), (long long)(corpus.n_train - (int64_t)corpus.text.size()),
                   (long long)corpus.heldout.size());
      f.mutable_config().provenance = {{"online", corpus.describe},
                                       {"options", o->t.to_json()},
                                       {"init_from", o->init_from},
                                       {"command", command_line()}};
      std::vector<FThetaSequence> heldout;
      for (const auto& ids : corpus.heldout) heldout.push_back(online_sequence(verifier, drafter, f.config(), ids));
      auto source = [&](int64_t i) {
        return online_sequence(verifier, drafter, f.config(), online_tokens(tok, corpus, co, i));
      };
      FThetaTrainer tr(verifier, f, source, corpus.n_train, std::move(heldout), o->t, ckpt);
      finish_training(tr, f, *o, dist, {{"online", corpus.describe}});
      return;
    }
    data::CaptureReader& rd = *reader;
    f.mutable_config().provenance = {{"capture", o->data},
                                     {"capture_models", {{"verifier", rd.manifest().value("verifier", json())},
                                                         {"drafter", rd.manifest().value("drafter", json())}}},
                                     {"options", o->t.to_json()},
                                     {"init_from", o->init_from},
                                     {"command", command_line()}};

    const int64_t n = rd.size();
    KAKEYA_CHECK(n > o->heldout && o->heldout > 0,
                 o->data << ": " << n << " complete sequences; need more than --heldout " << o->heldout << " (>0)");
    auto read = [&](int64_t i) {
      return to_training(rd.read(i, at::kFloat, at::kCPU), f.config(), o->t.max_len,
                         o->data + " sequence " + std::to_string(i));
    };
    std::vector<FThetaSequence> train, heldout;
    for (int64_t i = n - o->heldout; i < n; ++i) heldout.push_back(read(i));
    if (dist.world() > 1) {
      // Data-parallel: a rank reads a training sequence the first time one of its rows draws it.
      auto cache = std::make_shared<std::map<int64_t, FThetaSequence>>();
      auto source = [&, cache](int64_t i) {
        auto it = cache->find(i);
        return it != cache->end() ? it->second : cache->emplace(i, read(i)).first->second;
      };
      FThetaTrainer tr(verifier, f, source, n - o->heldout, std::move(heldout), o->t, ckpt);
      finish_training(tr, f, *o, dist, {{"capture", o->data}});
      return;
    }
    Progress prog("[train-ftheta] reading capture", n - o->heldout, "seq");
    for (int64_t i = 0; i < n - o->heldout; ++i) {
      train.push_back(read(i));
      prog.update(i + 1);
    }
    prog.finish();

    FThetaTrainer tr(verifier, f, std::move(train), std::move(heldout), o->t, ckpt);
    finish_training(tr, f, *o, dist, {{"capture", o->data}});
  });
}

}  // namespace kakeya::cli


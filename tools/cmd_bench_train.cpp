// kakeya bench train-ftheta: our f_θ training step (train/ftheta_train.h
// FThetaTrainer::step_on: loss, backward, finite check, AdamW) next to a
// PyTorch eager Python step (tools/ftheta_step_ref.py: the same loss written
// from the definitions with HF transformers' Gemma 3 modules) on the same
// batch, f_θ weights and options, in the same run. Both start from the same
// weights, so their first losses must agree (printed; a check that the two
// time the same computation).
//
// The batch is synthetic (normal noise of the captured tensors' shapes): step
// time does not depend on the values, and the bench needs no capture.
#include <cmath>
#include <cstdio>
#include <map>
#include <tuple>

#include "core/model/drafter.h"
#include "core/error.h"
#include "core/io/fs.h"
#include "core/model/ftheta.h"
#include "core/io/safetensors.h"
#include "infer/loop_util.h"
#include "tools/cli_common.h"
#include "train/ftheta_train.h"

namespace kakeya::cli {
using json = nlohmann::json;
using namespace kakeya::train;

namespace {

// B random sequences of length T shaped like a capture of (verifier, f_θ's drafter side).
std::vector<FThetaSequence> synthetic_sequences(const ModelConfig& vc, const FThetaConfig& fc, int64_t B, int64_t T,
                                                uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  auto randn = [&](std::vector<int64_t> shape) { return at::randn(shape, gen, at::kFloat).to(at::kBFloat16); };
  std::vector<FThetaSequence> out(B);
  for (auto& s : out) {
    s.dk = randn({T, fc.drafter_layers, fc.drafter_kv_heads, fc.drafter_head_dim});  // [T, L_d, H_d, D_d]
    s.dv = randn({T, fc.drafter_layers, fc.drafter_kv_heads, fc.drafter_head_dim});
    for (int64_t l = 0; l < vc.num_layers; ++l) {
      const int64_t D = vc.layer_head_dim[l];
      s.q.push_back(randn({T, vc.num_heads, D}));       // [T, H_q, D]
      s.k.push_back(randn({T, vc.kv_heads(l), D}));     // [T, H_kv, D]
      s.v.push_back(randn({T, vc.kv_heads(l), D}));     // [T, H_kv, D]
      s.o.push_back(randn({T, vc.hidden_size}) * 0.1);  // [T, hidden]
    }
  }
  return out;
}

}  // namespace

void register_bench_train_ftheta(CLI::App& bench) {
  struct Opts {
    std::string verifier = "checkpoints/models/gemma3-270m", drafter = "checkpoints/gemma3-270m/drafter", json;
    std::string python = "python3", peer = "tools/ftheta_step_ref.py", loss = "attn_distill_hybrid";
    int64_t batch = 4, len = 1024, rank = 256, steps = 20, warmup = 5;
    uint64_t seed = 0;
    FThetaLossOptions lo;
    DeviceFlags df;
  };
  auto o = std::make_shared<Opts>();
  auto* c = bench.add_subcommand("train-ftheta", "f_theta training step time: ours vs PyTorch eager (same batch, same run)");
  c->add_option("--verifier", o->verifier, "verifier HF model directory")->capture_default_str();
  c->add_option("--drafter", o->drafter, "drafter directory (f_theta's input side)")->capture_default_str();
  c->add_option("--loss", o->loss, "mse | cos_mag | combined | attn_distill | attn_distill_hybrid")->capture_default_str();
  c->add_option("--batch", o->batch, "sequences per step")->capture_default_str()->check(CLI::Range(1, 1024));
  c->add_option("--len", o->len, "tokens per sequence")->capture_default_str()->check(CLI::Range(2, 1 << 20));
  c->add_option("--rank", o->rank, "f_theta rank")->capture_default_str()->check(CLI::Range(1, 1 << 16));
  c->add_option("--sink", o->lo.layout.sink, "exact sink positions")->capture_default_str();
  c->add_option("--window", o->lo.layout.window, "exact recent positions per query")->capture_default_str();
  c->add_option("--steps", o->steps, "timed steps (each side)")->capture_default_str()->check(CLI::Range(1, 100000));
  c->add_option("--warmup", o->warmup, "untimed steps first (the first one gives the loss both sides compare)")
      ->capture_default_str()->check(CLI::Range(1, 1000));
  c->add_option("--seed", o->seed, "batch and f_theta initialisation seed")->capture_default_str();
  c->add_option("--python", o->python, "python with torch + transformers for the eager step ('' to skip it)")
      ->capture_default_str();
  c->add_option("--peer", o->peer, "the eager step script")->capture_default_str();
  c->add_option("--json", o->json, "write the results here");
  o->df.add(c);
  c->callback([o] {
    const DeviceFlags df = training_device_flags(o->df, "bench train-ftheta");
    const at::Device dev = df.torch_device();
    Model verifier = load_model(o->verifier, df, o->len + 1);
    DrafterConfig dcfg = DrafterConfig::from_file(o->drafter + "/config.json");
    dcfg.check_target(verifier.config());
    FTheta f = FTheta::random(FThetaConfig::for_pair(verifier.config(), dcfg, o->rank), o->seed, at::kFloat, dev);

    FThetaTrainOptions to;
    to.loss = o->lo;
    to.loss.type = parse_ftheta_loss(o->loss);
    to.steps = o->warmup + o->steps;
    to.batch = o->batch;
    to.max_len = o->len;
    to.lr = 1e-4;  // small and constant: the weights stay sane over the timed steps
    to.lr_schedule = "const";
    to.warmup_steps = 0;
    std::vector<FThetaSequence> seqs = synthetic_sequences(verifier.config(), f.config(), o->batch, o->len, o->seed);
    std::vector<const FThetaSequence*> ptrs;
    for (const auto& s : seqs) ptrs.push_back(&s);
    FThetaBatch b = make_ftheta_batch(ptrs, o->len, dev);

    // What the eager step reads: the batch, f_θ's initial weights, the options.
    const std::string dir = fs::temp_dir() + "/kakeya_bench_ftheta";
    fs::make_dirs(dir);
    if (!o->python.empty()) {
      std::map<std::string, at::Tensor> t{{"positions", b.positions.cpu()}, {"dk", b.dk.cpu()}, {"dv", b.dv.cpu()}};
      for (int64_t l = 0; l < verifier.config().num_layers; ++l) {
        t["q." + std::to_string(l)] = b.q[l].cpu();
        t["k." + std::to_string(l)] = b.k[l].cpu();
        t["v." + std::to_string(l)] = b.v[l].cpu();
        t["o." + std::to_string(l)] = b.o[l].cpu();
      }
      save_safetensors(dir + "/batch.safetensors", t, {});
      f.save(dir + "/ftheta");
      const auto& l = to.loss;
      write_json(dir + "/options.json",
                 {{"loss", o->loss},
                  {"sink", l.layout.sink},
                  {"window", l.layout.window},
                  {"lambdas", {l.lambda_k_dir, l.lambda_v_dir, l.lambda_k_mag, l.lambda_v_mag}},
                  {"lr", to.lr},
                  {"autocast", to.autocast},
                  {"adamw",
                   {{"beta1", to.adamw.beta1},
                    {"beta2", to.adamw.beta2},
                    {"eps", to.adamw.eps},
                    {"weight_decay", to.adamw.weight_decay},
                    {"grad_clip", to.adamw.grad_clip}}}});
    }

    // Ours: the trainer's own step on the fixed batch, eager and (CUDA) replaying a CUDA graph,
    // each from the same initial weights.
    auto time_ours = [&](bool graph) {
      FTheta fi = FTheta::random(f.config(), o->seed, at::kFloat, dev);
      FThetaTrainOptions t = to;
      t.cuda_graph = graph;
      FThetaTrainer tr(verifier, fi, seqs, {seqs[0]}, t, dir + "/unused-checkpoint.safetensors");
      std::fprintf(stderr, "[bench] ours (%s): %lld warmup + %lld timed steps, batch %lld x %lld tokens, rank %lld, %s\n",
                   graph ? "CUDA graph" : "eager", (long long)o->warmup, (long long)o->steps, (long long)o->batch,
                   (long long)o->len, (long long)o->rank, device_description(dev).c_str());
      const double loss0 = tr.step_on(b, to.lr).loss.item<double>();  // SYNC: the first loss, compared with the peer's
      for (int64_t i = 1; i < o->warmup; ++i) tr.step_on(b, to.lr);
      seconds_since(Clock::now(), dev);  // drain the queue before the clock starts
      auto t0 = Clock::now();
      for (int64_t i = 0; i < o->steps; ++i) tr.step_on(b, to.lr);
      return std::make_pair(loss0, 1e3 * seconds_since(t0, dev) / (double)o->steps);
    };
    const auto [loss0, eager_ms] = time_ours(false);
    double graph_ms = 0, graph_loss0 = 0;
    if (dev.is_cuda()) std::tie(graph_loss0, graph_ms) = time_ours(true);
    const double ours_ms = graph_ms > 0 ? graph_ms : eager_ms;

    json peer;
    if (!o->python.empty()) {
      const std::string cmd = o->python + " " + o->peer + " --dir '" + dir + "' --verifier '" + o->verifier +
                              "' --device " + o->df.device + " --steps " + std::to_string(o->steps) + " --warmup " +
                              std::to_string(o->warmup) + " --json '" + dir + "/peer.json' 2>&1";
      std::fprintf(stderr, "[bench] peer: %s\n", cmd.c_str());
      run_capture(cmd);
      peer = fs::read_json(dir + "/peer.json", "the eager step's result (step_ms, loss0)");
    }

    std::printf("\nf_theta training step (%s, batch %lld x %lld tokens, rank %lld, %lld timed steps)\n", o->loss.c_str(),
                (long long)o->batch, (long long)o->len, (long long)o->rank, (long long)o->steps);
    std::printf("%-34s %12s %14s\n", "", "ms/step", "first loss");
    std::printf("%-34s %12.2f %14.6g\n", "kakeya (C++/LibTorch, eager)", eager_ms, loss0);
    if (graph_ms > 0) std::printf("%-34s %12.2f %14.6g\n", "kakeya (C++/LibTorch, CUDA graph)", graph_ms, graph_loss0);
    json j = {{"bench", "train-ftheta"},
              {"commit", git_commit()},
              {"command", command_line()},
              {"device", device_description(dev)},
              {"loss", o->loss},
              {"batch", o->batch},
              {"len", o->len},
              {"rank", o->rank},
              {"f_theta_parameters", f.num_parameters()},
              {"steps", o->steps},
              {"warmup", o->warmup},
              {"ours_ms_per_step", ours_ms},
              {"ours_eager_ms_per_step", eager_ms},
              {"ours_graph_ms_per_step", graph_ms > 0 ? json(graph_ms) : json()},
              {"ours_first_loss", loss0},
              {"ours_graph_first_loss", graph_ms > 0 ? json(graph_loss0) : json()},
              {"peer", peer}};
    if (!peer.is_null()) {
      const double peer_ms = peer["step_ms"], peer_loss = peer["loss0"];
      const double rel = std::fabs(loss0 - peer_loss) / std::max(std::fabs(peer_loss), 1e-30);
      std::printf("%-34s %12.2f %14.6g\n", "PyTorch eager (Python, SDPA)", peer_ms, peer_loss);
      std::printf("speedup ours (%s) vs PyTorch eager: %.2fx; first losses differ by %.2e (relative)\n",
                  graph_ms > 0 ? "CUDA graph" : "eager", peer_ms / ours_ms, rel);
      j["speedup"] = peer_ms / ours_ms;
      j["first_loss_rel_diff"] = rel;
    }
    if (!o->json.empty()) write_json(o->json, j);
  });
}

}  // namespace kakeya::cli

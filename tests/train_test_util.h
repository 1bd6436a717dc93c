// Trainer fixtures shared by the training suites (test_ftheta, test_drafter_train,
// test_distributed): the tiny random models of tests/fixtures and small option sets.
#pragma once
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/io/safetensors.h"
#include "tests/test_util.h"
#include "train/drafter_data.h"
#include "train/drafter_train.h"
#include "train/ftheta_train.h"

namespace kakeya::test {

// ---- f_θ: the tiny random Gemma 3 of the ftheta fixture and its two captured sequences

// The fixture's drafter side: 2 layers × 3 KV heads × head dim 5.
inline DrafterConfig tiny_drafter() {
  DrafterConfig d;
  d.hidden_size = 48;
  d.intermediate_size = 64;
  d.num_layers = 2;
  d.num_heads = 3;
  d.num_kv_heads = 3;
  d.head_dim = 5;
  d.layer_types = {LayerType::Full, LayerType::Full};
  d.target_layer_ids = {1, 3};
  d.mask_token_id = 0;
  d.origin = "tiny drafter";
  return d;
}

struct FThetaFixture {
  Model m;
  std::vector<train::FThetaSequence> seqs;
  FThetaConfig fc;  // rank 6
};

inline FThetaFixture ftheta_fixture() {
  const std::string dir = fixtures_dir("ftheta") + "/gemma3";
  FThetaFixture t{Model::load(dir), {}, {}};
  TensorStore st = TensorStore::open_file(dir + "/data.safetensors");
  for (int64_t b = 0; b < 2; ++b) {
    train::FThetaSequence s;
    s.dk = st.get("dk")[b].to(at::kBFloat16);
    s.dv = st.get("dv")[b].to(at::kBFloat16);
    for (int64_t l = 0; l < t.m.config().num_layers; ++l) {
      const std::string n = std::to_string(l);
      s.q.push_back(st.get("q." + n)[b].to(at::kBFloat16));
      s.k.push_back(st.get("k." + n)[b].to(at::kBFloat16));
      s.v.push_back(st.get("v." + n)[b].to(at::kBFloat16));
      s.o.push_back(st.get("o." + n)[b].to(at::kBFloat16));
    }
    t.seqs.push_back(s);
  }
  t.fc = FThetaConfig::for_pair(t.m.config(), tiny_drafter(), 6);
  return t;
}

inline train::FThetaTrainOptions ftheta_small_options() {
  train::FThetaTrainOptions o;
  o.steps = 8;
  o.batch = 2;
  o.max_len = 19;
  o.lr = 3e-3;
  o.warmup_steps = 2;
  o.eval_every = 3;
  o.loss.layout = {2, 3};
  o.log_seconds = 0;
  o.checkpoint_seconds = 1e9;
  return o;
}

// ---- drafter: greedy continuations of the tiny Qwen3 target of the drafter fixture

inline std::string drafter_case_dir(const std::string& name) { return fixtures_dir("drafter") + "/" + name; }

inline std::unique_ptr<Model> load_drafter_target(const std::string& name) {
  ModelOptions mo;
  mo.max_positions = 64;
  return std::make_unique<Model>(Model::load(drafter_case_dir(name) + "/target", mo));
}

struct DrafterFixture {
  std::unique_ptr<Model> target;
  train::Sequences seqs;
  DrafterConfig cfg;
};

inline DrafterFixture drafter_fixture() {
  DrafterFixture s;
  s.target = load_drafter_target("qwen3");
  std::mt19937_64 rng(3);
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < 24; ++i) {
    std::vector<int64_t> p;
    for (int t = 0; t < 6; ++t) p.push_back((int64_t)(rng() % 100));
    prompts.push_back(p);
  }
  s.seqs = train::generate_continuations(*s.target, prompts, 26, 8, {}, "test");
  s.cfg = DrafterConfig::for_target(s.target->config(), 2, 4, 2, 16, 64, 4, 100);
  return s;
}

// A random drafter of the fixture's config in f32 (training runs in f32).
inline Drafter random_drafter(const DrafterFixture& s, uint64_t seed) {
  DrafterOptions dopt;
  dopt.dtype = at::kFloat;
  return Drafter::random(s.cfg, *s.target, seed, dopt);
}

inline train::TrainOptions drafter_small_options(int64_t steps) {
  train::TrainOptions o;
  o.batch = 8;
  o.anchors = 6;
  o.steps = steps;
  o.warmup_steps = 10;
  o.lr = 3e-3;
  o.log_seconds = 1e9;         // progress only at the end
  o.checkpoint_seconds = 1e9;  // checkpoints only at exit
  return o;
}

}  // namespace kakeya::test

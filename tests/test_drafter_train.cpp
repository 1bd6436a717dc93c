// The drafter trainer on the tiny fixture targets (tests/fixtures/make_drafter_fixtures.py):
// the training forward equals what the drafter computes when decoding (no
// train/serve skew), the loss falls and the acceptance length rises on a
// target's own greedy continuations, and a resumed run equals an uninterrupted one.
#include <ATen/ATen.h>

#include <unistd.h>

#include <cstdlib>
#include <random>

#include "core/drafter.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/model.h"
#include "tests/test_util.h"
#include "train/drafter_data.h"
#include "train/drafter_train.h"

using namespace kakeya;
using namespace kakeya::train;

namespace {

std::string case_dir(const std::string& name) { return test::fixtures_dir("drafter") + "/" + name; }

std::unique_ptr<Model> load_target(const std::string& name) {
  ModelOptions mo;
  mo.max_positions = 64;
  return std::make_unique<Model>(Model::load(case_dir(name) + "/target", mo));
}

std::string temp_path(const std::string& tag) {
  return fs::temp_dir() + "/kakeya_drafter_train_" + tag + "_" + std::to_string(::getpid()) + ".safetensors";
}

class TrainServe : public ::testing::TestWithParam<std::string> {};

// Block n of the training forward (context < anchor, itself only) gives the
// logits Drafter::draft gives after the cache was extended to the anchor.
TEST_P(TrainServe, BlockLogitsEqualDraftAfterExtend) {
  auto target = load_target(GetParam());
  auto drafter = Drafter::load(case_dir(GetParam()) + "/drafter", *target);
  auto ids = TensorStore::open_file(case_dir(GetParam()) + "/expected.safetensors").get("ids");  // [20]
  const int64_t B = drafter.config().block_size;
  auto tokens = ids.unsqueeze(0);                            // [1, S]
  auto A = at::tensor(std::vector<int64_t>{3, 9, 12, 14}, at::kLong).unsqueeze(0);  // [1, 4]
  auto lg = drafter.logits(block_hidden(*target, drafter, tokens, A));  // [1, 4, B-1, V]

  KVCacheOptions co;
  co.capacity = ids.size(0);
  KVCache cache(target->config(), co);
  TargetFeatureCapture cap(*target, drafter.config().target_layer_ids);
  ForwardOptions fo;
  fo.taps = &cap.taps();
  fo.skip_logits = true;
  target->forward(tokens, cache, fo);
  auto feats = cap.take();  // [1, S, n·H]
  for (int64_t n = 0; n < A.size(1); ++n) {
    const int64_t a = A[0][n].item<int64_t>();
    auto dc = drafter.make_cache(ids.size(0));
    drafter.extend(dc, feats.slice(1, 0, a));
    auto block = at::full({1, B}, drafter.config().mask_token_id, at::kLong);
    block[0][0] = ids[a];
    auto want = drafter.draft(dc, block)[0];  // [B-1, V]
    auto got = lg[0][n];
    double scale = want.abs().max().item<double>();
    EXPECT_LE((got - want).abs().max().item<double>(), 1e-4 * scale) << GetParam() << " anchor " << a;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, TrainServe, ::testing::Values("qwen3", "gemma3", "qwen3_causal"));

// Greedy continuations of the tiny Qwen3 target and a small fresh drafter.
struct Setup {
  std::unique_ptr<Model> target;
  Sequences seqs;
  DrafterConfig cfg;
};

Setup setup() {
  Setup s;
  s.target = load_target("qwen3");
  std::mt19937_64 rng(3);
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < 24; ++i) {
    std::vector<int64_t> p;
    for (int t = 0; t < 6; ++t) p.push_back((int64_t)(rng() % 100));
    prompts.push_back(p);
  }
  s.seqs = generate_continuations(*s.target, prompts, 26, 8, {}, "test");
  s.cfg = DrafterConfig::for_target(s.target->config(), 2, 4, 2, 16, 64, 4, 100);
  return s;
}

TrainOptions small_options(int64_t steps) {
  TrainOptions o;
  o.batch = 8;
  o.anchors = 6;
  o.steps = steps;
  o.warmup_steps = 10;
  o.lr = 3e-3;
  o.log_seconds = 1e9;         // progress only at the end
  o.checkpoint_seconds = 1e9;  // checkpoints only at exit
  return o;
}

TEST(DrafterTrain, LossFallsAndAcceptanceRises) {
  auto s = setup();
  DrafterOptions dopt;
  dopt.dtype = at::kFloat;
  auto drafter = Drafter::random(s.cfg, *s.target, 0, dopt);
  const std::string ckpt = temp_path("fall");
  DrafterTrainer t(*s.target, drafter, {s.seqs}, small_options(200), ckpt);
  auto before = t.evaluate(s.seqs, 3, 99);
  EXPECT_TRUE(t.run());
  auto after = t.evaluate(s.seqs, 3, 99);
  EXPECT_LT(after.loss, 0.6 * before.loss) << "before " << before.loss << " after " << after.loss;
  EXPECT_GT(after.accept_len, before.accept_len + 0.5) << "before " << before.accept_len << " after " << after.accept_len;
  EXPECT_EQ(t.state().step, 200);
  ::unlink(ckpt.c_str());
}

TEST(DrafterTrain, ResumedRunEqualsUninterruptedRun) {
  auto s = setup();
  DrafterOptions dopt;
  dopt.dtype = at::kFloat;
  const std::string ck1 = temp_path("straight"), ck2 = temp_path("resumed");
  auto straight = Drafter::random(s.cfg, *s.target, 5, dopt);
  DrafterTrainer a(*s.target, straight, {s.seqs}, small_options(12), ck1);
  EXPECT_TRUE(a.run());

  auto first = Drafter::random(s.cfg, *s.target, 5, dopt);
  auto o = small_options(12);
  o.max_steps_this_run = 5;
  {
    DrafterTrainer b1(*s.target, first, {s.seqs}, o, ck2);
    EXPECT_FALSE(b1.run());
    EXPECT_EQ(b1.state().step, 5);
  }
  auto second = Drafter::random(s.cfg, *s.target, 77, dopt);  // other weights: the checkpoint must restore them
  DrafterTrainer b2(*s.target, second, {s.seqs}, small_options(12), ck2);
  ASSERT_TRUE(b2.resume());
  EXPECT_EQ(b2.state().step, 5);
  EXPECT_TRUE(b2.run());
  auto pa = straight.named_parameters(), pb = second.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(at::allclose(pa[i].second, pb[i].second, 1e-5, 1e-6)) << pa[i].first;
  ::unlink(ck1.c_str());
  ::unlink(ck2.c_str());
}

TEST(DrafterTrain, CheckpointOfAnotherConfigIsRefused) {
  auto s = setup();
  DrafterOptions dopt;
  dopt.dtype = at::kFloat;
  const std::string ck = temp_path("other");
  auto d1 = Drafter::random(s.cfg, *s.target, 0, dopt);
  auto o = small_options(3);
  DrafterTrainer t1(*s.target, d1, {s.seqs}, o, ck);
  t1.run();
  auto other = DrafterConfig::for_target(s.target->config(), 2, 4, 2, 16, 96, 4, 100);  // wider MLP
  auto d2 = Drafter::random(other, *s.target, 0, dopt);
  DrafterTrainer t2(*s.target, d2, {s.seqs}, o, ck);
  EXPECT_THROW(t2.resume(), Error);
  ::unlink(ck.c_str());
}

}  // namespace

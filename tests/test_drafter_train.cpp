// The drafter trainer on the tiny fixture targets (tests/fixtures/make_drafter_fixtures.py):
// the training forward equals what the drafter computes when decoding (no
// train/serve skew), the loss falls and the acceptance length rises on a
// target's own greedy continuations, a resumed run equals an uninterrupted one, and
// freeze_context leaves the context path (fc, hidden_norm, k_proj, v_proj) bitwise as it was.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <unistd.h>

#include <cstdlib>
#include <random>
#include <set>

#include "core/model/drafter.h"
#include "core/error.h"
#include "core/io/fs.h"
#include "core/model/model.h"
#include "tests/drafter_test_util.h"
#include "tests/test_util.h"
#include "tests/train_test_util.h"
#include "train/drafter_data.h"
#include "train/drafter_train.h"

using namespace kakeya;
using namespace kakeya::train;

namespace {

std::string temp_path(const std::string& tag) {
  return fs::temp_dir() + "/kakeya_drafter_train_" + tag + "_" + std::to_string(::getpid()) + ".safetensors";
}

class TrainServe : public ::testing::TestWithParam<std::string> {};

// Block n of the training forward (context < anchor, itself only) gives the
// logits Drafter::draft gives after the cache was extended to the anchor.
TEST_P(TrainServe, BlockLogitsEqualDraftAfterExtend) {
  auto target = test::load_drafter_target(GetParam());
  auto drafter = Drafter::load(test::drafter_case_dir(GetParam()) + "/drafter", *target);
  auto ids = TensorStore::open_file(test::drafter_case_dir(GetParam()) + "/expected.safetensors").get("ids");  // [20]
  const int64_t B = drafter.config().block_size;
  auto tokens = ids.unsqueeze(0);                            // [1, S]
  auto A = at::tensor(std::vector<int64_t>{3, 9, 12, 14}, at::kLong).unsqueeze(0);  // [1, 4]
  auto lg = drafter.logits(block_hidden(*target, drafter, tokens, A));  // [1, 4, B-1, V]

  auto feats = test::target_features(*target, drafter, tokens);  // [1, S, n·H]
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

TEST(DrafterTrain, LossFallsAndAcceptanceRises) {
  auto s = test::drafter_fixture();
  auto drafter = test::random_drafter(s, 0);
  const std::string ckpt = temp_path("fall");
  DrafterTrainer t(*s.target, drafter, {s.seqs}, test::drafter_small_options(200), ckpt);
  auto before = t.evaluate(s.seqs, 3, 99);
  EXPECT_TRUE(t.run());
  auto after = t.evaluate(s.seqs, 3, 99);
  EXPECT_LT(after.loss, 0.6 * before.loss) << "before " << before.loss << " after " << after.loss;
  EXPECT_GT(after.accept_len, before.accept_len + 0.5) << "before " << before.accept_len << " after " << after.accept_len;
  EXPECT_EQ(t.state().step, 200);
  ::unlink(ckpt.c_str());
}

TEST(DrafterTrain, ResumedRunEqualsUninterruptedRun) {
  auto s = test::drafter_fixture();
  const std::string ck1 = temp_path("straight"), ck2 = temp_path("resumed");
  auto straight = test::random_drafter(s, 5);
  DrafterTrainer a(*s.target, straight, {s.seqs}, test::drafter_small_options(12), ck1);
  EXPECT_TRUE(a.run());

  auto first = test::random_drafter(s, 5);
  auto o = test::drafter_small_options(12);
  o.max_steps_this_run = 5;
  {
    DrafterTrainer b1(*s.target, first, {s.seqs}, o, ck2);
    EXPECT_FALSE(b1.run());
    EXPECT_EQ(b1.state().step, 5);
  }
  auto second = test::random_drafter(s, 77);  // other weights: the checkpoint must restore them
  DrafterTrainer b2(*s.target, second, {s.seqs}, test::drafter_small_options(12), ck2);
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
  auto s = test::drafter_fixture();
  DrafterOptions dopt;
  dopt.dtype = at::kFloat;
  const std::string ck = temp_path("other");
  auto d1 = test::random_drafter(s, 0);
  auto o = test::drafter_small_options(3);
  DrafterTrainer t1(*s.target, d1, {s.seqs}, o, ck);
  t1.run();
  auto other = DrafterConfig::for_target(s.target->config(), 2, 4, 2, 16, 96, 4, 100);  // wider MLP
  auto d2 = Drafter::random(other, *s.target, 0, dopt);
  DrafterTrainer t2(*s.target, d2, {s.seqs}, o, ck);
  EXPECT_THROW(t2.resume(), Error);
  ::unlink(ck.c_str());
}

// The raw context K/V f_θ reads (Tap::KProj/VProj of context_kv) plus context_kv's V, cloned.
std::vector<at::Tensor> raw_context_kv(const Drafter& drafter, const at::Tensor& feats) {
  at::NoGradGuard no_grad;
  struct Rec : TapSubscriber {
    std::vector<at::Tensor> got;
    void on_tap(Tap t, const TapContext&, at::Tensor& x) override {
      if (t == Tap::KProj || t == Tap::VProj) got.push_back(x.clone());  // [1, T, H_kv, D]
    }
  } rec;
  Taps taps;
  taps.subscribe(&rec);
  auto kv = drafter.context_kv(drafter.project_context(feats), at::arange(feats.size(1), at::kLong), &taps);
  for (auto& [k, v] : kv) rec.got.push_back(v.clone());  // [1, H_kv, T, D]: raw V as attention reads it
  return rec.got;
}

std::vector<std::pair<std::string, at::Tensor>> snapshot(const Drafter& d) {
  auto p = d.named_parameters();
  for (auto& [n, t] : p) t = t.detach().clone();
  return p;
}

// Fine-tuning with freeze_context: fc, hidden_norm and every k_proj/v_proj keep their
// bits (k/v are rows of the qkv tensor whose q rows do train), every other tensor
// trains, and the raw context K/V of real features are bitwise what they were.
TEST(DrafterTrain, FreezeContextKeepsContextKVBitwise) {
  auto s = test::drafter_fixture();
  auto drafter = test::random_drafter(s, 11);
  auto feats = test::target_features(*s.target, drafter, s.seqs.tokens.slice(0, 0, 1));  // [1, S, n·H]
  const auto before = snapshot(drafter);
  const auto kv_before = raw_context_kv(drafter, feats);

  const std::string ck = temp_path("freeze");
  auto o = test::drafter_small_options(8);
  o.freeze_context = true;
  DrafterTrainer t(*s.target, drafter, {s.seqs}, o, ck);
  EXPECT_TRUE(t.run());

  std::set<std::string> frozen{"fc.weight", "hidden_norm.weight"};
  for (int l = 0; l < s.cfg.num_layers; ++l)
    for (const char* w : {"k_proj", "v_proj"})
      frozen.insert("layers." + std::to_string(l) + ".self_attn." + w + ".weight");
  const auto after = drafter.named_parameters();
  ASSERT_EQ(after.size(), before.size());
  int64_t n_frozen = 0, n_changed = 0;
  for (size_t i = 0; i < after.size(); ++i) {
    const auto& [name, w] = after[i];
    EXPECT_EQ(is_context_parameter(name), frozen.count(name) == 1) << name;
    if (frozen.count(name)) {
      EXPECT_TRUE(at::equal(w, before[i].second)) << name << " changed under freeze_context";
      EXPECT_FALSE(w.requires_grad()) << name;
      n_frozen += w.numel();
    } else {
      n_changed += !at::equal(w, before[i].second);
      EXPECT_FALSE(at::equal(w, before[i].second)) << name << " did not train";
    }
  }
  EXPECT_GT(n_changed, 0);
  EXPECT_EQ(t.frozen_parameters(), n_frozen);
  EXPECT_EQ(t.trainable_parameters() + n_frozen, drafter.num_parameters());

  const auto kv_after = raw_context_kv(drafter, feats);
  ASSERT_EQ(kv_after.size(), kv_before.size());
  ASSERT_EQ(kv_after.size(), (size_t)(3 * s.cfg.num_layers));
  for (size_t i = 0; i < kv_after.size(); ++i) EXPECT_TRUE(at::equal(kv_after[i], kv_before[i])) << "context K/V " << i;
  ::unlink(ck.c_str());
}

// A checkpoint records freeze_context; resuming with the other setting, or with
// another init drafter under it, is refused naming the file.
TEST(DrafterTrain, FreezeContextMustMatchOnResume) {
  auto s = test::drafter_fixture();
  const std::string ck_frozen = temp_path("frozen"), ck_free = temp_path("free");
  auto o = test::drafter_small_options(6);
  o.max_steps_this_run = 3;
  auto of = o;
  of.freeze_context = true;
  {
    auto d = test::random_drafter(s, 2);
    DrafterTrainer t(*s.target, d, {s.seqs}, of, ck_frozen);
    EXPECT_FALSE(t.run());
  }
  {
    auto d = test::random_drafter(s, 2);
    DrafterTrainer t(*s.target, d, {s.seqs}, o, ck_free);
    EXPECT_FALSE(t.run());
  }
  {
    auto d = test::random_drafter(s, 2);
    DrafterTrainer t(*s.target, d, {s.seqs}, o, ck_frozen);
    test::expect_error([&] { t.resume(); }, ck_frozen + ": the checkpoint was written with freeze_context=true, "
                                            "this run has freeze_context=false");
  }
  {
    auto d = test::random_drafter(s, 2);
    DrafterTrainer t(*s.target, d, {s.seqs}, of, ck_free);
    test::expect_error([&] { t.resume(); }, ck_free + ": the checkpoint was written with freeze_context=false, "
                                          "this run has freeze_context=true");
  }
  {
    auto d = test::random_drafter(s, 3);  // another init: other frozen weights
    DrafterTrainer t(*s.target, d, {s.seqs}, of, ck_frozen);
    test::expect_error([&] { t.resume(); }, ck_frozen + ": frozen tensor 'fc.weight' differs");
  }
  {
    auto d = test::random_drafter(s, 2);  // same init, same flag: resumes and finishes
    const auto init = snapshot(d);
    DrafterTrainer t(*s.target, d, {s.seqs}, of, ck_frozen);
    ASSERT_TRUE(t.resume());
    EXPECT_EQ(t.state().step, 3);
    EXPECT_TRUE(t.run());
    const auto after = d.named_parameters();
    for (size_t i = 0; i < after.size(); ++i)
      if (is_context_parameter(after[i].first)) EXPECT_TRUE(at::equal(after[i].second, init[i].second)) << after[i].first;
  }
  ::unlink(ck_frozen.c_str());
  ::unlink(ck_free.c_str());
}

}  // namespace

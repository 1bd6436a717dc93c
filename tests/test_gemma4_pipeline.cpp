// The restored and fused decoders on a Gemma 4 mixture-of-experts verifier (random weights of
// small shape, tests/gemma4_test_util.h) with a random DFlash drafter and f_θ: exact restoration
// (a = 1) and the fused decoder give AR's tokens, a random f_θ changes them (restoration acts)
// and the fused decoder follows the restored one,
// the z-lab drafter layout of gemma-4-26B-A4B fits the 26B-A4B shape, and a drafter made for
// another target is refused.
#include <gtest/gtest.h>

#include "core/io/fs.h"
#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/model/random_weights.h"
#include "infer/decoder.h"
#include "infer/generate.h"
#include "tests/gemma4_test_util.h"
#include "tests/test_util.h"
#include "tests/train_test_util.h"
#include "train/ftheta_online.h"
#include "train/ftheta_train.h"

using namespace kakeya;

namespace {

constexpr int64_t kMask = 3;  // the drafter's mask token: any id of the vocabulary

const Model& model() {
  static Model m = [] {
    ModelOptions mo;
    mo.max_positions = 256;
    return Model::random(test::small_gemma4_moe(), 21, mo);
  }();
  return m;
}

const Drafter& drafter() {
  static Drafter d =
      Drafter::random(DrafterConfig::for_target(model().config(), 2, 4, 1, 64, 128, 8, kMask), model(), 5);
  return d;
}

std::vector<int64_t> prompt() { return test::small_gemma4_prompt(); }

DecodeOptions options(DecodeMode mode, double alpha) {
  DecodeOptions o;
  o.mode = mode;
  o.max_new_tokens = 16;
  o.stream = false;
  o.restore.sink = 4;
  o.restore.window = 8;
  o.restore.mix_alpha = alpha;
  return o;
}

std::vector<int64_t> ar_tokens() {
  DecodeOptions o;
  o.max_new_tokens = 16;
  o.stream = false;
  return generate(model(), prompt(), o).tokens;
}

TEST(Gemma4Pipeline, ExactRestorationAndFusedEqualAr) {
  const auto ar = ar_tokens();
  ASSERT_EQ(ar.size(), 16u);
  const FTheta f = FTheta::random(FThetaConfig::for_pair(model().config(), drafter().config(), 16), 8, at::kFloat,
                                  at::kCPU);
  auto r = decode(model(), &drafter(), &f, prompt(), options(DecodeMode::Restored, 1.0));
  EXPECT_EQ(r.tokens, ar);
  EXPECT_GT(r.restored_positions, 40);
  auto fu = decode(model(), &drafter(), &f, prompt(), options(DecodeMode::Fused, 1.0));
  EXPECT_EQ(fu.tokens, ar);
  // Restoration acts: 30% of a random f_θ's K/V moves the continuation, and the fused decoder
  // restores the same K/V (its verify blocks and the restored decoder's steps give the same
  // tokens). With mostly random K/V (a <= 0.5) this random model's logits have near-ties that
  // the two decoders' different product shapes can split (f32 rounding), so a = 0.7 is compared.
  auto mixed = decode(model(), &drafter(), &f, prompt(), options(DecodeMode::Restored, 0.7));
  EXPECT_NE(mixed.tokens, ar);
  EXPECT_EQ(decode(model(), &drafter(), &f, prompt(), options(DecodeMode::Fused, 0.7)).tokens, mixed.tokens);
}

// f_θ training data made on the Gemma 4 MoE (the verifier's raw q/k/v and attention outputs of
// every layer, the drafter's raw context K/V: what capture stores), and training on it: the
// held-out loss falls (optimisation on this shape, not generalisation: two sequences).
TEST(Gemma4Pipeline, FThetaTrainsOnItsCapturedSequences) {
  const auto fc = FThetaConfig::for_pair(model().config(), drafter().config(), 8);
  std::vector<train::FThetaSequence> seqs;
  for (int64_t s = 0; s < 2; ++s) {
    std::vector<int64_t> t;
    for (int64_t i = 0; i < 40; ++i) t.push_back((i * (29 + 6 * s) + 7 * s + 1) % 512);
    seqs.push_back(train::online_sequence(model(), drafter(), fc, t));
    ASSERT_EQ((int64_t)seqs.back().k.size(), model().config().num_layers);
    // K=V full layers: their captured V is the raw K projection, as the model computes it.
    EXPECT_TRUE(at::equal(seqs.back().k[2], seqs.back().v[2]));
  }
  FTheta f = FTheta::random(fc, 1, at::kFloat, at::kCPU);
  train::FThetaTrainOptions o = test::ftheta_small_options();
  o.steps = 40;
  o.lr = 2e-2;
  o.eval_every = 0;
  o.log_seconds = 1e9;
  o.loss.layout = {2, 6};
  const std::string dir = fs::temp_dir() + "/kakeya_test_gemma4_ftheta";
  fs::make_dirs(dir);
  train::FThetaTrainer tr(model(), f, seqs, {seqs[0]}, o, dir + "/ck.safetensors");
  tr.run();
  const auto r = tr.report();
  EXPECT_GT(r["reduction_factor"].get<double>(), 1.5) << r["heldout_loss_initial"] << " -> " << r["heldout_loss_final"];
  EXPECT_TRUE(r["final"]["by_layer_type"].contains("full_attention"));
}

TEST(Gemma4Pipeline, ZLabDrafterLayoutOf26BA4B) {
  // The 26B-A4B's shape (30 layers, hidden 2816) and z-lab's drafter for it: block 16, reading
  // target layers 1/6/11/17/22/27 (what DFlash derives for 30 target layers and 6 features).
  const auto big = ModelConfig::from_file(test::env_or_fail("KAKEYA_SOURCE_DIR") + "/bench/configs/gemma-4-26b-a4b.json");
  EXPECT_EQ(dflash_target_layer_ids(30, 6), (std::vector<int64_t>{1, 6, 11, 17, 22, 27}));
  nlohmann::json j = {{"architectures", {"DFlashDraftModel"}}, {"model_type", "qwen3"}, {"hidden_size", 2816},
                      {"intermediate_size", 8192}, {"num_hidden_layers", 6}, {"num_attention_heads", 32},
                      {"num_key_value_heads", 8}, {"head_dim", 128}, {"rms_norm_eps", 1e-6},
                      {"vocab_size", 262144}, {"max_position_embeddings", 262144}, {"rope_theta", 1000000.0},
                      {"block_size", 16}, {"num_target_layers", 30},
                      {"dflash_config", {{"target_layer_ids", {1, 6, 11, 17, 22, 27}}, {"mask_token_id", 4}}}};
  auto cfg = DrafterConfig::from_json(j, "z-lab gemma-4-26B-A4B drafter");
  EXPECT_NO_THROW(cfg.check_target(big));
  EXPECT_EQ(cfg.block_size, 16);
  EXPECT_EQ(cfg.target_layer_ids, (std::vector<int64_t>{1, 6, 11, 17, 22, 27}));
  // The same drafter against the small Gemma 4: refused, naming the field.
  test::expect_error([&] { cfg.check_target(model().config()); }, "hidden_size");
}

TEST(Gemma4Pipeline, DrafterOfAnotherTargetIsRefused) {
  ModelOptions mo;
  mo.max_positions = 256;
  Model other = Model::random(test::small_gemma4_moe(), 22, mo);
  Drafter foreign = Drafter::random(drafter().config(), other, 5);
  const FTheta f = FTheta::random(FThetaConfig::for_pair(model().config(), drafter().config(), 16), 7, at::kFloat,
                                  at::kCPU);
  test::expect_error([&] { decode(model(), &foreign, &f, prompt(), options(DecodeMode::Restored, 1.0)); },
                     "bound to another verifier");
}

}  // namespace

// Speculative decoding on the real default model (Gemma 3 270M, CPU f32) is
// token-identical to greedy AR with any drafter: a random one (almost every
// draft rejected) and an oracle that proposes AR's own tokens with mistakes
// (long acceptances, truncation of the sliding rings inside a block).
#include <ATen/ATen.h>

#include <cmath>

#include "core/model/drafter.h"
#include "core/model/model.h"
#include "core/io/tokenizer.h"
#include "infer/generate.h"
#include "infer/speculative.h"
#include "tests/test_util.h"

using namespace kakeya;

namespace {

const Model& model() { return test::real_model(); }

std::vector<int64_t> prompt() {
  return test::real_prompt("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n");
}

const Drafter& random_drafter() {
  static Drafter d = [] {
    // Small (2 layers) so the CPU test stays quick; the geometry train-drafter uses is irrelevant here.
    auto cfg = DrafterConfig::for_target(model().config(), 2, 4, 2, 64, 512, 16,
                                         test::real_tokenizer().token_id("<mask>"));
    return Drafter::random(cfg, model(), 7);
  }();
  return d;
}

const std::vector<int64_t>& ar_tokens() {
  static std::vector<int64_t> t = [] {
    DecodeOptions go;
    go.max_new_tokens = 32;
    go.stop_ids = model().config().eos_token_ids;
    return generate(model(), prompt(), go).tokens;
  }();
  return t;
}

TEST(DrafterRealModel, ConfigForGemmaTarget) {
  const auto& c = random_drafter().config();
  EXPECT_EQ(c.mask_token_id, 4);  // Gemma's <mask>
  EXPECT_DOUBLE_EQ(c.input_embedding_scale, std::sqrt(640.0));
  EXPECT_EQ(c.target_layer_ids, std::vector<int64_t>({1, 15}));
  EXPECT_EQ(c.hidden_size, 640);
  EXPECT_EQ(c.block_size, 16);
}

TEST(DrafterRealModel, RandomDrafterIsLossless) {
  DecodeOptions so;
  so.max_new_tokens = 32;
  so.stop_ids = model().config().eos_token_ids;
  auto r = speculative_generate(model(), random_drafter(), prompt(), so);
  EXPECT_EQ(r.tokens, ar_tokens());
  EXPECT_GE(r.tau(), 1.0);
}

TEST(DrafterRealModel, OracleDraftsAreAcceptedAndLossless) {
  const auto& ar = ar_tokens();
  const int64_t n_prompt = prompt().size();
  int64_t blocks = 0;
  DecodeOptions so;
  so.max_new_tokens = 32;
  so.stop_ids = model().config().eos_token_ids;
  SpeculativeHooks hooks;
  hooks.edit_draft = [&](int64_t start, at::Tensor& drafts) {
    const int64_t g = start - n_prompt + 1;
    const int64_t wrong = blocks++ % 2 ? 9 : 100;  // every other block all right, else a mistake at draft 9
    for (int64_t i = 0; i < drafts.size(0); ++i)
      if (g + i < (int64_t)ar.size()) drafts[i] = i == wrong ? (ar[g + i] + 1) % 262144 : ar[g + i];
  };
  auto r = speculative_generate(model(), random_drafter(), prompt(), so, hooks);
  EXPECT_EQ(r.tokens, ar);
  EXPECT_GE(r.tau(), 8.0) << "oracle proposals should be accepted";
}

// The shipped drafter (checkpoints/gemma3-270m/drafter, trained on the H100) loads in f32 on the CPU,
// stays lossless and is worth running: most of its drafts are accepted on held-in-style code.
TEST(DrafterRealModel, ShippedDrafterIsLosslessAndAccepted) {
  auto d = Drafter::load(test::shipped_dir("drafter"), model());
  EXPECT_EQ(d.config().block_size, 16);
  DecodeOptions so;
  so.max_new_tokens = 32;
  so.stop_ids = model().config().eos_token_ids;
  auto r = speculative_generate(model(), d, prompt(), so);
  EXPECT_EQ(r.tokens, ar_tokens());
  EXPECT_GE(r.tau(), 2.5) << "held-out tau was 4.0 on code at training time";
}

}  // namespace

// The restored-verifier decoder on the real default model (Gemma 3 270M, CPU
// f32), with a tiny exact window (sink 4 + window 8) and prompts longer than
// that, so positions really leave the window on every sliding layer:
//   - exact restoration (a = 1: restored K/V = the verifier's own) is
//     token-identical to plain AR, in both restored modes;
//   - incremental `restored` equals the `restored-reforward` reference token for
//     token with a seeded random drafter and f_θ (a = 0, a mix, full-attention
//     layers restored too, other prefill chunkings);
//   - every query sees each position of its span exactly once;
//   - bad input fails with a clear error.
#include <ATen/ATen.h>

#include <string>

#include "core/drafter.h"
#include "core/error.h"
#include "core/ftheta.h"
#include "core/model.h"
#include "core/tokenizer.h"
#include "infer/generate.h"
#include "infer/restored.h"
#include "tests/test_util.h"

using namespace kakeya;

namespace {

const Model& model() {
  static Model m = [] {
    ModelOptions mo;
    mo.max_positions = 256;
    return Model::load(test::real_model_dir(), mo);
  }();
  return m;
}

const Tokenizer& tokenizer() {
  static Tokenizer t = Tokenizer::from_file(test::real_model_dir() + "/tokenizer.json");
  return t;
}

std::vector<int64_t> encode(const std::string& s) {
  auto ids = tokenizer().encode(s);
  return std::vector<int64_t>(ids.begin(), ids.end());
}

// ~40 tokens: several times sink + window.
const std::vector<int64_t>& prompt() {
  static std::vector<int64_t> p = encode(
      "The lighthouse keeper wrote in his logbook every evening: the weather, the ships, the oil burned "
      "and the repairs. On the last page he wrote");
  return p;
}

DrafterConfig drafter_config() {
  auto cfg = DrafterConfig::for_target(model().config(), 2, 4, 1, 64, 256, 16, tokenizer().token_id("<mask>"));
  return cfg;
}

const Drafter& drafter() {
  static Drafter d = Drafter::random(drafter_config(), model(), 11);
  return d;
}

const FTheta& ftheta() {
  static FTheta f = FTheta::random(FThetaConfig::for_pair(model().config(), drafter().config(), 32), 5, at::kFloat,
                                   at::kCPU);
  return f;
}

DecodeOptions options(DecodeMode mode, double alpha, int64_t max_new = 16) {
  DecodeOptions o;
  o.mode = mode;
  o.max_new_tokens = max_new;
  o.restore.sink = 4;
  o.restore.window = 8;
  o.restore.mix_alpha = alpha;
  return o;
}

const std::vector<int64_t>& ar_tokens() {
  static std::vector<int64_t> t = [] {
    GenerateOptions go;
    go.max_new_tokens = 12;
    return generate(model(), prompt(), go).tokens;
  }();
  return t;
}

TEST(Restored, PromptIsLongerThanTheExactWindow) { EXPECT_GT(prompt().size(), 2u * 12u); }

TEST(Restored, ExactRestorationIncrementalEqualsAr) {
  auto r = decode(model(), nullptr, nullptr, prompt(), options(DecodeMode::Restored, 1.0, 12));
  EXPECT_EQ(r.tokens, ar_tokens());
  EXPECT_GT(r.restored_positions, 20);
  EXPECT_DOUBLE_EQ(r.attention_fraction_sliding, 1.0);
  EXPECT_DOUBLE_EQ(r.attention_fraction_full, 1.0);
}

TEST(Restored, ExactRestorationIncrementalWithFullAttentionRestoredEqualsAr) {
  auto o = options(DecodeMode::Restored, 1.0, 12);
  o.restore.full_attn = FullAttn::Restored;
  o.restore.chunk = 5;
  auto r = decode(model(), nullptr, nullptr, prompt(), o);
  EXPECT_EQ(r.tokens, ar_tokens());
  EXPECT_DOUBLE_EQ(r.attention_fraction_full, 1.0);
}

TEST(Restored, ExactRestorationReforwardEqualsAr) {
  auto r = decode(model(), nullptr, nullptr, prompt(), options(DecodeMode::RestoredReforward, 1.0, 3));
  EXPECT_EQ(r.tokens, std::vector<int64_t>(ar_tokens().begin(), ar_tokens().begin() + 3));
}

TEST(Restored, IncrementalEqualsReforwardWithRandomFTheta) {
  auto inc = decode(model(), &drafter(), &ftheta(), prompt(), options(DecodeMode::Restored, 0.0, 5));
  auto ref = decode(model(), &drafter(), &ftheta(), prompt(), options(DecodeMode::RestoredReforward, 0.0, 5));
  EXPECT_EQ(inc.tokens, ref.tokens);
  EXPECT_DOUBLE_EQ(inc.attention_fraction_sliding, 1.0);
  // Restoration really acts: a random f_θ changes the continuation.
  EXPECT_NE(inc.tokens, std::vector<int64_t>(ar_tokens().begin(), ar_tokens().begin() + 5));
}

TEST(Restored, IncrementalEqualsReforwardMixedAndFullRestored) {
  auto o = options(DecodeMode::Restored, 0.5, 3);
  o.restore.full_attn = FullAttn::Restored;
  o.restore.sink = 2;
  auto inc = decode(model(), &drafter(), &ftheta(), prompt(), o);
  o.mode = DecodeMode::RestoredReforward;
  o.restore.chunk = 5;  // another chunking of the same semantics
  auto ref = decode(model(), &drafter(), &ftheta(), prompt(), o);
  EXPECT_EQ(inc.tokens, ref.tokens);
}

TEST(Restored, ScoreThroughRestoredCache) {
  RestoreOptions ro;
  ro.sink = 4;
  ro.window = 8;
  ro.mix_alpha = 1.0;
  auto exact = score_restored(model(), nullptr, nullptr, prompt(), ro);
  ScoreOptions so;
  auto ar = score(model(), prompt(), so);
  ASSERT_EQ(exact.logprobs.size(), ar.logprobs.size());
  EXPECT_NEAR(exact.mean_nll(), ar.mean_nll(), 1e-4);
  ro.mix_alpha = 0.0;
  ro.stats = true;
  RestoreStats st;
  auto approx = score_restored(model(), &drafter(), &ftheta(), prompt(), ro, &st);
  EXPECT_GT(approx.mean_nll(), ar.mean_nll());
  EXPECT_GT(st.positions, 10);
  EXPECT_GT(st.rel(false, false, false), 0.5);  // random f_θ: far from the true raw K
  EXPECT_GT(st.rel(false, false, true), 0.5);
  EXPECT_EQ(st.rel(true, false, false), 0.0);   // full-attention layers exact: nothing restored there
}

TEST(Restored, MixAlphaOneHasZeroErrorAndKeepsTrueKv) {
  auto o = options(DecodeMode::Restored, 1.0, 4);
  o.restore.stats = true;
  auto r = decode(model(), &drafter(), &ftheta(), prompt(), o);
  EXPECT_EQ(r.stats.rel(false, false, false), 0.0);
  bool listed = false;
  for (const auto& l : r.memory.kv) listed |= l.name.find("true raw") != std::string::npos && l.bytes > 0;
  EXPECT_TRUE(listed) << r.memory.table();
}

TEST(Restored, MemoryReportHasBaselines) {
  auto r = decode(model(), &drafter(), &ftheta(), prompt(), options(DecodeMode::Restored, 0.0, 4));
  const int64_t n = prompt().size() + 4;
  EXPECT_EQ(r.memory.positions, n);
  EXPECT_EQ(r.memory.full_kv_bytes, 18 * 2 * 256 * n * 4);
  EXPECT_EQ(r.memory.native_kv_bytes, 18 * 2 * 256 * n * 4);  // n < 512: the native cache keeps everything
  // Sliding exact ring: window + chunk - 1 = 15 slots; restored region min(n, 512 - 8 + 7) = n slots.
  EXPECT_EQ(r.memory.kv[0].bytes, 15 * 2 * 256 * 15 * 4);
  EXPECT_EQ(r.memory.kv[1].bytes, 15 * 2 * 256 * n * 4);
  EXPECT_NE(r.memory.table().find("baseline: full KV"), std::string::npos);
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Restored, BadInput) {
  auto o = options(DecodeMode::Restored, 0.0, 4);
  o.restore.window = 510;
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "sliding window (512)");
  o.restore.window = 100;
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "larger than the context");
  o.restore.window = 8;
  o.max_new_tokens = 40000;
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "model's limit of 32768");
  o.max_new_tokens = 250;
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "RoPE table");
  o.max_new_tokens = 4;
  expect_error([&] { decode(model(), nullptr, nullptr, prompt(), o); }, "needs a drafter");
  // An f_θ made for another drafter geometry.
  auto other = DrafterConfig::for_target(model().config(), 3, 4, 1, 64, 256, 16, tokenizer().token_id("<mask>"));
  auto wrong = FTheta::random(FThetaConfig::for_pair(model().config(), other, 16), 1, at::kFloat, at::kCPU);
  expect_error([&] { decode(model(), &drafter(), &wrong, prompt(), o); }, "f_theta");
  o.restore.chunk = 9;
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "--chunk");
  o.restore.chunk = 0;
  o.restore.mix_alpha = 1.5;
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "--mix-alpha");
}

}  // namespace

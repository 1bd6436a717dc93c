// Continuous batching (infer/batch.h) against the one-sequence decoders it must equal: a small
// random Gemma 4 MoE (sliding window 16, so rows wrap their rings at different steps; K=V full
// layers, GQA, softcap, experts) in f32 on the CPU. Sequences join while others decode (into the
// first free row), leave from the middle, and each one's greedy tokens must be exactly those of
// its one-sequence decoder on its prompt alone: generate() for ar rows, the restored decoder for
// restored rows (a random drafter and f_θ at --mix-alpha 0, so every restored position is f_θ's:
// each row's restoration batches, on its own schedule, and its features from the shared ring).
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "core/model/model.h"
#include "tests/batch_test_util.h"
#include "tests/gemma4_test_util.h"
#include "infer/batch.h"
#include "infer/decoder.h"
#include "infer/generate.h"
#include "test_util.h"

using namespace kakeya;
using kakeya::test::expect_error;

namespace {

const Model& model() {
  static Model m = test::small_gemma4_moe_model(3);
  return m;
}

std::vector<int64_t> prompt(int64_t n, int64_t salt) {
  std::vector<int64_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back((i * 31 + salt * 17 + 5) % 512);
  return p;
}

constexpr int64_t kMask = 3;  // the drafter's mask token: any id of the vocabulary

const Drafter& drafter() {
  static Drafter d =
      Drafter::random(DrafterConfig::for_target(model().config(), 2, 4, 1, 64, 128, 8, kMask), model(), 5);
  return d;
}

DecodeOptions options(DecodeMode mode) {
  DecodeOptions o;
  o.mode = mode;
  o.stream = false;
  o.restore.sink = 4;
  o.restore.window = 8;
  return o;
}

// (prompt length, new tokens): short and long prompts against the window of 16 (and the exact
// window of 8: restored rows restore from their prefill on, or only once they decode past it).
const std::vector<std::pair<int64_t, int64_t>> kSpec = {{5, 30}, {23, 9}, {40, 21}, {70, 14}, {12, 25}, {3, 1}};

// Every sequence of kSpec through `bd` against `alone` of each: equal tokens, rows shared.
void expect_batch_equals_alone(BatchDecoder& bd,
                               const std::function<std::vector<int64_t>(const std::vector<int64_t>&, int64_t)>& alone) {
  std::vector<std::vector<int64_t>> prompts;
  std::vector<int64_t> budget;
  for (size_t i = 0; i < kSpec.size(); ++i) {
    prompts.push_back(prompt(kSpec[i].first, (int64_t)i));
    budget.push_back(kSpec[i].second);
  }
  const test::BatchRun r = test::run_batch(bd, prompts, budget);
  EXPECT_EQ(r.most, bd.max_rows()) << "the batch never filled its rows";
  for (size_t i = 0; i < kSpec.size(); ++i)
    EXPECT_EQ(r.tokens[i], alone(prompts[i], budget[i])) << "sequence " << i << " (prompt " << kSpec[i].first << ")";
  EXPECT_LT(r.steps, 30 + 9 + 21 + 14 + 25) << "no step served several sequences";
}

}  // namespace

TEST(BatchDecoder, JoinsAndLeavesBetweenStepsAndEqualsEachSequenceAlone) {
  BatchDecoder bd(model(), nullptr, nullptr, options(DecodeMode::Ar), 3, 128);
  expect_batch_equals_alone(bd, [](const std::vector<int64_t>& p, int64_t n) {
    DecodeOptions o;
    o.max_new_tokens = n;
    return generate(model(), p, o).tokens;
  });
}

// Restored rows: f_θ on the drafter's raw K/V (projected from the stored features at restoration
// time) with dense restored regions, then f_θ on the target features with int4-coded regions;
// evict-only. Each equals the restored decoder alone.
TEST(BatchDecoder, RestoredRowsEqualTheRestoredDecoderAlone) {
  struct Case {
    FThetaInput input;
    std::string region, layers;
  };
  for (const Case& c : {Case{FThetaInput::DrafterKV, "none", "auto"}, Case{FThetaInput::TargetFeatures, "int4", "auto"},
                        Case{FThetaInput::DrafterKV, "none", "none"}}) {
    SCOPED_TRACE(std::string(ftheta_input_name(c.input)) + " region " + c.region + " layers " + c.layers);
    const FTheta f =
        FTheta::random(FThetaConfig::for_pair(model().config(), drafter().config(), 16, c.input), 8, at::kFloat, at::kCPU);
    DecodeOptions o = options(DecodeMode::Restored);
    o.restore.region_code = ops::parse_row_code(c.region, "--restored-code");
    o.restore.layers = c.layers;
    BatchDecoder bd(model(), &drafter(), &f, o, 3, 128);
    EXPECT_TRUE(bd.restores());
    expect_batch_equals_alone(bd, [&](const std::vector<int64_t>& p, int64_t n) {
      DecodeOptions one = o;
      one.max_new_tokens = n;
      return make_decoder(model(), &drafter(), &f, one, 128)->run(p, one).tokens;
    });
  }
}

TEST(BatchDecoder, BadUse) {
  BatchDecoder bd(model(), nullptr, nullptr, options(DecodeMode::Ar), 2, 32);
  expect_error([&] { bd.join(prompt(30, 1), {}, 3); }, "exceed the 32 positions");
  expect_error([&] { bd.join({}, {}, 3); }, "empty prompt");
  expect_error([&] { bd.join(prompt(4, 1), {}, 0); }, "max_new_tokens");
  const int64_t a = bd.join(prompt(4, 1), {}, 2).first;
  bd.join(prompt(6, 2), {}, 5);
  expect_error([&] { bd.join(prompt(4, 3), {}, 2); }, "all 2 rows are taken");
  bd.step();  // a's second token: its budget is spent
  expect_error([&] { bd.step(); }, "must leave");
  bd.leave(a);
  expect_error([&] { bd.leave(a); }, "no sequence");
  EXPECT_EQ(bd.size(), 1);
  EXPECT_EQ(bd.step().size(), 1u);
  expect_error([] { BatchDecoder(model(), nullptr, nullptr, options(DecodeMode::Ar), 0, 32); }, "--batch expected >= 1");
  expect_error([] { BatchDecoder(model(), nullptr, nullptr, options(DecodeMode::Fused), 2, 32); },
               "--mode fused does not batch");
  DecodeOptions mixed = options(DecodeMode::Restored);
  mixed.restore.mix_alpha = 0.5;
  const FTheta f = FTheta::random(FThetaConfig::for_pair(model().config(), drafter().config(), 16), 8, at::kFloat, at::kCPU);
  expect_error([&] { BatchDecoder(model(), &drafter(), &f, mixed, 2, 32); }, "--mix-alpha 0 without --stats");
  expect_error([&] { BatchDecoder(model(), nullptr, nullptr, options(DecodeMode::Restored), 2, 32); }, "drafter");
  // A cache of independent rows takes per-row positions only, and the other way round.
  KVCacheOptions co;
  co.rows = true;
  co.batch = 2;
  co.capacity = 32;
  KVCache rows(model().config(), co);
  auto ids = at::zeros({2, 1}, at::kLong);
  expect_error([&] { model().forward(ids, at::zeros({1}, at::kLong), rows); }, "independent rows");
  KVCache one(model().config(), KVCacheOptions{});
  expect_error([&] { model().forward(ids.narrow(0, 0, 1), at::zeros({1, 1}, at::kLong), one); }, "one sequence");
  co.restore.window = 8;
  co.restore.linear = true;
  expect_error([&] { KVCache(model().config(), co); }, "no linear restore policy");
}

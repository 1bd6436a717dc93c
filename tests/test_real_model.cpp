// The real default model (Gemma 3 270M) against HF transformers on CPU:
// perplexity within 0.5% and identical greedy continuations (fixtures by
// tests/fixtures/make_real_model_fixtures.py).
#include <nlohmann/json.hpp>

#include <fstream>

#include "core/model/model.h"
#include "core/io/tokenizer.h"
#include "infer/generate.h"
#include "infer/score.h"
#include "tests/test_util.h"

using namespace kakeya;

namespace {

nlohmann::json reference() {
  std::ifstream f(test::fixtures_dir("real_model") + "/reference.json");
  EXPECT_TRUE(f.good()) << "reference.json missing";
  return nlohmann::json::parse(f);
}

const Model& model() {
  static Model m = [] {
    ModelOptions mo;
    mo.max_positions = 1024;
    return Model::load(test::real_model_dir(), mo);
  }();
  return m;
}

TEST(RealModel, TokenizerMatchesHF) {
  auto ref = reference();
  auto tok = Tokenizer::from_file(test::real_model_dir() + "/tokenizer.json");
  auto ids = tok.encode(ref["text"].get<std::string>());
  EXPECT_EQ(std::vector<int64_t>(ids.begin(), ids.end()), ref["ids"].get<std::vector<int64_t>>());
}

TEST(RealModel, PerplexityMatchesHF) {
  auto ref = reference();
  auto r = score(model(), ref["ids"].get<std::vector<int64_t>>(), {});
  double hf = ref["perplexity"].get<double>();
  EXPECT_NEAR(r.perplexity(), hf, 0.005 * hf) << "ours " << r.perplexity() << " vs HF " << hf;
  EXPECT_LT(r.perplexity(), 50.0) << "a real model on English prose";
}

TEST(RealModel, GreedyGenerationMatchesHF) {
  auto ref = reference();
  for (const auto& g : ref["generations"]) {
    auto want = g["generated_ids"].get<std::vector<int64_t>>();
    DecodeOptions opt;
    opt.max_new_tokens = want.size();
    opt.stop_ids = model().config().eos_token_ids;
    auto got = generate(model(), g["prompt_ids"].get<std::vector<int64_t>>(), opt);
    EXPECT_EQ(got.tokens, want) << "prompt: " << g["prompt"];
  }
}

}  // namespace

// Fused speculative decoding on the restored verifier (infer/fused.h) on the real
// default model (Gemma 3 270M, CPU f32) with the shipped DFlash drafter, a small
// exact window (sink 4 + window 16, so blocks cross the window boundary all the time):
//   - exact restoration (a = 1) is token-identical to plain AR, over prompts (code,
//     prose, one shorter than sink + window) and block sizes 4, 8, 16;
//   - with a seeded random f_θ at a = 0 it is token-identical to the `restored`
//     decoder it accelerates (the lossless claim on the restored verifier);
//   - a stop token inside a block ends the output there; the token budget is exact;
//   - bad input: a drafter of another target, a block past the window, a block larger
//     than the drafter was trained for (a warning, same tokens);
//   - rejection sampling: reproducible per seed, greedy at a near-zero temperature.
#include <ATen/ATen.h>

#include <fstream>
#include <numeric>
#include <string>

#include "core/model/drafter.h"
#include "core/error.h"
#include "core/io/fs.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/io/tokenizer.h"
#include "infer/fused.h"
#include "infer/generate.h"
#include "infer/decoder.h"
#include "infer/restored.h"
#include "tests/test_util.h"

using namespace kakeya;
using test::expect_error;

namespace {

// fused_generate with the restore options given apart, as most tests vary them alone.
DecodeResult fused_run(const Model& v, const Drafter& d, const FTheta* f, const RestoreOptions& ro,
                       const std::vector<int64_t>& prompt, DecodeOptions opt) {
  opt.restore = ro;
  return fused_generate(v, d, f, prompt, opt);
}


const Model& model() {
  static Model m = [] {
    ModelOptions mo;
    mo.max_positions = 160;
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

const Drafter& drafter() {
  static Drafter d = Drafter::load(test::shipped_dir("drafter"), model());
  return d;
}

const FTheta& ftheta() {
  static FTheta f = FTheta::random(FThetaConfig::for_pair(model().config(), drafter().config(), 32), 5, at::kFloat,
                                   at::kCPU);
  return f;
}

// Code (the drafter's strongest domain: long accepted runs), prose, and a prompt
// shorter than sink + window (restoration starts during generation).
const std::vector<std::vector<int64_t>>& prompts() {
  static std::vector<std::vector<int64_t>> p{
      encode("import os\nimport sys\n\n\ndef list_files(root):\n    \"\"\"Return every file under root.\"\"\"\n"
             "    out = []\n    for dirpath, dirnames, filenames in os.walk(root):\n"),
      encode("The lighthouse keeper wrote in his logbook every evening: the weather, the ships, the oil burned "
             "and the repairs. On the last page he wrote"),
      encode("def fibonacci(n):\n"),
  };
  return p;
}

constexpr int64_t kNew = 24;

RestoreOptions restore_options(double alpha) {
  RestoreOptions ro;
  ro.sink = 4;
  ro.window = 16;
  ro.mix_alpha = alpha;
  return ro;
}

// Greedy AR continuations, computed once per prompt on first use (ctest runs each test in its own process).
const std::vector<int64_t>& ar_tokens(size_t i) {
  static std::vector<std::vector<int64_t>> t(prompts().size());
  if (t[i].empty()) {
    DecodeOptions go;
    go.max_new_tokens = kNew;
    t[i] = generate(model(), prompts()[i], go).tokens;
  }
  return t[i];
}

DecodeResult fused(size_t prompt, int64_t block, double alpha, int64_t max_new = kNew,
                  std::vector<int64_t> stop = {}, const RestoreOptions* ro = nullptr) {
  DecodeOptions fo;
  fo.max_new_tokens = max_new;
  fo.block_size = block;
  fo.stop_ids = std::move(stop);
  return fused_run(model(), drafter(), alpha < 1.0 ? &ftheta() : nullptr, ro ? *ro : restore_options(alpha),
                        prompts()[prompt], fo);
}

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), (int64_t)0); }

TEST(Fused, PromptsCrossTheWindow) {
  EXPECT_GT(prompts()[0].size(), 2u * 20u);
  EXPECT_GT(prompts()[1].size(), 20u);
  EXPECT_LT(prompts()[2].size(), 20u);  // shorter than sink + window
}

TEST(Fused, ExactRestorationEqualsArOverPromptsAndBlocks) {
  double accepted = 0;
  int64_t forwards = 0;
  for (size_t p = 0; p < prompts().size(); ++p)
    for (int64_t b : {4, 8, 16}) {
      SCOPED_TRACE("prompt " + std::to_string(p) + ", block " + std::to_string(b));
      auto r = fused(p, b, 1.0);
      EXPECT_EQ(r.tokens, ar_tokens(p));
      EXPECT_EQ(r.block_size, b);
      EXPECT_TRUE(r.warnings.empty());
      // Every verify forward commits 1..b tokens; the first token comes from the prefill.
      EXPECT_EQ(sum(r.committed), (int64_t)r.tokens.size() - 1);
      for (int64_t c : r.committed) {
        EXPECT_GE(c, 1);
        EXPECT_LE(c, b);
      }
      EXPECT_EQ(r.split.blocks, (int64_t)r.committed.size());
      EXPECT_GT(r.restored_positions, 0);
      accepted += sum(r.committed);
      forwards += r.committed.size();
    }
  // The shipped drafter really drafts: more than one token per verify forward on average.
  EXPECT_GT(accepted / forwards, 1.5);
}

TEST(Fused, EqualsRestoredDecoderWithRandomFTheta) {
  bool acts = false;
  for (size_t p : {1u, 2u}) {
    DecodeOptions d;
    d.mode = DecodeMode::Restored;
    d.restore = restore_options(0.0);
    d.max_new_tokens = 16;
    auto ref = decode(model(), &drafter(), &ftheta(), prompts()[p], d);
    acts |= ref.tokens != std::vector<int64_t>(ar_tokens(p).begin(), ar_tokens(p).begin() + 16);
    for (int64_t b : {4, 16}) {
      SCOPED_TRACE("prompt " + std::to_string(p) + ", block " + std::to_string(b));
      auto r = fused(p, b, 0.0, 16);
      EXPECT_EQ(r.tokens, ref.tokens);
    }
  }
  EXPECT_TRUE(acts) << "a random f_θ changed no continuation: restoration does not act";
}

// Full-attention layers as coded rows (--full-attn codec): verify blocks write and read the codes
// by the same rules as single steps (rejected positions' rows are overwritten), so fused = restored.
TEST(Fused, EqualsRestoredDecoderWithCodedFullAttention) {
  for (double alpha : {1.0, 0.0}) {
    SCOPED_TRACE("a = " + std::to_string(alpha));
    const FTheta* f = alpha < 1.0 ? &ftheta() : nullptr;
    DecodeOptions d;
    d.mode = DecodeMode::Restored;
    d.restore = restore_options(alpha);
    d.restore.full_attn = FullAttn::Codec;
    d.restore.full_code = {ops::RowKind::Rotated, 3};
    d.max_new_tokens = 16;
    auto ref = decode(model(), &drafter(), f, prompts()[1], d);
    DecodeOptions fo;
    fo.block_size = 8;
    fo.max_new_tokens = 16;
    auto r = fused_run(model(), drafter(), f, d.restore, prompts()[1], fo);
    EXPECT_EQ(r.tokens, ref.tokens);
    EXPECT_GT(r.memory.find(MemoryPart::FullCoded)->bytes, 0) << r.memory.table();
  }
}

// A FusedDecoder kept across prompts (its caches and buffers reused, graphs captured once on
// CUDA) decodes each prompt as a fresh one does: nothing of an earlier prompt leaks into the
// next, in any order, also after a longer prompt and with stops and shorter budgets.
TEST(Fused, DecoderKeptAcrossPromptsEqualsFreshRuns) {
  for (double alpha : {1.0, 0.0}) {
    SCOPED_TRACE("a = " + std::to_string(alpha));
    const FTheta* f = alpha < 1.0 ? &ftheta() : nullptr;
    DecodeOptions fo;
    fo.block_size = 8;
    fo.max_new_tokens = 16;
    int64_t capacity = 0;
    for (const auto& p : prompts()) capacity = std::max<int64_t>(capacity, p.size() + fo.max_new_tokens);
    fo.restore = restore_options(alpha);
    FusedDecoder dec(model(), drafter(), f, fo, capacity);
    for (size_t p : {0u, 2u, 1u, 0u}) {
      SCOPED_TRACE("prompt " + std::to_string(p));
      DecodeOptions run = fo;
      if (p == 1) run.max_new_tokens = 9;  // a shorter budget in the middle
      auto kept = dec.run(prompts()[p], run);
      auto fresh = fused_run(model(), drafter(), f, restore_options(alpha), prompts()[p], run);
      EXPECT_EQ(kept.tokens, fresh.tokens);
      EXPECT_EQ(kept.committed, fresh.committed);
      EXPECT_EQ(kept.restored_positions, fresh.restored_positions);
    }
    // Options its buffers or graphs depend on are refused by name; so is a run past its capacity.
    DecodeOptions other = fo;
    other.block_size = 4;
    expect_error([&] { dec.run(prompts()[0], other); }, "built for blocks of 8");
    DecodeOptions longer = fo;
    longer.max_new_tokens = capacity;
    expect_error([&] { dec.run(prompts()[0], longer); }, "positions this decoder was built for");
  }
}

// The shipped drafter drafts from its FR-Spec vocabulary (core/model/drafter.h); output stays
// the verifier's with and without it, and both draft (τ > 1).
TEST(Fused, DraftVocabularyChangesOnlyTheDrafts) {
  ASSERT_TRUE(drafter().draft_vocab().defined()) << "checkpoints/gemma3-270m/drafter ships draft_vocab.safetensors";
  EXPECT_LT(drafter().draft_vocab().numel(), model().lm_head().size(0));
  DrafterOptions whole;
  whole.draft_vocab = false;
  Drafter full = Drafter::load(test::shipped_dir("drafter"), model(), whole);
  ASSERT_FALSE(full.draft_vocab().defined());
  DecodeOptions fo;
  fo.max_new_tokens = kNew;
  fo.block_size = 8;
  for (size_t p = 0; p < prompts().size(); ++p) {
    SCOPED_TRACE("prompt " + std::to_string(p));
    auto sub = fused_run(model(), drafter(), nullptr, restore_options(1.0), prompts()[p], fo);
    auto all = fused_run(model(), full, nullptr, restore_options(1.0), prompts()[p], fo);
    EXPECT_EQ(sub.tokens, ar_tokens(p));
    EXPECT_EQ(all.tokens, ar_tokens(p));
    if (p == 0) {
      EXPECT_GT(sub.tau(), 1.5);
      EXPECT_GT(all.tau(), 1.5);
    }
  }
}

TEST(Fused, DecodeModeFusedDispatches) {
  EXPECT_EQ(parse_decode_mode("fused"), DecodeMode::Fused);
  EXPECT_STREQ(decode_mode_name(DecodeMode::Fused), "fused");
  DecodeOptions d;
  d.mode = DecodeMode::Fused;
  d.restore = restore_options(1.0);
  d.restore.full_attn = FullAttn::Restored;  // full-attention layers through the restored cache too
  d.max_new_tokens = 10;
  d.block_size = 8;
  auto r = decode(model(), &drafter(), nullptr, prompts()[0], d);
  EXPECT_EQ(r.tokens, std::vector<int64_t>(ar_tokens(0).begin(), ar_tokens(0).begin() + 10));
  EXPECT_GT(r.tau(), 1.0);
  bool ctx = false;
  for (const auto& l : r.memory.kv) ctx |= l.part == MemoryPart::DrafterContext && l.bytes > 0;
  EXPECT_TRUE(ctx) << r.memory.table();
}

TEST(Fused, StopTokenInsideABlockAndExactBudget) {
  // Budget: 11 tokens is no multiple of anything the blocks commit.
  auto full = fused(0, 8, 1.0);
  auto cut = fused(0, 8, 1.0, 11);
  EXPECT_EQ(cut.tokens, std::vector<int64_t>(ar_tokens(0).begin(), ar_tokens(0).begin() + 11));
  // A stop id whose first occurrence is strictly inside a multi-token block.
  const auto& t = full.tokens;
  int64_t k = -1, pos = 1;  // pos: index in t of the block's first token
  for (int64_t c : full.committed) {
    for (int64_t i = pos; i < pos + c - 1 && k < 0; ++i)
      if (std::find(t.begin(), t.begin() + i, t[i]) == t.begin() + i) k = i;
    if (k >= 0) break;
    pos += c;
  }
  ASSERT_GE(k, 0) << "no multi-token block with a fresh token";
  auto stopped = fused(0, 8, 1.0, kNew, {t[k]});
  EXPECT_EQ(stopped.tokens, std::vector<int64_t>(t.begin(), t.begin() + k + 1));
  // The same through generate(): identical.
  DecodeOptions go;
  go.max_new_tokens = kNew;
  go.stop_ids = {t[k]};
  EXPECT_EQ(generate(model(), prompts()[0], go).tokens, stopped.tokens);
  // A stop as the prefill's very first token: no block runs.
  auto first = fused(0, 8, 1.0, kNew, {t[0]});
  EXPECT_EQ(first.tokens, std::vector<int64_t>{t[0]});
  EXPECT_TRUE(first.committed.empty());
}

TEST(Fused, BlockLargerThanTrainedWarnsAndStaysLossless) {
  RestoreOptions ro = restore_options(1.0);
  ro.window = 24;
  auto r = fused(1, 20, 1.0, 10, {}, &ro);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("larger than the drafter was trained for"), std::string::npos) << r.warnings[0];
  EXPECT_EQ(r.tokens, std::vector<int64_t>(ar_tokens(1).begin(), ar_tokens(1).begin() + 10));
}

TEST(Fused, DrafterOfAnotherTargetIsRefused) {
  // A drafter loaded against another verifier instance: bound to that one.
  ModelOptions mo;
  mo.max_positions = 64;
  Model other = Model::load(test::real_model_dir(), mo);
  Drafter foreign = Drafter::load(test::shipped_dir("drafter"), other);
  DecodeOptions fo;
  fo.max_new_tokens = 4;
  expect_error([&] { fused_run(model(), foreign, nullptr, restore_options(1.0), prompts()[0], fo); },
               "bound to another target");
  // A drafter checkpoint made for another target geometry is refused at load time.
  const std::string dir = fs::temp_dir() + "/kakeya_test_fused_foreign_drafter";
  fs::make_dirs(dir);
  std::ifstream in(test::shipped_dir("drafter") + "/config.json");
  auto cfg = nlohmann::json::parse(in);
  cfg["num_target_layers"] = 26;  // e.g. a Gemma 3 1B drafter
  cfg["dflash_config"]["target_layer_ids"] = {1, 6, 12, 18, 23};
  fs::write_atomic(dir + "/config.json", cfg.dump());
  expect_error([&] { Drafter::load(dir, model()); }, "drafter/target mismatch");
}

TEST(Fused, BadInput) {
  DecodeOptions fo;
  fo.max_new_tokens = 4;
  RestoreOptions ro = restore_options(1.0);
  fo.block_size = 17;  // > window 16
  expect_error([&] { fused_run(model(), drafter(), nullptr, ro, prompts()[0], fo); }, "exceeds --window");
  fo.block_size = 1;
  expect_error([&] { fused_run(model(), drafter(), nullptr, ro, prompts()[0], fo); }, ">= 2");
  fo.block_size = 8;
  fo.max_new_tokens = 160 - (int64_t)prompts()[0].size();  // fits the table without the last block's margin
  expect_error([&] { fused_run(model(), drafter(), nullptr, ro, prompts()[0], fo); }, "RoPE table");
  fo.max_new_tokens = 4;
  ro.mix_alpha = 0.0;
  expect_error([&] { fused_run(model(), drafter(), nullptr, ro, prompts()[0], fo); }, "needs f_θ");
  DecodeOptions d;
  d.mode = DecodeMode::Fused;
  d.restore = restore_options(1.0);
  d.max_new_tokens = 4;
  expect_error([&] { decode(model(), nullptr, nullptr, prompts()[0], d); }, "--drafter");
  d.sampling.temperature = 0.7;
  d.sampling.top_p = 0.0;
  expect_error([&] { decode(model(), &drafter(), nullptr, prompts()[0], d); }, "--top-p");
}

TEST(Fused, RejectionSamplingIsSeededAndGreedyAtTinyTemperature) {
  auto sampled = [](double t, double top_p, uint64_t seed) {
    DecodeOptions fo;
    fo.max_new_tokens = 10;
    fo.block_size = 8;
    fo.sampling = {t, top_p, seed};
    return fused_run(model(), drafter(), nullptr, restore_options(1.0), prompts()[0], fo);
  };
  // A near-zero temperature makes every distribution one-hot: acceptance, residual and bonus
  // all reduce to the verifier's argmax, so the output is greedy AR's.
  auto cold = sampled(1e-4, 1.0, 3);
  EXPECT_EQ(cold.tokens, std::vector<int64_t>(ar_tokens(0).begin(), ar_tokens(0).begin() + 10));
  EXPECT_GT(cold.tau(), 1.0);
  // Same seed, same tokens; the sampled run is a real sample (another seed or greedy differs).
  auto a = sampled(1.0, 0.9, 7), b = sampled(1.0, 0.9, 7), c = sampled(1.0, 0.9, 8);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.committed, b.committed);
  EXPECT_EQ(a.tokens.size(), 10u);
  EXPECT_TRUE(a.tokens != c.tokens || a.tokens != cold.tokens);
}

}  // namespace

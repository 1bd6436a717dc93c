// The restored-verifier decoder on the real default model (Gemma 3 270M, CPU
// f32), with a tiny exact window (sink 4 + window 8) and prompts longer than
// that, so positions really leave the window on every sliding layer:
//   - exact restoration (a = 1: restored K/V = the verifier's own) is
//     token-identical to plain AR, in both restored modes;
//   - incremental `restored` equals the `restored-reforward` reference token for
//     token with a seeded random drafter and f_θ (a = 0, a mix, full-attention
//     layers restored too, other prefill chunkings);
//   - every query sees each position of its span exactly once;
//   - --full-attn codec (full-attention K/V as lm4 coded rows): close to --full-attn exact,
//     incremental = reforward, its measured bytes = restored_memory_plan, and the plan at 8k
//     (window 128, int4 restored regions) within 1/5 of full KV, and with lm3 rows 0.35x of the
//     native cache;
//   - evict-only (--restore-layers none: sinks + the exact window) ignores f_θ entirely,
//     equals its reforward reference, and loses against the full cache; a layer list
//     restores exactly those layers; an f_θ reading the target features restores
//     incrementally as its reforward reference does;
//   - restored regions stored as coded rows (--restored-code): incremental = reforward, exact
//     restoration stays close to the full cache, the region costs the coded bytes of the plan;
//   - `bench memory`'s fits are the plans' (the longest context under a budget, sessions);
//   - bad input fails with a clear error.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>

#include <unistd.h>

#include "core/model/drafter.h"
#include "core/error.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/io/fs.h"
#include "core/io/tokenizer.h"
#include "infer/bench_memory.h"
#include "infer/generate.h"
#include "infer/long_eval.h"
#include "infer/memory.h"
#include "infer/decoder.h"
#include "infer/restored.h"
#include "infer/session.h"
#include "tests/test_util.h"

using namespace kakeya;
using test::expect_error;

namespace {

const Model& model() { return test::real_model(); }
const Tokenizer& tokenizer() { return test::real_tokenizer(); }

// ~40 tokens: several times sink + window.
const std::vector<int64_t>& prompt() {
  static std::vector<int64_t> p = test::real_prompt(
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
    DecodeOptions go;
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
  // The region takes the exact ring's copies: nothing pending, no raw K/V kept.
  for (const auto& l : r.memory.kv)
    EXPECT_FALSE((l.part == MemoryPart::TrueRaw || l.part == MemoryPart::RestorePending) && l.bytes > 0)
        << r.memory.table();
  EXPECT_DOUBLE_EQ(r.attention_fraction_sliding, 1.0);
  EXPECT_DOUBLE_EQ(r.attention_fraction_full, 1.0);
}

// Exact restoration takes prefill chunks longer than the window: a chunk reads its own positions
// exactly and the cache stores their restored copies as it writes them. With a plain region that
// is still the full cache: the same tokens, every position of the last query's span seen once
// (the copies are where the region says), and the cache no larger than with chunks of the window.
// With an int8 region the copies are coded; a long chunk reads its own old positions exactly where
// chunks of the window read their codes, so its tokens follow AR's at least as far as theirs do
// (int8 regions part from AR after 10 of these 12 tokens with chunks of the window), in the same bytes.
TEST(Restored, ExactRestorationLongChunksEqualAr) {
  // 31 tokens: chunks of 16 (two long ones), 23 (a long one, then one of the window's 8 tokens)
  // and 64 (the whole prompt at once).
  ASSERT_GT(prompt().size(), 16u + 8u);
  auto agree = [](const std::vector<int64_t>& a) {  // tokens in common with AR's from the first on
    size_t i = 0;
    while (i < a.size() && i < ar_tokens().size() && a[i] == ar_tokens()[i]) ++i;
    return i;
  };
  for (ops::RowCode code : {ops::RowCode{}, ops::RowCode{ops::RowKind::Affine, 8}}) {
    auto o = options(DecodeMode::Restored, 1.0, 12);
    o.restore.region_code = code;
    o.restore.chunk = o.restore.window;
    const auto window_chunks = decode(model(), nullptr, nullptr, prompt(), o);
    for (int64_t chunk : {16, 23, 64, 0}) {  // 0: RestoreOptions::kLongChunk, the whole prompt here
      SCOPED_TRACE("chunk " + std::to_string(chunk) + (code.defined() ? " int8" : " plain"));
      o.restore.chunk = chunk;
      auto r = decode(model(), nullptr, nullptr, prompt(), o);
      if (!code.defined()) EXPECT_EQ(r.tokens, ar_tokens());
      EXPECT_GE(agree(r.tokens), agree(window_chunks.tokens));
      EXPECT_EQ(r.restored_positions, window_chunks.restored_positions);
      EXPECT_DOUBLE_EQ(r.attention_fraction_sliding, 1.0);
      EXPECT_DOUBLE_EQ(r.attention_fraction_full, 1.0);
      EXPECT_EQ(r.memory.kv_bytes(), window_chunks.memory.kv_bytes()) << r.memory.table();
    }
  }
  // f_θ restoration cannot: a chunk's queries would need f_θ's copies of the chunk itself.
  auto o = options(DecodeMode::Restored, 0.0, 4);
  o.restore.chunk = 16;
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "only exact restoration");
  o.restore.mix_alpha = 1.0;
  o.restore.full_attn = FullAttn::Restored;
  expect_error([&] { decode(model(), nullptr, nullptr, prompt(), o); }, "--full-attn exact or codec");
}

// Without streaming, stops are read every kStopCheckEvery steps: the result still ends at
// the first stop token, whichever batch it falls in (the steps run after it are dropped).
TEST(Restored, BatchedStopCheckEndsAtTheFirstStop) {
  const auto& ref = ar_tokens();
  for (size_t at : {size_t(3), size_t(9)}) {
    const int64_t stop = ref[at];
    const size_t first = std::find(ref.begin(), ref.end(), stop) - ref.begin();
    const std::vector<int64_t> want(ref.begin(), ref.begin() + first + 1);
    for (DecodeMode m : {DecodeMode::Ar, DecodeMode::Restored}) {
      auto o = options(m, 1.0, 12);
      o.stream = false;
      o.stop_ids = {stop};
      std::vector<int64_t> seen;
      o.on_token = [&](int64_t t) { seen.push_back(t); };
      auto r = decode(model(), nullptr, nullptr, prompt(), o);
      EXPECT_EQ(r.tokens, want) << decode_mode_name(m) << ", stop at " << at;
      EXPECT_EQ(seen, want) << decode_mode_name(m);
    }
  }
}

// A session continues a conversation without prefilling it again: each turn feeds only the
// new tokens (and the previous turn's last token), and its tokens equal a fresh decode of the
// whole conversation so far, for the full cache and the restored one (past the window, so
// restoration happens across turns). Options it was not built for leave it empty.
TEST(Restored, SessionTurnsEqualFreshDecodesOfTheWholeConversation) {
  const std::vector<int64_t> turn1(prompt().begin(), prompt().begin() + 20);
  const std::vector<int64_t> turn2(prompt().begin() + 20, prompt().end());
  for (DecodeMode m : {DecodeMode::Ar, DecodeMode::Restored}) {
    SCOPED_TRACE(decode_mode_name(m));
    const DecodeOptions o = options(m, 0.0, 8);
    Session s(model(), &drafter(), &ftheta(), o, prompt().size() + 3 * 8);
    auto a = s.send(turn1, o);
    EXPECT_EQ(a.tokens, decode(model(), &drafter(), &ftheta(), turn1, o).tokens);
    EXPECT_EQ(a.served_positions, (int64_t)turn1.size() + 7);  // the last token is fed by the next turn
    std::vector<int64_t> whole = turn1;
    whole.insert(whole.end(), a.tokens.begin(), a.tokens.end());
    whole.insert(whole.end(), turn2.begin(), turn2.end());
    auto b = s.send(turn2, o);
    EXPECT_EQ(b.tokens, decode(model(), &drafter(), &ftheta(), whole, o).tokens);
    EXPECT_EQ(b.served_positions, (int64_t)whole.size() + 7);
    if (m == DecodeMode::Restored) EXPECT_GT(b.restored_positions, 0);
    whole.insert(whole.end(), b.tokens.begin(), b.tokens.end());
    EXPECT_EQ(s.history(), whole);
    DecodeOptions too_long = o;
    too_long.max_new_tokens = 64;
    expect_error([&] { s.send(turn2, too_long); }, "positions this decoder was built for");
    EXPECT_TRUE(s.history().empty());
    // A conversation may start shorter than the window (nothing restored yet: the plain model's
    // tokens), which a one-off decode refuses as an experiment that measures nothing.
    const std::vector<int64_t> hello(prompt().begin(), prompt().begin() + 3);
    DecodeOptions few = o;
    few.max_new_tokens = 3;
    DecodeOptions ar = few;
    ar.mode = DecodeMode::Ar;
    EXPECT_EQ(s.send(hello, few).tokens, generate(model(), hello, ar).tokens);
    if (m == DecodeMode::Restored) expect_error([&] { decode(model(), &drafter(), &ftheta(), hello, few); }, "larger than the context");
  }
}

// A session of exact restoration with chunks longer than the window: the second turn's chunk
// starts after decode steps (off any chunk grid) and reads its own positions exactly. With a plain
// region every turn equals a fresh decode of the whole conversation (both the full cache's tokens),
// and the last query sees each position of its span once: the copies went where the region says.
TEST(Restored, ExactRestorationSessionTurnsWithLongChunks) {
  const std::vector<int64_t> turn1(prompt().begin(), prompt().begin() + 20);
  const std::vector<int64_t> turn2(prompt().begin() + 20, prompt().end());
  DecodeOptions o = options(DecodeMode::Restored, 1.0, 8);
  o.restore.chunk = 16;
  Session s(model(), nullptr, nullptr, o, prompt().size() + 3 * 8);
  auto a = s.send(turn1, o);
  EXPECT_EQ(a.tokens, decode(model(), nullptr, nullptr, turn1, o).tokens);
  std::vector<int64_t> whole = turn1;
  whole.insert(whole.end(), a.tokens.begin(), a.tokens.end());
  whole.insert(whole.end(), turn2.begin(), turn2.end());
  auto b = s.send(turn2, o);  // 12 tokens: the previous turn's last and turn2's 11, past the window of 8
  auto fresh = decode(model(), nullptr, nullptr, whole, o);
  EXPECT_EQ(b.tokens, fresh.tokens);
  EXPECT_EQ(b.restored_positions, fresh.restored_positions);
  EXPECT_DOUBLE_EQ(b.attention_fraction_sliding, 1.0);
}

// Decoders kept across prompts (ar, restored: caches and buffers reused, CUDA graphs captured
// once) decode each prompt as a fresh one does, whatever came before; options they were not
// built for are refused by name.
TEST(Restored, DecodersKeptAcrossPromptsEqualFreshRuns) {
  const std::vector<int64_t> shorter(prompt().begin(), prompt().begin() + 17);
  for (DecodeMode m : {DecodeMode::Ar, DecodeMode::Restored}) {
    SCOPED_TRACE(decode_mode_name(m));
    const DecodeOptions o = options(m, 0.0, 12);
    auto dec = make_decoder(model(), &drafter(), &ftheta(), o, prompt().size() + 12);
    for (const auto* p : {&prompt(), &shorter, &prompt()}) {
      auto kept = dec->run(*p, o);
      auto fresh = decode(model(), &drafter(), &ftheta(), *p, o);
      EXPECT_EQ(kept.tokens, fresh.tokens);
      EXPECT_EQ(kept.restored_positions, fresh.restored_positions);
    }
    DecodeOptions other = o;
    other.mode = m == DecodeMode::Ar ? DecodeMode::Restored : DecodeMode::Ar;
    expect_error([&] { dec->run(prompt(), other); }, "built for --mode");
    if (m == DecodeMode::Restored) {
      other = o;
      other.restore.window = 12;
      expect_error([&] { dec->run(prompt(), other); }, "differ from the ones it was built with");
    }
  }
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

// An f_θ with a nonlinear branch restores through the same paths: incremental = reforward, and the
// branch changes what is restored (scores differ from the same f_θ with F2 = 0).
TEST(Restored, IncrementalEqualsReforwardWithNonlinearFTheta) {
  FThetaConfig c = FThetaConfig::for_pair(model().config(), drafter().config(), 32);
  c.mlp_hidden = 16;
  FTheta f = FTheta::random(c, 7, at::kFloat, at::kCPU);
  RestoreOptions ro;
  ro.sink = 4;
  ro.window = 8;
  const double zero_branch = score_restored(model(), &drafter(), &f, prompt(), ro).mean_nll();
  for (auto& [name, t] : f.named_parameters())
    if (name.find(".mlp.fc2.") != std::string::npos) t.normal_(0.0, 0.5);
  EXPECT_NE(score_restored(model(), &drafter(), &f, prompt(), ro).mean_nll(), zero_branch);
  auto inc = decode(model(), &drafter(), &f, prompt(), options(DecodeMode::Restored, 0.0, 5));
  auto ref = decode(model(), &drafter(), &f, prompt(), options(DecodeMode::RestoredReforward, 0.0, 5));
  EXPECT_EQ(inc.tokens, ref.tokens);
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

// Evict-only drops every restored position: what f_θ would predict cannot matter, and
// it is not the full cache.
TEST(Restored, EvictOnlyIgnoresFThetaAndDropsOldPositions) {
  RestoreOptions ro;
  ro.sink = 4;
  ro.window = 8;
  ro.layers = "none";
  auto other = FTheta::random(ftheta().config(), 99, at::kFloat, at::kCPU);
  auto a = score_restored(model(), &drafter(), &ftheta(), prompt(), ro);
  auto b = score_restored(model(), &drafter(), &other, prompt(), ro);
  auto c = score_restored(model(), nullptr, nullptr, prompt(), ro);  // needs neither
  ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
  for (size_t i = 0; i < a.logprobs.size(); ++i) {
    EXPECT_EQ(a.logprobs[i], b.logprobs[i]) << i;
    EXPECT_EQ(a.logprobs[i], c.logprobs[i]) << i;
  }
  auto ar = score(model(), prompt(), ScoreOptions{});
  double diff = 0;
  for (size_t i = 0; i < a.logprobs.size(); ++i) diff = std::max(diff, std::abs(a.logprobs[i] - ar.logprobs[i]));
  EXPECT_GT(diff, 1e-3);  // positions older than the window are gone
  // The first sink + window tokens see everything either way.
  for (size_t i = 0; i + 1 < 12; ++i) EXPECT_NEAR(a.logprobs[i], ar.logprobs[i], 1e-4) << i;
  // The incremental decoder and its reforward reference agree on it.
  auto o = options(DecodeMode::Restored, 0.0, 5);
  o.restore.layers = "none";
  auto inc = decode(model(), nullptr, nullptr, prompt(), o);
  o.mode = DecodeMode::RestoredReforward;
  auto ref = decode(model(), nullptr, nullptr, prompt(), o);
  EXPECT_EQ(inc.tokens, ref.tokens);
  // Its restored region holds the sinks (and one slot for everything else), not a ring of old
  // positions: evict-only costs less than the restored decoder.
  const int64_t capacity = (int64_t)prompt().size() + 5;
  KVCache evict(model().config(), restored_cache_options(model(), nullptr, ro, capacity, false));
  RestoreOptions all = ro;
  all.layers = "all";
  KVCache full(model().config(), restored_cache_options(model(), &ftheta(), all, capacity, false));
  for (int64_t l = 0; l < model().config().num_layers; ++l)
    if (model().config().is_sliding(l)) {
      EXPECT_TRUE(evict.sinks_only(l));
      EXPECT_EQ(evict.restored_slots(l), ro.sink + 1);
      EXPECT_FALSE(full.sinks_only(l));
      EXPECT_GT(full.restored_slots(l), ro.sink + 1);
    }
  EXPECT_LT(evict.bytes(), full.bytes());
}

// --restore-layers L1,L2: exactly those layers read restored positions; a = 1 on a layer set
// is exact there and evicted elsewhere, so it lies between evict-only and the full cache.
TEST(Restored, LayerListRestoresOnlyThoseLayers) {
  const ModelConfig& cfg = model().config();
  RestoreOptions ro;
  ro.sink = 4;
  ro.window = 8;
  ro.layers = "1,3";
  auto mask = resolve_restore_layers(cfg, &ftheta(), ro);
  for (int64_t l = 0; l < cfg.num_layers; ++l) EXPECT_EQ(mask[l], l == 1 || l == 3) << l;
  ro.layers = "all";
  mask = resolve_restore_layers(cfg, &ftheta(), ro);
  for (int64_t l = 0; l < cfg.num_layers; ++l) EXPECT_EQ(mask[l], cfg.is_sliding(l)) << l;
  // "auto" reads f_θ's measured list; unmeasured means every covered layer.
  FTheta measured = FTheta::random(ftheta().config(), 5, at::kFloat, at::kCPU);
  measured.mutable_config().restore_layers = {2};
  measured.mutable_config().restore_layers_measured = true;
  ro.layers = "auto";
  mask = resolve_restore_layers(cfg, &measured, ro);
  for (int64_t l = 0; l < cfg.num_layers; ++l) EXPECT_EQ(mask[l], l == 2) << l;
  measured.mutable_config().restore_layers = {};
  EXPECT_EQ(resolve_restore_layers(cfg, &measured, ro), std::vector<bool>(cfg.num_layers, false));
  // That f_θ restores nothing, so settle_auto_layers makes "auto" evict-only (nothing loaded for
  // it); a kept list, an unmeasured f_θ, exact restoration or an explicit list stay as they are.
  RestoreOptions so;
  ASSERT_EQ(so.layers, "auto");
  ASSERT_TRUE(so.needs_ftheta());
  EXPECT_TRUE(settle_auto_layers(so, measured.config()));
  EXPECT_TRUE(so.evict_only());
  EXPECT_FALSE(so.needs_ftheta());
  EXPECT_FALSE(settle_auto_layers(so, measured.config()));  // already "none"
  RestoreOptions keep;
  EXPECT_FALSE(settle_auto_layers(keep, ftheta().config()));  // never measured: every covered layer
  keep.mix_alpha = 1.0;
  EXPECT_FALSE(settle_auto_layers(keep, measured.config()));  // exact restoration reads no f_θ
  keep.mix_alpha = 0.0;
  keep.layers = "1,3";
  EXPECT_FALSE(settle_auto_layers(keep, measured.config()));
  keep.layers = "auto";
  measured.mutable_config().restore_layers = {2};
  EXPECT_FALSE(settle_auto_layers(keep, measured.config()));
  EXPECT_EQ(keep.layers, "auto");
  measured.mutable_config().restore_layers = {};

  ro.mix_alpha = 1.0;
  auto nll = [&](const std::string& layers) {
    ro.layers = layers;
    return score_restored(model(), nullptr, nullptr, prompt(), ro).mean_nll();
  };
  const double none = nll("none"), some = nll("0,1,2,3,4,6,7,8"), all = nll("all");
  const double ar = score(model(), prompt(), ScoreOptions{}).mean_nll();
  EXPECT_NEAR(all, ar, 1e-4);
  EXPECT_NE(some, none);
  EXPECT_NE(some, all);
  std::printf("mean NLL: evict-only %.4f, exact on 8 layers %.4f, exact on all %.4f, ar %.4f\n", none, some, all, ar);
}

// An f_θ that reads the target features: the incremental decoder restores what the reforward
// reference does, and the prediction is f_θ of the RMS-normalised features.
TEST(Restored, TargetFeatureInputIncrementalEqualsReforward) {
  auto fc = FThetaConfig::for_pair(model().config(), drafter().config(), 32, FThetaInput::TargetFeatures);
  ASSERT_EQ(fc.in_features(), (int64_t)drafter().config().target_layer_ids.size() * model().config().hidden_size);
  auto f = FTheta::random(fc, 7, at::kFloat, at::kCPU);
  auto inc = decode(model(), &drafter(), &f, prompt(), options(DecodeMode::Restored, 0.0, 5));
  auto ref = decode(model(), &drafter(), &f, prompt(), options(DecodeMode::RestoredReforward, 0.0, 5));
  EXPECT_EQ(inc.tokens, ref.tokens);
  EXPECT_NE(inc.tokens, std::vector<int64_t>(ar_tokens().begin(), ar_tokens().begin() + 5));
  // input_rows: each layer's row divided by its RMS (a scale of a row does not change it).
  const int64_t n = (int64_t)fc.feature_layers.size(), H = fc.hidden;
  auto x = at::randn({3, n * H});
  auto scaled = x.clone();
  scaled.narrow(1, H, H).mul_(7.5);
  auto want = x.view({3, n, H});
  want = (want / (want.pow(2).mean(-1, true) + 1e-6).sqrt()).view({3, n * H});
  EXPECT_TRUE(at::allclose(f.input_rows(x, false), want, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(f.predict_fused(x, true), f.predict_fused(scaled, true), 1e-4, 1e-5));
}

// Exact layers: a layer fed by a feature layer gets its raw K/V in closed form (the verifier's
// projections and input norm), checked against the forward's own k_proj / v_proj taps; the fixed
// tensors stay out of the trained parameters, survive save/load, and restoring only those layers
// through f_θ scores as restoring them exactly (a = 1) does.
TEST(Restored, ExactLayersAreTheVerifiersOwnKv) {
  auto fc = FThetaConfig::for_pair(model().config(), drafter().config(), 32, FThetaInput::TargetFeatures);
  auto f = FTheta::random(fc, 7, at::kFloat, at::kCPU);
  const auto before = f.named_parameters().size();
  f.add_exact_layers(model());
  const auto ex = f.config().exact_layers;
  ASSERT_FALSE(ex.empty());
  EXPECT_EQ(f.named_parameters().size(), before);
  for (int64_t l : ex) EXPECT_GE(f.config().exact_feature(l), 0) << l;

  struct Raw : TapSubscriber {
    std::map<int64_t, at::Tensor> k, v;  // layer -> [1, T, H_kv, D]
    void on_tap(Tap t, const TapContext& c, at::Tensor& x) override {
      if (t == Tap::KProj) k[c.layer] = x.clone();
      if (t == Tap::VProj) v[c.layer] = x.clone();
    }
    bool reads(Tap t) const override { return t == Tap::KProj || t == Tap::VProj; }
  } raw;
  at::NoGradGuard no_grad;
  auto ids = at::tensor(prompt(), at::kLong).unsqueeze(0);  // [1, T]
  KVCacheOptions co;
  co.capacity = ids.size(1);
  KVCache cache(model().config(), co);
  TargetFeatureCapture cap(model(), fc.feature_layers);
  Taps taps;
  taps.subscribe(&cap);
  taps.subscribe(&raw);
  ForwardOptions fo;
  fo.taps = &taps;
  fo.skip_logits = true;
  model().forward(ids, cache, fo);
  at::Tensor feats = cap.take();  // [1, T, n·H]
  auto pred = f.predict(feats, feats);
  auto rel = [](const at::Tensor& a, const at::Tensor& b) { return ((a - b).norm() / b.norm()).item<double>(); };
  for (int64_t l = 0; l < fc.num_layers(); ++l) {
    const bool exact = std::find(ex.begin(), ex.end(), l) != ex.end();
    const double ek = rel(pred[l].first, raw.k.at(l)), ev = rel(pred[l].second, raw.v.at(l));
    if (exact) {
      EXPECT_LT(ek, 1e-5) << "layer " << l;
      EXPECT_LT(ev, 1e-5) << "layer " << l;
    } else {
      EXPECT_GT(ek, 0.1) << "layer " << l << " (learned rows of a random f_theta)";
    }
  }
  const std::string dir = fs::temp_dir() + "/kakeya_test_ftheta_exact_" + std::to_string(getpid());
  f.save(dir);
  FTheta g = FTheta::load(dir, at::kFloat, at::kCPU);
  EXPECT_EQ(g.config().exact_layers, ex);
  EXPECT_TRUE(at::equal(g.predict_fused(feats, false), f.predict_fused(feats, false)));
  EXPECT_TRUE(at::equal(g.predict_fused(feats, true), f.predict_fused(feats, true)));

  RestoreOptions ro;
  ro.sink = 4;
  ro.window = 8;
  std::string layers;
  for (int64_t l : ex)
    if (model().config().is_sliding(l)) layers += (layers.empty() ? "" : ",") + std::to_string(l);
  ASSERT_FALSE(layers.empty());
  ro.layers = layers;
  const double through_f = score_restored(model(), &drafter(), &g, prompt(), ro).mean_nll();
  ro.mix_alpha = 1.0;
  const double exact = score_restored(model(), &drafter(), &g, prompt(), ro).mean_nll();
  ro.layers = "none";
  const double evict = score_restored(model(), &drafter(), &g, prompt(), ro).mean_nll();
  EXPECT_NEAR(through_f, exact, 1e-4);
  EXPECT_GT(std::abs(evict - exact), 1e-3);
  std::printf("layers %s: nll through f_theta %.5f, exact %.5f, evicted %.5f\n", layers.c_str(), through_f, exact, evict);
}

// The first layer's K/V are a function of the token alone: restored from the token (the default),
// that layer scores as exact restoration does, whatever f_θ predicts there (a random f_θ, far from
// it); restored by f_θ (--token-layers off) it does not. Incremental = reforward either way.
TEST(Restored, TokenLayerIsRestoredFromTheToken) {
  ASSERT_TRUE(token_layer(0));
  ASSERT_FALSE(token_layer(1));
  ASSERT_TRUE(model().config().is_sliding(0));
  RestoreOptions ro;
  ro.sink = 4;
  ro.window = 8;
  ro.layers = "0";
  ASSERT_TRUE(ro.token_layers);
  const double token = score_restored(model(), &drafter(), &ftheta(), prompt(), ro).mean_nll();
  ro.token_layers = false;
  const double learned = score_restored(model(), &drafter(), &ftheta(), prompt(), ro).mean_nll();
  ro.mix_alpha = 1.0;
  const double exact = score_restored(model(), &drafter(), &ftheta(), prompt(), ro).mean_nll();
  EXPECT_NEAR(token, exact, 1e-6);
  EXPECT_GT(std::abs(learned - exact), 1e-3);
  std::printf("layer 0: nll from the token %.5f, by a random f_theta %.5f, exact %.5f\n", token, learned, exact);
  for (bool on : {true, false}) {
    auto inc_o = options(DecodeMode::Restored, 0.0, 5), ref_o = options(DecodeMode::RestoredReforward, 0.0, 5);
    inc_o.restore.token_layers = ref_o.restore.token_layers = on;
    EXPECT_EQ(decode(model(), &drafter(), &ftheta(), prompt(), inc_o).tokens,
              decode(model(), &drafter(), &ftheta(), prompt(), ref_o).tokens)
        << "token layers " << on;
  }
}

TEST(Restored, MixAlphaOneHasZeroErrorAndKeepsTrueKv) {
  auto o = options(DecodeMode::Restored, 1.0, 4);
  o.restore.stats = true;
  auto r = decode(model(), &drafter(), &ftheta(), prompt(), o);
  EXPECT_EQ(r.stats.rel(false, false, false), 0.0);
  bool listed = false;
  for (const auto& l : r.memory.kv) listed |= l.part == MemoryPart::TrueRaw && l.bytes > 0;
  EXPECT_TRUE(listed) << r.memory.table();
}

TEST(Restored, MemoryReportHasBaselines) {
  auto r = decode(model(), &drafter(), &ftheta(), prompt(), options(DecodeMode::Restored, 0.0, 4));
  const int64_t n = prompt().size() + 4;
  EXPECT_EQ(r.memory.positions, n);
  EXPECT_EQ(r.memory.full_kv_bytes, 18 * 2 * 256 * n * 4);
  EXPECT_EQ(r.memory.native_kv_bytes, 18 * 2 * 256 * n * 4);  // n < 512: the native cache keeps everything
  // Sliding exact ring: window = 8 slots (prefill chunks attend over [ring ++ chunk]); restored
  // region min(n, 512 - 8 + 7) = n slots.
  EXPECT_EQ(r.memory.kv[0].bytes, 15 * 2 * 256 * 8 * 4);
  EXPECT_EQ(r.memory.kv[1].bytes, 15 * 2 * 256 * n * 4);
  EXPECT_NE(r.memory.table().find("baseline: full KV"), std::string::npos);
}

// Full-attention layers as lm4 rows (the default --full-code); the window of 8 sends most of
// the short CPU prompts' positions through the codes.
DecodeOptions codec_options(DecodeMode mode, int64_t max_new, FullAttn fa = FullAttn::Codec) {
  auto o = options(mode, 1.0, max_new);  // exact restoration on sliding layers: only the codec differs
  o.restore.full_attn = fa;
  return o;
}

const std::vector<std::vector<int64_t>>& codec_prompts() {
  static std::vector<std::vector<int64_t>> p{
      prompt(),
      test::real_prompt("def merge_sort(xs):\n    \"\"\"Sort a list with merge sort.\"\"\"\n    if len(xs) <= 1:\n"
                        "        return xs\n    mid = len(xs) // 2\n")};
  return p;
}

// Free-running greedy text diverges for good at its first differing token, so the bound is on
// per-step agreement: the exact-policy continuation teacher-forced through the codec cache, its
// argmax compared with the exact policy's token at every generated position. The free-running
// agreement is reported.
TEST(RestoredCodec, CloseToExactFullAttention) {
  int64_t same_free = 0, same_forced = 0, total = 0;
  for (const auto& p : codec_prompts()) {
    auto exact = decode(model(), nullptr, nullptr, p, codec_options(DecodeMode::Restored, 32, FullAttn::Exact));
    auto coded = decode(model(), nullptr, nullptr, p, codec_options(DecodeMode::Restored, 32));
    ASSERT_EQ(exact.tokens.size(), 32u);
    ASSERT_EQ(coded.tokens.size(), 32u);
    EXPECT_GT(coded.memory.find(MemoryPart::FullCoded)->bytes, 0) << "positions really went through the codec";
    EXPECT_DOUBLE_EQ(coded.attention_fraction_full, 1.0);
    for (size_t i = 0; i < 32; ++i) same_free += exact.tokens[i] == coded.tokens[i];
    std::vector<int64_t> seq = p;
    seq.insert(seq.end(), exact.tokens.begin(), exact.tokens.end());
    auto forced = score_restored(model(), nullptr, nullptr, seq, codec_options(DecodeMode::Restored, 1).restore);
    for (size_t i = forced.top1.size() - 32; i < forced.top1.size(); ++i) same_forced += forced.top1[i];
    total += 32;
  }
  std::printf("codec vs exact full attention: %lld of %lld tokens equal free-running, %lld of %lld teacher-forced\n",
              (long long)same_free, (long long)total, (long long)same_forced, (long long)total);
  EXPECT_GE(same_forced, total * 9 / 10);
  EXPECT_GE(same_free, total / 2);
}

// The session's first forward sets the coded layers' means: the same first chunk in both.
TEST(RestoredCodec, IncrementalEqualsReforward) {
  auto o = codec_options(DecodeMode::Restored, 4);
  o.restore.chunk = 5;
  auto inc = decode(model(), nullptr, nullptr, prompt(), o);
  o.mode = DecodeMode::RestoredReforward;
  auto ref = decode(model(), nullptr, nullptr, prompt(), o);
  EXPECT_EQ(inc.tokens, ref.tokens);
}

void expect_same_kv_lines(const MemoryReport& measured, const MemoryReport& plan);

// Weighted rows (--full-code pw4): K weights from the shipped bundle (kakeya calibrate k-weights),
// held per session beside the means. Teacher-forced agreement with exact full attention as for
// lm4 above; the bytes as planned; a missing or wrong bundle and a weighted restored region
// refused before any decoding.
TEST(RestoredCodec, WeightedRowsReadTheShippedBundle) {
  RestoreOptions ro = codec_options(DecodeMode::Restored, 1).restore;
  ro.full_code = ops::parse_row_code("pw4", "--full-code");
  ro.calib = test::shipped_dir("calib");
  int64_t same_forced = 0, total = 0;
  for (const auto& p : codec_prompts()) {
    auto exact = decode(model(), nullptr, nullptr, p, codec_options(DecodeMode::Restored, 32, FullAttn::Exact));
    ASSERT_EQ(exact.tokens.size(), 32u);
    std::vector<int64_t> seq = p;
    seq.insert(seq.end(), exact.tokens.begin(), exact.tokens.end());
    auto forced = score_restored(model(), nullptr, nullptr, seq, ro);
    for (size_t i = forced.top1.size() - 32; i < forced.top1.size(); ++i) same_forced += forced.top1[i];
    total += 32;
  }
  std::printf("pw4 vs exact full attention: %lld of %lld tokens equal teacher-forced\n", (long long)same_forced,
              (long long)total);
  EXPECT_GE(same_forced, total * 9 / 10);

  auto o = codec_options(DecodeMode::Restored, 6);
  o.restore.full_code = ro.full_code;
  o.restore.calib = ro.calib;
  auto r = decode(model(), &drafter(), &ftheta(), prompt(), o);
  const int64_t n = prompt().size() + 6;
  expect_same_kv_lines(r.memory, restored_memory_plan(model().config(), &drafter().config(), &ftheta().config(),
                                                      o.restore, at::kFloat, n));
  EXPECT_NE(r.memory.table().find("as pw4 coded rows"), std::string::npos) << r.memory.table();
  // A split code (K rows in pw5, V rows in lm3): the same bytes as pw4, as planned.
  auto split = o;
  split.restore.full_code = ops::parse_row_code("pw5v3", "--full-code");
  auto rs = decode(model(), &drafter(), &ftheta(), prompt(), split);
  expect_same_kv_lines(rs.memory, restored_memory_plan(model().config(), &drafter().config(), &ftheta().config(),
                                                       split.restore, at::kFloat, n));
  EXPECT_NE(rs.memory.table().find("as pw5v3 coded rows"), std::string::npos) << rs.memory.table();
  EXPECT_EQ(rs.memory.find(MemoryPart::FullCoded)->bytes, r.memory.find(MemoryPart::FullCoded)->bytes);
  // A layer's own code (pw5v4 on full-attention layer 5, pw4 on the others): measured as planned, 32
  // more bytes a position and KV head than pw4 (K rows in 5 bits: 160 + 4 bytes against 128 + 4).
  auto mixed = o;
  std::tie(mixed.restore.full_code, mixed.restore.full_code_layers) = ops::parse_layer_codes("pw4+5=pw5v4", "--full-code");
  auto rm = decode(model(), &drafter(), &ftheta(), prompt(), mixed);
  expect_same_kv_lines(rm.memory, restored_memory_plan(model().config(), &drafter().config(), &ftheta().config(),
                                                       mixed.restore, at::kFloat, n));
  EXPECT_NE(rm.memory.table().find("as pw4+5=pw5v4 coded rows"), std::string::npos) << rm.memory.table();
  EXPECT_EQ(rm.memory.find(MemoryPart::FullCoded)->bytes,
            r.memory.find(MemoryPart::FullCoded)->bytes + n * model().config().kv_heads(5) * 32);
  EXPECT_EQ(rm.tokens.size(), 6u);
  auto sliding_layer = mixed;
  std::tie(sliding_layer.restore.full_code, sliding_layer.restore.full_code_layers) =
      ops::parse_layer_codes("pw4+4=pw5v4", "--full-code");
  expect_error([&] { decode(model(), nullptr, nullptr, prompt(), sliding_layer); },
               "--full-code pw4+4=pw5v4: layer 4 is not a full-attention layer that stores K/V (this model's: 5, 11, 17)");

  auto bad = o;
  bad.restore.calib = "";
  expect_error([&] { decode(model(), nullptr, nullptr, prompt(), bad); }, "--full-code pw4 needs --calib DIR");
  bad.restore.calib = "/nonexistent/kakeya-calib";
  expect_error([&] { decode(model(), nullptr, nullptr, prompt(), bad); }, "/nonexistent/kakeya-calib/manifest.json");
  bad = o;
  bad.restore.region_code = ro.full_code;
  expect_error([&] { decode(model(), nullptr, nullptr, prompt(), bad); },
               "--restored-code pw4: weighted codes are for full-attention rows");
}

void expect_same_kv_lines(const MemoryReport& measured, const MemoryReport& plan) {
  ASSERT_EQ(measured.kv.size(), plan.kv.size()) << measured.table() << plan.table();
  for (size_t i = 0; i < plan.kv.size(); ++i) {
    EXPECT_EQ(measured.kv[i].name, plan.kv[i].name);
    EXPECT_EQ(measured.kv[i].bytes, plan.kv[i].bytes) << plan.kv[i].name;
  }
  EXPECT_EQ(measured.full_kv_bytes, plan.full_kv_bytes);
  EXPECT_EQ(measured.native_kv_bytes, plan.native_kv_bytes);
}

TEST(RestoredCodec, MeasuredBytesEqualThePlan) {
  // a = 1 (true raw K/V kept) and a = 0 (drafter raw K/V ring), coded full-attention layers.
  for (double a : {1.0, 0.0}) {
    auto o = codec_options(DecodeMode::Restored, 6);
    o.restore.mix_alpha = a;
    auto r = decode(model(), &drafter(), &ftheta(), prompt(), o);
    const int64_t n = prompt().size() + 6;
    EXPECT_EQ(r.served_positions, n - 1);
    auto plan = restored_memory_plan(model().config(), &drafter().config(), &ftheta().config(), o.restore, at::kFloat, n);
    expect_same_kv_lines(r.memory, plan);
    int64_t coded = 0;
    for (const auto& l : r.memory.kv) coded += l.part == MemoryPart::FullCoded ? l.bytes : 0;
    EXPECT_GT(coded, 0) << r.memory.table();
  }
  // The other policies too, and evict-only (its sinks-only regions).
  for (FullAttn fa : {FullAttn::Exact, FullAttn::Restored})
    for (const char* layers : {"auto", "none"}) {
      auto o = options(DecodeMode::Restored, 0.0, 4);
      o.restore.full_attn = fa;
      o.restore.layers = layers;
      auto r = decode(model(), &drafter(), &ftheta(), prompt(), o);
      const int64_t n = prompt().size() + 4;
      expect_same_kv_lines(r.memory, restored_memory_plan(model().config(), &drafter().config(), &ftheta().config(),
                                                          o.restore, at::kFloat, n));
    }
}

// Exact restoration's prefill chunks past the window over coded full-attention layers: such a
// chunk attends over [the layer's slots ++ itself] and codes itself after. Its own positions are
// read exactly (the whole prompt in one chunk gives the full cache's logits), the coded layer's
// ring keeps what a chunk of the window needs (the bytes of chunks of the window, as planned),
// and chunks of 16 read the first chunk's old positions through their codes (not exactly), about
// as close to the full cache as chunks of the window.
TEST(RestoredCodec, LongChunksReadTheirOwnPositionsExactly) {
  const int64_t n = prompt().size();
  ASSERT_GT(n, 16 + 8);  // the second chunk of 16 reaches past the window of 8
  const auto ids = at::tensor(prompt(), at::kLong).view({1, n});
  KVCacheOptions plain;
  plain.capacity = n;
  KVCache pc(model().config(), plain);
  ForwardOptions fo;
  fo.last_logits_only = true;
  const auto want = at::log_softmax(model().forward(ids, at::arange(n, at::kLong), pc, fo).view({-1}), 0);
  RestoreOptions ro = codec_options(DecodeMode::Restored, 1).restore;
  ASSERT_TRUE(ro.long_chunks());
  auto prefill = [&](int64_t chunk, int64_t* bytes) {
    ro.chunk = chunk;
    KVCache cache(model().config(), restored_cache_options(model(), nullptr, ro, n, false));
    Restorer r(model(), nullptr, nullptr, ro, cache);
    auto lp = at::log_softmax(run_chunks(model(), cache, r, ids, 0, ro.resolved_chunk(), true).view({-1}), 0);
    *bytes = cache.bytes();
    return (lp - want).abs().max().item<double>();  // max |Δ log p| against the full cache
  };
  int64_t b_window = 0, b_whole = 0, b_16 = 0;
  const double window = prefill(ro.window, &b_window), whole = prefill(0, &b_whole), by16 = prefill(16, &b_16);
  std::printf("max |Δ log p| vs the full cache: chunks of the window %.5f, of 16 %.5f, one chunk %.2e\n", window, by16,
              whole);
  EXPECT_LT(whole, 1e-4);
  EXPECT_GT(by16, 1e-3) << "the second chunk reads the first one's old positions through their codes";
  EXPECT_LT(by16, 2 * window + 1e-2);
  EXPECT_EQ(b_whole, b_window);
  EXPECT_EQ(b_16, b_window);
  // Decoding after a long prefill: the bytes the plan names, each position of the span seen once.
  auto o = codec_options(DecodeMode::Restored, 6);
  auto r = decode(model(), nullptr, nullptr, prompt(), o);
  expect_same_kv_lines(r.memory, restored_memory_plan(model().config(), nullptr, nullptr, o.restore, at::kFloat, n + 6));
  EXPECT_DOUBLE_EQ(r.attention_fraction_full, 1.0);
  EXPECT_DOUBLE_EQ(r.attention_fraction_sliding, 1.0);
}

TEST(RestoredCodec, PlanAt8kIsWithinAFifthOfFullKv) {
  const auto& cfg = model().config();
  auto dc = DrafterConfig::from_file(test::shipped_dir("drafter") + "/config.json");
  auto fc = FThetaConfig::from_file(test::shipped_dir("ftheta") + "/f_theta_config.json");
  RestoreOptions o;
  // Sink 4, window 128, chunk 64, int4 restored regions: the compact layout in bf16.
  o.window = 128;
  o.chunk = 64;
  o.region_code = {ops::RowKind::Affine, 4};
  const int64_t n = 8192;
  for (ops::RowCode code : {ops::RowCode{ops::RowKind::Rotated, 4}, ops::RowCode{ops::RowKind::Rotated, 3}}) {
    o.full_code = code;
    o.full_attn = FullAttn::Codec;
    auto coded = restored_memory_plan(cfg, &dc, &fc, o, at::kBFloat16, n);
    o.full_attn = FullAttn::Exact;
    auto exact = restored_memory_plan(cfg, &dc, &fc, o, at::kBFloat16, n);
    const double rc = (double)coded.kv_bytes() / coded.full_kv_bytes, re = (double)exact.kv_bytes() / exact.full_kv_bytes;
    const double nc = (double)coded.kv_bytes() / coded.native_kv_bytes;
    std::printf("8k, %s: codec %.4fx of full KV (%.4fx native), exact full attention %.4fx\n%s",
                ops::row_code_name(code).c_str(), rc, nc, re, coded.table().c_str());
    EXPECT_LE(rc, 0.2);
    EXPECT_GT((double)exact.kv_bytes() / exact.native_kv_bytes, 0.9);  // the codec is what shrinks it
    if (code.bits == 3) EXPECT_LE(nc, 0.35);
  }
}

// ---- restored regions stored as coded rows (--restored-code int8 | int4) ----

DecodeOptions coded_region_options(DecodeMode mode, int bits, double alpha, int64_t max_new) {
  auto o = options(mode, alpha, max_new);
  o.restore.region_code = {ops::RowKind::Affine, bits};
  return o;
}

// The coded region changes what restored positions hold, not the rules: the incremental decoder
// and its reforward reference quantize the same restored rows, so they agree token for token.
TEST(RestoredRegionCode, IncrementalEqualsReforward) {
  // int4, lm4, ru5 (evenly spaced levels) and ru5v3 (V rows in 3 bits) regions.
  for (ops::RowCode code : {ops::RowCode{ops::RowKind::Affine, 4}, {ops::RowKind::Rotated, 4},
                            {ops::RowKind::Rotated, 5, false, true}, {ops::RowKind::Rotated, 5, false, true, 3}}) {
    auto oi = options(DecodeMode::Restored, 0.0, 4);
    oi.restore.region_code = code;
    auto inc = decode(model(), &drafter(), &ftheta(), prompt(), oi);
    auto o = options(DecodeMode::RestoredReforward, 0.0, 4);
    o.restore.region_code = code;
    o.restore.chunk = 5;
    auto ref = decode(model(), &drafter(), &ftheta(), prompt(), o);
    EXPECT_EQ(inc.tokens, ref.tokens) << ops::row_code_name(code);
    EXPECT_DOUBLE_EQ(inc.attention_fraction_sliding, 1.0);
  }
}

// Exact restoration (a = 1) through coded regions: the teacher-forced NLL of the prompt stays
// close to the full cache's (8 bits closer than 4), yet differs (the codes really are read), and
// the region costs the coded bytes the plan computes: 288 (8 bits) / 160 (4 bits) bytes per
// 256-value row against 1024 in f32.
TEST(RestoredRegionCode, ExactRestorationStaysCloseAndCostsTheCodedBytes) {
  ScoreOptions so;
  const double ar = score(model(), prompt(), so).mean_nll();
  double err[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    const int bits = i == 0 ? 8 : 4;
    auto o = coded_region_options(DecodeMode::Restored, bits, 1.0, 4);
    err[i] = std::abs(score_restored(model(), nullptr, nullptr, prompt(), o.restore).mean_nll() - ar);
    auto r = decode(model(), nullptr, nullptr, prompt(), o);
    const int64_t n = prompt().size() + 4;
    expect_same_kv_lines(r.memory, restored_memory_plan(model().config(), nullptr, nullptr, o.restore, at::kFloat, n));
    // 15 sliding layers, K and V, one KV head, min(n, 512 - window + chunk - 1) = n slots.
    EXPECT_EQ(r.memory.find(MemoryPart::SlidingRestored)->bytes, 15 * 2 * n * (bits == 8 ? 288 : 160));
    EXPECT_NE(r.memory.table().find(bits == 8 ? "int8 coded rows" : "int4 coded rows"), std::string::npos);
  }
  std::printf("coded restored region, exact restoration: |NLL - full cache| = %.5f (int8), %.5f (int4)\n", err[0], err[1]);
  EXPECT_GT(err[0], 0.0);
  EXPECT_LT(err[0], 0.01);
  EXPECT_LT(err[1], 0.1);
  EXPECT_LT(err[0], err[1]);
}

TEST(Restored, BudgetFitIsTheLongestContextUnderTheBudget) {
  auto bytes = [](int64_t n) { return 1000 + 7 * std::min<int64_t>(n, 100) + 3 * n; };  // non-decreasing
  for (int64_t budget : {500, 1007, 1010, 2000, 50000}) {
    BudgetFit f = fit_budget(bytes, budget, 4000, 64);
    int64_t brute = 0;
    for (int64_t n = 1; n <= 4000 && bytes(n) <= budget; ++n) brute = n;
    EXPECT_EQ(f.longest, brute) << budget;
    EXPECT_EQ(f.limited_by_model, bytes(4000) <= budget) << budget;
    EXPECT_EQ(f.sessions, budget / bytes(64)) << budget;
  }
  expect_error([&] { fit_budget(bytes, 0, 4000, 64); }, "budget");
  expect_error([&] { fit_budget(bytes, 100, 4000, 5000); }, "context 5000");
}

TEST(Restored, BenchMemoryRowsAreWhatThePlansFit) {
  // The shipped pair's shapes in bf16, no decoding: every row's fit comes from the plans.
  const auto& cfg = model().config();
  auto dc = DrafterConfig::from_file(test::shipped_dir("drafter") + "/config.json");
  auto fc = FThetaConfig::from_file(test::shipped_dir("ftheta") + "/f_theta_config.json");
  BenchMemoryOptions o;
  o.configs = "oracle,evict:256,restored:256,restored-int4:256";
  o.budgets = {40ll << 20, 256ll << 20};
  auto r = bench_memory(cfg, at::kBFloat16, &dc, &fc, o);
  std::printf("%s", bench_memory_table(r).c_str());
  ASSERT_EQ(r["configs"].size(), 4u);
  std::map<std::string, int64_t> at_context;
  for (const auto& row : r["configs"]) {
    const auto c = parse_long_eval_config(row["config"], o.restore);
    auto bytes = [&](int64_t n) {
      return c.oracle() ? ar_memory_plan(cfg, at::kBFloat16, n).kv_bytes()
                        : restored_memory_plan(cfg, &dc, &fc, c.restore, at::kBFloat16, n).kv_bytes();
    };
    at_context[c.name] = row["kv_bytes_at_context"];
    EXPECT_EQ(row["kv_bytes_at_context"].get<int64_t>(), bytes(8192));
    ASSERT_FALSE(row["curve"].empty());
    EXPECT_EQ(row["curve"].back()["context"].get<int64_t>(), cfg.max_position_embeddings);  // the curve's ladder
    for (const auto& p : row["curve"]) EXPECT_EQ(p["kv_bytes"].get<int64_t>(), bytes(p["context"].get<int64_t>()));
    for (const auto& f : row["budgets"]) {
      const int64_t budget = f["budget_bytes"], n = f["longest_context"];
      EXPECT_EQ(f["sessions"].get<int64_t>(), budget / bytes(8192)) << c.name;
      EXPECT_LE(bytes(n), budget) << c.name;
      if (!f["limited_by_model"].get<bool>()) EXPECT_GT(bytes(n + 1), budget) << c.name;
      else EXPECT_EQ(n, cfg.max_position_embeddings) << c.name;
    }
  }
  EXPECT_DOUBLE_EQ(r["configs"][0]["ratio_vs_native_at_context"].get<double>(), 1.0);  // the oracle is the native cache
  EXPECT_LT(at_context["restored-int4:256"], at_context["restored:256"]);
  // Bad input names the flag.
  BenchMemoryOptions bad = o;
  bad.context = cfg.max_position_embeddings + 1;
  expect_error([&] { bench_memory(cfg, at::kBFloat16, &dc, &fc, bad); }, "--context");
  bad = o;
  bad.configs = "restored-int3:256";
  expect_error([&] { bench_memory(cfg, at::kBFloat16, &dc, &fc, bad); }, "unknown modifier 'int3'");
  bad.configs = "restored:abc";
  expect_error([&] { bench_memory(cfg, at::kBFloat16, &dc, &fc, bad); }, "--configs");
}

TEST(Restored, BenchMemoryRefusesAChunkPastTheWindow) {
  // A plan never decodes, so the window/chunk rule the decoder enforces must hold here too: a
  // 128-token chunk over a 64-token window would need restored K/V of the chunk itself.
  auto dc = DrafterConfig::from_file(test::shipped_dir("drafter") + "/config.json");
  auto fc = FThetaConfig::from_file(test::shipped_dir("ftheta") + "/f_theta_config.json");
  BenchMemoryOptions o;
  o.configs = "oracle,restored-int8:64";
  o.restore.chunk = 128;
  expect_error([&] { bench_memory(model().config(), at::kBFloat16, &dc, &fc, o); }, "--chunk expected in [1, window=64]");
  o.restore.chunk = 64;
  EXPECT_EQ(bench_memory(model().config(), at::kBFloat16, &dc, &fc, o)["configs"].size(), 2u);
  // Exact restoration takes the longer chunk, in the bytes of chunks of the window.
  o.configs = "oracle,exact-int8:64";
  const auto w = bench_memory(model().config(), at::kBFloat16, &dc, &fc, o);
  o.restore.chunk = 1024;
  const auto l = bench_memory(model().config(), at::kBFloat16, &dc, &fc, o);
  EXPECT_EQ(l["configs"][1]["kv_bytes_at_context"], w["configs"][1]["kv_bytes_at_context"]);
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
  // An f_θ made for another verifier.
  ModelConfig other_verifier = model().config();
  other_verifier.hidden_size = 1024;
  auto foreign = FTheta::random(FThetaConfig::for_pair(other_verifier, drafter().config(), 16), 1, at::kFloat, at::kCPU);
  expect_error([&] { decode(model(), &drafter(), &foreign, prompt(), o); }, "trained for another verifier");
  o.restore.full_attn = FullAttn::Codec;
  o.restore.full_code = {ops::RowKind::Affine, 3};
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "--full-code on layer 5: affine codes take 8, 6 or 4 bits");
  o.restore.full_code = {};
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "needs a --full-code");
  o.restore.full_code = {ops::RowKind::Rotated, 4};
  o.restore.full_attn = FullAttn::Exact;
  o.restore.chunk = 9;
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "--chunk");
  o.restore.chunk = 0;
  o.restore.mix_alpha = 1.5;
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "--mix-alpha");
  o.restore.mix_alpha = 0.0;
  for (const char* bad : {"5", "40", "1,x", "sliding"}) {  // layer 5 is a full-attention layer
    o.restore.layers = bad;
    expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "--restore-layers");
  }
  o.restore.layers = "none";
  o.restore.stats = true;
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "--stats");
  o.restore.layers = "auto";
  o.restore.stats = false;
  o.restore.region_code = {ops::RowKind::Rotated, 6};
  expect_error([&] { decode(model(), &drafter(), &ftheta(), prompt(), o); }, "--restored-code on layer 0: lm6: bits expected 2, 3, 4 or 5");
  expect_error([] { ops::parse_row_code("int2", "--restored-code"); }, "--restored-code: expected none | int8 | int6 | int4 | lm5 | lm4 | lm3 | lm2");
}

}  // namespace

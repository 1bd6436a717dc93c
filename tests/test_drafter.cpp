// The DFlash drafter against the `dflash` package's torch reference on tiny
// random configs (fixtures by tests/fixtures/make_drafter_fixtures.py), the
// z-lab checkpoint layout both ways, load-time errors, and the speculative
// loop against greedy AR (token-identical) on the same tiny targets.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "core/model/drafter.h"
#include "core/error.h"
#include "core/model/model.h"
#include "infer/generate.h"
#include "infer/speculative.h"
#include "tests/drafter_test_util.h"
#include "tests/test_util.h"

using namespace kakeya;
using json = nlohmann::json;

namespace {

std::string case_dir(const std::string& name) { return test::fixtures_dir("drafter") + "/" + name; }

struct Case {
  std::unique_ptr<Model> target;  // the drafter keeps a pointer to it: stable address
  std::unique_ptr<Drafter> drafter;
  TensorStore expected;
  json meta;
};

Case load(const std::string& name) {
  const std::string dir = case_dir(name);
  ModelOptions mo;
  mo.max_positions = 64;
  Case c{std::make_unique<Model>(Model::load(dir + "/target", mo)), nullptr,
         TensorStore::open_file(dir + "/expected.safetensors"), json()};
  c.drafter = std::make_unique<Drafter>(Drafter::load(dir + "/drafter", *c.target));
  std::ifstream f(dir + "/expected.json");
  c.meta = json::parse(f);
  return c;
}

std::vector<int64_t> to_vec(const at::Tensor& t) {
  auto c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// Tolerance: 1e-4 of the logit scale (f32, same op order as the reference).
void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  double scale = want.abs().max().item<double>();
  double diff = (got - want).abs().max().item<double>();
  EXPECT_LE(diff, 1e-4 * scale) << what << ": max |Δlogit| " << diff << " at scale " << scale;
}

// No std::filesystem here (core/io/fs.h says why): POSIX and the shell.
void remove_all(const std::string& d) { ASSERT_EQ(std::system(("rm -rf '" + d + "'").c_str()), 0); }
void copy_file(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  std::ofstream out(to, std::ios::binary);
  out << in.rdbuf();
  ASSERT_TRUE(in.good() && out.good()) << from << " -> " << to;
}
std::string temp_dir(const std::string& tag) {
  std::string d = fs::temp_dir() + "/kakeya_drafter_" + tag + "_" + std::to_string(::getpid());
  remove_all(d);
  fs::make_dirs(d);
  return d;
}

class DrafterParity : public ::testing::TestWithParam<std::string> {};

// The reference's draft logits after extending the context by 9, 3, 1 and 4 positions.
TEST_P(DrafterParity, DraftLogitsAfterContextExtensions) {
  auto c = load(GetParam());
  const Drafter& d = *c.drafter;
  auto ids = c.expected.get("ids");
  auto feats = test::target_features(*c.target, d, ids.unsqueeze(0));  // [1, T, n·H]
  auto steps = c.expected.get("steps");
  auto cache = d.make_cache(ids.size(0));
  const int64_t B = c.meta["block_size"];
  EXPECT_EQ(d.config().block_size, B);
  EXPECT_EQ(d.config().target_layer_ids, c.meta["target_layer_ids"].get<std::vector<int64_t>>());
  for (int64_t i = 0; i < steps.size(0); ++i) {
    int64_t c0 = steps[i][0].item<int64_t>(), s = steps[i][1].item<int64_t>();
    ASSERT_EQ(cache.length(), c0);
    d.extend(cache, feats.slice(1, c0, s));
    auto block = at::full({1, B}, d.config().mask_token_id, at::kLong);
    block[0][0] = ids[s];
    auto lg = d.draft(cache, block);
    expect_close(lg[0], c.expected.get("step" + std::to_string(i) + "_logits"),
                 GetParam() + " step " + std::to_string(i));
  }
}

// The reference's own greedy decode loop: same draft logits block by block, same output.
TEST_P(DrafterParity, SpeculativeLoopMatchesDFlashGenerate) {
  auto c = load(GetParam());
  auto prompt = to_vec(c.expected.get("prompt"));
  auto want = to_vec(c.expected.get("output"));
  DecodeOptions so;
  so.max_new_tokens = c.meta["max_new_tokens"];
  std::vector<at::Tensor> drafts;
  SpeculativeHooks hooks;
  hooks.on_draft = [&](int64_t, const at::Tensor& lg) { drafts.push_back(lg.clone()); };
  auto r = speculative_generate(*c.target, *c.drafter, prompt, so, hooks);
  std::vector<int64_t> got(prompt);
  got.insert(got.end(), r.tokens.begin(), r.tokens.end());
  EXPECT_EQ(got, want);
  ASSERT_EQ((int64_t)drafts.size(), c.meta["generate_blocks"].get<int64_t>());
  for (size_t j = 0; j < drafts.size(); ++j)
    expect_close(drafts[j], c.expected.get("gen" + std::to_string(j) + "_logits"),
                 GetParam() + " generate block " + std::to_string(j));
  EXPECT_EQ(r.committed_tokens() + 1, (int64_t)r.tokens.size());
}

// Extending the context in pieces gives the same cache as one extension, and
// taps see the drafter's per-layer K and V at exactly the committed positions.
TEST_P(DrafterParity, IncrementalContextEqualsOneShotAndTapsSeeKV) {
  auto c = load(GetParam());
  const Drafter& d = *c.drafter;
  const auto& cfg = d.config();
  auto ids = c.expected.get("ids");
  auto feats = test::target_features(*c.target, d, ids.unsqueeze(0));  // [1, T, n·H]
  const int64_t T = ids.size(0);
  auto whole = d.make_cache(T), pieces = d.make_cache(T);
  d.extend(whole, feats);
  struct KV : TapSubscriber {
    std::vector<std::tuple<Tap, int64_t, at::Tensor, at::Tensor>> seen;
    void on_tap(Tap t, const TapContext& ctx, at::Tensor& x) override {
      seen.emplace_back(t, ctx.layer, ctx.positions.clone(), x.clone());
    }
  } kv;
  Taps taps;
  taps.subscribe(&kv);
  for (auto [a, b] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 6}, {6, T}}) {
    kv.seen.clear();
    d.extend(pieces, feats.slice(1, a, b), &taps);
    ASSERT_EQ(kv.seen.size(), (size_t)(4 * cfg.num_layers));  // KProj, VProj, KNorm, VNorm per layer
    for (auto& [tap, layer, pos, x] : kv.seen) {
      EXPECT_EQ(to_vec(pos), to_vec(at::arange(a, b)));
      EXPECT_EQ(x.sizes(), at::IntArrayRef({1, b - a, cfg.num_kv_heads, cfg.head_dim})) << tap_name(tap);
    }
  }
  // Same math on different row counts: equal up to f32 GEMM blocking (1e-5 of the scale).
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    for (auto [a, b] : {std::make_pair(whole.keys(l), pieces.keys(l)), std::make_pair(whole.values(l), pieces.values(l))}) {
      auto x = a.slice(2, 0, T), y = b.slice(2, 0, T);
      EXPECT_LE((x - y).abs().max().item<double>(), 1e-5 * x.abs().max().item<double>()) << "layer " << l;
    }
}

// z-lab layout: what we save loads back identically here and in dflash's own code.
TEST_P(DrafterParity, CheckpointRoundTrip) {
  auto c = load(GetParam());
  const std::string dir = temp_dir("rt_" + GetParam());
  c.drafter->save(dir, at::kFloat, {{"note", "round trip"}});
  auto again = Drafter::load(dir, *c.target);
  auto a = c.drafter->named_parameters(), b = again.named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
  }
  const auto& x = c.drafter->config();
  const auto& y = again.config();
  EXPECT_EQ(x.target_layer_ids, y.target_layer_ids);
  EXPECT_EQ(x.mask_token_id, y.mask_token_id);
  EXPECT_EQ(x.block_size, y.block_size);
  EXPECT_EQ(x.layer_types, y.layer_types);
  EXPECT_EQ(x.sliding_window, y.sliding_window);
  EXPECT_EQ(x.is_causal, y.is_causal);
  EXPECT_EQ(x.input_embedding_scale, y.input_embedding_scale);
  EXPECT_EQ(x.output_multiplier, y.output_multiplier);
  EXPECT_EQ(x.final_logit_softcap, y.final_logit_softcap);
  EXPECT_FALSE(y.target_layer_ids_derived);  // saved explicitly
  // Reference weights file names: exactly the z-lab set, nothing else.
  auto st = TensorStore::open_dir(dir);
  EXPECT_EQ(st.names().size(), a.size());
  EXPECT_TRUE(st.has("fc.weight") && st.has("hidden_norm.weight") && st.has("norm.weight") &&
              st.has("layers.0.self_attn.q_proj.weight") && st.has("layers.0.mlp.down_proj.weight"));
  // ... and they load in dflash.
  const std::string cmd = test::env_or_fail("KAKEYA_PYTHON") + " " + test::env_or_fail("KAKEYA_SOURCE_DIR") +
                          "/tests/fixtures/check_drafter_load.py " + dir + " " + case_dir(GetParam()) + "/drafter";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  // bf16 (what we ship): the values are the bf16 roundings.
  const std::string dir16 = temp_dir("bf16_" + GetParam());
  c.drafter->save(dir16, at::kBFloat16);
  auto st16 = TensorStore::open_dir(dir16);
  EXPECT_EQ(st16.get("fc.weight").scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(st16.get("fc.weight").to(at::kFloat), a[0].second.to(at::kBFloat16).to(at::kFloat)));
  remove_all(dir);
  remove_all(dir16);
}

// Greedy verification is lossless: token-identical to greedy AR for any
// drafter. The fixture's random drafter is almost always rejected, so an
// "oracle" edit also proposes AR's own continuation with one wrong token in
// every block, which makes every acceptance length occur.
TEST_P(DrafterParity, SpeculativeEqualsGreedyAR) {
  auto c = load(GetParam());
  auto prompt = to_vec(c.expected.get("prompt"));
  const int64_t n_new = 24;
  DecodeOptions go;
  go.max_new_tokens = n_new;
  auto ar = generate(*c.target, prompt, go).tokens;
  for (int64_t B : {2, 3, 4, 8}) {
    for (bool oracle : {false, true}) {
      DecodeOptions so;
      so.max_new_tokens = n_new;
      so.block_size = B;
      int64_t blocks = 0;
      SpeculativeHooks hooks;
      if (oracle)
        hooks.edit_draft = [&](int64_t start, at::Tensor& drafts) {
          const int64_t g = start - (int64_t)prompt.size() + 1;  // AR index of the first draft
          const int64_t wrong = (blocks++ * 7 + 1) % (B + 1);    // B - 1 or more: every draft right
          const int64_t V = c.target->config().vocab_size;
          for (int64_t i = 0; i < drafts.size(0); ++i)
            if (g + i < n_new) drafts[i] = (ar[g + i] + (i == wrong ? 1 : 0)) % V;
        };
      // The drafter's K/V taps see every committed position exactly once, in order.
      struct Positions : TapSubscriber {
        std::vector<int64_t> seen;
        void on_tap(Tap t, const TapContext& ctx, at::Tensor&) override {
          if (t == Tap::KProj && ctx.layer == 0) {
            auto p = ctx.positions.cpu();
            seen.insert(seen.end(), p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
          }
        }
      } pos;
      Taps taps;
      taps.subscribe(&pos);
      hooks.drafter_taps = &taps;
      auto r = speculative_generate(*c.target, *c.drafter, prompt, so, hooks);
      EXPECT_EQ(r.tokens, ar) << GetParam() << " B=" << B << (oracle ? " oracle" : " drafter");
      EXPECT_EQ(pos.seen, to_vec(at::arange((int64_t)(prompt.size() + r.committed_tokens()))));
      for (int64_t k : r.committed) EXPECT_TRUE(k >= 1 && k <= B);
      if (oracle && B > 2) EXPECT_GT(r.tau(), 1.5) << "the oracle's proposals should be accepted";
    }
  }
}

// FR-Spec draft vocabulary: greedy drafts are the argmax of the drafter's logits over the
// subset (reference: logits() restricted by index_select), a vocabulary of every id changes
// nothing, it survives save/load (and DrafterOptions::draft_vocab = false ignores it), the
// memory report counts its head rows, and bad files are refused naming the file.
TEST_P(DrafterParity, DraftVocabRestrictsGreedyDrafts) {
  auto c = load(GetParam());
  Drafter& d = *c.drafter;
  const int64_t V = c.target->lm_head().size(0), H = d.config().hidden_size;
  at::manual_seed(3);
  at::Tensor hidden = at::randn({2, 5, H});  // [B, T, H]
  at::Tensor logits = d.logits(hidden);       // [B, T, V]
  EXPECT_TRUE(at::equal(d.draft_tokens(hidden), logits.argmax(-1)));
  const int64_t bytes = d.weight_bytes();
  // A third of the vocabulary that leaves out every full-vocabulary argmax: the restriction must show.
  at::Tensor banned = at::zeros({V}, at::kBool).index_fill_(0, logits.argmax(-1).flatten(), true);
  at::Tensor ids = at::randperm(V, at::kLong);
  ids = ids.index_select(0, banned.index_select(0, ids).logical_not().nonzero().flatten()).narrow(0, 0, V / 3);
  d.set_draft_vocab(ids, "test");
  at::Tensor got = d.draft_tokens(hidden);  // [B, T]
  at::Tensor want = ids.index_select(0, logits.index_select(-1, ids).argmax(-1).flatten()).view({2, 5});
  EXPECT_TRUE(at::equal(got, want)) << got << want;
  EXPECT_FALSE(banned.index_select(0, got.flatten()).any().item<bool>());
  EXPECT_EQ(d.weight_bytes(), bytes + (V / 3) * H * (int64_t)c.target->lm_head().element_size() + (V / 3) * 8);
  // Saved beside the weights, loaded back; ignored on request.
  const std::string dir = temp_dir("vocab_" + GetParam());
  d.save(dir, at::kFloat);
  EXPECT_TRUE(at::equal(Drafter::load(dir, *c.target).draft_vocab(), ids));
  DrafterOptions no_vocab;
  no_vocab.draft_vocab = false;
  EXPECT_TRUE(at::equal(Drafter::load(dir, *c.target, no_vocab).draft_tokens(hidden), logits.argmax(-1)));
  // Every id, in any order: the whole vocabulary again.
  d.set_draft_vocab(at::randperm(V, at::kLong), "test");
  EXPECT_TRUE(at::equal(d.draft_tokens(hidden), logits.argmax(-1)));
  d.set_draft_vocab(at::Tensor(), "test");
  EXPECT_EQ(d.weight_bytes(), bytes);
  // Bad files.
  const std::string file = dir + "/" + Drafter::kDraftVocabFile;
  auto refuse = [&](const std::map<std::string, at::Tensor>& t, const std::string& needle) {
    save_safetensors(file, t);
    try {
      Drafter::load(dir, *c.target);
      ADD_FAILURE() << "expected an error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    }
  };
  refuse({{"ids", at::tensor(std::vector<int64_t>{1, 2, V}, at::kLong)}}, "expected [0, " + std::to_string(V));
  refuse({{"ids", at::tensor(std::vector<int64_t>{1, 2, 1}, at::kLong)}}, "repeats");
  refuse({{"ids", at::tensor(std::vector<int32_t>{1, 2}, at::kInt)}}, "int64");
  refuse({{"tokens", at::tensor(std::vector<int64_t>{1, 2}, at::kLong)}}, "missing tensor 'ids'");
  remove_all(dir);
}

// A stop token inside an accepted block ends generation right after it,
// exactly where AR stops; the budget cuts a block the same way.
TEST_P(DrafterParity, StopTokenInsideABlockAndBudget) {
  auto c = load(GetParam());
  auto prompt = to_vec(c.expected.get("prompt"));
  DecodeOptions go;
  go.max_new_tokens = 20;
  auto free_run = generate(*c.target, prompt, go).tokens;
  const int64_t stop = free_run[6];
  go.stop_ids = {stop};
  auto ar = generate(*c.target, prompt, go).tokens;
  ASSERT_LE(ar.size(), 7u);
  for (int64_t B : {4, 8}) {
    DecodeOptions so;
    so.max_new_tokens = 20;
    so.block_size = B;
    so.stop_ids = {stop};
    SpeculativeHooks hooks;
    hooks.edit_draft = [&](int64_t start, at::Tensor& drafts) {  // AR's continuation: the stop lands mid-block
      const int64_t g = start - (int64_t)prompt.size() + 1;
      for (int64_t i = 0; i < drafts.size(0); ++i)
        if (g + i < (int64_t)free_run.size()) drafts[i] = free_run[g + i];
    };
    auto r = speculative_generate(*c.target, *c.drafter, prompt, so, hooks);
    EXPECT_EQ(r.tokens, ar) << GetParam() << " B=" << B;
    // Budget: 5 tokens with B=8 and perfect drafts: one prefill token + one block cut to 4.
    so.stop_ids.clear();
    so.max_new_tokens = 5;
    auto r5 = speculative_generate(*c.target, *c.drafter, prompt, so, hooks);
    EXPECT_EQ(r5.tokens, std::vector<int64_t>(free_run.begin(), free_run.begin() + 5));
    EXPECT_EQ(r5.committed, std::vector<int64_t>({4}));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, DrafterParity, ::testing::Values("qwen3", "gemma3", "qwen3_causal"));

TEST(DrafterConfig, DerivedTargetLayerIdsMatchDFlash) {
  // Values of dflash.model.build_target_layer_ids (Python rounds halves to even: 4.5 -> 4, 11.5 -> 12).
  EXPECT_EQ(dflash_target_layer_ids(36, 5), std::vector<int64_t>({1, 9, 17, 25, 33}));
  EXPECT_EQ(dflash_target_layer_ids(18, 5), std::vector<int64_t>({1, 4, 8, 12, 15}));
  EXPECT_EQ(dflash_target_layer_ids(18, 4), std::vector<int64_t>({1, 6, 10, 15}));
  EXPECT_EQ(dflash_target_layer_ids(18, 1), std::vector<int64_t>({9}));
  EXPECT_EQ(dflash_target_layer_ids(62, 7), std::vector<int64_t>({1, 11, 20, 30, 40, 49, 59}));
  EXPECT_EQ(dflash_target_layer_ids(12, 6), std::vector<int64_t>({1, 3, 4, 6, 7, 9}));
}

// ---- bad input: clear errors at load time, naming the file and the field ----

json fixture_config(const std::string& name) {
  std::ifstream f(case_dir(name) + "/drafter/config.json");
  return json::parse(f);
}

// Copies the fixture drafter with a changed config and expects Drafter::load to
// fail with every one of `needles` in the message.
void expect_load_error(const std::string& name, const std::function<void(json&)>& edit,
                       const std::vector<std::string>& needles) {
  auto c = load(name);
  const std::string dir = temp_dir("bad_" + name);
  copy_file(case_dir(name) + "/drafter/model.safetensors", dir + "/model.safetensors");
  json j = fixture_config(name);
  edit(j);
  std::ofstream(dir + "/config.json") << j.dump(2);
  try {
    Drafter::load(dir, *c.target);
    ADD_FAILURE() << "expected an error containing " << needles[0];
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg;
    EXPECT_NE(msg.find(dir), std::string::npos) << "message should name the file: " << msg;
  }
  remove_all(dir);
}

TEST(DrafterErrors, HiddenSizeMismatch) {
  expect_load_error("gemma3", [](json& j) { j["hidden_size"] = 64; }, {"dimension mismatch", "hidden_size", "48"});
}

TEST(DrafterErrors, MaskTokenOutsideVocabulary) {
  expect_load_error("gemma3", [](json& j) { j["dflash_config"]["mask_token_id"] = 101; },
                    {"mask_token_id", "outside the target vocabulary"});
  expect_load_error("gemma3", [](json& j) { j["dflash_config"].erase("mask_token_id"); }, {"mask_token_id"});
}

TEST(DrafterErrors, LayerIdsOutOfRange) {
  expect_load_error("gemma3", [](json& j) { j["dflash_config"]["target_layer_ids"] = {0, 3, 6}; },
                    {"target_layer_ids[2]", "6", "out of range"});
  expect_load_error("gemma3", [](json& j) { j["dflash_config"]["target_layer_ids"] = {0, -1, 5}; },
                    {"target_layer_ids[1]", "negative"});
  // Derived ids (no target_layer_ids) for a drafter that claims another target depth.
  expect_load_error("qwen3", [](json& j) { j["num_target_layers"] = 9; }, {"num_target_layers", "9", "5 layers"});
}

TEST(DrafterErrors, FeatureCountMismatchWithWeights) {
  // Two layer ids where the weights were made for three: fc's input width names the problem.
  expect_load_error("gemma3", [](json& j) { j["dflash_config"]["target_layer_ids"] = {0, 3}; },
                    {"dimension mismatch", "fc.weight", "144", "96"});
}

TEST(DrafterErrors, UnsupportedVariantsAndMalformedFields) {
  expect_load_error("qwen3", [](json& j) { j["architectures"] = {"DFlash2DraftModel"}; }, {"DFlash2DraftModel"});
  expect_load_error("qwen3", [](json& j) { j["block_size"] = 1; }, {"block_size"});
  expect_load_error("qwen3", [](json& j) { j["dflash_config"]["input_embedding_scale"] = "big"; },
                    {"dflash_config.input_embedding_scale", "number"});
  expect_load_error("gemma3", [](json& j) { j["use_sliding_window"] = false; }, {"use_sliding_window"});
  expect_load_error("qwen3", [](json& j) { j["num_attention_heads"] = 3; }, {"num_attention_heads"});
}

TEST(DrafterErrors, MissingDirectoryAndUnknownTensor) {
  auto c = load("qwen3");
  EXPECT_THROW(Drafter::load("/nonexistent/drafter", *c.target), Error);
  const std::string dir = temp_dir("extra");
  c.drafter->save(dir, at::kFloat);
  auto st = TensorStore::open_dir(dir);
  std::map<std::string, at::Tensor> t;
  for (const auto& n : st.names()) t[n] = st.get(n).clone();
  t["layers.0.attention_conv.base_kernel"] = at::zeros({2, 2, 48});
  save_safetensors(dir + "/model.safetensors", t);
  try {
    Drafter::load(dir, *c.target);
    ADD_FAILURE() << "expected an error for an unknown tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attention_conv.base_kernel"), std::string::npos) << e.what();
  }
  remove_all(dir);
}

}  // namespace

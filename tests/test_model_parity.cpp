// Our decoder against HF transformers on tiny random configs of every family
// (fixtures by tests/fixtures/make_model_fixtures.py): full forward, chunked
// prefill through sliding rings, token-by-token decode, and truncate + redo.
#include <ATen/ATen.h>

#include "core/error.h"
#include "core/model/model.h"
#include "core/model/random_weights.h"
#include "tests/test_util.h"

using namespace kakeya;

namespace {

struct Case {
  Model model;
  at::Tensor ids;       // [T]
  at::Tensor expected;  // [T, V]
};

Case load(const std::string& name) {
  std::string dir = test::fixtures_dir("model_parity") + "/" + name;
  auto exp = TensorStore::open_file(dir + "/expected.safetensors");
  ModelOptions mo;
  mo.max_positions = 64;
  return {Model::load(dir, mo), exp.get("ids"), exp.get("logits")};
}

// Tolerance: 1e-4 of the logit scale (f32, same op order as HF).
void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  double scale = want.abs().max().item<double>();
  double diff = (got - want).abs().max().item<double>();
  EXPECT_LE(diff, 1e-4 * scale) << what << ": max |Δlogit| " << diff << " at scale " << scale;
}

// Forward ids in chunks of the given sizes (cycled) through one cache.
at::Tensor run_chunks(const Model& m, const at::Tensor& ids, std::vector<int64_t> chunks, int64_t rollback) {
  KVCacheOptions co;
  co.capacity = ids.size(0);
  co.rollback = rollback;
  KVCache cache(m.config(), co);
  std::vector<at::Tensor> out;
  int64_t i = 0, c = 0;
  while (i < ids.size(0)) {
    int64_t n = std::min(chunks[c++ % chunks.size()], ids.size(0) - i);
    out.push_back(m.forward(ids.slice(0, i, i + n).unsqueeze(0), cache).squeeze(0));
    i += n;
  }
  EXPECT_EQ(cache.length(), ids.size(0));
  return at::cat(out);
}

class Parity : public ::testing::TestWithParam<std::string> {};

TEST_P(Parity, FullForward) {
  auto c = load(GetParam());
  expect_close(run_chunks(c.model, c.ids, {c.ids.size(0)}, 0), c.expected, GetParam() + " full forward");
}

TEST_P(Parity, TokenByTokenDecode) {
  auto c = load(GetParam());
  expect_close(run_chunks(c.model, c.ids, {1}, 0), c.expected, GetParam() + " incremental decode");
}

TEST_P(Parity, ChunkedPrefillThroughSlidingRing) {
  auto c = load(GetParam());
  // Chunks longer and shorter than the window, with a small ring (rollback 2):
  // exercises both the write-first and the attend-then-write paths.
  expect_close(run_chunks(c.model, c.ids, {9, 1, 3, 2, 7}, 2), c.expected, GetParam() + " chunked");
}

TEST_P(Parity, TruncateAndRedo) {
  auto c = load(GetParam());
  const auto& m = c.model;
  KVCacheOptions co;
  co.capacity = c.ids.size(0);
  co.rollback = 4;
  KVCache cache(m.config(), co);
  const int64_t T = c.ids.size(0);
  m.forward(c.ids.slice(0, 0, 12).unsqueeze(0), cache);
  // A rejected speculative block: 4 wrong tokens, then roll back and continue with the right ones.
  m.forward((c.ids.slice(0, 12, 16) + 1).remainder(m.config().vocab_size).unsqueeze(0), cache);
  cache.truncate(12);
  auto rest = m.forward(c.ids.slice(0, 12, T).unsqueeze(0), cache).squeeze(0);
  expect_close(rest, c.expected.slice(0, 12), GetParam() + " after truncate");
  // The ring keeps exactly `rollback` extra slots: one token further back is refused, not silently wrong.
  if (m.config().sliding_window > 0) EXPECT_THROW(cache.truncate(T - co.rollback - 1), Error);
  EXPECT_NO_THROW(cache.truncate(T - co.rollback));
}

// ForwardOptions::argmax: the greedy tokens are the argmax of the same forward's logits, for every
// position and for the last only (Gemma 4's final softcap takes the capped logits' argmax).
TEST_P(Parity, GreedyTokensAreTheArgmaxOfTheLogits) {
  auto c = load(GetParam());
  const auto ids = c.ids.unsqueeze(0);
  KVCacheOptions co;
  co.capacity = ids.size(1);
  for (bool last : {false, true}) {
    KVCache a(c.model.config(), co), b(c.model.config(), co);
    ForwardOptions fo;
    fo.last_logits_only = last;
    const at::Tensor logits = c.model.forward(ids, a, fo);  // [1, T or 1, V]
    fo.argmax = true;
    const at::Tensor tokens = c.model.forward(ids, b, fo);  // [1, T or 1]
    EXPECT_TRUE(tokens.equal(logits.argmax(-1))) << GetParam() << (last ? " last position" : " every position");
  }
}

// Random weights drawn by Model::random (core/model/random_weights.h) are exactly HF's model
// filled by tools/random_weights.py with the same seed: its logits, to the parity tolerance,
// with no weight file between the two. A different seed gives another model.
TEST(RandomInit, MatchesHfFilledWithTheSameRule) {
  const std::string dir = test::fixtures_dir("model_parity") + "/gemma4_moe_random";
  auto exp = TensorStore::open_file(dir + "/expected.safetensors");
  const auto cfg = ModelConfig::from_file(dir + "/config.json");
  ModelOptions mo;
  mo.max_positions = 64;
  const auto seed = (uint64_t)exp.get("seed").item<int64_t>();
  auto ids = exp.get("ids"), want = exp.get("logits");
  expect_close(run_chunks(Model::random(cfg, seed, mo), ids, {ids.size(0)}, 0), want, "random init, full forward");
  expect_close(run_chunks(Model::random(cfg, seed, mo), ids, {1}, 0), want, "random init, token by token");
  auto other = run_chunks(Model::random(cfg, seed + 1, mo), ids, {ids.size(0)}, 0);
  EXPECT_GT((other - want).abs().max().item<double>(), 0.1 * want.abs().max().item<double>());
  EXPECT_NE(random_weight_seed("model.norm.weight", seed), random_weight_seed("model.norm.weight", seed + 1));
}

// KV sharing in the cache: a shared layer's buffers are its source layer's (what it attends
// over), cost nothing more, are never written through it, and restoration is refused.
TEST(KvSharing, CacheAliasesTheSourceLayer) {
  auto c = load("gemma4_shared_kv");
  const ModelConfig& cfg = c.model.config();
  ASSERT_EQ(cfg.kv_layer, (std::vector<int64_t>{0, 1, 2, 2, 2, 1}));
  KVCacheOptions co;
  co.capacity = 16;
  co.rollback = 0;
  KVCache cache(cfg, co);
  EXPECT_TRUE(cache.keys(4).is_same(cache.keys(2)) && cache.values(3).is_same(cache.values(2)));
  EXPECT_TRUE(cache.keys(5).is_same(cache.keys(1)) && cache.values(5).is_same(cache.values(1)));
  int64_t own = 0;
  for (int64_t l = 0; l < 3; ++l) own += 2 * cache.keys(l).numel() * cache.keys(l).element_size();
  EXPECT_EQ(cache.bytes(), own);
  auto kv = at::zeros({1, cfg.kv_heads(3), 1, cfg.layer_head_dim[3]});
  test::expect_error([&] { cache.write(3, kv, kv, at::zeros({1}, at::kLong)); }, "layer 3 is KV-shared");
  co.restore.window = 4;
  test::expect_error([&] { KVCache restored(cfg, co); }, "'num_kv_shared_layers' = 3");
}

INSTANTIATE_TEST_SUITE_P(Families, Parity,
                         ::testing::Values("gemma3", "gemma3_softcap_attn", "qwen3", "llama", "gemma4", "gemma4_kv",
                                           "gemma4_moe", "gemma4_ple", "gemma4_shared_kv"));

}  // namespace

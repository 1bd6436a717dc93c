// f_θ model and losses. Every loss value, per-layer statistic and gradient
// equals the PyTorch reference of tests/fixtures/make_ftheta_fixtures.py
// (tiny random Gemma 3 from HF transformers with GQA, sliding + full layers,
// with and without an attention softcap; odd shapes); checkpoint round trips;
// mismatched configs refused with errors naming the field.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>

#include <fstream>

#include "core/error.h"
#include "core/io/fs.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/io/safetensors.h"
#include "tests/test_util.h"
#include "tests/train_test_util.h"
#include "train/ftheta_loss.h"
#include "train/ftheta_train.h"

using namespace kakeya;
using namespace kakeya::train;
using json = nlohmann::json;

namespace {

std::string temp_dir(const std::string& tag) {
  std::string d = fs::temp_dir() + "/kakeya_test_ftheta_" + tag + "_" + std::to_string(getpid());
  fs::make_dirs(d);
  return d;
}

// max |a - b| <= rtol · max |b| + atol
void expect_close(const at::Tensor& a, const at::Tensor& b, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double err = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  const double scale = b.to(at::kDouble).abs().max().item<double>();
  EXPECT_LE(err, rtol * scale + atol) << what << ": max abs error " << err << " (reference max " << scale << ")";
}

class FThetaLossTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FThetaLossTest, ValuesStatsAndGradientsMatchPyTorch) {
  const std::string dir = test::fixtures_dir("ftheta") + "/" + GetParam();
  Model m = Model::load(dir);
  TensorStore st = TensorStore::open_file(dir + "/data.safetensors");
  const int64_t L = m.config().num_layers;
  FThetaConfig fc = FThetaConfig::for_pair(m.config(), test::tiny_drafter(), 7);
  FTheta f = FTheta::random(fc, 0, at::kFloat, at::kCPU);
  for (auto& [name, p] : f.named_parameters()) {
    p.copy_(st.get("param." + name));
    p.requires_grad_(true);
  }
  FThetaBatch b;
  b.positions = st.get("positions");
  b.dk = st.get("dk");
  b.dv = st.get("dv");
  for (int64_t l = 0; l < L; ++l) {
    const std::string s = std::to_string(l);
    b.q.push_back(st.get("q." + s));
    b.k.push_back(st.get("k." + s));
    b.v.push_back(st.get("v." + s));
    b.o.push_back(st.get("o." + s));
  }
  std::ifstream cf(dir + "/cases.json");
  json cases = json::parse(cf);
  ASSERT_EQ(cases.size(), 7u);
  for (const auto& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    FThetaLossOptions o;
    o.type = parse_ftheta_loss(c["loss"]);
    o.layout.sink = c["sink"];
    o.layout.window = c["window"];
    if (c.contains("layers")) o.layers = c["layers"].get<std::vector<int64_t>>();
    if (c.contains("lambdas")) {
      auto lam = c["lambdas"].get<std::vector<double>>();
      o.lambda_k_dir = lam[0], o.lambda_v_dir = lam[1], o.lambda_k_mag = lam[2], o.lambda_v_mag = lam[3];
    }
    for (auto& [pn, p] : f.named_parameters())
      if (p.grad().defined()) p.mutable_grad().zero_();
    FThetaLossResult r = ftheta_loss(m, f, b, o);
    r.loss.backward();
    expect_close(r.loss, st.get("loss." + name), 2e-5, 0, "loss");
    expect_close(r.stats, st.get("stats." + name), 1e-4, 1e-6, "stats");
    for (auto& [pn, p] : f.named_parameters()) expect_close(p.grad(), st.get("grad." + name + "." + pn), 1e-4, 1e-7, "grad of " + pn);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, FThetaLossTest, ::testing::Values("gemma3", "gemma3_softcap"));

// Exact K/V everywhere make the attention term vanish: the recomputed layer
// output is the captured one (the loss reuses the model's own attention).
TEST(FThetaLoss, ExactKVGiveZeroAttentionLoss) {
  const std::string dir = test::fixtures_dir("ftheta") + "/gemma3";
  Model m = Model::load(dir);
  TensorStore st = TensorStore::open_file(dir + "/data.safetensors");
  FThetaBatch b;
  b.positions = st.get("positions");
  std::vector<std::pair<at::Tensor, at::Tensor>> pred;
  for (int64_t l = 0; l < m.config().num_layers; ++l) {
    const std::string s = std::to_string(l);
    b.q.push_back(st.get("q." + s));
    b.k.push_back(st.get("k." + s));
    b.v.push_back(st.get("v." + s));
    b.o.push_back(st.get("o." + s));
    pred.push_back({b.k.back(), b.v.back()});
  }
  FThetaLossOptions o;
  o.layout = {0, 0};
  FThetaLossResult r = ftheta_kv_loss(m, pred, b, o);
  EXPECT_LT(r.loss.item<double>(), 1e-6);  // f32 round-off of cosines and attention
  EXPECT_GT(r.stats.select(1, kStatAttnRatio).max().item<double>(), -1);  // defined
  EXPECT_LT(r.stats.select(1, kStatAttn).max().item<double>(), 1e-9);
}

TEST(FThetaLoss, UnknownLossNamesTheChoices) {
  try {
    parse_ftheta_loss("attn");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attn_distill_hybrid"), std::string::npos) << e.what();
  }
}

TEST(FThetaLoss, LayerSpecs) {
  ModelConfig mc;
  mc.num_layers = 4;
  mc.layer_types = {LayerType::Sliding, LayerType::Sliding, LayerType::Full, LayerType::Sliding};
  EXPECT_TRUE(parse_ftheta_loss_layers("all", mc).empty());  // empty = every layer
  EXPECT_EQ(parse_ftheta_loss_layers("sliding", mc), (std::vector<int64_t>{0, 1, 3}));
  EXPECT_EQ(parse_ftheta_loss_layers("full", mc), (std::vector<int64_t>{2}));
  // restored: the sliding layers but the first, which a restored decode takes from the token
  EXPECT_EQ(parse_ftheta_loss_layers("restored", mc), (std::vector<int64_t>{1, 3}));
  try {
    parse_ftheta_loss_layers("slide", mc);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--layers 'slide' (expected all, sliding, full or restored)"),
              std::string::npos)
        << e.what();
  }
  mc.layer_types.assign(4, LayerType::Sliding);
  EXPECT_THROW(parse_ftheta_loss_layers("full", mc), Error);  // no such layers
}

// ---------------------------------------------------------------------------
// FTheta model

// Gemma 4-like verifier layout: head dims and KV heads differ per layer, K=V layers.
FThetaConfig mixed_config() {
  FThetaConfig c;
  c.rank = 5;
  c.drafter_layers = 3, c.drafter_kv_heads = 1, c.drafter_head_dim = 7;
  c.kv_heads = {2, 1, 2};
  c.head_dim = {8, 16, 8};
  c.layer_types = {LayerType::Sliding, LayerType::Full, LayerType::Sliding};
  c.v_from_k = {false, true, false};
  c.verifier_fingerprint = "v", c.drafter_fingerprint = "d";
  return c;
}

TEST(FTheta, PredictShapesAndKEqV) {
  FTheta f = FTheta::random(mixed_config(), 3, at::kFloat, at::kCPU);
  EXPECT_EQ(f.config().k_out(), 16 + 16 + 16);
  EXPECT_EQ(f.config().v_out(), 32);
  at::Tensor dk = at::randn({4, 9, 3, 1, 7}), dv = at::randn({4, 9, 3, 1, 7});
  auto out = f.predict(dk, dv);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].first.sizes(), at::IntArrayRef({4, 9, 2, 8}));
  EXPECT_EQ(out[1].second.sizes(), at::IntArrayRef({4, 9, 1, 16}));
  EXPECT_TRUE(at::equal(out[1].first, out[1].second));  // V = K on the K=V layer
  EXPECT_FALSE(at::equal(out[2].first, out[2].second));
  // Definition: K = dec(enc(flatten(dk))) rows of the layer.
  auto P = f.named_parameters();
  at::Tensor z = at::linear(dk.flatten(2), P[0].second, P[1].second);
  at::Tensor y = at::linear(z, P[2].second, P[3].second);
  EXPECT_TRUE(at::allclose(out[2].first.flatten(2), y.narrow(-1, 32, 16)));
  EXPECT_THROW(f.predict(at::randn({4, 3, 2, 7}), dv), Error);  // wrong drafter heads
}

TEST(FTheta, SaveLoadRoundTripAnyDtype) {
  const std::string dir = temp_dir("roundtrip");
  FTheta f = FTheta::random(mixed_config(), 11, at::kFloat, at::kCPU);
  f.mutable_config().provenance = {{"note", "test"}};
  f.save(dir);
  FTheta g = FTheta::load(dir, at::kFloat, at::kCPU);
  EXPECT_EQ(g.config().to_json(), f.config().to_json());
  auto pf = f.named_parameters(), pg = g.named_parameters();
  for (size_t i = 0; i < pf.size(); ++i) EXPECT_TRUE(at::equal(pf[i].second, pg[i].second)) << pf[i].first;
  FTheta h = FTheta::load(dir, at::kBFloat16, at::kCPU);
  EXPECT_EQ(h.dtype(), at::kBFloat16);
  at::Tensor dk = at::randn({5, 3, 1, 7}), dv = at::randn({5, 3, 1, 7});
  auto a = f.predict(dk, dv), c = h.predict(dk, dv);
  for (size_t l = 0; l < a.size(); ++l) expect_close(c[l].first.to(at::kFloat), a[l].first, 3e-2, 1e-2, "bf16 K");
  // A tampered weight file is refused, naming the tensor.
  save_safetensors(dir + "/f_theta.safetensors", {{"k.encoder.weight", at::zeros({5, 20})}});
  try {
    FTheta::load(dir, at::kFloat, at::kCPU);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k.encoder.weight"), std::string::npos) << e.what();
  }
}

// The nonlinear branch: y = dec(enc(x)) + gelu(x F1^T + f1) F2^T; added at zero it changes nothing;
// saved and loaded with the rest; gradients reach it; configs written without it read as none.
TEST(FTheta, NonlinearBranch) {
  FTheta lin = FTheta::random(mixed_config(), 5, at::kFloat, at::kCPU);
  at::Tensor dk = at::randn({2, 7, 3, 1, 7}), dv = at::randn({2, 7, 3, 1, 7});
  const at::Tensor before = lin.predict_fused(dk, false);
  lin.add_mlp(6, 9);
  EXPECT_EQ(lin.config().mlp_hidden, 6);
  EXPECT_TRUE(at::equal(lin.predict_fused(dk, false), before));  // F2 = 0
  EXPECT_THROW(lin.add_mlp(6, 9), Error);                        // one branch

  FThetaConfig c = mixed_config();
  c.mlp_hidden = 6;
  FTheta f = FTheta::random(c, 5, at::kFloat, at::kCPU);
  auto P = f.named_parameters();
  ASSERT_EQ(P.size(), 14u);
  EXPECT_EQ(P[8].first, "k.mlp.fc1.weight");
  EXPECT_EQ(P[13].first, "v.mlp.fc2.weight");
  EXPECT_EQ(P[10].second.sizes(), at::IntArrayRef({48, 6}));  // [k_out, h]
  P[10].second.normal_();  // a trained-looking F2 for K (nothing requires grad yet)
  P[13].second.normal_();
  at::Tensor rows = dk.flatten(2);  // [2, 7, 21]
  at::Tensor lin_k = at::linear(at::linear(rows, P[0].second, P[1].second), P[2].second, P[3].second);
  at::Tensor mlp_k = at::linear(at::gelu(at::linear(rows, P[8].second, P[9].second)), P[10].second);
  expect_close(f.predict_fused(dk, false), lin_k + mlp_k, 1e-5, 1e-5, "K = code + branch");
  at::Tensor rows_v = dv.flatten(2);
  at::Tensor lin_v = at::linear(at::linear(rows_v, P[4].second, P[5].second), P[6].second, P[7].second);
  at::Tensor mlp_v = at::linear(at::gelu(at::linear(rows_v, P[11].second, P[12].second)), P[13].second);
  expect_close(f.predict_fused(dv, true), lin_v + mlp_v, 1e-5, 1e-5, "V = code + branch");

  const std::string dir = temp_dir("mlp");
  f.save(dir);
  FTheta g = FTheta::load(dir, at::kFloat, at::kCPU);
  EXPECT_EQ(g.config().mlp_hidden, 6);
  auto pg = g.named_parameters();
  ASSERT_EQ(pg.size(), P.size());
  for (size_t i = 0; i < P.size(); ++i) EXPECT_TRUE(at::equal(P[i].second, pg[i].second)) << P[i].first;

  for (auto& [name, t] : P) t.requires_grad_(true);
  f.predict_fused(dk, false).pow(2).sum().backward();
  EXPECT_GT(P[10].second.grad().abs().sum().item<double>(), 0);  // F2
  EXPECT_GT(P[8].second.grad().abs().sum().item<double>(), 0);   // F1 (F2 is not zero here)

  json j = f.config().to_json();
  EXPECT_EQ(j["mlp_hidden"], 6);
  EXPECT_FALSE(mixed_config().to_json().contains("mlp_hidden"));  // none: as before the branch existed
  j["mlp_hidden"] = -1;
  test::expect_error([&] { FThetaConfig::from_json(j, "f.json"); }, "field 'mlp_hidden' expected an integer >= 0");
}

TEST(FTheta, MismatchedConfigRefused) {
  const std::string dir = test::fixtures_dir("ftheta") + "/gemma3";
  ModelConfig v = ModelConfig::from_file(dir + "/config.json");
  DrafterConfig d = test::tiny_drafter();
  FThetaConfig c = FThetaConfig::for_pair(v, d, 4);
  EXPECT_NO_THROW(c.check(v, d, "f.json"));
  auto expect_error = [&](const ModelConfig& vv, const DrafterConfig& dd, const std::string& needle) {
    try {
      c.check(vv, dd, "f.json");
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("f.json"), std::string::npos) << e.what();
    }
  };
  DrafterConfig d2 = d;
  d2.head_dim = 6;
  expect_error(v, d2, "field 'drafter'");
  ModelConfig v2 = v;
  v2.layer_kv_heads[3] = 1;
  expect_error(v2, d, "verifier_layers[3]");
  ModelConfig v3 = v;
  v3.layer_types[0] = LayerType::Full;
  expect_error(v3, d, "verifier_layers[0].layer_type");
  ModelConfig v4 = v;
  v4.rope_full.theta = 1234;  // same dimensions, another model
  expect_error(v4, d, "verifier_fingerprint");
  DrafterConfig d3 = d;
  d3.target_layer_ids = {0, 2};
  expect_error(v, d3, "drafter_fingerprint");
  // The JSON reader: wrong format, missing and mistyped fields.
  json j = c.to_json();
  EXPECT_NO_THROW(FThetaConfig::from_json(j, "f.json"));
  json bad = j;
  bad["format"] = "other";
  EXPECT_THROW(FThetaConfig::from_json(bad, "f.json"), Error);
  bad = j;
  bad["verifier_layers"][2].erase("head_dim");
  try {
    FThetaConfig::from_json(bad, "f.json");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("verifier_layers[2].head_dim"), std::string::npos) << e.what();
  }
  bad = j;
  bad["rank"] = -3;
  EXPECT_THROW(FThetaConfig::from_json(bad, "f.json"), Error);
}

// The target-features input: config round trip (input, measured restore layers), configs written
// before it read as the drafter's K/V, and a drafter reading other layers is refused by field.
TEST(FTheta, TargetFeatureInputConfig) {
  const std::string dir = test::fixtures_dir("ftheta") + "/gemma3";
  ModelConfig v = ModelConfig::from_file(dir + "/config.json");
  DrafterConfig d = test::tiny_drafter();
  FThetaConfig c = FThetaConfig::for_pair(v, d, 4, FThetaInput::TargetFeatures);
  EXPECT_EQ(c.in_features(), (int64_t)d.target_layer_ids.size() * v.hidden_size);
  EXPECT_NO_THROW(c.check(v, d, "f.json"));
  json j = c.to_json();
  EXPECT_TRUE(j["restore_layers"].is_null());
  FThetaConfig r = FThetaConfig::from_json(j, "f.json");
  EXPECT_TRUE(r.reads_features());
  EXPECT_EQ(r.feature_layers, d.target_layer_ids);
  EXPECT_FALSE(r.restore_layers_measured);
  c.restore_layers = {0, 2};
  c.restore_layers_measured = true;
  r = FThetaConfig::from_json(c.to_json(), "f.json");
  EXPECT_TRUE(r.restore_layers_measured);
  EXPECT_EQ(r.restore_layers, (std::vector<int64_t>{0, 2}));
  c.restore_layers.clear();  // measured: no layer helps
  r = FThetaConfig::from_json(c.to_json(), "f.json");
  EXPECT_TRUE(r.restore_layers_measured);
  EXPECT_TRUE(r.restore_layers.empty());
  json legacy = FThetaConfig::for_pair(v, d, 4).to_json();
  legacy.erase("input");
  legacy.erase("restore_layers");
  r = FThetaConfig::from_json(legacy, "f.json");
  EXPECT_FALSE(r.reads_features());
  EXPECT_FALSE(r.restore_layers_measured);
  json bad = j;
  bad["input"]["kind"] = "hidden";
  test::expect_error([&] { FThetaConfig::from_json(bad, "f.json"); }, "input.kind");
  bad = j;
  bad["restore_layers"] = json::array({99});
  test::expect_error([&] { FThetaConfig::from_json(bad, "f.json"); }, "restore_layers");
  DrafterConfig d2 = d;
  d2.target_layer_ids = {0, 1};
  test::expect_error([&] { c.check(v, d2, "f.json"); }, "input.layers");
  // predict reads [..., n·H] rows for both paths.
  FTheta f = FTheta::random(c, 2, at::kFloat, at::kCPU);
  auto out = f.predict(at::randn({3, c.in_features()}), at::randn({3, c.in_features()}));
  EXPECT_EQ(out[0].first.sizes(), at::IntArrayRef({3, v.kv_heads(0), v.layer_head_dim[0]}));
  test::expect_error([&] { f.predict(at::randn({3, 7}), at::randn({3, 7})); }, "target-feature input");
}

// ---------------------------------------------------------------------------
// Trainer (tiny random Gemma 3 of the fixture; its two captured sequences)

TEST(FThetaTrain, KilledAndResumedEqualsUninterrupted) {
  test::FThetaFixture t = test::ftheta_fixture();
  const std::string dir = temp_dir("resume");
  FTheta a = FTheta::random(t.fc, 5, at::kFloat, at::kCPU);
  FThetaTrainer ta(t.m, a, t.seqs, {t.seqs[1]}, test::ftheta_small_options(), dir + "/a.safetensors");
  EXPECT_TRUE(ta.run());

  FThetaTrainOptions o = test::ftheta_small_options();
  o.max_steps_this_run = 5;  // "killed" after step 5 (its checkpoint is the last thing it wrote)
  {
    FTheta b = FTheta::random(t.fc, 5, at::kFloat, at::kCPU);
    FThetaTrainer tb(t.m, b, t.seqs, {t.seqs[1]}, o, dir + "/b.safetensors");
    EXPECT_FALSE(tb.run());
    EXPECT_EQ(tb.step(), 5);
  }
  o.max_steps_this_run = 0;
  FTheta c = FTheta::random(t.fc, 99, at::kFloat, at::kCPU);  // other init: the checkpoint must overwrite it
  FThetaTrainer tc(t.m, c, t.seqs, {t.seqs[1]}, o, dir + "/b.safetensors");
  ASSERT_TRUE(tc.resume());
  EXPECT_TRUE(tc.run());
  auto pa = a.named_parameters(), pc = c.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i].second, pc[i].second)) << pa[i].first;
  EXPECT_EQ(ta.report()["evals"], tc.report()["evals"]);
  EXPECT_EQ(ta.report()["evals"].size(), 4u);  // start, steps 3, 6, 8

  // A resume with other options or another f_θ config is refused.
  FThetaTrainOptions o2 = test::ftheta_small_options();
  o2.lr = 1e-2;
  FTheta d = FTheta::random(t.fc, 5, at::kFloat, at::kCPU);
  FThetaTrainer td(t.m, d, t.seqs, {t.seqs[1]}, o2, dir + "/b.safetensors");
  EXPECT_THROW(td.resume(), Error);
  FTheta e = FTheta::random(FThetaConfig::for_pair(t.m.config(), test::tiny_drafter(), 4), 5, at::kFloat, at::kCPU);
  FThetaTrainer te(t.m, e, t.seqs, {t.seqs[1]}, test::ftheta_small_options(), dir + "/b.safetensors");
  try {
    te.resume();
    FAIL() << "no error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("f_theta config differs"), std::string::npos) << err.what();
  }
}

// Online training (sequences made on demand by a source) draws the same batches as training
// on the same sequences in memory: the same weights after the same steps.
TEST(FThetaTrain, OnlineSourceEqualsInMemory) {
  test::FThetaFixture t = test::ftheta_fixture();
  FThetaTrainOptions o = test::ftheta_small_options();
  o.steps = 5;
  FTheta a = FTheta::random(t.fc, 4, at::kFloat, at::kCPU), b = FTheta::random(t.fc, 4, at::kFloat, at::kCPU);
  FThetaTrainer ta(t.m, a, t.seqs, {t.seqs[1]}, o, temp_dir("mem") + "/ckpt.safetensors");
  int64_t made = 0;
  auto src = [&](int64_t i) {
    ++made;
    return t.seqs.at(i);
  };
  FThetaTrainer tb(t.m, b, src, (int64_t)t.seqs.size(), {t.seqs[1]}, o, temp_dir("online") + "/ckpt.safetensors");
  ASSERT_TRUE(ta.run());
  ASSERT_TRUE(tb.run());
  EXPECT_EQ(made, o.steps * o.batch);
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
}

TEST(FThetaTrain, HybridReducesHeldOutLoss) {
  test::FThetaFixture t = test::ftheta_fixture();
  FTheta f = FTheta::random(t.fc, 1, at::kFloat, at::kCPU);
  FThetaTrainOptions o = test::ftheta_small_options();
  o.steps = 60;
  o.lr = 2e-2;
  o.eval_every = 0;
  o.log_seconds = 1e9;
  // Held out = trained on here: this checks the optimisation, not generalisation (2 sequences).
  FThetaTrainer tr(t.m, f, t.seqs, {t.seqs[0]}, o, temp_dir("reduce") + "/ck.safetensors");
  tr.run();
  const json r = tr.report();
  EXPECT_GT(r["reduction_factor"].get<double>(), 2.0) << r["heldout_loss_initial"] << " -> " << r["heldout_loss_final"];
  EXPECT_TRUE(r["final"]["by_layer_type"].contains("sliding_attention"));
  EXPECT_TRUE(r["final"]["by_layer_type"].contains("full_attention"));
}

TEST(FThetaTrain, NonFiniteLossHaltsNamingStepAndLayer) {
  test::FThetaFixture t = test::ftheta_fixture();
  // A NaN in one captured output of layer 3 poisons that layer's attention term only.
  t.seqs[0].o[3][7][0] = NAN;
  t.seqs[1].o[3][7][0] = NAN;
  FTheta f = FTheta::random(t.fc, 1, at::kFloat, at::kCPU);
  FThetaTrainOptions o = test::ftheta_small_options();
  o.eval_every = 0;
  FThetaTrainer tr(t.m, f, t.seqs, {t.seqs[0]}, o, temp_dir("nan") + "/ck.safetensors");
  auto before = f.named_parameters()[0].second.clone();
  try {
    tr.run();
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("at step 0"), std::string::npos) << w;
    EXPECT_NE(w.find("layer(s) 3"), std::string::npos) << w;
  }
  EXPECT_TRUE(at::equal(before, f.named_parameters()[0].second));  // no update with NaN
}

}  // namespace

// Disk full while checkpointing (simulated with RLIMIT_FSIZE: writes past the limit fail with
// EFBIG, as they would with ENOSPC): the save fails naming the file, no temp file is left, and the
// last complete checkpoint is untouched, so --resume continues from it.
TEST(FThetaTrain, DiskFullKeepsTheLastCheckpoint) {
  test::FThetaFixture t = test::ftheta_fixture();
  const std::string dir = temp_dir("diskfull");
  const std::string ck = dir + "/ck.safetensors";
  FThetaTrainOptions o = test::ftheta_small_options();
  o.max_steps_this_run = 3;
  FTheta a = FTheta::random(t.fc, 5, at::kFloat, at::kCPU);
  {
    FThetaTrainer tr(t.m, a, t.seqs, {t.seqs[1]}, o, ck);
    EXPECT_FALSE(tr.run());  // 3 steps, checkpoint at step 3
  }
  auto read = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  const std::string before = read(ck);
  ASSERT_GT(before.size(), 4096u);

  FTheta b = FTheta::random(t.fc, 5, at::kFloat, at::kCPU);
  FThetaTrainer tr(t.m, b, t.seqs, {t.seqs[1]}, o, ck);
  ASSERT_TRUE(tr.resume());
  tr.step_on(make_ftheta_batch({&t.seqs[0], &t.seqs[1]}, 19, at::kCPU), 1e-3);  // step 4, not saved yet
  struct rlimit old {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto prev_handler = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of a signal
  struct rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string msg;
  try {
    tr.save_checkpoint();
  } catch (const Error& e) {
    msg = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, prev_handler);
  EXPECT_NE(msg.find("ck.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("write failed"), std::string::npos) << msg;
  EXPECT_EQ(read(ck), before);  // the complete checkpoint of step 3 is intact
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) EXPECT_EQ(std::string(e->d_name).find(".tmp"), std::string::npos) << e->d_name;
    closedir(d);
  }
  FTheta c = FTheta::random(t.fc, 7, at::kFloat, at::kCPU);
  FThetaTrainer tc(t.m, c, t.seqs, {t.seqs[1]}, o, ck);
  ASSERT_TRUE(tc.resume());
  EXPECT_EQ(tc.step(), 3);
}

// The shipped f_θ (checkpoints/gemma3-270m/ftheta, trained online on the H100) on the real
// default model and the shipped drafter, CPU f32: it loads against both (fingerprints, shapes,
// the drafter's target layers), and on a document from a source it was never trained on
// (data/longeval/docs: man pages, pod, info, changelogs; tools/ftheta_corpus.py refuses any
// training file sharing a 64-character window with them) teacher-forced scoring through the
// restored cache (sink 4 + window 64, the layout it was trained for) beats evict-only (the
// baseline restoration must beat) and an untrained f_θ, and stays close to exact attention.
// Also: layer selection against evict-only (train/ftheta_select.h), and the online corpus packing
// (train/ftheta_online.h) on the real tokenizer.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "core/model/drafter.h"
#include "core/io/fs.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/io/tokenizer.h"
#include "infer/restored.h"
#include "infer/score.h"
#include "tests/test_util.h"
#include "train/ftheta_online.h"
#include "train/ftheta_select.h"

using namespace kakeya;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// `n` tokens of a held-out document: positions leave the 64-token exact window on every sliding layer.
std::vector<int64_t> heldout_doc(const Tokenizer& tok, const std::string& name, size_t n) {
  auto ids = tok.encode(read_file(test::env_or_fail("KAKEYA_SOURCE_DIR") + "/data/longeval/docs/" + name));
  std::vector<int64_t> out(ids.begin(), ids.end());
  if (out.size() > n) out.resize(n);
  return out;
}

}  // namespace

TEST(FThetaReal, ShippedFThetaBeatsEvictOnlyOnHeldOutText) {
  const std::string vdir = test::real_model_dir();
  ModelOptions mo;
  mo.max_positions = 1024;
  Model model = Model::load(vdir, mo);
  Tokenizer tok = Tokenizer::from_file(vdir + "/tokenizer.json");
  Drafter drafter = Drafter::load(test::shipped_dir("drafter"), model);
  const std::string fdir = test::shipped_dir("ftheta");
  FTheta f = FTheta::load(fdir, at::kFloat, at::kCPU);
  f.config().check(model.config(), drafter.config(), fdir + "/f_theta_config.json");
  FTheta untrained = FTheta::random(f.config(), 1, at::kFloat, at::kCPU);

  for (const char* doc : {"00.txt", "03.txt"}) {
    SCOPED_TRACE(doc);
    auto ids = heldout_doc(tok, doc, 600);
    ASSERT_EQ(ids.size(), 600u);
    RestoreOptions ro;
    ro.window = 64;  // sink 4, window 64: the layout f_θ was trained for (and more restored positions)
    ro.mix_alpha = 1.0;
    const double exact = score_restored(model, nullptr, nullptr, ids, ro).perplexity();
    ro.mix_alpha = 0.0;
    ro.layers = "none";
    const double evict = score_restored(model, nullptr, nullptr, ids, ro).perplexity();
    ro.layers = "auto";
    ro.stats = true;
    RestoreStats st_f, st_u;
    const double restored = score_restored(model, &drafter, &f, ids, ro, &st_f).perplexity();
    const double random = score_restored(model, &drafter, &untrained, ids, ro, &st_u).perplexity();
    const double k_f = st_f.rel(false, false, true), k_u = st_u.rel(false, false, true);
    std::printf("%s: ppl exact %.3f, evict-only %.3f, shipped f_theta %.3f, untrained %.3f; sliding K rel err (cache "
                "space) %.3f vs %.3f, V %.3f vs %.3f\n",
                doc, exact, evict, restored, random, k_f, k_u, st_f.rel(false, true, true), st_u.rel(false, true, true));
    EXPECT_GT(st_f.positions, 500);
    EXPECT_LT(restored, evict);         // restoring beats dropping the positions
    EXPECT_LT(restored, 1.10 * exact);  // near exact attention
    EXPECT_LT(restored, random);        // and learnt
    EXPECT_LT(k_f, 0.8 * k_u);
  }
}

// Layer selection (train/ftheta_select.h) on held-out text, window 12: a subset of the layers
// replaces "every covered layer" only with a paired interval below 0 in the report. The shipped
// f_θ restores more than it drops; an untrained one, whose K/V on every layer are worse than
// dropping them, never restores every layer.
TEST(FThetaReal, LayerSelectionKeepsEveryLayerUnlessASubsetIsSignificantlyBetter) {
  ModelOptions mo;
  mo.max_positions = 64;
  Model model = Model::load(test::real_model_dir(), mo);
  Tokenizer tok = Tokenizer::from_file(test::real_model_dir() + "/tokenizer.json");
  Drafter drafter = Drafter::load(test::shipped_dir("drafter"), model);
  FTheta f = FTheta::load(test::shipped_dir("ftheta"), at::kFloat, at::kCPU);
  std::vector<std::vector<int64_t>> seqs = {heldout_doc(tok, "01.txt", 48), heldout_doc(tok, "05.txt", 48)};
  train::LayerSelectOptions lo;
  lo.restore.window = 12;
  auto check = [&](FTheta& ft, const char* what) {
    const auto rep = train::select_restore_layers(model, drafter, ft, seqs, lo);
    const auto pick = rep["restore_layers"].get<std::vector<int64_t>>();
    std::printf("%s: %s -> %s (%s)\n", what, rep["ppl"].dump().c_str(), rep["restore_layers"].dump().c_str(),
                rep["why"].get<std::string>().c_str());
    EXPECT_EQ(rep["per_layer"].size(), 15u);  // the sliding layers
    EXPECT_EQ(rep["nll_per_sequence"]["all"].size(), 2u);
    if (!pick.empty() && pick.size() < 15) EXPECT_LT(rep["chosen_minus_all_ci95"][1].get<double>(), 0.0) << rep.dump();
    EXPECT_EQ(ft.config().restore_layers, pick);
    return rep;
  };
  const auto rep = check(f, "shipped");
  EXPECT_LT(rep["nll"]["all"].get<double>(), rep["nll"]["none"].get<double>());
  EXPECT_FALSE(rep["restore_layers"].empty());
  FTheta untrained = FTheta::random(f.config(), 1, at::kFloat, at::kCPU);
  const auto bad = check(untrained, "untrained");
  EXPECT_GT(bad["nll"]["all"].get<double>(), bad["nll"]["none"].get<double>());
  EXPECT_LT(bad["restore_layers"].size(), 15u);
}

TEST(FThetaReal, OnlineCorpusPacksWholeSequences) {
  Tokenizer tok = Tokenizer::from_file(test::real_model_dir() + "/tokenizer.json");
  const std::string dir = fs::temp_dir() + "/kakeya_test_online_" + std::to_string(getpid());
  fs::make_dirs(dir);
  const std::string para = read_file(test::env_or_fail("KAKEYA_SOURCE_DIR") + "/data/longeval/docs/05.txt").substr(0, 6000);
  {
    std::ofstream tr(dir + "/train.txt"), he(dir + "/heldout.txt");
    for (int i = 0; i < 4; ++i) tr << "doc " << i << "\n" << para << "\n<|doc|>\n";
    he << para << "\n<|doc|>\n" << para << "\n";
  }
  train::OnlineCorpusOptions o;
  o.dir = dir;
  o.seq_len = 1024;
  o.heldout = 2;
  o.synthetic_every = 4;
  o.synthetic_source_dir = test::env_or_fail("KAKEYA_SOURCE_DIR") + "/data";
  auto c = train::load_online_corpus(tok, o);
  ASSERT_FALSE(c.text.empty());
  EXPECT_EQ(c.heldout.size(), 2u);
  for (const auto& s : c.text) {
    ASSERT_EQ((int64_t)s.size(), o.seq_len);
    EXPECT_EQ(s[0], tok.bos_id());
  }
  const int64_t n = (int64_t)c.text.size();
  EXPECT_EQ(c.n_train, n + n / 3);  // one synthetic slot after every 3 text slots
  // Slot 3 is a synthetic task prompt of the train split, exactly seq_len tokens; slot 4 is text 3 % n.
  auto syn = train::online_tokens(tok, c, o, 3);
  EXPECT_EQ((int64_t)syn.size(), o.seq_len);
  EXPECT_EQ(train::online_tokens(tok, c, o, 4), c.text[3 % n]);
  EXPECT_EQ(train::online_tokens(tok, c, o, 3), syn);  // deterministic
  auto again = train::load_online_corpus(tok, o);
  EXPECT_EQ(again.text, c.text);
  o.heldout = 50;
  test::expect_error([&] { train::load_online_corpus(tok, o); }, "heldout.txt");
  o.dir = dir + "/missing";
  test::expect_error([&] { train::load_online_corpus(tok, o); }, "cannot open");
}

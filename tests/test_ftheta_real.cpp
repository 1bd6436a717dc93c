// The shipped f_θ (checkpoints/gemma3-270m/ftheta, trained on the H100) on the
// real default model and the shipped drafter, CPU f32: it loads against both
// (fingerprints, shapes), and on text it was not trained on (the tail of
// data/codec/eval.txt; training used its first 48 paragraphs) teacher-forced
// scoring through the restored cache (sink 4 + window 64, the layout it was
// trained for) stays close to exact attention and far better than an untrained
// f_θ of the same shape.
#include <ATen/ATen.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "core/drafter.h"
#include "core/ftheta.h"
#include "core/model.h"
#include "core/tokenizer.h"
#include "infer/restored.h"
#include "infer/score.h"
#include "tests/test_util.h"

using namespace kakeya;

namespace {

// 400 tokens of held-out prose: positions leave the 64-token exact window on every layer type.
std::vector<int64_t> heldout_text(const Tokenizer& tok) {
  const std::string path = test::env_or_fail("KAKEYA_SOURCE_DIR") + "/data/codec/eval.txt";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string all = buf.str();
  std::vector<std::string> paras;
  size_t at = 0;
  while (at < all.size()) {
    size_t end = all.find("\n\n", at);
    if (end == std::string::npos) end = all.size();
    std::string p = all.substr(at, end - at);
    if (p.size() > 200) paras.push_back(p);
    at = end + 2;
  }
  std::string text;
  for (size_t i = paras.size() - 1; i > 48 && text.size() < 3000; --i) text = paras[i] + "\n\n" + text;
  auto ids = tok.encode(text);
  std::vector<int64_t> out(ids.begin(), ids.end());
  if (out.size() > 400) out.resize(400);
  return out;
}

}  // namespace

TEST(FThetaReal, ShippedFThetaRestoresHeldOutTextNearExact) {
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

  auto ids = heldout_text(tok);
  ASSERT_EQ(ids.size(), 400u);
  RestoreOptions ro;  // sink 4, window 64: the layout f_θ was trained for
  ro.mix_alpha = 1.0;
  const double exact = score_restored(model, nullptr, nullptr, ids, ro).perplexity();
  ro.mix_alpha = 0.0;
  ro.stats = true;
  RestoreStats st_f, st_u;
  const double restored = score_restored(model, &drafter, &f, ids, ro, &st_f).perplexity();
  const double random = score_restored(model, &drafter, &untrained, ids, ro, &st_u).perplexity();
  // Relative error of restored K as attention reads it (after k_norm + RoPE): the hybrid loss
  // trains direction there and only weakly the raw magnitude, which k_norm removes.
  const double k_f = st_f.rel(false, false, true), k_u = st_u.rel(false, false, true);
  std::printf("held-out ppl: exact %.3f, shipped f_theta %.3f, untrained %.3f; sliding K rel err (cache space) %.3f vs "
              "%.3f, raw %.3f vs %.3f\n",
              exact, restored, random, k_f, k_u, st_f.rel(false, false, false), st_u.rel(false, false, false));
  EXPECT_GT(st_f.positions, 300);
  EXPECT_LT(restored, 1.15 * exact);  // near exact attention
  EXPECT_LT(restored, random);        // and learnt: an untrained projection does much worse
  EXPECT_LT(k_f, 0.8 * k_u);
}

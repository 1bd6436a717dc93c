// kakeya capture (data/capture.h) on the tiny Gemma 3 target + drafter of the
// drafter fixtures (tests/fixtures/make_drafter_fixtures.py): the HDF5 shards,
// read back by h5py (tests/fixtures/check_capture_h5.py) and by CaptureReader,
// equal what this test's own tap subscribers see in a forward over the same
// tokens; a killed capture resumes to the same data; mismatched inputs or
// models are refused.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "core/model/drafter.h"
#include "core/error.h"
#include "core/io/fs.h"
#include "core/io/safetensors.h"
#include "data/capture.h"
#include "infer/generate.h"
#include "tests/test_util.h"

using namespace kakeya;
using namespace kakeya::data;

namespace {

// Tiny tensors: intra-op threads only add synchronization, which on a loaded
// 2-core CI machine costs 30x (measured: 27 s vs 0.7 s for the resume test).
const bool kOneThread = (at::set_num_threads(1), true);

std::string case_dir() { return test::fixtures_dir("drafter") + "/gemma3"; }
std::string verifier_dir() { return case_dir() + "/target"; }
std::string drafter_dir() { return case_dir() + "/drafter"; }

std::string temp_dir(const std::string& tag) {
  return fs::temp_dir() + "/kakeya_capture_" + tag + "_" + std::to_string(::getpid());
}
void remove_all(const std::string& d) { ASSERT_EQ(std::system(("rm -rf '" + d + "'").c_str()), 0); }

struct Models {
  std::unique_ptr<Model> verifier;
  std::unique_ptr<Drafter> drafter;
  Models() {
    ModelOptions mo;
    mo.max_positions = 64;
    verifier = std::make_unique<Model>(Model::load(verifier_dir(), mo));
    drafter = std::make_unique<Drafter>(Drafter::load(drafter_dir(), *verifier));
  }
};

std::vector<CapturePrompt> prompts(int n) {
  std::vector<CapturePrompt> out;
  uint64_t s = 12345;
  for (int i = 0; i < n; ++i) {
    std::vector<int64_t> ids;
    for (int t = 0; t < 5 + i % 4; ++t) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      ids.push_back(5 + (int64_t)((s >> 33) % 95));
    }
    out.push_back({ids, i % 2 ? "niah" : "corpus"});
  }
  return out;
}

CaptureOptions options(const std::string& dir) {
  CaptureOptions o;
  o.out_dir = dir;
  o.gen_len = 4;
  o.seqs_per_shard = 2;
  o.deflate = 1;
  o.bench_seqs = 1;
  return o;
}

// The test's own subscribers: every verifier layer's raw q/k/v and attention
// output, the drafter features, and the drafter's raw context K/V.
struct Seen : TapSubscriber {
  std::map<std::string, at::Tensor> t;
  std::string prefix;
  void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override {
    const char* n = tap == Tap::QProj ? "q" : tap == Tap::KProj ? "k" : tap == Tap::VProj ? "v" : tap == Tap::AttnOut ? "o" : nullptr;
    if (n) t[prefix + "l" + std::to_string(ctx.layer) + "_" + n] = x[0].clone();
  }
};

std::map<std::string, at::Tensor> what_taps_see(const Models& m, const at::Tensor& tokens, int64_t i) {
  const int64_t T = tokens.size(0);
  Seen seen;
  seen.prefix = "s" + std::to_string(i) + "_";
  TargetFeatureCapture feats(*m.verifier, m.drafter->config().target_layer_ids);
  Taps taps;
  taps.subscribe(&seen);
  taps.subscribe(&feats);
  // The capture's cache layout (no rollback slots): another sliding ring size changes the
  // attention's summation order, hence the last bits of o.
  KVCacheOptions co;
  co.capacity = T;
  co.rollback = 0;
  KVCache cache(m.verifier->config(), co);
  ForwardOptions fo;
  fo.taps = &taps;
  m.verifier->forward(tokens.view({1, T}), cache, fo);
  struct DSeen : TapSubscriber {
    std::vector<at::Tensor> k, v;
    void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override {
      if (tap == Tap::KProj) k.push_back(x[0].clone());
      if (tap == Tap::VProj) v.push_back(x[0].clone());
    }
  } ds;
  Taps dt;
  dt.subscribe(&ds);
  m.drafter->context_kv(m.drafter->project_context(feats.take()), at::arange(T, at::kLong), &dt);
  auto out = seen.t;
  out[seen.prefix + "dk"] = at::stack(ds.k, 1);
  out[seen.prefix + "dv"] = at::stack(ds.v, 1);
  out[seen.prefix + "tokens"] = tokens;
  return out;
}

void expect_equal(const CaptureSequence& a, const CaptureSequence& b, const std::string& what) {
  ASSERT_TRUE(at::equal(a.tokens, b.tokens)) << what;
  ASSERT_EQ(a.q.size(), b.q.size()) << what;
  for (size_t l = 0; l < a.q.size(); ++l) {
    EXPECT_TRUE(at::equal(a.q[l], b.q[l])) << what << " q layer " << l;
    EXPECT_TRUE(at::equal(a.k[l], b.k[l])) << what << " k layer " << l;
    EXPECT_TRUE(at::equal(a.v[l], b.v[l])) << what << " v layer " << l;
    EXPECT_TRUE(at::equal(a.o[l], b.o[l])) << what << " o layer " << l;
  }
  EXPECT_TRUE(at::equal(a.dk, b.dk)) << what;
  EXPECT_TRUE(at::equal(a.dv, b.dv)) << what;
}

}  // namespace

// f32 and bf16 storage: h5py reads back exactly what the taps saw (bf16: bit for bit
// the taps' values rounded to bf16), and so does CaptureReader; continuations are greedy.
TEST(Capture, H5pyAndReaderEqualTheTaps) {
  Models m;
  auto ps = prompts(5);
  for (auto store : {at::kFloat, at::kBFloat16}) {
    const std::string dir = temp_dir(store == at::kFloat ? "f32" : "bf16");
    remove_all(dir);
    auto o = options(dir);
    o.store_dtype = store;
    auto rep = run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, o);
    EXPECT_EQ(rep.sequences, 5);
    EXPECT_EQ(rep.resumed_sequences, 0);
    EXPECT_GT(rep.bench_verifier_seconds, 0.0);
    EXPECT_GT(rep.capture_cost_ratio(), 0.0);
    for (int s = 0; s < 3; ++s) EXPECT_TRUE(fs::exists(dir + "/shard-0000" + std::to_string(s) + ".h5"));

    CaptureReader r(dir);
    ASSERT_EQ(r.size(), 5);
    EXPECT_TRUE(r.complete());
    EXPECT_EQ(r.num_layers(), m.verifier->config().num_layers);
    EXPECT_EQ(r.layer_types(), m.verifier->config().layer_types);
    EXPECT_EQ(r.drafter_layers(), m.drafter->config().num_layers);
    std::map<std::string, at::Tensor> expected;
    int64_t tokens = 0;
    for (int64_t i = 0; i < r.size(); ++i) {
      auto s = r.read(i, store);
      tokens += s.length();
      EXPECT_EQ(s.source, ps[i].source);
      EXPECT_EQ(s.prompt_len, (int64_t)ps[i].ids.size());
      DecodeOptions g;
      g.max_new_tokens = 4;
      g.stream = false;
      auto gen = generate(*m.verifier, ps[i].ids, g).tokens;
      std::vector<int64_t> want = ps[i].ids;
      want.insert(want.end(), gen.begin(), gen.end());
      ASSERT_TRUE(at::equal(s.tokens, at::tensor(want, at::kLong))) << "sequence " << i << ": not prompt + greedy";
      EXPECT_TRUE(at::equal(s.positions, at::arange(s.length(), at::kLong)));
      auto seen = what_taps_see(m, s.tokens, i);
      const std::string p = "s" + std::to_string(i) + "_";
      for (int64_t l = 0; l < r.num_layers(); ++l) {
        const std::string pl = p + "l" + std::to_string(l) + "_";
        EXPECT_TRUE(at::equal(s.q[l], seen[pl + "q"].to(store))) << pl << "q";
        EXPECT_TRUE(at::equal(s.k[l], seen[pl + "k"].to(store))) << pl << "k";
        EXPECT_TRUE(at::equal(s.v[l], seen[pl + "v"].to(store))) << pl << "v";
        EXPECT_TRUE(at::equal(s.o[l], seen[pl + "o"].to(store)))
            << pl << "o: max diff " << (s.o[l].to(at::kFloat) - seen[pl + "o"]).abs().max().item<float>();
      }
      EXPECT_TRUE(at::equal(s.dk, seen[p + "dk"].to(store)));
      EXPECT_TRUE(at::equal(s.dv, seen[p + "dv"].to(store)));
      EXPECT_EQ(s.dk.sizes(), (std::vector<int64_t>{s.length(), m.drafter->config().num_layers,
                                                   m.drafter->config().num_kv_heads, m.drafter->config().head_dim}));
      for (auto& kv : seen) expected[kv.first] = kv.second.contiguous();
      expected[p + "prompt_len"] = at::tensor(std::vector<int64_t>{(int64_t)ps[i].ids.size()}, at::kLong);
      // capture_sequence (what run_capture stores) agrees too.
      auto direct = capture_sequence(*m.verifier, *m.drafter, want);
      EXPECT_TRUE(at::equal(direct.k[0].to(store), s.k[0]));
    }
    EXPECT_EQ(r.total_tokens(), tokens);
    // Only K/V asked for: nothing else is read.
    auto kv = r.read(0, at::kFloat, at::kCPU, CaptureFields{false, true, false, false});
    EXPECT_TRUE(kv.q.empty() && kv.o.empty() && !kv.dk.defined());
    EXPECT_EQ((int64_t)kv.k.size(), r.num_layers());
    // A lone shard is self-describing.
    CaptureReader one(dir + "/shard-00001.h5");
    ASSERT_EQ(one.size(), 2);
    expect_equal(one.read(0), r.read(2), "lone shard");

    const std::string exp = dir + "/expected.safetensors";
    save_safetensors(exp, expected);
    const std::string cmd = test::env_or_fail("KAKEYA_PYTHON") + " " + test::env_or_fail("KAKEYA_SOURCE_DIR") +
                            "/tests/fixtures/check_capture_h5.py " + dir + " " + exp + " " + verifier_dir() + " " +
                            drafter_dir();
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    remove_all(dir);
  }
}

// A capture killed in the middle of shard 1 (the progress callback throws, and a
// stale half-written shard file is left behind as a SIGKILL would) resumes from
// shard 1 and ends with the same data as an uninterrupted run.
TEST(Capture, ResumeAfterKillEqualsUninterrupted) {
  Models m;
  auto ps = prompts(5);
  const std::string full = temp_dir("full"), killed = temp_dir("killed");
  remove_all(full);
  remove_all(killed);
  run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, options(full));

  struct Killed {};
  EXPECT_THROW(run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, options(killed),
                           [](const CaptureProgress& p) {
                             if (p.done_seqs == 3) throw Killed{};
                           }),
               Killed);
  EXPECT_TRUE(fs::exists(killed + "/shard-00000.h5"));
  EXPECT_FALSE(fs::exists(killed + "/shard-00001.h5"));
  EXPECT_FALSE(fs::exists(killed + "/shard-00001.h5.tmp"));  // removed on the way out
  {
    CaptureReader partial(killed);
    EXPECT_EQ(partial.size(), 2);
    EXPECT_FALSE(partial.complete());
  }
  { std::ofstream(killed + "/shard-00001.h5.tmp") << "half a shard"; }  // what a SIGKILL leaves
  EXPECT_THROW(CaptureReader(killed + "/shard-00001.h5.tmp"), Error);

  auto rep = run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, options(killed));
  EXPECT_EQ(rep.resumed_sequences, 2);
  EXPECT_EQ(rep.sequences, 5);
  EXPECT_FALSE(fs::exists(killed + "/shard-00001.h5.tmp"));
  CaptureReader a(full), b(killed);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(b.complete());
  for (int64_t i = 0; i < a.size(); ++i) expect_equal(a.read(i), b.read(i), "sequence " + std::to_string(i));
  // A rerun of a complete capture does nothing.
  auto again = run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, options(killed));
  EXPECT_EQ(again.resumed_sequences, 5);
  remove_all(full);
  remove_all(killed);
}

// Data-parallel capture: ranks write shards s ≡ rank (mod world); no manifest while a shard is
// missing; the rank that completes the set writes it; the result reads like a one-process capture.
// A rank killed mid-shard is resumed by a run with another number of ranks.
TEST(Capture, ShardedByRankEqualsOneProcess) {
  Models m;
  auto ps = prompts(5);  // options(): 2 sequences per shard -> shards 0, 1, 2
  const std::string full = temp_dir("one"), split = temp_dir("split");
  remove_all(full);
  remove_all(split);
  run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, options(full));
  auto rank = [&](int r, int world) {
    CaptureOptions o = options(split);
    o.rank = r;
    o.world = world;
    return o;
  };
  struct Killed {};
  // Rank 1 of 2 writes shard 1 only; killed in its only shard first, so nothing is left of it.
  EXPECT_THROW(run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, rank(1, 2),
                           [](const CaptureProgress& p) {
                             if (p.done_seqs == 1) throw Killed{};
                           }),
               Killed);
  EXPECT_FALSE(fs::exists(split + "/shard-00001.h5"));
  auto r0 = run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, rank(0, 2));
  EXPECT_TRUE(fs::exists(split + "/shard-00000.h5"));
  EXPECT_TRUE(fs::exists(split + "/shard-00002.h5"));
  EXPECT_FALSE(fs::exists(split + "/capture.json")) << "a manifest while shard 1 is missing";
  EXPECT_EQ(r0.sequences, 0);
  // Resumed on 3 ranks: rank 1 of 3 owns shard 1 and completes the set.
  for (int r : {0, 2}) {
    auto rr = run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, rank(r, 3));
    EXPECT_EQ(rr.resumed_sequences, r == 0 ? 2 : 1) << "rank " << r << " of 3 finds its shard done";
  }
  EXPECT_FALSE(fs::exists(split + "/capture.json"));
  auto r1 = run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, rank(1, 3));
  EXPECT_EQ(r1.sequences, 5);
  CaptureReader a(full), b(split);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(b.complete());
  for (int64_t i = 0; i < a.size(); ++i) expect_equal(a.read(i), b.read(i), "sequence " + std::to_string(i));
  test::expect_error([&] { run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, rank(3, 3)); },
               "rank 3 of 3");
  remove_all(full);
  remove_all(split);
}

// Resuming with other inputs or another drafter, or training on data captured
// from another model, is refused with an error naming the field.
TEST(Capture, MismatchesAreRefused) {
  Models m;
  auto ps = prompts(3);
  const std::string dir = temp_dir("mismatch"), other = temp_dir("other_drafter");
  remove_all(dir);
  remove_all(other);
  run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, options(dir));

  using test::expect_error;
  auto o = options(dir);
  o.gen_len = 5;
  expect_error([&] { run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps, o); }, "identity.gen_len");
  auto ps2 = ps;
  ps2[1].ids[0] += 1;
  expect_error([&] { run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), ps2, options(dir)); },
               "identity.prompts_sha256");

  // Another drafter for the same target (other weights): refused on resume and by check_models.
  auto d2 = Drafter::random(m.drafter->config(), *m.verifier, 99);
  d2.save(other, at::kFloat);
  expect_error([&] { run_capture(*m.verifier, verifier_dir(), d2, other, ps, options(dir)); },
               "identity.drafter.");
  CaptureReader r(dir);
  r.check_models(verifier_dir(), drafter_dir());  // the right pair passes
  expect_error([&] { r.check_models(verifier_dir(), other); }, "captured from another model");
  expect_error([&] { r.check_models(drafter_dir(), drafter_dir()); }, "verifier");
  // The loaded drafter must be the directory's.
  expect_error([&] { run_capture(*m.verifier, verifier_dir(), *m.drafter, verifier_dir(), ps, options(other)); },
               verifier_dir() + "/config.json");
  remove_all(dir);
  remove_all(other);
}

// Write failures name the file: the output directory cannot be created under a regular file.
TEST(Capture, WriteFailureNamesThePath) {
  Models m;
  const std::string file = temp_dir("notadir");
  { std::ofstream(file) << "x"; }
  try {
    run_capture(*m.verifier, verifier_dir(), *m.drafter, drafter_dir(), prompts(1), options(file + "/out"));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
  }
  ::unlink(file.c_str());
}

// Continuous batching (infer/batch.h) against the one-sequence AR decoder it must equal: a small
// random Gemma 4 MoE (sliding window 16, so rows wrap their rings at different steps; K=V full
// layers, GQA, softcap, experts) in f32 on the CPU. Sequences join while others decode, leave
// from the middle (the last row moves into the hole), and each one's greedy tokens must be
// exactly those of generate() on its prompt alone.
#include <gtest/gtest.h>

#include <map>

#include "core/model/model.h"
#include "tests/gemma4_test_util.h"
#include "infer/batch.h"
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

std::vector<int64_t> alone(const std::vector<int64_t>& p, int64_t new_tokens) {
  DecodeOptions o;
  o.max_new_tokens = new_tokens;
  return generate(model(), p, o).tokens;
}

}  // namespace

TEST(BatchDecoder, JoinsAndLeavesBetweenStepsAndEqualsEachSequenceAlone) {
  // (prompt length, new tokens): short and long prompts against the window of 16.
  const std::vector<std::pair<int64_t, int64_t>> spec = {{5, 30}, {23, 9}, {40, 21}, {70, 14}, {12, 25}, {3, 1}};
  std::vector<std::vector<int64_t>> prompts, want;
  for (size_t i = 0; i < spec.size(); ++i) {
    prompts.push_back(prompt(spec[i].first, (int64_t)i));
    want.push_back(alone(prompts.back(), spec[i].second));
  }
  BatchDecoder bd(model(), 3, 128);
  std::map<int64_t, size_t> which;  // id -> spec index
  std::map<size_t, std::vector<int64_t>> got;
  size_t next = 0;
  int64_t steps = 0, most = 0;
  auto done = [&](size_t i) { return (int64_t)got[i].size() >= spec[i].second; };
  while (next < spec.size() || bd.size() > 0) {
    // One join per step while rows are free, so sequences enter at different steps.
    if (next < spec.size() && bd.size() < bd.max_rows()) {
      const auto [id, first] = bd.join(prompts[next], {}, spec[next].second);
      which[id] = next;
      got[next].push_back(first);
      ++next;
    }
    for (auto it = which.begin(); it != which.end();) {
      if (done(it->second)) {
        bd.leave(it->first);
        it = which.erase(it);
      } else {
        ++it;
      }
    }
    if (bd.size() == 0) continue;
    most = std::max(most, bd.size());
    for (const auto& [id, t] : bd.step()) got[which.at(id)].push_back(t);
    ++steps;
  }
  EXPECT_EQ(most, 3) << "the batch never filled its rows";
  for (size_t i = 0; i < spec.size(); ++i) EXPECT_EQ(got[i], want[i]) << "sequence " << i << " (prompt " << spec[i].first << ")";
  EXPECT_LT(steps, 30 + 9 + 21 + 14 + 25) << "no step served several sequences";
}

TEST(BatchDecoder, BadUse) {
  BatchDecoder bd(model(), 2, 32);
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
  expect_error([] { BatchDecoder(model(), 0, 32); }, "--batch expected >= 1");
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
  expect_error([&] { KVCache(model().config(), co); }, "no restore policy");
}

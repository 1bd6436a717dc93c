// The lm_head's int8 screen (ops::HeadScreen, ModelOptions::head_screen) on the real Gemma 3 270M
// (label gpu: runs on the GPU machine only): greedy decoding with the screen gives the whole head's
// tokens, bit for bit, over held-out prose and code, and the screen sends few rows a token to the
// exact sums. The kernels' own cases (odd sizes, ties, NaN) are test_cuda_ops' ScreenedArgmax.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/model/model.h"
#include "infer/generate.h"
#include "tests/test_util.h"

using namespace kakeya;

namespace {

TEST(CudaHeadScreen, RealModelGreedyTokensEqualTheWholeHeads) {
  if (!at::hasCUDA()) GTEST_FAIL() << "no CUDA device (label gpu tests run on the GPU machine)";
  ModelOptions mo;
  mo.device = at::Device(at::kCUDA, 0);
  mo.dtype = at::kBFloat16;
  mo.max_positions = 1024;
  mo.head_screen = true;
  const Model m = Model::load(test::real_model_dir(), mo);
  ASSERT_TRUE(m.head_screen().defined());
  EXPECT_EQ(m.head_screen_bytes(), m.config().vocab_size * (m.config().hidden_size + 8));
  const std::vector<std::string> texts = {
      "In the spring the river rose over the low fields, and the families who farmed them moved their animals "
      "to the hill pastures, as their grandparents had done. ",
      "def merge(intervals):\n    intervals.sort(key=lambda iv: iv[0])\n    out = []\n    for lo, hi in intervals:\n"};
  for (const std::string& t : texts) {
    const std::vector<int64_t> prompt = test::real_prompt(t);
    const int64_t n = 200;
    DecodeOptions o;
    o.max_new_tokens = n;
    o.stream = false;
    DecodeOptions whole = o;
    whole.head_screen = false;
    ArDecoder screened(m, (int64_t)prompt.size() + n, o), full(m, (int64_t)prompt.size() + n, whole);
    m.head_screen().summed.zero_();
    const DecodeResult a = screened.run(prompt, o);
    const int summed = m.head_screen().summed.item<int>();
    const DecodeResult b = full.run(prompt, whole);
    ASSERT_EQ((int64_t)a.tokens.size(), n);
    EXPECT_EQ(a.tokens, b.tokens) << t;
    EXPECT_EQ(m.head_screen().summed.item<int>(), summed) << "the whole-head decoder went through the screen";
    EXPECT_GE(summed, n) << "every step sums at least its argmax's row exactly";
    EXPECT_LT(summed, 200 * n) << "the screen passed " << summed / (double)n << " rows a token of "
                               << m.config().vocab_size;
    std::printf("[head screen] %s...: %.1f rows a token summed exactly\n", t.substr(0, 24).c_str(), summed / (double)n);
    // A second run replays the captured step: the same tokens, no allocation.
    const DecodeResult again = screened.run(prompt, o);
    EXPECT_EQ(again.tokens, a.tokens);
    EXPECT_EQ(again.steady_allocations, 0);
  }
}

}  // namespace

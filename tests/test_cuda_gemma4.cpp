// A Gemma 4 mixture-of-experts verifier on the GPU (random weights of small shape drawn on the
// host, tests/gemma4_test_util.h, the same values on both devices), f32: the forward (prefill,
// which groups tokens by expert, and decode steps, which take the expert GEMV) gives the CPU's
// logits (the q/k/v kernel with v_norm and K=V layers included); greedy AR decoding through CUDA
// graphs gives the CPU's tokens; exact restoration
// (a = 1) and the fused decoder give AR's tokens on the GPU too; batched steps over sequences at
// different positions (infer/batch.h) give each one's AR tokens. bf16 decodes (label gpu).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>

#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/model/random_weights.h"
#include "infer/batch.h"
#include "infer/decoder.h"
#include "infer/generate.h"
#include "tests/batch_test_util.h"
#include "tests/gemma4_test_util.h"

using namespace kakeya;

namespace {

const at::Device kCuda(at::kCUDA, 0);

Model small(at::Device device, at::ScalarType dt) {
  ModelOptions mo;
  mo.device = device;
  mo.dtype = dt;
  mo.max_positions = 256;
  return Model::from_weights(test::small_gemma4_moe(), random_weights(21, at::kCPU), mo);
}

std::vector<int64_t> prompt() { return test::small_gemma4_prompt(); }

at::Tensor logits(const Model& m, const std::vector<int64_t>& ids, int64_t chunk) {
  KVCacheOptions co;
  co.capacity = (int64_t)ids.size();
  co.device = m.device();
  co.dtype = m.dtype();
  KVCache cache(m.config(), co);
  auto t = at::tensor(ids, at::kLong).to(m.device());
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < t.size(0); i += chunk) {
    const int64_t n = std::min(chunk, t.size(0) - i);
    out.push_back(m.forward(t.slice(0, i, i + n).unsqueeze(0), cache).squeeze(0).to(at::kCPU));
  }
  return at::cat(out);
}

class CudaGemma4 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_FAIL() << "no CUDA device (label gpu tests run on the GPU machine)";
  }
};

TEST_F(CudaGemma4, ForwardEqualsCpu) {
  Model cpu = small(at::kCPU, at::kFloat), gpu = small(kCuda, at::kFloat);
  const auto ids = prompt();
  auto want = logits(cpu, ids, (int64_t)ids.size());
  const double scale = want.abs().max().item<double>();
  // 70 tokens at once (experts grouped by token), steps of 1 and blocks of 16 (the expert GEMV).
  for (int64_t chunk : {(int64_t)ids.size(), int64_t{1}, int64_t{16}}) {
    auto got = logits(gpu, ids, chunk);
    EXPECT_LE((got - want).abs().max().item<double>(), 1e-4 * scale) << "chunk " << chunk;
  }
}

TEST_F(CudaGemma4, GreedyDecodesEqualCpuAndRestorationIsLossless) {
  Model cpu = small(at::kCPU, at::kFloat), gpu = small(kCuda, at::kFloat);
  DecodeOptions o;
  o.max_new_tokens = 24;
  o.stream = false;
  const auto want = generate(cpu, prompt(), o).tokens;
  ASSERT_EQ(want.size(), 24u);
  auto ar = generate(gpu, prompt(), o);
  EXPECT_EQ(ar.tokens, want);
  auto dcfg = DrafterConfig::for_target(gpu.config(), 2, 4, 1, 64, 128, 8, 3);
  Drafter d = Drafter::random(dcfg, gpu, 5);
  FTheta f = FTheta::random(FThetaConfig::for_pair(gpu.config(), dcfg, 16), 7, at::kFloat, kCuda);
  for (DecodeMode mode : {DecodeMode::Restored, DecodeMode::Fused}) {
    DecodeOptions r = o;
    r.mode = mode;
    r.restore.sink = 4;
    r.restore.window = 8;
    r.restore.mix_alpha = 1.0;
    auto got = decode(gpu, &d, &f, prompt(), r);
    EXPECT_EQ(got.tokens, want) << (mode == DecodeMode::Fused ? "fused" : "restored");
    EXPECT_GT(got.restored_positions, 40);
  }
}

TEST_F(CudaGemma4, Bf16Decodes) {
  Model gpu = small(kCuda, at::kBFloat16);
  DecodeOptions o;
  o.max_new_tokens = 16;
  o.stream = false;
  auto r = generate(gpu, prompt(), o);
  EXPECT_EQ(r.tokens.size(), 16u);
  for (int64_t t : r.tokens) EXPECT_TRUE(t >= 0 && t < 512);
}

}  // namespace

// Continuous batching on the GPU (per-row positions through the q/k/v and attention kernels, B
// rows through the expert GEMV): each sequence's greedy tokens equal AR's on its prompt alone, f32.
TEST_F(CudaGemma4, BatchedStepsEqualEachSequenceAlone) {
  Model gpu = small(kCuda, at::kFloat);
  const std::vector<int64_t> lengths = {70, 9, 33, 17, 50}, budget = {12, 20, 7, 15, 10};
  BatchDecoder bd(gpu, nullptr, nullptr, DecodeOptions{}, 3, 128);
  const auto all = prompt();
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t n : lengths) prompts.emplace_back(all.begin(), all.begin() + n);
  const test::BatchRun r = test::run_batch(bd, prompts, budget);
  for (size_t i = 0; i < lengths.size(); ++i) {
    DecodeOptions o;
    o.max_new_tokens = budget[i];
    EXPECT_EQ(r.tokens[i], generate(gpu, prompts[i], o).tokens) << "sequence " << i << " (prompt " << lengths[i] << ")";
  }
}

// The decode step as persistent-kernel programs (ops::StepProgram, DecodeOptions::megakernel)
// against the same step's kernels replayed from a CUDA graph (label gpu: runs on the GPU machine
// only). The program runs the kernels' own bodies, so in bf16 the two agree bit for bit: the same
// greedy tokens and the same K/V cache contents after the run.
//   - the real Gemma 3 270M, 300-token prompt, 96 new tokens, with the whole greedy head and with
//     the int8 head screen (ModelOptions::head_screen);
//   - random weights of a small Gemma 3 shape with other sizes (hidden 200, head dim 128, two KV
//     heads, a 16-token sliding window the decode wraps around), the same;
//   - the trace (KAKEYA_MEGA_TRACE) keeps the program's order;
//   - f32 (the program holds bf16 bodies and the dtype-free bookkeeping only): the few recorded
//     launches run in the program, every other as a kernel of its own, and the tokens are the same.
// Also capture_graph (infer/graph_capture.h), which captures the step: a throw inside the capture
// ends it, so the stream takes launches again.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/error.h"
#include "core/model/model.h"
#include "infer/generate.h"
#include "infer/graph_capture.h"
#include "tests/test_util.h"

using namespace kakeya;

namespace {

const at::Device kCuda(at::kCUDA, 0);

struct DecodeRun {
  DecodeResult res;
  std::vector<at::Tensor> kv;  // every layer's keys and values after the run
};

DecodeRun decode(const Model& m, const std::vector<int64_t>& prompt, int64_t new_tokens, bool megakernel) {
  DecodeOptions o;
  o.max_new_tokens = new_tokens;
  o.stream = false;
  o.megakernel = megakernel;
  ArDecoder d(m, (int64_t)prompt.size() + new_tokens, o);
  DecodeRun r;
  // Twice on one decoder: the second run replays the graph (and program) the first captured.
  const std::vector<int64_t> first = d.run(prompt, o).tokens;
  r.res = d.run(prompt, o);
  EXPECT_EQ(r.res.tokens, first) << (megakernel ? "persistent kernels" : "graph step") << ": a replay differs";
  for (int64_t l = 0; l < m.config().num_layers; ++l) {
    r.kv.push_back(d.cache().keys(l).clone());
    r.kv.push_back(d.cache().values(l).clone());
  }
  return r;
}

// The step's kernels against the step's program: tokens, no allocation in the replays, caches.
void expect_same_decode(const Model& m, const std::vector<int64_t>& prompt, int64_t new_tokens) {
  const DecodeRun want = decode(m, prompt, new_tokens, false);
  const DecodeRun got = decode(m, prompt, new_tokens, true);
  EXPECT_NE(got.res.step_program.find("persistent-kernel launches"), std::string::npos) << got.res.step_program;
  ASSERT_EQ((int64_t)got.res.tokens.size(), new_tokens);
  EXPECT_EQ(got.res.tokens, want.res.tokens);
  EXPECT_EQ(got.res.steady_allocations, 0);
  ASSERT_EQ(got.kv.size(), want.kv.size());
  for (size_t i = 0; i < got.kv.size(); ++i)
    EXPECT_TRUE(at::equal(got.kv[i], want.kv[i])) << (i % 2 ? "values" : "keys") << " of layer " << i / 2;
}

ModelOptions on_cuda(at::ScalarType dtype, int64_t max_positions, bool head_screen = false) {
  ModelOptions mo;
  mo.head_screen = head_screen;
  mo.device = kCuda;
  mo.dtype = dtype;
  mo.max_positions = max_positions;
  return mo;
}

TEST(CudaMegakernel, RealModelBf16EqualsTheGraphStep) {
  if (!at::hasCUDA()) GTEST_FAIL() << "no CUDA device (label gpu tests run on the GPU machine)";
  const std::vector<int64_t> text = test::real_prompt(
      "The persistent kernel walks the step's instructions in order; each block takes its share of every "
      "launch, waits for the launch before it, and moves on. ");
  std::vector<int64_t> prompt = text;
  while (prompt.size() < 300) prompt.insert(prompt.end(), text.begin() + 1, text.end());
  prompt.resize(300);
  for (const bool screen : {false, true}) {
    SCOPED_TRACE(screen ? "greedy head through the int8 screen" : "whole greedy head");
    const Model m = Model::load(test::real_model_dir(), on_cuda(at::kBFloat16, 1024, screen));
    expect_same_decode(m, prompt, 96);
  }
}

TEST(CudaMegakernel, SmallRandomShapeBf16EqualsTheGraphStep) {
  if (!at::hasCUDA()) GTEST_FAIL() << "no CUDA device (label gpu tests run on the GPU machine)";
  nlohmann::json j;
  std::ifstream(test::real_model_dir() + "/config.json") >> j;
  j["vocab_size"] = 1000;
  j["hidden_size"] = 200;
  j["intermediate_size"] = 328;
  j["num_hidden_layers"] = 5;
  j["num_attention_heads"] = 4;
  j["num_key_value_heads"] = 2;
  j["head_dim"] = 128;
  j["query_pre_attn_scalar"] = 128;
  j["sliding_window"] = 16;
  j["layer_types"] = {"sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                      "sliding_attention"};
  const ModelConfig cfg = ModelConfig::from_json(j, "small gemma3 (test)");
  std::vector<int64_t> prompt;
  for (int64_t i = 0; i < 37; ++i) prompt.push_back((i * 389 + 11) % 1000);
  // With the screen asked for, hidden 200 (no multiple of 16) has none: the whole head answers.
  for (const bool screen : {false, true}) {
    SCOPED_TRACE(screen ? "head screen asked for" : "whole greedy head");
    const Model m = Model::random(cfg, 7, on_cuda(at::kBFloat16, 256, screen));
    expect_same_decode(m, prompt, 61);
  }
}

// KAKEYA_MEGA_TRACE: the last step's timeline, one entry per recorded launch. The blocks' clocks
// (globaltimer) show the program's order: no block ends its wait for an instruction before every
// block has finished the one before it.
TEST(CudaMegakernel, TraceShowsEveryInstructionAfterTheOneBefore) {
  if (!at::hasCUDA()) GTEST_FAIL() << "no CUDA device (label gpu tests run on the GPU machine)";
  const Model m = Model::load(test::real_model_dir(), on_cuda(at::kBFloat16, 512));
  const std::vector<int64_t> prompt = test::real_prompt("A step whose every instruction is timed by its blocks.");
  const std::string path = ::testing::TempDir() + "kakeya_mega_trace.json";
  std::remove(path.c_str());
  setenv("KAKEYA_MEGA_TRACE", path.c_str(), 1);
  DecodeOptions o;
  o.max_new_tokens = 16;
  o.stream = false;
  o.megakernel = true;
  DecodeResult r;
  {
    ArDecoder d(m, (int64_t)prompt.size() + 16, o);
    r = d.run(prompt, o);
  }
  unsetenv("KAKEYA_MEGA_TRACE");
  long long recorded = -1;
  ASSERT_EQ(std::sscanf(r.step_program.c_str(), "%lld launches", &recorded), 1) << r.step_program;
  nlohmann::json j;
  std::ifstream f(path);
  ASSERT_TRUE(f.good()) << path;
  f >> j;
  const auto& ins = j.at("instructions");
  ASSERT_EQ((long long)ins.size(), recorded);
  int64_t prev_done = -1;
  for (size_t i = 0; i < ins.size(); ++i) {
    const int64_t w0 = ins[i]["wait_end_ns"][0], w1 = ins[i]["wait_end_ns"][1];
    const int64_t d0 = ins[i]["done_ns"][0], d1 = ins[i]["done_ns"][1];
    EXPECT_GE(w0, prev_done) << "instruction " << i << " (" << ins[i]["op"] << ") began before the one before ended";
    EXPECT_LE(w0, w1);
    EXPECT_LE(d0, d1);
    EXPECT_GE(d1, w1);
    EXPECT_GE((int64_t)ins[i]["longest_block_ns"], 0);
    prev_done = d1;
  }
  EXPECT_GT(prev_done, 0);
}

TEST(CudaMegakernel, F32RunsMostKernelsAloneWithTheSameTokens) {
  if (!at::hasCUDA()) GTEST_FAIL() << "no CUDA device (label gpu tests run on the GPU machine)";
  const Model m = Model::load(test::real_model_dir(), on_cuda(at::kFloat, 512));
  const std::vector<int64_t> prompt = test::real_prompt("A short prompt for a step that keeps its kernels.");
  const DecodeRun want = decode(m, prompt, 24, false);
  const DecodeRun got = decode(m, prompt, 24, true);
  long long recorded = -1, segments = -1, blocks = -1, alone = -1;
  ASSERT_EQ(std::sscanf(got.res.step_program.c_str(), "%lld launches as %lld persistent-kernel launches of %lld blocks + %lld",
                        &recorded, &segments, &blocks, &alone),
            4)
      << got.res.step_program;
  EXPECT_GT(alone, 10 * recorded) << got.res.step_program;  // the f32 GEMVs, norms and attention
  EXPECT_EQ(got.res.tokens, want.res.tokens);
  for (size_t i = 0; i < got.kv.size(); ++i) EXPECT_TRUE(at::equal(got.kv[i], want.kv[i])) << i;
}

}  // namespace

TEST(CudaGraphCapture, AThrowEndsTheCaptureAndTheStreamTakesLaunchesAgain) {
  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());  // capture refuses the default stream
  at::Tensor x = at::zeros({4}, at::TensorOptions().device(kCuda));
  EXPECT_THROW(capture_graph([&] {
                 x.add_(1);
                 throw Error("inside the capture");
               }),
               Error);
  EXPECT_EQ(c10::cuda::currentStreamCaptureStatusMayInitCtx(), c10::cuda::CaptureStatus::None);
  EXPECT_EQ(capture_graph([&] {
              x.add_(1);
              return false;  // what it recorded cannot be used
            }),
            nullptr);
  auto g = capture_graph([&] { x.add_(1); });
  ASSERT_NE(g, nullptr);
  g->replay();
  g->replay();
  // Captures record without running: only the two replays added.
  EXPECT_EQ(x.sum().item<float>(), 8.f);
}

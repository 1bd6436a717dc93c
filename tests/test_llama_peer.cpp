// The llama.cpp peer of `kakeya bench decode` (infer/llama_peer.h): its llama-bench command and the
// parse of llama-bench's JSON output, on an output llama-bench itself wrote (tests/fixtures/
// llama_bench_gemma3_270m_bf16_h200.json: tools/device/llama_bench.sh's build, the default model in
// BF16, `-p 512 -n 256 -d 0,512 -r 3 -o json` on an H200).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "infer/llama_peer.h"
#include "tests/test_util.h"

using namespace kakeya;

namespace {

std::string fixture() {
  const std::string path = test::env_or_fail("KAKEYA_SOURCE_DIR") + "/tests/fixtures/llama_bench_gemma3_270m_bf16_h200.json";
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(LlamaPeer, CommandAsksForPrefillAtDepthZeroAndDecodeAtThePromptsDepth) {
  EXPECT_EQ(llama_bench_command("/opt/llama-bench", "/m/a.gguf", 512, 256, 5),
            "'/opt/llama-bench' -m '/m/a.gguf' -ngl 99 -fa on -p 512 -n 256 -d 0,512 -r 5 -o json");
}

TEST(LlamaPeer, ParsesLlamaBenchOutput) {
  // stderr-free stdout may still carry a log line before the array: the parser starts at '['.
  auto r = parse_llama_bench("main: loaded\n" + fixture(), "/tmp/models/gemma-3-270m-bf16.gguf", 512, 256);
  EXPECT_EQ(r["model_type"], "gemma3 270M BF16");
  EXPECT_EQ(r["gpu_info"], "NVIDIA H200");
  EXPECT_EQ(r["model_size"], 536308224);
  EXPECT_NEAR(r["prefill_tps"].get<double>(), 61815.4, 0.1);      // pp512 at depth 0
  EXPECT_NEAR(r["decode_tps"].get<double>(), 830.1, 0.1);         // tg256 at depth 512
  EXPECT_NEAR(r["decode_tps_depth0"].get<double>(), 800.7, 0.1);  // tg256 at depth 0
  const double e2e = 256 / (512 / r["prefill_tps"].get<double>() + 256 / r["decode_tps"].get<double>());
  EXPECT_NEAR(r["e2e_tps"].get<double>(), e2e, 1e-9);
}

TEST(LlamaPeer, BadOutputNamesWhatIsMissing) {
  test::expect_error([] { parse_llama_bench(fixture(), "a.gguf", 1024, 256); }, "no prefill test (n_prompt 1024");
  test::expect_error([] { parse_llama_bench(fixture(), "a.gguf", 512, 128); }, "no decode test (n_prompt 0, n_gen 128");
  test::expect_error([] { parse_llama_bench("error: failed to load model\n", "a.gguf", 512, 256); },
                     "a.gguf: no JSON array");
  test::expect_error([] { parse_llama_bench("[{\"n_prompt\": 512}", "a.gguf", 512, 256); }, "is not JSON");
  test::expect_error([] { parse_llama_bench("[{\"n_prompt\": 512}]", "a.gguf", 512, 256); }, "a test without n_prompt");
}

}  // namespace

#include "infer/llama_peer.h"

#include "core/error.h"

namespace kakeya {

std::string llama_bench_command(const std::string& bin, const std::string& gguf, int64_t prompt_len,
                                int64_t new_tokens, int64_t repeats) {
  // llama-bench runs the product of its lists: pp at depths 0 and prompt_len, tg at both; the
  // parser takes pp at 0 and tg at prompt_len (tg at 0 is reported beside it).
  return "'" + bin + "' -m '" + gguf + "' -ngl 99 -fa on -p " + std::to_string(prompt_len) + " -n " +
         std::to_string(new_tokens) + " -d 0," + std::to_string(prompt_len) + " -r " + std::to_string(repeats) +
         " -o json";
}

nlohmann::json parse_llama_bench(const std::string& out, const std::string& gguf, int64_t prompt_len,
                                 int64_t new_tokens) {
  const auto start = out.find('[');
  KAKEYA_CHECK(start != std::string::npos, "llama-bench on " << gguf << ": no JSON array in its output:\n" << out);
  nlohmann::json tests;
  try {
    tests = nlohmann::json::parse(out.substr(start));
  } catch (const nlohmann::json::exception& e) {
    KAKEYA_FAIL("llama-bench on " << gguf << ": its output is not JSON (" << e.what() << "):\n" << out);
  }
  KAKEYA_CHECK(tests.is_array(), "llama-bench on " << gguf << ": expected an array of tests");
  auto find = [&](int64_t n_prompt, int64_t n_gen, int64_t depth, const char* what) -> const nlohmann::json& {
    for (const auto& t : tests) {
      KAKEYA_CHECK(t.is_object() && t.contains("n_prompt") && t.contains("n_gen") && t.contains("n_depth") &&
                       t.contains("avg_ts"),
                   "llama-bench on " << gguf << ": a test without n_prompt / n_gen / n_depth / avg_ts: " << t.dump());
      if (t["n_prompt"].get<int64_t>() == n_prompt && t["n_gen"].get<int64_t>() == n_gen &&
          t["n_depth"].get<int64_t>() == depth)
        return t;
    }
    KAKEYA_FAIL("llama-bench on " << gguf << ": no " << what << " test (n_prompt " << n_prompt << ", n_gen " << n_gen
                                  << ", n_depth " << depth << ") in its output");
  };
  const auto& pp = find(prompt_len, 0, 0, "prefill");
  const auto& tg = find(0, new_tokens, prompt_len, "decode");
  const auto& tg0 = find(0, new_tokens, 0, "depth-0 decode");
  const double prefill = pp["avg_ts"].get<double>(), decode = tg["avg_ts"].get<double>();
  KAKEYA_CHECK(prefill > 0 && decode > 0, "llama-bench on " << gguf << ": non-positive tok/s");
  return {{"gguf", gguf},
          {"model_type", tg.value("model_type", "")},
          {"model_size", tg.value("model_size", int64_t{0})},
          {"gpu_info", tg.value("gpu_info", "")},
          {"build_commit", tg.value("build_commit", "")},
          {"prefill_tps", prefill},
          {"decode_tps", decode},
          {"decode_stddev_tps", tg.value("stddev_ts", 0.0)},
          {"decode_tps_depth0", tg0["avg_ts"].get<double>()},
          {"e2e_tps", new_tokens / (prompt_len / prefill + new_tokens / decode)}};
}

}  // namespace kakeya

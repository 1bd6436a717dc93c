// `kakeya bench memory`: what a fixed KV budget buys with each decoder config — the longest
// context one session fits, how many sessions of a given context fit side by side, and (on a
// loaded model) how fast each config decodes at that context next to AR in the same run.
//
// Bytes come from the memory plans (infer/memory.h ar_memory_plan / restored_memory_plan: the
// layouts the caches allocate, checked against the measured reports by tests), so budgets and
// contexts up to the model's limit are answered without allocating them; with speed on, each
// timed decoder's own measured report is kept next to its plan at the timed context.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "core/model/config.h"
#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "infer/decoder.h"
#include "infer/options.h"
#include "infer/result.h"

namespace kakeya {

struct BenchMemoryOptions {
  // comma-separated eval-long specs; int4 and lm5 regions take the same bytes (lm5 4x less error)
  std::string configs = "oracle,evict:256,restored:256,restored-int4:256,restored-lm5:256";
  RestoreOptions restore;             // the restore options the configs start from (sink, chunk, codes, …)
  std::vector<int64_t> budgets{64ll << 20, 256ll << 20};  // KV bytes per budget
  int64_t context = 8192;             // positions per session for the session count and the timing
  int64_t max_context = 0;            // the longest context considered (0: the model's limit)
  // Timing (needs the models): prompt = context - new_tokens tokens, then new_tokens greedy tokens.
  int64_t new_tokens = 256;
  int64_t repeats = 3;                // timed runs per config, in rounds with AR (median reported)
};

// What the timed configs decode with (all null: bytes only).
struct BenchMemoryModels {
  const Model* verifier = nullptr;
  const Drafter* drafter = nullptr;
  const FTheta* ftheta = nullptr;
  std::vector<int64_t> prompt;  // context - new_tokens tokens
};

// {"configs": [{"config", "restore", "kv_bytes_at_context", "ratio_vs_native_at_context", "budgets": [BudgetFit],
//   "curve": [{"context", "kv_bytes"}], "decode_tps", "decode_ratio_vs_ar", "memory_measured"}], "context",
//   "max_context", "budgets_bytes", "native_curve", …}; curves at 256 · 2^k positions up to max_context.
// Throws naming the config or flag at fault (a bad config, a context past the limit).
nlohmann::json bench_memory(const ModelConfig& cfg, at::ScalarType dtype, const DrafterConfig* drafter,
                            const FThetaConfig* ftheta, const BenchMemoryOptions& o,
                            const BenchMemoryModels& models = {});
std::string bench_memory_table(const nlohmann::json& report);  // aligned text table

// Decoders timed on one prompt in rounds (each once, then again), after one untimed warm-up run
// each (allocator, cuBLAS handles, CUDA-graph capture): a clock that drifts during the run
// weighs on every decoder alike. Every run must generate exactly new_tokens tokens.
struct TimedDecoder {
  TimedDecoder(Decoder* d, const DecodeOptions& o) : decoder(d), options(o) {}
  Decoder* decoder = nullptr;
  DecodeOptions options;
  std::vector<double> decode_tps, e2e_tps, prefill_tps;  // per timed run (prefill: prompt tokens / prefill seconds)
  DecodeResult last;                                     // the last timed run
  double median_decode_tps() const;
  double median_e2e_tps() const;
  double median_prefill_tps() const;
};
void time_in_rounds(std::vector<TimedDecoder>& ds, const std::vector<int64_t>& prompt, int64_t repeats,
                    int64_t new_tokens);

// The device's measured memory bandwidth in bytes/s (read + write) of a plain copy of 1 GiB
// (256 MiB on the CPU), the best of 5 after a warm-up: what a decode step that streams its
// weights can hope for, so bench decode states its speed as a fraction of this bound.
double copy_bandwidth(at::Device device);

}  // namespace kakeya

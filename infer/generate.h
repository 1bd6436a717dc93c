// The plain autoregressive decode loop (the `ar` baseline every other mode is
// compared with): prefill, then one token per forward. On CUDA the decode step
// is captured once as a CUDA graph that also feeds its own output back, so the
// steady state launches one graph per token and syncs only to stream text. An
// ArDecoder keeps its cache, buffers and graph across prompts.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/kv_cache.h"
#include "core/model.h"
#include "core/sampling.h"
#include "infer/loop_util.h"
#include "infer/upkeep.h"

namespace kakeya {

// Without streaming, stop tokens are looked for every this many steps: the steps after a
// stop inside a batch are wasted work, but none of them waits on the host.
constexpr int64_t kStopCheckEvery = 8;

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  SamplingOptions sampling;
  std::vector<int64_t> stop_ids;        // generation ends after emitting one of these
  bool cuda_graph = true;               // CUDA only
  bool stream = true;                   // call on_token per token (one host sync each); otherwise
                                        // stops are checked every kStopCheckEvery steps (one sync each)
  std::function<void(int64_t)> on_token;
};

struct GenerateResult {
  std::vector<int64_t> tokens;          // generated ids (prompt excluded)
  double prefill_seconds = 0;
  double decode_seconds = 0;            // from the first to the last generated token
  double capture_seconds = 0;           // CUDA graph capture inside decode_seconds (a decoder's first run only)
  int64_t cache_bytes = 0;
  int64_t steady_allocations = -1;      // CUDA allocations from the first graph replay to the end (-1: no replay)
  double decode_tokens_per_second() const {
    return tokens.size() > 1 && decode_seconds > 0 ? (tokens.size() - 1) / decode_seconds : 0.0;
  }
};

GenerateResult generate(const Model& model, const std::vector<int64_t>& prompt, const GenerateOptions& opt);

// The CUDA graph of a DecodeLoop's step, kept with the loop's static buffers by a decoder
// that runs many prompts, so capture happens once (a server captures once). Opaque outside
// generate.cpp.
struct LoopGraphs;

// The one-token-per-forward decode loop generate() and the restored decoder share.
// `step` runs one decode step on the static buffers (feeds `cur` at its device-side
// position, samples into out[step_idx] and back into `cur`, advances both); on CUDA it
// is captured once as a graph and replayed, unless `before` is set.
struct DecodeLoop {
  std::function<void()> step;
  std::function<void(int64_t p)> before;  // host work before the step feeding p (forces eager steps)
  std::function<void(int64_t p)> after;   // host bookkeeping after that step
  at::Tensor cur;       // [1, 1] int64: the token the next step feeds
  at::Tensor step_idx;  // [1] int64: index into out of the next sampled token
  at::Tensor out;       // [>= max_new_tokens] int64: every sampled token
  // Periodic device work between steps (batched restoration). Before the step feeding p the
  // loop asks upkeep_due(p) until it answers from < 0 and hands each batch to `upkeep`
  // (infer/upkeep.h: on CUDA with graphs a side-stream graph that overlaps the steps before
  // read_at, whose step waits for it), which the loop captures with the step.
  std::function<UpkeepBatch(int64_t p)> upkeep_due = nullptr;
  UpkeepRunner* upkeep = nullptr;
  std::shared_ptr<LoopGraphs> graphs;  // captured by the first run_decode_loop, replayed by later ones
};
// From the token sampled after the prefill (`first`: [1] int64) to max_new_tokens or a
// stop: streams tokens (opt.stream) or reads them once at the end, advances `cache` per step.
// Fills res.tokens, res.prefill_seconds (from t0 to the first token), res.decode_seconds and
// res.capture_seconds (0 when loop.graphs came captured).
void run_decode_loop(DecodeLoop& loop, const at::Tensor& first, KVCache& cache, int64_t n_prompt,
                     const GenerateOptions& opt, Clock::time_point t0, const at::Device& dev, GenerateResult& res);

// The AR decoder kept across prompts: a KV cache for `capacity` positions (prompt + new
// tokens of the longest run), the step's static buffers and, on CUDA, its graph, captured by
// the first greedy run and replayed by every later one. generate() is one used once.
// Sampling (temperature > 0) and cuda_graph are fixed at construction; run() checks them.
class ArDecoder {
 public:
  ArDecoder(const Model& model, int64_t capacity, const GenerateOptions& opt);
  ArDecoder(const ArDecoder&) = delete;  // the loop's functions hold `this`
  ArDecoder& operator=(const ArDecoder&) = delete;
  GenerateResult run(const std::vector<int64_t>& prompt, const GenerateOptions& opt);
  int64_t capacity() const { return cache_.capacity(); }

 private:
  const Model& model_;
  GenerateOptions opt_;
  KVCache cache_;
  Sampler sampler_;
  at::Tensor cur_, pos_, step_, out_;  // [1, 1], [1], [1], [capacity] int64: the step's static buffers
  DecodeLoop loop_;
};

// Checks that a persistent decoder built with `built` can serve a run with `run`: the options
// its graphs depend on (sampling, cuda_graph) must match, and prompt + new tokens must fit.
void check_run_fits(const char* who, int64_t capacity, int64_t n_prompt, const GenerateOptions& built,
                    const GenerateOptions& run);

}  // namespace kakeya

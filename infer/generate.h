// The plain autoregressive decode loop (the `ar` baseline every other mode is
// compared with): prefill, then one token per forward. On CUDA the decode step
// is captured once as a CUDA graph that also feeds its own output back, so the
// steady state launches one graph per token and syncs only to stream text.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/model.h"
#include "core/sampling.h"
#include "infer/loop_util.h"

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
  double capture_seconds = 0;           // CUDA graph capture inside decode_seconds (once per session)
  int64_t cache_bytes = 0;
  double decode_tokens_per_second() const {
    return tokens.size() > 1 && decode_seconds > 0 ? (tokens.size() - 1) / decode_seconds : 0.0;
  }
};

GenerateResult generate(const Model& model, const std::vector<int64_t>& prompt, const GenerateOptions& opt);

// The one-token-per-forward decode loop generate() and the restored decoder share.
// `step` runs one decode step on the static buffers (feeds `cur` at its device-side
// position, samples into out[step_idx] and back into `cur`, advances both); on CUDA it
// is captured once as a graph and replayed, unless `before` is set.
struct DecodeLoop {
  std::function<void()> step;
  std::function<void(int64_t p)> before;  // host work before the step feeding position p (forces eager steps)
  std::function<void(int64_t p)> after;   // host bookkeeping after that step
  at::Tensor cur;       // [1, 1] int64: the token the next step feeds
  at::Tensor step_idx;  // [1] int64: index into out of the next sampled token
  at::Tensor out;       // [max_new_tokens] int64: every sampled token
  // Periodic device work between steps (batched restoration): when upkeep_due(p) (host)
  // says so, `upkeep` runs before the step feeding p; on CUDA it is a second graph.
  std::function<bool(int64_t p)> upkeep_due = nullptr;
  std::function<void()> upkeep = nullptr;
};
// From the token sampled after the prefill (`first`: [1] int64) to max_new_tokens or a
// stop: streams tokens (opt.stream) or reads them once at the end, advances `cache` per step.
// Fills res.tokens, res.prefill_seconds (from t0 to the first token) and res.decode_seconds.
void run_decode_loop(DecodeLoop& loop, const at::Tensor& first, KVCache& cache, int64_t n_prompt,
                     const GenerateOptions& opt, Clock::time_point t0, const at::Device& dev, GenerateResult& res);

}  // namespace kakeya

// The plain autoregressive decode loop (the `ar` baseline every other mode is
// compared with): prefill, then one token per forward. On CUDA the decode step
// is captured once as a CUDA graph that also feeds its own output back, so the
// steady state launches one graph per token and syncs only to stream text. An
// ArDecoder keeps its cache, buffers and graph across calls (infer/decoder.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/model/kv_cache.h"
#include "core/model/model.h"
#include "core/model/sampling.h"
#include "infer/decoder.h"
#include "infer/loop_util.h"
#include "infer/upkeep.h"

namespace kakeya {

// The AR cache of `capacity` positions: the model's own attention, no rollback (throws when the
// model's position table is shorter).
KVCacheOptions ar_cache_options(const Model& model, int64_t capacity);

// One AR decode (opt.mode is not read): an ArDecoder for prompt + new tokens, used once.
DecodeResult generate(const Model& model, const std::vector<int64_t>& prompt, const DecodeOptions& opt);

// The CUDA graph of a DecodeLoop's step, kept with the loop's static buffers by a decoder
// that runs many prompts, so capture happens once (a server captures once). Opaque outside
// generate.cpp.
struct LoopGraphs;

// The one-token-per-forward decode loop generate() and the restored decoder share.
// `step` runs one decode step on the static buffers (feeds `cur` at its device-side
// position, samples into out[step_idx] and back into `cur`, advances both); on CUDA it
// is captured once as a graph and replayed.
struct DecodeLoop {
  std::function<void()> step;
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
// From the token sampled after the prefill (`first`: [1] int64; n_fed positions went through
// the verifier before it) to max_new_tokens, a stop token or opt.should_stop: streams tokens
// (opt.reads_each_token) or reads them in batches, advances `cache` per step.
// Fills res.tokens, res.prefill_seconds (from t0 to the first token), res.decode_seconds and
// res.capture_seconds (0 when loop.graphs came captured).
void run_decode_loop(DecodeLoop& loop, const at::Tensor& first, KVCache& cache, int64_t n_fed,
                     const DecodeOptions& opt, Clock::time_point t0, const at::Device& dev, DecodeResult& res);

// The AR decoder: a KV cache for `capacity` positions, the step's static buffers and, on CUDA,
// its graph, captured by the first greedy run and replayed by every later one.
class ArDecoder : public Decoder {
 public:
  ArDecoder(const Model& model, int64_t capacity, const DecodeOptions& opt);
  int64_t capacity() const override { return cache_.capacity(); }
  int64_t length() const override { return cache_.length(); }
  MemoryReport memory() const override;
  const KVCache& cache() const { return cache_; }  // what the runs left (tests compare decode strategies)

 private:
  DecodeResult feed(const std::vector<int64_t>& tokens, const DecodeOptions& opt, bool fresh) override;
  const Model& model_;
  KVCache cache_;
  Sampler sampler_;
  at::Tensor cur_, pos_, step_, out_;  // [1, 1], [1], [1], [capacity] int64: the step's static buffers
  DecodeLoop loop_;
};

}  // namespace kakeya

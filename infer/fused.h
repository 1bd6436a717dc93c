// Fused speculative decoding on the restored verifier (`--mode fused`, issue 7).
//
// The `restored` decoder (infer/restored.h) accelerated by the DFlash drafter it
// already runs for restoration. Per block of B tokens, nothing O(context) is
// recomputed and nothing is run twice:
//
//   draft    [carried, MASK × (B-1)] through the drafter over its context cache (on CUDA
//            the block's own K/V go into that cache at their positions and one attention
//            kernel per layer reads context and block: Drafter::forward_block_in_cache)
//            -> B-1 greedy draft tokens
//   verify   [carried, d_1 .. d_{B-1}] through the verifier on its restored cache:
//            one forward whose taps also capture the drafter's context features (A);
//            greedy acceptance on the device (leading run of d_i == argmax_{i-1}),
//            n = accepted + 1 tokens committed
//   extend   the drafter's context K/V at the block's positions from those features (B),
//            which the Restorer also stores for restoration; the next block starts at pos + n
//            with the verifier's own token after the accepted drafts carried as its
//            position-0 token (no correction forward)
//   restore  in batches, off the critical path (Restorer::next_upkeep, infer/upkeep.h):
//            once the committed positions cover a batch, f_θ's drafter inputs are projected
//            from the stored target features and the batch is restored ahead of need; on
//            CUDA the batch is a graph on a side stream that overlaps the next blocks, and
//            the first block whose queries read it waits for it (a stream wait)
//
// Rejected positions are never rolled back explicitly (C): their K/V stay in the
// verifier's exact ring and the drafter's context, invisible (the drafter masks
// positions >= the block start) until the next block, which covers every one of them
// (it starts at pos + n <= pos + B - 1 and spans B positions), overwrites them.
// Accepted K/V are kept: no token is forwarded twice.
//
// All parts read and write static device buffers only (positions live on the device,
// and the block's advance happens there too), so on CUDA each is captured once as a CUDA
// graph and replayed per block; the host reads each block's report once (the B verifier
// tokens and n: stop tokens and the token budget are applied there), keeping the next
// block enqueued ahead of that read while the budget certainly needs it, so the device
// does not wait for the host between blocks. No allocation in the steady state. A
// FusedDecoder keeps its caches, buffers and graphs across prompts (capture happens once,
// as a server does).
//
// Lossless: every committed token is the verifier's argmax given the committed prefix
// under the restoration rules of infer/restored.h, so the output equals `restored`
// token for token (and `ar` when a = 1), up to floating-point ties between a B-token
// and a 1-token forward. The drafter only changes how many tokens a forward commits.
//
// Sampling (temperature > 0; top-p as core/sampling.h): speculative rejection sampling.
// Drafts are sampled from the drafter's distributions q_i; draft i is accepted with
// probability min(1, p_i(d_i) / q_i(d_i)) (p_i: the verifier's, same temperature and
// top-p), the first rejected position takes a token from norm(max(0, p_i - q_i)), a
// fully accepted block a bonus token from p_B. The committed tokens are distributed as
// the verifier's own sampling; one seeded generator makes a run reproducible. Sampling
// runs the parts eagerly (no CUDA graphs: the generator is not registered with them).
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/drafter.h"
#include "core/ftheta.h"
#include "core/model.h"
#include "core/sampling.h"
#include "infer/restored.h"

namespace kakeya {

struct FusedOptions {
  int64_t max_new_tokens = 64;
  int64_t block_size = 0;               // B: tokens per verify forward; 0 = the drafter's block_size
  std::vector<int64_t> stop_ids;        // generation ends after emitting one of these
  std::function<void(int64_t)> on_token;  // committed tokens, after each block's one sync
  bool cuda_graph = true;               // CUDA: capture the parts once, replay per block
  bool time_split = true;               // per-part times (CUDA events: no extra sync)
  SamplingOptions sampling;             // temperature 0: greedy (lossless); > 0: rejection sampling
};

// Seconds summed over blocks (the prefill and the first token excluded).
struct FusedTiming {
  double draft = 0, verify = 0, extend = 0;
  // Restoration batches (device time). On CUDA with graphs they run on a side stream next to
  // the blocks (restore_overlapped): not on the critical path, so not part of upkeep().
  double restore = 0;
  bool restore_overlapped = false;
  double capture = 0;  // CUDA graph capture (host wall time, inside the decode time; a decoder's first run)
  int64_t blocks = 0;
  // Cache upkeep on the critical path: the drafter context extension (+ restoration when in place).
  double upkeep() const { return extend + (restore_overlapped ? 0.0 : restore); }
  FusedTiming& operator+=(const FusedTiming& o);
  nlohmann::json to_json() const;
};

struct FusedResult {
  DecodeResult decode;                  // tokens, timings, memory, committed (τ = decode.tau())
  FusedTiming split;
  int64_t block_size = 0;
  bool cuda_graph = false;              // the blocks replayed CUDA graphs
  std::vector<std::string> warnings;    // e.g. a block larger than the drafter was trained for
};

// The fused decoder kept across prompts: the verifier's restored cache, the Restorer, the
// drafter's context cache and the block buffers for `capacity` positions (prompt + new tokens
// of the longest run; the block margin is added inside), and on CUDA the graphs of the three
// parts and of a restoration batch, captured by the first greedy run and replayed by every
// later one. drafter: required, bound to `verifier`; ftheta: required when mix_alpha < 1.
// The restore options, block size, sampling and cuda_graph are fixed at construction.
class FusedDecoder {
 public:
  FusedDecoder(const Model& verifier, const Drafter& drafter, const FTheta* ftheta, const RestoreOptions& ro,
               const FusedOptions& opt, int64_t capacity);
  ~FusedDecoder();
  FusedDecoder(const FusedDecoder&) = delete;
  FusedDecoder& operator=(const FusedDecoder&) = delete;
  // Throws on bad input (validate_fused) or options this decoder was not built for.
  FusedResult run(const std::vector<int64_t>& prompt, const FusedOptions& opt);
  int64_t block_size() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One fused decode session: a FusedDecoder used once.
FusedResult fused_generate(const Model& verifier, const Drafter& drafter, const FTheta* ftheta,
                           const RestoreOptions& ro, const std::vector<int64_t>& prompt, const FusedOptions& opt);

// The checks fused_generate runs before anything else: validate_restore's, plus the
// drafter (present, bound to this verifier), the block size (>= 2, <= window: a block's
// queries must never need restored K/V of the block itself) and the position tables
// (the last verify block may reach B - 1 positions past the budget). Returns warnings
// (block larger than the drafter's trained block_size).
std::vector<std::string> validate_fused(const Model& verifier, const Drafter* drafter, const FTheta* ftheta,
                                        const RestoreOptions& ro, int64_t n_prompt, int64_t max_new_tokens,
                                        int64_t block_size);

// DecodeOptions (infer/decoder.h's DecodeMode::Fused) -> FusedOptions.
FusedOptions fused_options(const DecodeOptions& opt);

// Positions a session needs in the verifier's RoPE table beyond prompt + new tokens (the
// last block's draft positions): tools add it when they size the model's table.
inline int64_t fused_position_margin(int64_t block_size) { return block_size; }

}  // namespace kakeya

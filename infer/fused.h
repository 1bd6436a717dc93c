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
// Sampling (temperature > 0; top-p as core/model/sampling.h): speculative rejection sampling.
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

#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/model/sampling.h"
#include "infer/decoder.h"
#include "infer/restorer.h"

namespace kakeya {


// The fused decoder: the verifier's restored cache, the Restorer, the drafter's context cache
// and the block buffers for `capacity` positions (the block margin is added inside), and on
// CUDA the graphs of the three parts and of a restoration batch, captured by the first greedy
// run and replayed by every later one. drafter: required, bound to `verifier`; ftheta:
// required when mix_alpha < 1. Every call starts over (extends() is false: a continued
// conversation is fed again from its start).
class FusedDecoder : public Decoder {
 public:
  FusedDecoder(const Model& verifier, const Drafter& drafter, const FTheta* ftheta, const DecodeOptions& opt,
               int64_t capacity);
  ~FusedDecoder() override;
  bool extends() const override { return false; }
  int64_t capacity() const override;
  int64_t length() const override { return 0; }
  MemoryReport memory() const override;
  int64_t block_size() const;

 private:
  // Throws on bad input (validate_fused) or options this decoder was not built for.
  DecodeResult feed(const std::vector<int64_t>& prompt, const DecodeOptions& opt, bool fresh) override;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One fused decode session: a FusedDecoder used once (opt.restore: the restoration rules).
DecodeResult fused_generate(const Model& verifier, const Drafter& drafter, const FTheta* ftheta,
                            const std::vector<int64_t>& prompt, const DecodeOptions& opt);

// The checks fused_generate runs before anything else: validate_restore's, plus the
// drafter (present, bound to this verifier), the block size (>= 2, <= window: a block's
// queries must never need restored K/V of the block itself) and the position tables
// (the last verify block may reach B - 1 positions past the budget). Returns warnings
// (block larger than the drafter's trained block_size).
std::vector<std::string> validate_fused(const Model& verifier, const Drafter* drafter, const FTheta* ftheta,
                                        const RestoreOptions& ro, int64_t n_prompt, int64_t max_new_tokens,
                                        int64_t block_size);

// Positions a session needs in the verifier's RoPE table beyond prompt + new tokens (the
// last block's draft positions): tools add it when they size the model's table.
inline int64_t fused_position_margin(int64_t block_size) { return block_size; }

}  // namespace kakeya

// Lossless greedy speculative decoding with a DFlash block drafter (dflash's
// dflash_generate at temperature 0):
//
//   prefill the target on the prompt (capturing the drafter's context features)
//   loop:  draft   [last, MASK × (b-1)] -> b-1 draft tokens        (drafter, one forward)
//          verify  [last, d_1 .. d_{b-1}] with the target           (one forward; its taps yield the
//                                                                    features of the same tokens)
//          accept  the longest prefix with d_i == argmax_i, plus the target's own next token (bonus)
//          commit  truncate the target KV cache to the committed length, extend the drafter
//                  context with the committed tokens' features
//
// Every committed token is the target's argmax given the committed prefix, so
// the output equals greedy AR (infer/generate.h) token for token, up to
// floating-point ties between a one-token and a b-token forward.
// τ = committed tokens per verify forward (the prefill's first token excluded).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/drafter.h"
#include "core/model.h"

namespace kakeya {

struct SpeculativeOptions {
  int64_t max_new_tokens = 64;
  int64_t block_size = 0;              // b: tokens per verify forward; 0 = the drafter's block_size
  std::vector<int64_t> stop_ids;       // generation ends after emitting one of these
  std::function<void(int64_t)> on_token;
  // Subscribers to the drafter's per-layer K/V (Tap::KProj/KNorm/VProj/VNorm, [1, n, H_kv, D]) at
  // every committed position as the context is extended (prompt, then each block): f_θ's inputs.
  const Taps* drafter_taps = nullptr;
  // Diagnostics and tests. on_draft sees each block's draft logits [b-1, V] f32 (start = the
  // block's first position); edit_draft may replace the proposal ids [b-1] int64 before verification.
  std::function<void(int64_t start, const at::Tensor& logits)> on_draft;
  std::function<void(int64_t start, at::Tensor& draft_ids)> edit_draft;
};

struct SpeculativeResult {
  std::vector<int64_t> tokens;          // generated ids (prompt excluded)
  std::vector<int64_t> committed;       // tokens committed by each verify forward (accepted drafts + 1)
  double prefill_seconds = 0;
  double decode_seconds = 0;            // from the first generated token to the last
  int64_t target_cache_bytes = 0, drafter_cache_bytes = 0;
  int64_t verify_forwards() const { return (int64_t)committed.size(); }
  int64_t committed_tokens() const;
  double tau() const;                   // mean committed tokens per verify forward (0 if none)
  double decode_tokens_per_second() const {
    return tokens.size() > 1 && decode_seconds > 0 ? (tokens.size() - 1) / decode_seconds : 0.0;
  }
};

SpeculativeResult speculative_generate(const Model& target, const Drafter& drafter, const std::vector<int64_t>& prompt,
                                       const SpeculativeOptions& opt);

}  // namespace kakeya

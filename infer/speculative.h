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

#include "core/model/drafter.h"
#include "core/model/model.h"
#include "infer/memory.h"
#include "infer/options.h"
#include "infer/result.h"

namespace kakeya {

// Diagnostics and f_θ's inputs around a speculative decode (the options are DecodeOptions:
// max_new_tokens, block_size, stop_ids, on_token, should_stop).
struct SpeculativeHooks {
  // Subscribers to the drafter's per-layer K/V (Tap::KProj/KNorm/VProj/VNorm, [1, n, H_kv, D]) at
  // every committed position as the context is extended (prompt, then each block): f_θ's inputs.
  const Taps* drafter_taps = nullptr;
  // on_draft sees each block's draft logits [b-1, V] f32 (start = the block's first position);
  // edit_draft may replace the proposal ids [b-1] int64 before verification.
  std::function<void(int64_t start, const at::Tensor& logits)> on_draft;
  std::function<void(int64_t start, at::Tensor& draft_ids)> edit_draft;
};

// result.committed: tokens committed by each verify forward (accepted drafts + 1); the memory
// report holds the target's cache and the drafter's context.
DecodeResult speculative_generate(const Model& target, const Drafter& drafter, const std::vector<int64_t>& prompt,
                                  const DecodeOptions& opt, const SpeculativeHooks& hooks = {});

}  // namespace kakeya

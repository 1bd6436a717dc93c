#include "infer/speculative.h"

#include <numeric>

#include "core/error.h"
#include "infer/loop_util.h"


namespace kakeya {

DecodeResult speculative_generate(const Model& target, const Drafter& drafter, const std::vector<int64_t>& prompt,
                                  const DecodeOptions& opt, const SpeculativeHooks& hooks) {
  KAKEYA_CHECK(!prompt.empty(), "speculative: empty prompt (the tokenizer produced no tokens)");
  KAKEYA_CHECK(opt.max_new_tokens > 0, "speculative: --max-new-tokens expected > 0, got " << opt.max_new_tokens);
  KAKEYA_CHECK(&drafter.target() == &target, "speculative: the drafter is bound to another target model");
  const int64_t B = opt.block_size > 0 ? opt.block_size : drafter.config().block_size;
  KAKEYA_CHECK(B >= 2, "speculative: --block-size expected >= 2, got " << B);
  const at::Device dev = target.device();
  const int64_t n_prompt = prompt.size();
  const int64_t mask_id = drafter.config().mask_token_id;

  // A verify forward writes up to B positions past the committed length, and
  // truncate() must be able to take all but one of them back.
  const KVCacheOptions co = target.cache_options(n_prompt + opt.max_new_tokens + B, 1, B);
  KAKEYA_CHECK(co.capacity <= target.options().max_positions,
               "speculative: prompt (" << n_prompt << ") + new tokens (" << opt.max_new_tokens << ") + block (" << B
                                       << ") exceed the model's position table (" << target.options().max_positions << ")");
  KVCache cache(target.config(), co);
  DrafterCache dcache = drafter.make_cache(co.capacity);
  TargetFeatureCapture capture(target, drafter.config().target_layer_ids);
  ForwardOptions fo;
  fo.taps = &capture.taps();

  DecodeResult res;
  auto iopt = at::TensorOptions().dtype(at::kLong).device(dev);
  auto t0 = Clock::now();
  {
    fo.last_logits_only = true;
    auto ids = at::tensor(prompt, at::kLong).view({1, n_prompt}).to(dev);
    auto logits = target.forward(ids, cache, fo);  // [1, 1, V]
    drafter.extend(dcache, capture.take(), hooks.drafter_taps);  // context = every prompt position
    // SYNC: the first token decides what the first block starts with (and may be a stop).
    res.tokens.push_back(logits.select(1, 0).argmax(-1).item<int64_t>());
    fo.last_logits_only = false;
  }
  res.prefill_seconds = seconds_since(t0, dev);
  if (opt.on_token) opt.on_token(res.tokens.back());
  bool stopped = ends_generation(res.tokens.back(), opt);
  auto t1 = Clock::now();

  while (!stopped && (int64_t)res.tokens.size() < opt.max_new_tokens) {
    // start: position of the last committed token, which the target has not seen yet.
    const int64_t g = res.tokens.size(), start = n_prompt + g - 1;
    const int64_t b = std::min(B, opt.max_new_tokens - g + 1);  // never verify past the last token we may emit
    KAKEYA_CHECK(cache.length() == start && dcache.length() == start, "speculative: cache lengths out of step");

    auto block = at::full({1, b}, mask_id, iopt);  // [1, b]
    block.select(1, 0).fill_(res.tokens.back());
    auto draft_logits = drafter.draft(dcache, block);  // [1, b-1, V]
    if (hooks.on_draft) hooks.on_draft(start, draft_logits[0]);
    at::Tensor drafts = draft_logits[0].argmax(-1);  // [b-1]
    if (hooks.edit_draft) hooks.edit_draft(start, drafts);
    block.slice(1, 1).copy_(drafts.view({1, b - 1}));

    auto logits = target.forward(block, cache, fo);  // [1, b, V]; cache now holds start .. start+b-1
    auto posterior = logits[0].argmax(-1);           // [b]: the target's token after each block position
    // SYNC: acceptance needs the proposal and the target's choices on the host (one copy per block).
    auto both = at::cat({drafts, posterior}).cpu();
    const int64_t* d = both.data_ptr<int64_t>();
    const int64_t* p = d + (b - 1);
    int64_t accepted = 0;
    while (accepted < b - 1 && d[accepted] == p[accepted]) ++accepted;
    // Committed this block: the accepted drafts and the bonus token, within the budget and up to a stop.
    std::vector<int64_t> fresh(d, d + accepted);
    fresh.push_back(p[accepted]);
    const int64_t produced = commit_tokens(fresh.data(), fresh.size(), opt, res, stopped);
    // Positions start .. start+produced-1 hold [last, d_1 .. d_{produced-1}] = committed tokens;
    // the rest of the block was rejected (or is past a stop). The bonus token is not in the
    // cache yet: it opens the next block.
    cache.truncate(start + produced);
    at::Tensor feats = capture.take();  // [1, b, n·H] from this same verify forward
    drafter.extend(dcache, feats.slice(1, 0, produced), hooks.drafter_taps);
  }
  res.decode_seconds = seconds_since(t1, dev);
  res.block_size = B;
  res.served_positions = cache.length();
  res.memory = ar_memory_report(target, co.capacity);
  res.memory.set({MemoryPart::DrafterContext, "drafter context cache", dcache.bytes(), "every committed position", true});
  return res;
}

}  // namespace kakeya

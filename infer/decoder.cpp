#include "infer/decoder.h"

#include "core/error.h"
#include "infer/fused.h"
#include "infer/generate.h"
#include "infer/restored.h"

namespace kakeya {
namespace {

void check_positions(const Model& v, int64_t n_prompt, int64_t max_new) {
  KAKEYA_CHECK(n_prompt > 0, "decode: empty prompt (the tokenizer produced no tokens)");
  const int64_t context = n_prompt + max_new;
  const auto& cfg = v.config();
  KAKEYA_CHECK(cfg.max_position_embeddings <= 0 || context <= cfg.max_position_embeddings,
               "decode: prompt of " << n_prompt << " tokens + " << max_new << " new tokens = " << context
                                    << " positions exceeds the model's limit of " << cfg.max_position_embeddings
                                    << " (max_position_embeddings)");
}

}  // namespace

void Decoder::check_call(const char* who, int64_t n_tokens, const DecodeOptions& opt, bool fresh) const {
  KAKEYA_CHECK(n_tokens > 0, who << ": no tokens to feed (the tokenizer produced none)");
  KAKEYA_CHECK(opt.max_new_tokens > 0, who << ": --max-new-tokens expected > 0, got " << opt.max_new_tokens);
  KAKEYA_CHECK(fresh || extends(), who << ": keeps nothing between calls: start a new conversation (run)");
  const int64_t held = fresh ? 0 : length();
  KAKEYA_CHECK(held + n_tokens + opt.max_new_tokens <= capacity(),
               who << ": " << held << " positions held + " << n_tokens << " new + " << opt.max_new_tokens
                   << " to generate exceed the " << capacity() << " positions this decoder was built for");
  KAKEYA_CHECK(opt.mode == opt_.mode,
               who << ": built for --mode " << decode_mode_name(opt_.mode) << ", asked for " << decode_mode_name(opt.mode));
  const auto &a = opt_.sampling, &b = opt.sampling;
  KAKEYA_CHECK(a.temperature == b.temperature && a.top_p == b.top_p && opt_.cuda_graph == opt.cuda_graph &&
                   opt_.megakernel == opt.megakernel && opt_.head_screen == opt.head_screen,
               who << ": sampling / cuda_graph / megakernel / head_screen options differ from the ones this decoder was built with "
                      "(its graphs depend on them): build another decoder");
  KAKEYA_CHECK(opt.block_size == opt_.block_size,
               who << ": built for blocks of " << opt_.block_size << " (--block-size), asked for " << opt.block_size);
  KAKEYA_CHECK(opt.mode == DecodeMode::Ar || opt.restore.to_json() == opt_.restore.to_json(),
               who << ": restore options " << opt.restore.to_json().dump() << " differ from the ones it was built with "
                   << opt_.restore.to_json().dump());
}

std::unique_ptr<Decoder> make_decoder(const Model& v, const Drafter* d, const FTheta* f, const DecodeOptions& opt,
                                      int64_t capacity) {
  switch (opt.mode) {
    case DecodeMode::Ar: return std::make_unique<ArDecoder>(v, capacity, opt);
    case DecodeMode::Restored: return std::make_unique<RestoredDecoder>(v, d, f, opt, capacity);
    case DecodeMode::RestoredReforward: return std::make_unique<ReforwardDecoder>(v, d, f, opt, capacity);
    case DecodeMode::Fused:
      KAKEYA_CHECK(d, "fused: --mode fused drafts with the drafter: give --drafter DIR");
      return std::make_unique<FusedDecoder>(v, *d, f, opt, capacity);
  }
  KAKEYA_FAIL("decoder: unknown mode");
}

void decode_checks(const Model& v, const Drafter* d, const FTheta* f, const std::vector<int64_t>& prompt,
                   const DecodeOptions& opt) {
  check_positions(v, prompt.size(), opt.max_new_tokens);
  if (opt.mode == DecodeMode::Ar) return;
  if (opt.mode == DecodeMode::Fused) {
    KAKEYA_CHECK(d, "fused: --mode fused drafts with the drafter: give --drafter DIR");
    validate_fused(v, d, f, opt.restore, prompt.size(), opt.max_new_tokens, opt.block_size);
  } else {
    validate_restore(v, d, f, opt.restore, prompt.size(), opt.max_new_tokens);
  }
  check_restores_something(opt.restore, prompt.size(), opt.max_new_tokens);
}

DecodeResult decode(const Model& v, const Drafter* d, const FTheta* f, const std::vector<int64_t>& prompt,
                    const DecodeOptions& opt) {
  decode_checks(v, d, f, prompt, opt);  // bad input is refused before anything is allocated for it
  auto dec = make_decoder(v, d, f, opt, (int64_t)prompt.size() + opt.max_new_tokens);
  return dec->run(prompt, opt);
}

}  // namespace kakeya

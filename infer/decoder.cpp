#include "infer/decoder.h"

#include "core/error.h"

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

Decoder::Decoder(const Model& v, const Drafter* d, const FTheta* f, const DecodeOptions& opt, int64_t capacity)
    : v_(v), d_(d), f_(f), opt_(opt), capacity_(capacity) {
  switch (opt.mode) {
    case DecodeMode::Ar: ar_ = std::make_unique<ArDecoder>(v, capacity, generate_options(opt)); break;
    case DecodeMode::Restored: restored_ = std::make_unique<RestoredDecoder>(v, d, f, opt, capacity); break;
    case DecodeMode::Fused:
      KAKEYA_CHECK(d, "fused: --mode fused drafts with the drafter: give --drafter DIR");
      fused_ = std::make_unique<FusedDecoder>(v, *d, f, opt.restore, fused_options(opt), capacity);
      break;
    case DecodeMode::RestoredReforward: break;  // keeps nothing between tokens, let alone prompts
  }
}

Decoder::~Decoder() = default;

DecodeResult Decoder::run(const std::vector<int64_t>& prompt, const DecodeOptions& opt) {
  KAKEYA_CHECK(opt.mode == opt_.mode, "decoder: built for --mode " << decode_mode_name(opt_.mode) << ", asked for "
                                                                   << decode_mode_name(opt.mode));
  check_positions(v_, prompt.size(), opt.max_new_tokens);
  switch (opt.mode) {
    case DecodeMode::Ar: {
      DecodeResult d = DecodeResult::from_loop(ar_->run(prompt, generate_options(opt)));
      d.memory = ar_memory_report(v_, capacity_);
      return d;
    }
    case DecodeMode::Restored: return restored_->run(prompt, opt);
    case DecodeMode::Fused: {
      auto r = fused_->run(prompt, fused_options(opt));
      split_ = r.split;
      return std::move(r.decode);
    }
    case DecodeMode::RestoredReforward:
      validate_restore(v_, d_, f_, opt.restore, prompt.size(), opt.max_new_tokens);
      return decode_reforward(v_, d_, f_, prompt, opt);
  }
  KAKEYA_FAIL("decoder: unknown mode");
}

void decode_checks(const Model& v, const Drafter* d, const FTheta* f, const std::vector<int64_t>& prompt,
                   const DecodeOptions& opt) {
  check_positions(v, prompt.size(), opt.max_new_tokens);
  if (opt.mode == DecodeMode::Fused) {
    KAKEYA_CHECK(d, "fused: --mode fused drafts with the drafter: give --drafter DIR");
    validate_fused(v, d, f, opt.restore, prompt.size(), opt.max_new_tokens, opt.block_size);
  } else if (opt.mode != DecodeMode::Ar) {
    validate_restore(v, d, f, opt.restore, prompt.size(), opt.max_new_tokens);
  }
}

DecodeResult decode(const Model& v, const Drafter* d, const FTheta* f, const std::vector<int64_t>& prompt,
                    const DecodeOptions& opt) {
  decode_checks(v, d, f, prompt, opt);  // bad input is refused before anything is allocated for it
  Decoder dec(v, d, f, opt, (int64_t)prompt.size() + opt.max_new_tokens);
  return dec.run(prompt, opt);
}

}  // namespace kakeya

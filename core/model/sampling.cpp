#include "core/model/sampling.h"

#include <ATen/Context.h>

#include "core/error.h"
#include "core/kernels/ops.h"

namespace kakeya {

Sampler::Sampler(const SamplingOptions& opt, at::Device device) : opt_(opt) {
  KAKEYA_CHECK(opt.temperature >= 0.0, "sampling: --temperature expected >= 0, got " << opt.temperature);
  KAKEYA_CHECK(opt.top_p > 0.0 && opt.top_p <= 1.0, "sampling: --top-p expected in (0, 1], got " << opt.top_p);
  // A private generator per sampler (a clone of the device default), so runs are reproducible per seed.
  gen_ = at::globalContext().defaultGenerator(device).clone();
  gen_.set_current_seed(opt.seed);
}

at::Tensor Sampler::probs(const at::Tensor& logits) const {
  KAKEYA_CHECK(!greedy(), "sampling: probs() needs a temperature > 0");
  auto probs = at::softmax(logits.to(at::kFloat) / opt_.temperature, -1);
  if (opt_.top_p < 1.0) {
    // Keep the smallest prefix of the sorted distribution whose mass reaches top_p.
    auto [sorted, idx] = probs.sort(-1, /*descending=*/true);
    auto before = sorted.cumsum(-1) - sorted;  // mass strictly before each token
    sorted = sorted.masked_fill(before.ge(opt_.top_p), 0.0);
    probs = at::zeros_like(probs).scatter_(-1, idx, sorted);
    probs = probs / probs.sum(-1, true);
  }
  return probs;
}

at::Tensor Sampler::sample(const at::Tensor& logits) {
  if (greedy()) {
    // ops::argmax_rows: on CUDA two small kernels over the vocabulary (a decode step's greedy
    // choice), where ATen's generic reduction took ~10 us; the same first-of-equal-maxima index.
    auto shape = logits.sizes().vec();
    shape.pop_back();
    at::Tensor out = at::empty(shape, logits.options().dtype(at::kLong));
    ops::argmax_rows(logits, {}, out);
    return out;
  }
  auto probs = this->probs(logits);
  auto p = probs.device() == gen_.device() ? probs : probs.to(gen_.device());
  return at::multinomial(p, 1, false, gen_).squeeze(-1).to(logits.device());
}

}  // namespace kakeya

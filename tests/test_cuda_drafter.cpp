// The drafter's CUDA fast paths (Drafter::store_context, forward_block_in_cache,
// draft_tokens) against its LibTorch reference (context_kv, forward_block with
// masks, logits) on the real Gemma 3 270M and the shipped drafter, f32 and bf16
// (label gpu: runs on the GPU machine only; CI builds without CUDA).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>

#include "core/model/drafter.h"
#include "core/model/model.h"
#include "tests/test_util.h"

using namespace kakeya;

namespace {

const at::Device kCuda(at::kCUDA, 0);

// Records what a tap sees, per layer.
struct Recorder : TapSubscriber {
  Tap which;
  std::vector<at::Tensor> got;
  explicit Recorder(Tap t) : which(t) {}
  void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override {
    if (tap != which) return;
    if ((int64_t)got.size() <= ctx.layer) got.resize(ctx.layer + 1);
    got[ctx.layer] = x.clone();
  }
  bool reads(Tap tap) const override { return tap == which; }
};

// Relative max error against the reference's scale.
double rel_err(const at::Tensor& got, const at::Tensor& want) {
  auto g = got.to(at::kCPU, at::kFloat), w = want.to(at::kCPU, at::kFloat);
  EXPECT_EQ(g.sizes(), w.sizes());
  return (g - w).abs().max().item<double>() / (w.abs().max().item<double>() + 1e-12);
}

class CudaDrafter : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_FAIL() << "no CUDA device (label gpu tests run on the GPU machine)";
    at::manual_seed(7);
    ModelOptions mo;
    mo.device = kCuda;
    mo.dtype = GetParam();
    mo.max_positions = 256;
    target_ = std::make_unique<Model>(Model::load(test::real_model_dir(), mo));
    drafter_ = std::make_unique<Drafter>(Drafter::load(test::shipped_dir("drafter"), *target_));
    ASSERT_TRUE(drafter_->block_in_cache_supported()) << "the shipped drafter is full-attention, non-causal";
  }
  // f32: the same math in another op order; bf16: a few roundings of the activations.
  double tol() const { return GetParam() == at::kFloat ? 1e-4 : 4e-2; }
  // Context of C positions from random target features, in the drafter dtype: [1, C, H].
  at::Tensor context(int64_t C) const {
    const auto& dc = drafter_->config();
    auto f = at::randn({1, C, dc.num_features() * target_->config().hidden_size},
                       at::TensorOptions().device(kCuda).dtype(target_->dtype()));
    return drafter_->project_context(f);
  }
  std::vector<at::Tensor> garbage_cache(int64_t S) const {  // per layer [1, H_kv, S, D]
    const auto& dc = drafter_->config();
    std::vector<at::Tensor> c;
    for (int64_t l = 0; l < dc.num_layers; ++l)
      c.push_back(at::randn({1, dc.num_kv_heads, S, dc.head_dim},
                            at::TensorOptions().device(kCuda).dtype(drafter_->dtype())));
    return c;
  }
  std::unique_ptr<Model> target_;
  std::unique_ptr<Drafter> drafter_;
};

// store_context writes context_kv's K/V at slot = position (non-contiguous positions,
// slots around them untouched) and its taps see the same raw K/V.
TEST_P(CudaDrafter, StoreContextEqualsContextKV) {
  const int64_t C = 37, S = 101;
  at::Tensor c = context(C);
  at::Tensor pos = at::arange(3, 3 + 2 * C, 2, at::TensorOptions().dtype(at::kLong).device(kCuda));  // [C]
  Recorder ref_rec(Tap::KProj), got_rec(Tap::KProj);
  Taps ref_taps, got_taps;
  ref_taps.subscribe(&ref_rec);
  got_taps.subscribe(&got_rec);
  auto want = drafter_->context_kv(c, pos, &ref_taps);
  auto k = garbage_cache(S), v = garbage_cache(S);
  auto k0 = k, v0 = v;
  for (auto& t : k0) t = t.clone();
  for (auto& t : v0) t = t.clone();
  drafter_->store_context(c, pos, k, v, &got_taps);
  at::Tensor untouched = at::ones({S}, at::kBool);
  untouched.index_fill_(0, pos.cpu(), false);
  const auto ut = untouched.to(kCuda);
  for (int64_t l = 0; l < drafter_->config().num_layers; ++l) {
    const std::string L = "layer " + std::to_string(l);
    EXPECT_LE(rel_err(k[l].index_select(2, pos), want[l].first), tol()) << L << " K";
    EXPECT_LE(rel_err(v[l].index_select(2, pos), want[l].second), tol() / 100) << L << " V (a GEMM, no rounding chain)";
    EXPECT_TRUE(at::equal(k[l].index_select(2, ut.nonzero().squeeze(1)), k0[l].index_select(2, ut.nonzero().squeeze(1))))
        << L << ": K slots of other positions changed";
    ASSERT_EQ((int64_t)got_rec.got.size(), drafter_->config().num_layers);
    EXPECT_LE(rel_err(got_rec.got[l], ref_rec.got[l]), 1e-6) << L << " KProj tap";
  }
}

// The in-cache block forward equals forward_block over [context ++ block] with every
// key visible (the rule of full non-causal layers), whatever sits in slots past the block.
TEST_P(CudaDrafter, BlockInCacheEqualsForwardBlock) {
  const auto& dc = drafter_->config();
  const int64_t C = 53, T = dc.block_size, S = C + T + 29;
  auto iopt = at::TensorOptions().dtype(at::kLong).device(kCuda);
  at::Tensor c = context(C);
  at::Tensor cpos = at::arange(C, iopt);
  auto kv = drafter_->context_kv(c, cpos);
  auto k = garbage_cache(S), v = garbage_cache(S);
  drafter_->store_context(c, cpos, k, v);
  std::vector<at::Tensor> ck, cv, no_masks(dc.num_layers);
  for (auto& [kk, vv] : kv) {
    ck.push_back(kk);
    cv.push_back(vv);
  }
  at::Tensor ids = at::full({1, T}, dc.mask_token_id, iopt);
  ids.select(1, 0).fill_(818);
  at::Tensor x = drafter_->embed(ids);
  at::Tensor q_pos = at::arange(C, C + T, iopt);
  at::Tensor want = drafter_->forward_block(x, q_pos, ck, cv, no_masks);  // [1, T, H]
  at::Tensor slot_pos = at::arange(S, iopt);
  at::Tensor got = drafter_->forward_block_in_cache(x, q_pos, q_pos.narrow(0, T - 1, 1), k, v, slot_pos);
  EXPECT_LE(rel_err(got, want), tol()) << "final hidden";
  // Greedy drafts from the raw head scores: logits()'s argmax (bf16: up to ties the
  // rounded softcap creates), also from the fast path's hidden states.
  const double agree = GetParam() == at::kFloat ? 1.0 : 0.8;
  at::Tensor want_tok = drafter_->logits(want.narrow(1, 1, T - 1)).argmax(-1).cpu();
  at::Tensor got_tok = drafter_->draft_tokens(want.narrow(1, 1, T - 1)).cpu();
  at::Tensor fast_tok = drafter_->draft_tokens(got.narrow(1, 1, T - 1)).cpu();
  EXPECT_GE(got_tok.eq(want_tok).to(at::kFloat).mean().item<double>(), agree) << got_tok << " vs " << want_tok;
  EXPECT_GE(fast_tok.eq(want_tok).to(at::kFloat).mean().item<double>(), agree) << fast_tok << " vs " << want_tok;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaDrafter, ::testing::Values(at::kFloat, at::kBFloat16));

}  // namespace

// Gemma 4's mixture-of-experts block (26B-A4B): a router on the layer's residual
// stream picks top_k of num_experts feed-forward experts per token; their outputs,
// weighted by the renormalised router probabilities, run beside the dense MLP.
// The forward (model.cpp) sums the two branches in one residual step (ops::moe_residual);
// this file holds the router and the experts so that the decoder loop stays one
// description of the model.
#pragma once
#include <ATen/ATen.h>

#include "core/kernels/ops.h"

namespace kakeya {

struct MoeWeights {
  at::Tensor router_scale;      // [hidden] model dtype (router.scale)
  at::Tensor router_proj;       // [E, hidden] router.proj.weight
  at::Tensor per_expert_scale;  // [E] model dtype
  at::Tensor gate_up;           // [E, 2·I, hidden] experts.gate_up_proj: gate rows, then up rows
  at::Tensor down;              // [E, hidden, I] experts.down_proj
  at::Tensor pre_norm;          // [hidden] f32 pre_feedforward_layernorm_2 (expert input)
  at::Tensor post_norm;         // [hidden] f32 post_feedforward_layernorm_2 (expert sum)
  at::Tensor post_dense_norm;   // [hidden] f32 post_feedforward_layernorm_1 (the dense MLP's output)

  bool defined() const { return gate_up.defined(); }
  int64_t num_experts() const { return gate_up.size(0); }
};

// Up to this many tokens (decode steps and verify blocks, the steps CUDA graphs capture; the
// attention kernel's limit too) the experts run per (token, expert) pair: no host sync.
constexpr int64_t kMoeGatherMaxTokens = 32;

// Router (ops::route_experts): h [N, hidden], the residual stream before the feed-forward norms.
// Few tokens (<= kMoeGatherMaxTokens) get the pairs' plan as well.
ops::ExpertRoute moe_route(const MoeWeights& w, const at::Tensor& h, int64_t top_k, const ops::NormSpec& ns);

// The experts on x [N, hidden] (already pre-normed): with the route's plan (few tokens) the pair
// rows [N·K, hidden], unweighted (ops::moe_residual weights and sums them); else the weighted
// sum [N, hidden]. In x's dtype.
at::Tensor moe_experts(const MoeWeights& w, const at::Tensor& x, const ops::ExpertRoute& r, bool gelu_tanh);

}  // namespace kakeya

// Gemma 4's mixture-of-experts block (26B-A4B): a router on the layer's residual
// stream picks top_k of num_experts feed-forward experts per token; their outputs,
// weighted by the renormalised router probabilities, run beside the dense MLP.
// The forward (model.cpp) sums the two branches; this file holds the router and
// the expert sum so that the decoder loop stays one description of the model.
#pragma once
#include <ATen/ATen.h>

#include "core/kernels/ops.h"

namespace kakeya {

struct MoeWeights {
  at::Tensor router_norm;       // [hidden] f32 ones: the router's RMSNorm has no weight
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

struct MoeRoute {
  at::Tensor weights;  // [N, K] f32: renormalised top-k probabilities × per-expert scale
  at::Tensor experts;  // [N, K] int64 expert indices
};

// Router: scale-free RMSNorm of the residual × scale × hidden^-0.5, linear to E
// scores, softmax in f32, top-k, renormalised to sum 1, × per_expert_scale.
// h: [N, hidden] (the residual stream before the feed-forward norms).
MoeRoute moe_route(const MoeWeights& w, const at::Tensor& h, int64_t top_k, const ops::NormSpec& ns);

// Σ_k weight_k · expert_k(x) for each row: x [N, hidden] (already pre-normed) -> [N, hidden] in x's dtype.
at::Tensor moe_experts(const MoeWeights& w, const at::Tensor& x, const MoeRoute& r, bool gelu_tanh);

// The expert branch of one layer: h [.., hidden] residual -> post-normed expert sum [.., hidden].
at::Tensor moe_block(const MoeWeights& w, const at::Tensor& h, int64_t top_k, const ops::NormSpec& ns, bool gelu_tanh);

}  // namespace kakeya

#include "core/model/moe.h"

#include <cmath>

namespace kakeya {

MoeRoute moe_route(const MoeWeights& w, const at::Tensor& h, int64_t top_k, const ops::NormSpec& ns) {
  const int64_t H = h.size(-1);
  // Same op order as the reference: normed (model dtype) × scale × hidden^-0.5, each in the model dtype.
  auto x = ops::rms_norm(h, w.router_norm, ns) * w.router_scale * std::pow((double)H, -0.5);  // [N, H]
  auto probs = at::softmax(ops::linear(x, w.router_proj), -1, at::kFloat);                 // [N, E] f32
  auto [top, idx] = at::topk(probs, top_k, -1);                                              // [N, K]
  top = top / top.sum(-1, true);
  return {top * w.per_expert_scale.index_select(0, idx.flatten()).view_as(idx), idx};
}

namespace {
// Up to this many tokens (decode steps and verify blocks, the steps CUDA graphs capture;
// the attention kernel's limit too) the experts run per (token, expert) pair: no host sync.
constexpr int64_t kGatherMaxTokens = 32;
}  // namespace

at::Tensor moe_experts(const MoeWeights& w, const at::Tensor& x, const MoeRoute& r, bool gelu_tanh) {
  const int64_t N = x.size(0), H = x.size(1), K = r.experts.size(1), E = w.num_experts();
  if (N <= kGatherMaxTokens) {
    // Few tokens: each (token, expert) pair's products, grouped by expert on the device (CUDA:
    // each selected expert read once; CPU: gathered per pair). No host sync, so a CUDA graph can
    // capture it.
    const auto plan = ops::plan_experts(r.experts, E);
    auto act = ops::expert_linear(x, w.gate_up, plan, K, /*gated=*/true, gelu_tanh);             // [N·K, I]
    auto y = ops::expert_linear(act, w.down, plan, 1, /*gated=*/false, false).view({N, K, H});   // [N, K, H]
    // Each expert's output × its f32 weight, rounded to the model dtype, then summed (as the reference adds them).
    return (y * r.weights.unsqueeze(-1)).to(x.scalar_type()).sum(1);
  }
  // Many tokens (prefill): group the (token, expert) pairs by expert and run each
  // selected expert once on its tokens. The group sizes cost one host sync.
  auto flat = r.experts.flatten();                                 // [N·K]
  auto order = at::argsort(flat, /*stable=*/true);                 // pairs sorted by expert
  auto tok = at::floor_divide(order, K);                           // [N·K] token of each sorted pair
  auto wts = r.weights.flatten().index_select(0, order);           // [N·K] f32
  auto counts = at::bincount(flat, {}, E).to(at::kCPU);            // [E]
  auto out = at::zeros_like(x);                                    // [N, H]
  const int64_t* cnt = counts.data_ptr<int64_t>();
  for (int64_t e = 0, start = 0; e < E; start += cnt[e++]) {
    if (cnt[e] == 0) continue;
    auto rows = tok.narrow(0, start, cnt[e]);                      // [n_e]
    auto y = ops::linear(ops::linear_act_mul(x.index_select(0, rows), w.gate_up[e], {}, gelu_tanh), w.down[e]);
    out.index_add_(0, rows, (y * wts.narrow(0, start, cnt[e]).unsqueeze(-1)).to(x.scalar_type()));
  }
  return out;
}

at::Tensor moe_block(const MoeWeights& w, const at::Tensor& h, int64_t top_k, const ops::NormSpec& ns, bool gelu_tanh) {
  auto flat = h.reshape({-1, h.size(-1)});  // [N, H]
  auto route = moe_route(w, flat, top_k, ns);
  auto y = moe_experts(w, ops::rms_norm(flat, w.pre_norm, ns), route, gelu_tanh);
  return ops::rms_norm(y.view(h.sizes()), w.post_norm, ns);
}

}  // namespace kakeya

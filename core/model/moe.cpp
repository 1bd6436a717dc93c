#include "core/model/moe.h"

namespace kakeya {

ops::ExpertRoute moe_route(const MoeWeights& w, const at::Tensor& h, int64_t top_k, const ops::NormSpec& ns) {
  return ops::route_experts(h, w.router_scale, w.router_proj, w.per_expert_scale, top_k, ns,
                            /*with_plan=*/h.size(0) <= kMoeGatherMaxTokens);
}

at::Tensor moe_experts(const MoeWeights& w, const at::Tensor& x, const ops::ExpertRoute& r, bool gelu_tanh) {
  const int64_t K = r.experts.size(1), E = w.num_experts();
  if (r.plan.experts.defined()) {
    // Few tokens: each (token, expert) pair's products, grouped by expert on the device (CUDA:
    // each selected expert read once; CPU: gathered per pair). No host sync, so a CUDA graph can
    // capture it.
    auto act = ops::expert_linear(x, w.gate_up, r.plan, K, /*gated=*/true, gelu_tanh);  // [N·K, I]
    return ops::expert_linear(act, w.down, r.plan, 1, /*gated=*/false, false);         // [N·K, H]
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

}  // namespace kakeya

#include "train/train_util.h"

#include <ATen/core/grad_mode.h>

#include <cmath>

namespace kakeya::train {

double now_unix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

at::Tensor adamw_step(std::vector<at::Tensor>& params, std::vector<at::Tensor>& m, std::vector<at::Tensor>& v,
                      int64_t step, double lr, const AdamWOptions& opt) {
  at::NoGradGuard no_grad;
  // Multi-tensor (foreach) ops: a handful of launches for all parameters, not ~8 per tensor.
  std::vector<at::Tensor> ps, gs, ms, vs, mats;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& p = params[i];
    if (!p.grad().defined()) continue;
    ps.push_back(p);
    gs.push_back(p.grad());
    ms.push_back(m[i]);
    vs.push_back(v[i]);
    if (p.dim() >= 2) mats.push_back(p);
  }
  if (ps.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(params[0].device()));
  at::Tensor grad_norm = at::stack(at::_foreach_norm(gs, 2)).pow(2).sum().sqrt();  // [] f32, stays on the device
  // Clip without a host sync: scale = min(1, clip / ‖g‖).
  at::Tensor scale = (opt.grad_clip / (grad_norm + 1e-6)).clamp_max(1.0);
  at::_foreach_mul_(gs, scale);
  const double t = (double)step;
  const double bc1 = 1.0 - std::pow(opt.beta1, t), bc2 = 1.0 - std::pow(opt.beta2, t);
  if (opt.weight_decay > 0 && !mats.empty()) at::_foreach_mul_(mats, 1.0 - lr * opt.weight_decay);
  at::_foreach_mul_(ms, opt.beta1);
  at::_foreach_add_(ms, gs, 1.0 - opt.beta1);
  at::_foreach_mul_(vs, opt.beta2);
  at::_foreach_addcmul_(vs, gs, gs, 1.0 - opt.beta2);
  auto denom = at::_foreach_div(vs, bc2);
  at::_foreach_sqrt_(denom);
  at::_foreach_add_(denom, opt.eps);
  at::_foreach_addcdiv_(ps, ms, denom, -lr / bc1);
  for (auto& p : ps) p.mutable_grad() = at::Tensor();
  return grad_norm;
}

}  // namespace kakeya::train

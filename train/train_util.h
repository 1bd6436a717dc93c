// Pieces every trainer shares (train-drafter, train-ftheta): clocks and the
// AdamW step, so the optimiser math exists once.
#pragma once
#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <vector>

namespace kakeya::train {

double now_unix();                                           // wall clock, unix seconds (deadlines)
double seconds_since(std::chrono::steady_clock::time_point t0);

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.01;  // decoupled, on matrices only (biases and norm gains keep their scale)
  double grad_clip = 1.0;      // global L2 norm
};

// One AdamW step over the parameters with a gradient (moments m, v alike params;
// `step` counts from 1 for the bias correction), after clipping the global
// gradient norm to opt.grad_clip without a host sync. Clears the gradients.
// Returns the global gradient norm before clipping: [] f32 on the device.
at::Tensor adamw_step(std::vector<at::Tensor>& params, std::vector<at::Tensor>& m, std::vector<at::Tensor>& v,
                      int64_t step, double lr, const AdamWOptions& opt);

}  // namespace kakeya::train

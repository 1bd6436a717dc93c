// Test helpers shared by the drafter suites (test_drafter, test_drafter_train).
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "core/model/drafter.h"
#include "core/model/model.h"

namespace kakeya::test {

// The target's drafter features of whole sequences tokens [B, S] in one forward
// through a fresh cache: [B, S, n·H] (what a drafter's context is made from).
inline at::Tensor target_features(const Model& target, const Drafter& d, const at::Tensor& tokens) {
  at::NoGradGuard no_grad;
  KVCacheOptions co;
  co.batch = tokens.size(0);
  co.capacity = tokens.size(1);
  KVCache cache(target.config(), co);
  TargetFeatureCapture cap(target, d.config().target_layer_ids);
  ForwardOptions fo;
  fo.taps = &cap.taps();
  fo.skip_logits = true;
  target.forward(tokens, cache, fo);
  return cap.take();
}

}  // namespace kakeya::test

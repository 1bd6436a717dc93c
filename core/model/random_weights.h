// Random weights of a model's real shape, generated where they are used: no checkpoint, no
// file round trip (a 26B-A4B-shaped model for speed measurements is 50 GB). Every tensor is
// drawn from its own generator, seeded by the tensor's checkpoint name and the run's seed, so
// HF transformers can fill its model with exactly the same values on the same device
// (tools/random_weights.py, the same rule): speed is then compared on identical weights, and
// the parity test (test_model_parity RandomInit) proves the two agree.
//
// The rule, per tensor of checkpoint name `name` and shape `shape`:
//   g = a fresh generator of the device, seeded with random_weight_seed(name, seed)
//   t = randn(shape, g, f32); t = t · scale + base (in place), then rounded to the model dtype
//   where scale = 1/sqrt(shape[-1]) and base = 0 for matrices (rows of unit-variance products),
//   and scale = 0.1, base = 1 for vectors (norm weights, scales, biases, layer scalars).
// Random weights are for speed and plumbing only, never for quality.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "core/model/model.h"

namespace kakeya {

// FNV-1a (64 bit) of the name's bytes, xor the seed, top bit cleared (a valid seed everywhere).
uint64_t random_weight_seed(const std::string& name, uint64_t seed);

// The tensor `name` of the given shape, f32 on `device`.
at::Tensor random_weight(const std::string& name, at::IntArrayRef shape, uint64_t seed, at::Device device);

// A WeightSource that has every tensor the loader asks for, generated on `device`.
WeightSource random_weights(uint64_t seed, at::Device device);

}  // namespace kakeya

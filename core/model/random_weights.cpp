#include "core/model/random_weights.h"

#include <ATen/Context.h>

#include <cmath>

namespace kakeya {

uint64_t random_weight_seed(const std::string& name, uint64_t seed) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return (h ^ seed) & 0x7fffffffffffffffull;
}

at::Tensor random_weight(const std::string& name, at::IntArrayRef shape, uint64_t seed, at::Device device) {
  // A fresh generator of the device's kind (as torch.Generator(device) in Python), seeded for this tensor.
  at::Generator g = at::globalContext().defaultGenerator(device).clone();
  g.set_current_seed(random_weight_seed(name, seed));
  auto t = at::randn(shape, g, at::TensorOptions().dtype(at::kFloat).device(device));
  const bool matrix = shape.size() >= 2;
  const double scale = matrix ? 1.0 / std::sqrt((double)shape.back()) : 0.1, base = matrix ? 0.0 : 1.0;
  return t.mul_(scale).add_(base);
}

WeightSource random_weights(uint64_t seed, at::Device device) {
  WeightSource s;
  s.origin = "random weights (seed " + std::to_string(seed) + ")";
  s.has = [](const std::string&) { return true; };
  s.get = [seed, device](const std::string& name, at::IntArrayRef shape) {
    return random_weight(name, shape, seed, device);
  };
  return s;
}

}  // namespace kakeya

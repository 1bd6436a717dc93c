#include "core/model/random_weights.h"

#include <ATen/Context.h>

#include <cmath>
#include <fstream>
#include <memory>

#include "core/error.h"

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

namespace {
// MemAvailable of /proc/meminfo in bytes (0 where it cannot be read).
int64_t host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}
}  // namespace

WeightSource random_weights(uint64_t seed, at::Device device) {
  WeightSource s;
  s.origin = "random weights (seed " + std::to_string(seed) + ")";
  s.has = [](const std::string&) { return true; };
  // On the host a shape too large for memory would be killed by the kernel part way (memory is
  // overcommitted), so the weights drawn are counted against what was available at the start;
  // a CUDA device refuses an allocation it cannot make with an error of its own.
  const int64_t limit = device.is_cpu() ? host_memory_available() * 4 / 5 : 0;
  auto drawn = std::make_shared<int64_t>(0);
  s.get = [seed, device, limit, drawn, origin = s.origin](const std::string& name, at::IntArrayRef shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    *drawn += n * (int64_t)sizeof(float);
    KAKEYA_CHECK(limit <= 0 || *drawn <= limit,
                 origin << ": the weights drawn up to '" << name << "' need " << *drawn / (1 << 20)
                        << " MiB in f32, more than the " << limit / (1 << 20)
                        << " MiB this host can spare: the config is too large for the CPU (use a CUDA device)");
    return random_weight(name, shape, seed, device);
  };
  return s;
}

}  // namespace kakeya

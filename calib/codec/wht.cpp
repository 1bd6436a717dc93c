#include "calib/codec/wht.h"

#include <cmath>
#include <random>

#include "core/error.h"

namespace kakeya {

bool is_pow2(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

int64_t next_pow2(int64_t n) {
  KAKEYA_CHECK(n >= 1, "next_pow2: expected n >= 1, got " << n);
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

at::Tensor wht(const at::Tensor& x) {
  const int64_t n = x.size(-1);
  KAKEYA_CHECK(is_pow2(n), "wht: last dimension must be a power of two, got " << n << " (use pad_pow2)");
  auto shape = x.sizes().vec();
  auto y = x.reshape({-1, n}).contiguous();
  const int64_t m = y.size(0);
  // Butterfly: log2(n) stages of (a+b, a-b) on pairs h apart. O(n log n) and
  // no n×n matrix, so it also works for large n.
  for (int64_t h = 1; h < n; h *= 2) {
    auto v = y.view({m, n / (2 * h), 2, h});
    auto a = v.select(2, 0), b = v.select(2, 1);
    y = at::stack({a + b, a - b}, 2).view({m, n});
  }
  return (y * (1.0 / std::sqrt((double)n))).view(shape);
}

at::Tensor pad_pow2(const at::Tensor& x) {
  const int64_t n = x.size(-1), p = next_pow2(n);
  if (p == n) return x;
  return at::constant_pad_nd(x, {0, p - n}, 0.0);
}

at::Tensor random_signs(int64_t n, uint64_t seed, at::Device device) {
  std::mt19937_64 rng(seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)n));
  std::vector<float> s(n);
  for (auto& v : s) v = (rng() >> 63) ? 1.0f : -1.0f;
  return at::tensor(s, at::kFloat).to(device);
}

at::Tensor rht(const at::Tensor& x, const at::Tensor& signs) { return wht(x * signs.to(x.scalar_type())); }

at::Tensor rht_inverse(const at::Tensor& y, const at::Tensor& signs) { return wht(y) * signs.to(y.scalar_type()); }

}  // namespace kakeya

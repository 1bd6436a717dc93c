#include "calib/codec/lloyd_max.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

#include "core/error.h"

namespace kakeya {

int ScalarCodebook::bits() const {
  int b = 0;
  while ((size_t(1) << b) < centroids.size()) ++b;
  return b;
}

std::vector<float> ScalarCodebook::boundaries() const {
  std::vector<float> b;
  for (size_t i = 0; i + 1 < centroids.size(); ++i) b.push_back(0.5f * (centroids[i] + centroids[i + 1]));
  return b;
}

at::Tensor ScalarCodebook::centroids_tensor(at::Device d) const { return at::tensor(centroids, at::kFloat).to(d); }
at::Tensor ScalarCodebook::boundaries_tensor(at::Device d) const { return at::tensor(boundaries(), at::kFloat).to(d); }

void ScalarCodebook::validate(const std::string& what) const {
  const size_t n = centroids.size();
  KAKEYA_CHECK(n >= 2 && n <= 256 && (n & (n - 1)) == 0,
               what << ": a codebook needs 2^bits entries with bits in 1..8, got " << n);
  for (size_t i = 0; i < n; ++i) {
    KAKEYA_CHECK(std::isfinite(centroids[i]), what << ": centroid " << i << " is not finite");
    KAKEYA_CHECK(i == 0 || centroids[i] > centroids[i - 1],
                 what << ": centroids must be strictly ascending (entry " << i << ": " << centroids[i - 1] << " then "
                      << centroids[i] << ")");
  }
}

namespace {
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
double phi(double x) { return std::isinf(x) ? 0.0 : kInvSqrt2Pi * std::exp(-0.5 * x * x); }
double Phi(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }
// ∫_a^b x^2 φ = [Φ(b)-Φ(a)] + aφ(a) - bφ(b) (the x·φ terms vanish at ±∞).
double xphi(double x) { return std::isinf(x) ? 0.0 : x * phi(x); }

ScalarCodebook gaussian_table(int bits) {
  const int k = 1 << bits;
  std::vector<double> c(k);
  for (int i = 0; i < k; ++i) c[i] = 4.0 * ((i + 0.5) / k - 0.5);  // spread over ±2σ, Lloyd does the rest
  for (int it = 0; it < 100000; ++it) {
    double moved = 0;
    std::vector<double> nc(k);
    for (int i = 0; i < k; ++i) {
      double a = i == 0 ? -INFINITY : 0.5 * (c[i - 1] + c[i]);
      double b = i == k - 1 ? INFINITY : 0.5 * (c[i] + c[i + 1]);
      // Conditional mean of N(0,1) on (a, b); tail cells use erfc, accurate far out.
      double mass = i < k / 2 ? Phi(b) - Phi(a) : Phi(-a) - Phi(-b);
      nc[i] = (phi(a) - phi(b)) / mass;
      moved = std::max(moved, std::abs(nc[i] - c[i]));
    }
    c = nc;
    if (moved < 1e-13) break;
  }
  ScalarCodebook cb;
  for (double v : c) cb.centroids.push_back((float)v);
  return cb;
}
}  // namespace

const ScalarCodebook& gaussian_codebook(int bits) {
  KAKEYA_CHECK(bits >= 1 && bits <= 8, "Gaussian Lloyd-Max table: bits must be in 1..8, got " << bits);
  static std::mutex mu;
  static std::map<int, ScalarCodebook> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(bits);
  if (it == cache.end()) it = cache.emplace(bits, gaussian_table(bits)).first;
  return it->second;
}

double gaussian_mse(const ScalarCodebook& cb) {
  const auto& c = cb.centroids;
  const int k = (int)c.size();
  double mse = 0;
  for (int i = 0; i < k; ++i) {
    double a = i == 0 ? -INFINITY : 0.5 * ((double)c[i - 1] + c[i]);
    double b = i == k - 1 ? INFINITY : 0.5 * ((double)c[i] + c[i + 1]);
    double mass = Phi(b) - Phi(a);
    double m1 = phi(a) - phi(b);
    double m2 = mass + xphi(a) - xphi(b);
    mse += m2 - 2.0 * c[i] * m1 + (double)c[i] * c[i] * mass;
  }
  return mse;
}

ScalarCodebook lloyd_max_fit(const at::Tensor& samples, int bits, const LloydMaxOptions& opt) {
  KAKEYA_CHECK(bits >= 1 && bits <= 8, "Lloyd-Max fit: bits must be in 1..8, got " << bits);
  auto x = samples.reshape({-1}).to(at::kFloat);
  const int64_t k = int64_t(1) << bits;
  KAKEYA_CHECK(x.numel() >= 4 * k, "Lloyd-Max fit: " << x.numel() << " samples are too few for " << k << " levels");
  KAKEYA_CHECK(at::isfinite(x).all().item<bool>(),
               "Lloyd-Max fit: calibration samples contain NaN or Inf (" << at::isfinite(x).logical_not().sum().item<int64_t>()
                                                                         << " of " << x.numel() << ")");
  if (x.numel() > opt.max_samples) x = x.slice(0, 0, x.numel(), (x.numel() + opt.max_samples - 1) / opt.max_samples);
  auto xs = std::get<0>(x.to(at::kDouble).sort());                                // [M] ascending
  auto cs = at::cat({at::zeros({1}, xs.options()), xs.cumsum(0)});              // [M+1] prefix sums
  const double mean = xs.mean().item<double>(), sd = xs.std().item<double>();
  KAKEYA_CHECK(sd > 0, "Lloyd-Max fit: samples are constant (std 0)");
  const auto& g = gaussian_codebook(bits);
  auto c = (at::tensor(g.centroids, at::kDouble) * sd + mean).to(xs.device());  // [K]
  auto ends = at::tensor(std::vector<int64_t>{0}, at::kLong).to(xs.device());
  auto endm = at::tensor(std::vector<int64_t>{xs.numel()}, at::kLong).to(xs.device());
  for (int it = 0; it < opt.max_iters; ++it) {
    auto b = (c.slice(0, 1) + c.slice(0, 0, k - 1)) * 0.5;  // [K-1]
    auto pos = at::searchsorted(xs, b);                        // [K-1] count of samples < b
    auto edges = at::cat({ends, pos, endm});                   // [K+1]
    auto lo = edges.slice(0, 0, k), hi = edges.slice(0, 1);
    auto cnt = (hi - lo).to(at::kDouble);
    auto sum = cs.index_select(0, hi) - cs.index_select(0, lo);
    auto nc = at::where(cnt > 0, sum / cnt.clamp_min(1), c);  // an empty cell keeps its level
    double moved = (nc - c).abs().max().item<double>();
    c = nc;
    if (moved < opt.tol * sd) break;
  }
  std::vector<double> cv(k);
  auto cc = std::get<0>(c.cpu().sort());
  for (int64_t i = 0; i < k; ++i) cv[i] = cc[i].item<double>();
  ScalarCodebook cb;
  for (int64_t i = 0; i < k; ++i) {
    float v = (float)cv[i];
    // Duplicate levels (degenerate data) would break strict ordering: nudge them apart.
    if (i > 0 && v <= cb.centroids.back()) v = std::nextafter(cb.centroids.back(), INFINITY);
    cb.centroids.push_back(v);
  }
  return cb;
}

double empirical_mse(const at::Tensor& samples, const ScalarCodebook& cb) {
  auto x = samples.reshape({-1}).to(at::kFloat);
  auto q = lm_dequantize(lm_quantize(x, cb.boundaries_tensor(x.device())), cb.centroids_tensor(x.device()));
  return (x - q).pow(2).mean().item<double>();
}

at::Tensor lm_quantize(const at::Tensor& x, const at::Tensor& boundaries) {
  return at::bucketize(x.contiguous(), boundaries, /*out_int32=*/true).to(at::kByte);
}

at::Tensor lm_dequantize(const at::Tensor& idx, const at::Tensor& centroids) {
  return centroids.index_select(0, idx.reshape({-1}).to(at::kLong)).view(idx.sizes());
}

}  // namespace kakeya

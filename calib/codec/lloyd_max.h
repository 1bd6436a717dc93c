// Lloyd-Max scalar quantizers: the codec's per-coordinate codebooks. Tables are
// tiny host vectors (2^bits ascending f32 centroids); quantize/dequantize are
// LibTorch ops on any device. Gaussian-optimal tables are computed numerically
// (closed-form cell moments of N(0,1)), not copied from the literature, so the
// tests can check them against the published values.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace kakeya {

struct ScalarCodebook {
  std::vector<float> centroids;  // [2^bits] strictly ascending (reconstruction levels)
  int bits() const;
  std::vector<float> boundaries() const;  // [2^bits - 1] decision thresholds (midpoints)
  // Device copies for quantize/dequantize.
  at::Tensor centroids_tensor(at::Device d) const;   // [2^bits] f32
  at::Tensor boundaries_tensor(at::Device d) const;  // [2^bits - 1] f32
  void validate(const std::string& what) const;  // bits in 1..8, finite, strictly ascending
};

// N(0,1)-optimal Lloyd-Max table for 1..8 bits (cached after the first call).
const ScalarCodebook& gaussian_codebook(int bits);
// E[(x - Q(x))^2] for x ~ N(0,1), closed form per cell.
double gaussian_mse(const ScalarCodebook& cb);

struct LloydMaxOptions {
  int max_iters = 300;
  double tol = 1e-6;              // stop when no centroid moves more than tol · sample std
  int64_t max_samples = 1 << 24;  // strided subsample above this (sorting cost)
};

// Fits a 2^bits-level table to samples (any shape/device; flattened; every
// value must be finite), starting from the Gaussian table scaled to the
// samples' mean and std. Exact Lloyd iterations on the sorted samples (prefix
// sums), so each iteration costs O(2^bits · log n).
ScalarCodebook lloyd_max_fit(const at::Tensor& samples, int bits, const LloydMaxOptions& opt = {});
// Mean squared quantization error of `samples` under `cb`.
double empirical_mse(const at::Tensor& samples, const ScalarCodebook& cb);

// x: any shape f32 -> same shape uint8 cell indices; boundaries: [K-1] f32.
at::Tensor lm_quantize(const at::Tensor& x, const at::Tensor& boundaries);
// idx: uint8 any shape -> f32 reconstruction levels; centroids: [K] f32.
at::Tensor lm_dequantize(const at::Tensor& idx, const at::Tensor& centroids);

}  // namespace kakeya

// Walsh–Hadamard transform: the codec's rotation. Orthonormal (H/√n), symmetric,
// hence its own inverse; with seeded random signs (x -> H·(s⊙x)) it turns any
// vector into coordinates that are close to i.i.d. Gaussian, which is what a
// single scalar Lloyd-Max table wants. LibTorch ops only (CPU and CUDA).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace kakeya {

bool is_pow2(int64_t n);
int64_t next_pow2(int64_t n);  // smallest power of two >= n (n >= 1)

// x: [..., n], n a power of two. Returns H_n·x/√n along the last dim (same dtype
// and device). Throws naming n otherwise.
at::Tensor wht(const at::Tensor& x);

// x: [..., n] -> [..., next_pow2(n)] zero-padded, so wht applies to any width;
// the inverse keeps the first n coordinates of wht(y). Padding keeps the
// transform orthonormal on the padded space, at the price of coding
// next_pow2(n) coordinates instead of n.
at::Tensor pad_pow2(const at::Tensor& x);

// [n] f32 ±1 on `device`, a deterministic function of (n, seed) on every device
// (drawn on the CPU), so the decoder regenerates them from the seed: no side info.
at::Tensor random_signs(int64_t n, uint64_t seed, at::Device device);

// Randomised Hadamard rotation and its inverse; x, y: [..., n]; signs: [n].
at::Tensor rht(const at::Tensor& x, const at::Tensor& signs);          // H·(s⊙x)
at::Tensor rht_inverse(const at::Tensor& y, const at::Tensor& signs);  // s⊙(H·y)

}  // namespace kakeya

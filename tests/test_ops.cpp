// Coded rows (core/kernels/ops.h quantize_rows / dequantize_rows) on the CPU: the stored layout
// (nibble order, side values), the round-trip error bound of an affine code, and clear errors.
// The CUDA kernels that store and read the same rows are checked against these in test_cuda_ops.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "core/kernels/ops.h"
#include "tests/test_util.h"

using namespace kakeya;
using test::expect_error;

namespace {

// One group 0, 1, ..., 31 in 4 bits: min 0, scale 31/15; code i = round(i · 15/31).
TEST(CodedRows, LayoutOfOneGroup) {
  auto x = at::arange(32, at::kFloat).view({1, 32});
  auto [codes, side] = ops::quantize_rows(x, 4);
  ASSERT_EQ(codes.sizes(), (std::vector<int64_t>{1, 16}));
  ASSERT_EQ(side.sizes(), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(side.scalar_type(), at::kHalf);
  const float scale = side[0][0].item<float>(), mn = side[0][1].item<float>();
  EXPECT_FLOAT_EQ(mn, 0.f);
  EXPECT_FLOAT_EQ(scale, at::tensor(31.f / 15.f).to(at::kHalf).item<float>());
  for (int i = 0; i < 32; i += 2) {
    const int byte = codes[0][i / 2].item<int>();
    EXPECT_EQ(byte & 15, (int)std::nearbyint(i / scale)) << i;          // value 2j: low nibble
    EXPECT_EQ(byte >> 4, (int)std::nearbyint((i + 1) / scale)) << i;    // value 2j + 1: high nibble
  }
}

// Every value decodes within half a step of the code (plus the f16 rounding of min and scale),
// over odd leading shapes, both bit widths, f32 and bf16 inputs; constant groups decode exactly.
TEST(CodedRows, RoundTripWithinHalfAStep) {
  at::manual_seed(7);
  for (int bits : {8, 4}) {
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      auto x = (at::randn({3, 5, 7, 96}) * 4 + 1).to(dt);
      x.select(-1, 0).fill_(1e-3);  // one tiny value among large ones
      x[1][2][3].fill_(-2.5);       // one constant row: scale 0
      auto [codes, side] = ops::quantize_rows(x, bits);
      ASSERT_EQ(codes.sizes(), (std::vector<int64_t>{3, 5, 7, 96 * bits / 8}));
      ASSERT_EQ(side.sizes(), (std::vector<int64_t>{3, 5, 7, 6}));
      auto y = ops::dequantize_rows(codes, side, bits, at::kFloat);
      ASSERT_EQ(y.sizes(), x.sizes());
      auto xf = x.to(at::kFloat).view({-1, 3, 32});
      auto range = std::get<0>(xf.max(-1, true)) - std::get<0>(xf.min(-1, true));  // [N, 3, 1]
      const double levels = (1 << bits) - 1;
      // Half a step, and the f16 rounding of min (2^-11 relative) and of scale times the code.
      auto bound = range / levels * 0.5 * (1 + 2e-3) + xf.abs().amax(-1, true) * 2e-3 + 1e-6;
      auto err = (y.view({-1, 3, 32}) - xf).abs();
      EXPECT_TRUE(err.le(bound).all().item<bool>())
          << bits << " bits " << dt << ": max err " << err.max().item<double>();
      EXPECT_TRUE(y[1][2][3].eq(-2.5).all().item<bool>()) << "a constant row decodes exactly";
      // Codes span the range: the group's min and max values code to 0 and 2^bits - 1.
      auto c = bits == 8 ? codes : at::stack({codes.bitwise_and(15), codes.bitwise_right_shift(4)}, -1);
      EXPECT_EQ(c.max().item<int>(), (int)levels);
      EXPECT_EQ(c.min().item<int>(), 0);
    }
  }
}

TEST(CodedRows, BadInput) {
  expect_error([] { ops::quantize_rows(at::zeros({2, 48}), 4); }, "not a multiple of the code group 32");
  expect_error([] { ops::quantize_rows(at::zeros({2, 64}), 3); }, "bits expected 8 or 4");
  auto [codes, side] = ops::quantize_rows(at::zeros({2, 64}), 8);
  expect_error([&] { ops::dequantize_rows(codes, side.to(at::kFloat), 8, at::kFloat); }, "side f16");
}

}  // namespace

// Coded rows (core/kernels/ops.h quantize_rows / dequantize_rows) on the CPU: the stored layout
// (nibble order, side values; the rotated code's bit stream), the round-trip error bound of an
// affine code, the rotated code's distortion (the N(0,1) Lloyd-Max levels, fitted independently by
// calib/codec/lloyd_max.h) and kept norms, the Hadamard transform against its matrix, clear errors.
// The CUDA kernels that store and read the same rows are checked against these in test_cuda_ops.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "calib/codec/lloyd_max.h"
#include "core/kernels/ops.h"
#include "tests/test_util.h"

using namespace kakeya;
using test::expect_error;

namespace {

const ops::RowCode kInt8{ops::RowKind::Affine, 8}, kInt4{ops::RowKind::Affine, 4};

// One group 0, 1, ..., 31 in 4 bits: min 0, scale 31/15; code i = round(i · 15/31).
// The lm_head's int8 screen (ops::make_head_screen): every row's bounds hold the logit however it is
// summed (f64, and ATen's f32 GEMV), and the rows the screen keeps (upper bound, rounded to bf16, at
// least the largest lower bound, rounded) hold every row tied at the largest rounded logit: the CUDA
// kernel's exact pass then finds the whole head's argmax. Rows of very different scales, a zero row,
// an exact copy, and x with a few large dimensions, as a model's final hidden state has.
TEST(HeadScreen, BoundsHoldAndKeepTheArgmax) {
  at::manual_seed(7);
  const int64_t V = 3001, K = 80;
  at::Tensor w = at::randn({V, K}) * 0.05 * at::pow(10.0, at::randint(-3, 2, {V, 1}).to(at::kFloat));
  w[5].zero_();
  w[17] = at::randn({K}) * 2.0;  // the longest row: x along it makes 17 and its copy the maximum
  w[V - 1] = w[17];
  w = w.to(at::kBFloat16);
  const ops::HeadScreen s = ops::make_head_screen(w);
  ASSERT_TRUE(s.defined());
  EXPECT_EQ(s.codes.scalar_type(), at::kChar);
  EXPECT_LE(s.codes.abs().max().item<int>(), 127);
  // The codes are the rows to within half a step.
  const at::Tensor step = s.scale.unsqueeze(1);
  EXPECT_TRUE(((s.codes.to(at::kFloat) * step - w.to(at::kFloat)).abs() <= step * 0.5001 + 1e-30).all().item<bool>());
  EXPECT_EQ(s.err[5].item<float>(), 0.f) << "a zero row is exact";
  for (int i = 0; i < 40; ++i) {
    at::Tensor x = at::randn({K}) * 4;
    if (i % 2) x.index_put_({at::randint(K, {2}, at::kLong)}, 200.0);
    if (i == 3) x = w[17].to(at::kFloat) * 30;  // rows 17 and V - 1 tie
    x = x.to(at::kBFloat16);
    const auto [lo, up] = ops::head_screen_bounds(x, s);
    const at::Tensor v64 = at::mv(w.to(at::kDouble), x.to(at::kDouble));
    const at::Tensor v32 = at::mv(w.to(at::kFloat), x.to(at::kFloat));
    for (const at::Tensor& v : {v64, v32.to(at::kDouble)}) {
      EXPECT_TRUE((lo.to(at::kDouble) <= v).all().item<bool>()) << "x " << i;
      EXPECT_TRUE((v <= up.to(at::kDouble)).all().item<bool>()) << "x " << i;
    }
    const at::Tensor rounded = v32.to(at::kBFloat16).to(at::kFloat);
    const at::Tensor tied = rounded == rounded.max();
    const at::Tensor kept = up.to(at::kBFloat16).to(at::kFloat) >= lo.max().to(at::kBFloat16).to(at::kFloat);
    EXPECT_TRUE((kept | ~tied).all().item<bool>()) << "x " << i << ": a row tied at the maximum was screened out";
    EXPECT_LT(kept.sum().item<int64_t>(), V / 4) << "x " << i << ": the screen kept most rows";
    if (i == 3) EXPECT_TRUE(kept[17].item<bool>() && kept[V - 1].item<bool>());
  }
  expect_error([&] { ops::make_head_screen(w.to(at::kInt)); }, "make_head_screen");
}

TEST(CodedRows, LayoutOfOneGroup) {
  auto x = at::arange(32, at::kFloat).view({1, 32});
  auto [codes, side] = ops::quantize_rows(x, kInt4);
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

// The same group in 6 bits, over a row of 128 (int6's shortest): value i at bits 6i .. 6i + 5 of
// the row's little-endian bytes, 24 bytes a group; the other groups (zeros) code to 0.
TEST(CodedRows, LayoutOfOneGroupIn6Bits) {
  auto x = at::zeros({1, 128});
  x.narrow(1, 32, 32).copy_(at::arange(32, at::kFloat));
  const ops::RowCode int6 = ops::parse_row_code("int6", "--x");
  auto [codes, side] = ops::quantize_rows(x, int6);
  ASSERT_EQ(codes.sizes(), (std::vector<int64_t>{1, 96}));
  ASSERT_EQ(side.sizes(), (std::vector<int64_t>{1, 8}));
  const float scale = side[0][2].item<float>();
  EXPECT_FLOAT_EQ(side[0][3].item<float>(), 0.f);
  EXPECT_FLOAT_EQ(scale, at::tensor(31.f / 63.f).to(at::kHalf).item<float>());
  std::vector<int> b(96);
  for (int i = 0; i < 96; ++i) b[i] = codes[0][i].item<int>();
  for (int i = 0; i < 128; ++i) {
    const int bit = 6 * i, v = ((b[bit / 8] | (bit / 8 + 1 < 96 ? b[bit / 8 + 1] << 8 : 0)) >> (bit % 8)) & 63;
    EXPECT_EQ(v, i >= 32 && i < 64 ? (int)std::nearbyint((i - 32) / scale) : 0) << i;
  }
  EXPECT_EQ(ops::row_code_name(int6), "int6");
  expect_error([] { ops::quantize_rows(at::zeros({2, 96}), ops::parse_row_code("int6", "--x")); },
               "int6 codes rows whose 32nds are whole bytes of codes (a multiple of 128 values); the row length is 96");
}

// Every value decodes within half a step of the code (plus the f16 rounding of min and scale),
// over odd leading shapes, both bit widths, f32 and bf16 inputs; constant groups decode exactly.
TEST(CodedRows, RoundTripWithinHalfAStep) {
  at::manual_seed(7);
  for (int bits : {8, 6, 4}) {
    const int64_t D = bits == 6 ? 128 : 96;  // int6: a multiple of 128 values
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      auto x = (at::randn({3, 5, 7, D}) * 4 + 1).to(dt);
      x.select(-1, 0).fill_(1e-3);  // one tiny value among large ones
      x[1][2][3].fill_(-2.5);       // one constant row: scale 0
      const ops::RowCode code{ops::RowKind::Affine, bits};
      auto [codes, side] = ops::quantize_rows(x, code);
      ASSERT_EQ(codes.sizes(), (std::vector<int64_t>{3, 5, 7, D * bits / 8}));
      ASSERT_EQ(side.sizes(), (std::vector<int64_t>{3, 5, 7, D / 16}));
      auto y = ops::dequantize_rows(codes, side, code, at::kFloat);
      ASSERT_EQ(y.sizes(), x.sizes());
      auto xf = x.to(at::kFloat).view({-1, D / 32, 32});
      auto range = std::get<0>(xf.max(-1, true)) - std::get<0>(xf.min(-1, true));  // [N, 3, 1]
      const double levels = (1 << bits) - 1;
      // Half a step, and the f16 rounding of min (2^-11 relative) and of scale times the code.
      auto bound = range / levels * 0.5 * (1 + 2e-3) + xf.abs().amax(-1, true) * 2e-3 + 1e-6;
      auto err = (y.view({-1, D / 32, 32}) - xf).abs();
      EXPECT_TRUE(err.le(bound).all().item<bool>())
          << bits << " bits " << dt << ": max err " << err.max().item<double>();
      EXPECT_TRUE(y[1][2][3].eq(-2.5).all().item<bool>()) << "a constant row decodes exactly";
      // Codes span the range: the group's min and max values code to 0 and 2^bits - 1.
      // (6 bits: four codes in every 3 bytes, b0 | b1 << 8 | b2 << 16.)
      auto tri = codes.reshape({-1, 3}).to(at::kInt);
      auto word = tri.select(1, 0) + tri.select(1, 1) * 256 + tri.select(1, 2) * 65536;
      auto c = bits == 8   ? codes
               : bits == 6 ? at::stack({word.bitwise_and(63), word.bitwise_right_shift(6).bitwise_and(63),
                                        word.bitwise_right_shift(12).bitwise_and(63), word.bitwise_right_shift(18)}, -1)
                           : at::stack({codes.bitwise_and(15), codes.bitwise_right_shift(4)}, -1);
      EXPECT_EQ(c.max().item<int>(), (int)levels);
      EXPECT_EQ(c.min().item<int>(), 0);
    }
  }
}

// H·x / sqrt(D) against the Sylvester matrix (kron of [[1, 1], [1, -1]]), over leading shapes.
TEST(CodedRows, HadamardTransformIsTheMatrix) {
  at::manual_seed(3);
  for (int64_t D : {2, 8, 64, 256}) {
    auto h = at::ones({1, 1});
    auto h2 = at::tensor({1.f, 1.f, 1.f, -1.f}).view({2, 2});
    while (h.size(0) < D) h = at::kron(h, h2);
    auto x = at::randn({3, 5, D});
    auto want = at::matmul(x, h.t()) / std::sqrt((double)D);
    EXPECT_TRUE(at::allclose(ops::fwht(x), want, 1e-5, 1e-5)) << D;
    EXPECT_TRUE(at::allclose(ops::fwht(ops::fwht(x)), x, 1e-5, 1e-5)) << D << ": the transform is its own inverse";
  }
  expect_error([] { ops::fwht(at::zeros({2, 48})); }, "not a power of two");
}

TEST(CodedRows, RotatedLevelsAreTheGaussianLloydMaxTables) {
  for (int bits : {2, 3, 4, 5}) {
    const auto& lv = ops::rotated_levels(bits);
    const auto& fit = gaussian_codebook(bits).centroids;
    ASSERT_EQ(lv.size(), fit.size());
    for (size_t i = 0; i < lv.size(); ++i) EXPECT_NEAR(lv[i], fit[i], 2e-5) << bits << " bits, level " << i;
  }
}

// Uniform levels (ruB): evenly spaced by uniform_step, symmetric, and the step is the N(0,1) optimum
// (calib's own distortion integral is larger 1% to either side).
TEST(CodedRows, UniformLevelsAreEvenlySpacedAtTheGaussianOptimum) {
  for (int bits : {2, 3, 4, 5}) {
    const auto& lv = ops::rotated_levels(bits, true);
    const float step = ops::uniform_step(bits);
    ASSERT_EQ((int)lv.size(), 1 << bits);
    for (size_t i = 0; i < lv.size(); ++i) {
      EXPECT_NEAR(lv[i], ((double)i - 0.5 * (double)(lv.size() - 1)) * step, 1e-6) << bits << " bits, level " << i;
      EXPECT_EQ(lv[i], -lv[lv.size() - 1 - i]) << bits << " bits: symmetric";
    }
    auto mse = [&](double s) {
      ScalarCodebook cb;
      for (size_t i = 0; i < lv.size(); ++i) cb.centroids.push_back((float)(((double)i - 0.5 * (lv.size() - 1)) * s));
      return gaussian_mse(cb);
    };
    EXPECT_LT(mse(step), mse(step * 0.99)) << bits << " bits";
    EXPECT_LT(mse(step), mse(step * 1.01)) << bits << " bits";
    // Lloyd-Max is the optimum over every level set: uniform levels cost more, by at most 1.6x here.
    EXPECT_GT(mse(step), gaussian_mse(gaussian_codebook(bits))) << bits << " bits";
    EXPECT_LT(mse(step), 1.6 * gaussian_mse(gaussian_codebook(bits))) << bits << " bits";
  }
}

// The bit stream: value i's index at bits i·b .. i·b + b - 1. Hand-packed indices i mod 2^b (scale
// g = 1) decode to x̂ whose rotation H·(s ⊙ x̂)/sqrt(D) is exactly those levels.
TEST(CodedRows, RotatedLayout) {
  for (int bits : {2, 3, 4, 5}) {
    const int64_t D = 256;
    std::vector<uint8_t> bytes(D * bits / 8, 0);
    for (int64_t i = 0; i < D; ++i)
      for (int b = 0; b < bits; ++b)
        if (((i % (1 << bits)) >> b) & 1) bytes[(i * bits + b) / 8] |= (uint8_t)(1u << ((i * bits + b) % 8));
    auto codes = at::from_blob(bytes.data(), {1, (int64_t)bytes.size()}, at::kByte).clone();
    auto side = at::ones({1, 1}, at::kFloat).view(at::kHalf);
    const ops::RowCode code{ops::RowKind::Rotated, bits};
    auto x = ops::dequantize_rows(codes, side, code, at::kFloat);  // [1, D]
    std::vector<float> s(D);
    for (int64_t i = 0; i < D; ++i) s[i] = ops::rotation_sign(i);
    auto y = ops::fwht(x * at::tensor(s));
    const auto& lv = ops::rotated_levels(bits);
    for (int64_t i = 0; i < D; ++i) EXPECT_NEAR(y[0][i].item<float>(), lv[i % (1 << bits)], 1e-5) << bits << " bits, " << i;
  }
}

// Any row (here Gaussian rows with a few large outlier channels, as K has): the decoded row keeps
// its norm, and the mean relative squared error is the N(0,1) Lloyd-Max distortion of the bits.
TEST(CodedRows, RotatedRoundTripKeepsTheNormAtTheGaussianDistortion) {
  at::manual_seed(11);
  for (int bits : {2, 3, 4, 5}) {
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      const int64_t D = 256;
      auto x = at::randn({4, 7, D});
      x.select(-1, 3).mul_(20);  // outlier channels
      x.select(-1, 100).add_(15);
      x = x.to(dt);
      for (bool uniform : {false, true}) {  // lmB, ruB
        const ops::RowCode code{ops::RowKind::Rotated, bits, false, uniform};
        auto [codes, side] = ops::quantize_rows(x, code);
        ASSERT_EQ(codes.sizes(), (std::vector<int64_t>{4, 7, D * bits / 8}));
        ASSERT_EQ(side.sizes(), (std::vector<int64_t>{4, 7, 2}));
        auto y = ops::dequantize_rows(codes, side, code, at::kFloat);
        auto xf = x.to(at::kFloat);
        auto n = xf.pow(2).sum(-1);
        EXPECT_TRUE(at::allclose(y.pow(2).sum(-1), n, 1e-4, 0)) << ops::row_code_name(code) << ": the norm is kept";
        const double rel = ((y - xf).pow(2).sum(-1) / n).mean().item<double>();
        ScalarCodebook cb;
        cb.centroids = ops::rotated_levels(bits, uniform);
        const double want = gaussian_mse(cb);
        EXPECT_GT(rel, want * 0.8) << ops::row_code_name(code);
        EXPECT_LT(rel, want * 1.2) << ops::row_code_name(code);
        // A zero row decodes to zeros.
        auto [zc, zs] = ops::quantize_rows(at::zeros({1, D}), code);
        EXPECT_TRUE(ops::dequantize_rows(zc, zs, code, at::kFloat).eq(0).all().item<bool>());
      }
    }
  }
}

TEST(CodedRows, BadInput) {
  expect_error([] { ops::quantize_rows(at::zeros({2, 48}), kInt4); }, "not a multiple of the code group 32");
  expect_error([] { ops::quantize_rows(at::zeros({2, 64}), ops::RowCode{ops::RowKind::Affine, 3}); },
               "affine codes take 8, 6 or 4 bits");
  expect_error([] { ops::quantize_rows(at::zeros({2, 128}), ops::RowCode{ops::RowKind::Rotated, 3}); },
               "lm3 codes rows of a power-of-two length in 64..512 whose 32nds are whole bytes of codes, at most 8 a lane; the head dim is 128 (use lm4 or lm2)");
  // 5 bits: 40 bits a lane at D = 256; 80 at D = 512, past the kernels' one 64-bit word.
  expect_error([] { ops::quantize_rows(at::zeros({2, 512}), ops::RowCode{ops::RowKind::Rotated, 5}); },
               "the head dim is 512 (use lm4, lm3 or lm2)");
  EXPECT_EQ(ops::parse_row_code("lm5", "--x"), (ops::RowCode{ops::RowKind::Rotated, 5}));
  expect_error([] { ops::quantize_rows(at::zeros({2, 96}), ops::RowCode{ops::RowKind::Rotated, 4}); }, "the head dim is 96");
  auto [codes, side] = ops::quantize_rows(at::zeros({2, 64}), kInt8);
  expect_error([&] { ops::dequantize_rows(codes, side.to(at::kFloat), kInt8, at::kFloat); }, "side f16");
  EXPECT_EQ(ops::parse_row_code("lm3", "--x"), (ops::RowCode{ops::RowKind::Rotated, 3}));
  EXPECT_EQ(ops::parse_row_code("int8", "--x"), kInt8);
  EXPECT_FALSE(ops::parse_row_code("none", "--x").defined());
  EXPECT_EQ(ops::row_code_name(kInt4), "int4");
  expect_error([] { ops::parse_row_code("lm6", "--full-code"); },
               "--full-code: expected none | int8 | int6 | int4 | lm5 | lm4 | lm3 | lm2 | ru5 | ru4 | ru3 | ru2 | pw5 | pw4 | pw3 | pw2, got 'lm6'");
  expect_error([] { ops::parse_row_code("pw1", "--full-code"); }, "got 'pw1'");
  EXPECT_EQ(ops::parse_row_code("pw4", "--x"), (ops::RowCode{ops::RowKind::Rotated, 4, true}));
  EXPECT_FALSE(ops::parse_row_code("pw4", "--x") == ops::parse_row_code("lm4", "--x"));
  EXPECT_EQ(ops::row_code_name(ops::parse_row_code("pw5", "--x")), "pw5");
  EXPECT_EQ(ops::parse_row_code("ru5", "--x"), (ops::RowCode{ops::RowKind::Rotated, 5, false, true}));
  EXPECT_FALSE(ops::parse_row_code("ru5", "--x") == ops::parse_row_code("lm5", "--x"));
  EXPECT_EQ(ops::row_code_name(ops::parse_row_code("ru3", "--x")), "ru3");
  expect_error([] { ops::check_row_code(256, ops::RowCode{ops::RowKind::Rotated, 4, true, true}, "--x"); },
               "weighted rows (pwB) take Lloyd-Max levels");
  for (const char* n : {"int8", "int6", "int4", "lm5", "lm2", "ru5", "ru2", "pw5", "pw2"}) EXPECT_TRUE(ops::is_row_code_name(n)) << n;
  for (const char* n : {"none", "lm6", "pw", "int2", "lm44"}) EXPECT_FALSE(ops::is_row_code_name(n)) << n;
  // A code per layer over a default one (--full-code pw4+17=pw5v4).
  {
    auto [base, layers] = ops::parse_layer_codes("pw4+17=pw5v4+5=lm5", "--full-code");
    EXPECT_EQ(base, ops::parse_row_code("pw4", "--x"));
    ASSERT_EQ(layers.size(), 18u);
    EXPECT_EQ(ops::layer_code(base, layers, 17), ops::parse_row_code("pw5v4", "--x"));
    EXPECT_EQ(ops::layer_code(base, layers, 5), ops::parse_row_code("lm5", "--x"));
    EXPECT_EQ(ops::layer_code(base, layers, 11), base);
    EXPECT_EQ(ops::layer_code(base, layers, 40), base);
    EXPECT_EQ(ops::layer_codes_name(base, layers), "pw4+5=lm5+17=pw5v4");
    EXPECT_TRUE(ops::parse_layer_codes("int6", "--x").second.empty());
    EXPECT_FALSE(ops::parse_layer_codes("none", "--x").first.defined());
    for (const char* n : {"pw4+", "pw4+17", "pw4+x=pw5", "pw4+17=none", "pw4+17=lm9", "pw6", ""})
      EXPECT_THROW(ops::parse_layer_codes(n, "--x"), std::exception) << n;
    expect_error([] { ops::parse_layer_codes("pw4+17", "--full-code"); },
                 "--full-code: '17' in 'pw4+17': expected LAYER=CODE (a layer's own code, e.g. pw4+17=pw5v4)");
    expect_error([] { ops::parse_layer_codes("pw4+5=pw5+5=lm4", "--full-code"); }, "--full-code: layer 5 given twice");
    expect_error([] { ops::parse_layer_codes("pw4+5=lm7", "--full-code"); }, "--full-code: expected none | int8");
    expect_error([] { ops::parse_layer_codes("none+5=lm4", "--full-code"); }, "layers' own codes over no default code");
  }
  // Split codes: V rows in other bits than K's.
  const ops::RowCode pw5v3 = ops::parse_row_code("pw5v3", "--x");
  EXPECT_EQ(pw5v3, (ops::RowCode{ops::RowKind::Rotated, 5, true, false, 3}));
  EXPECT_EQ(ops::row_code_name(pw5v3), "pw5v3");
  EXPECT_EQ(pw5v3.k(), ops::parse_row_code("pw5", "--x"));
  EXPECT_EQ(pw5v3.v(), ops::parse_row_code("lm3", "--x"));  // V rows are never weighted
  EXPECT_EQ(ops::parse_row_code("ru5v3", "--x").v(), ops::parse_row_code("ru3", "--x"));
  EXPECT_FALSE(pw5v3 == ops::parse_row_code("pw5", "--x"));
  EXPECT_EQ(ops::code_bytes(256, pw5v3.k()) + ops::code_bytes(256, pw5v3.v()), 2 * ops::code_bytes(256, ops::parse_row_code("pw4", "--x")));
  for (const char* n : {"pw5v3", "lm4v2", "ru5v4"}) EXPECT_TRUE(ops::is_row_code_name(n)) << n;
  for (const char* n : {"int4v3", "pw5v6", "pw5v", "pw5x3", "lm5v31"}) EXPECT_FALSE(ops::is_row_code_name(n)) << n;
  expect_error([] { ops::parse_row_code("int4v3", "--full-code"); }, "(a rotated code + v2 .. v5 codes V rows in those bits: pw5v3)");
  EXPECT_NO_THROW(ops::check_row_code(256, pw5v3, "--x"));
  expect_error([&] { ops::check_row_code(128, ops::parse_row_code("lm4v3", "--x"), "--x"); },
               "--x: lm4v3: V rows in 3 bits do not fit rows of 128 values");
  expect_error([] { ops::check_row_code(256, ops::RowCode{ops::RowKind::Affine, 4, false, false, 3}, "--x"); },
               "a split code (V rows in other bits) is a rotated one");
  expect_error([&] { ops::quantize_rows(at::randn({2, 256}), pw5v3); }, "quantize_rows: pw5v3 codes K and V rows apart");
  expect_error([] { ops::check_row_code(256, ops::RowCode{ops::RowKind::Affine, 4, true}, "--x"); },
               "weighted rows are rotated codes");
  expect_error([] { ops::check_row_code(256, ops::RowCode{ops::RowKind::Affine, 4, false, true}, "--x"); },
               "and so are uniform ones (ru2 .. ru5)");
}

// Weighted rows (pwB) through the reference code_rows: K rows are coded as w ⊙ (k - mean), so
// read back as decoded / w + mean their error lands where w is small: with w = 2 on half the
// coordinates and 0.5 on the rest, the squared error is (0.5 / 2)² = 1/16 as large on the first half.
// V rows are coded as the unweighted code codes them.
TEST(CodedRows, WeightedRows) {
  const ops::RowCode pw4 = ops::parse_row_code("pw4", "--x"), lm4 = ops::parse_row_code("lm4", "--x");
  const int64_t H = 1, S = 64, D = 256;
  auto k = at::randn({1, H, S, D}) * 3, v = at::randn({1, H, S, D});
  auto w = at::cat({at::full({D / 2}, 2.0), at::full({D / 2}, 0.5)}).view({1, H, D});
  ops::CodedSlots c;
  c.code = pw4;
  c.k_codes = at::zeros({1, H, S, ops::code_bytes(D, pw4)}, at::kByte);
  c.v_codes = at::zeros_like(c.k_codes);
  c.k_side = at::zeros({1, H, S, ops::side_halves(D, pw4)}, at::kHalf);
  c.v_side = at::zeros_like(c.k_side);
  c.k_mean = at::randn({1, H, D});
  c.v_mean = at::randn({1, H, D});
  c.k_weight = w;
  auto slots = at::arange(S, at::kLong);
  ops::code_rows(k, v, slots, slots, c);
  auto kd = ops::dequantize_rows(c.k_codes, c.k_side, pw4, at::kFloat) / w.unsqueeze(2) + c.k_mean.unsqueeze(2);
  auto e = (kd - k).pow(2).mean(at::IntArrayRef{0, 1, 2});  // [D]
  const double ratio = (e.slice(0, 0, D / 2).mean() / e.slice(0, D / 2, D).mean()).item<double>();
  EXPECT_GT(ratio, 1.0 / 24) << "squared error, w = 2 vs w = 0.5 coordinates";
  EXPECT_LT(ratio, 1.0 / 10) << "squared error, w = 2 vs w = 0.5 coordinates";
  // The codes are the unweighted code's of the weighted rows; V's are plain lm4 rows.
  auto [want_k, want_ks] = ops::quantize_rows((k - c.k_mean.unsqueeze(2)) * w.unsqueeze(2), lm4);
  EXPECT_TRUE(c.k_codes.equal(want_k));
  auto [want_v, want_vs] = ops::quantize_rows(v - c.v_mean.unsqueeze(2), lm4);
  EXPECT_TRUE(c.v_codes.equal(want_v));
  EXPECT_TRUE(c.v_side.view(at::kShort).equal(want_vs.view(at::kShort)));  // f32 scales in f16 halves: compare bits
}

// A split code through the reference code_rows: K rows in the K half's code (weighted), V rows in
// the V half's, each what quantize_rows makes of them; pw5v3's rows cost pw4's bytes.
TEST(CodedRows, SplitRows) {
  const ops::RowCode pw5v3 = ops::parse_row_code("pw5v3", "--x");
  const int64_t H = 2, S = 40, D = 256;
  auto k = at::randn({1, H, S, D}) * 3, v = at::randn({1, H, S, D});
  ops::CodedSlots c;
  c.code = pw5v3;
  c.k_codes = at::zeros({1, H, S, ops::code_bytes(D, pw5v3.k())}, at::kByte);
  c.v_codes = at::zeros({1, H, S, ops::code_bytes(D, pw5v3.v())}, at::kByte);
  c.k_side = at::zeros({1, H, S, ops::side_halves(D, pw5v3.k())}, at::kHalf);
  c.v_side = at::zeros({1, H, S, ops::side_halves(D, pw5v3.v())}, at::kHalf);
  c.k_mean = at::randn({1, H, D});
  c.v_mean = at::randn({1, H, D});
  c.k_weight = at::exp(at::rand({1, H, D}) - 0.5);
  auto slots = at::arange(S, at::kLong);
  ops::code_rows(k, v, slots, slots, c);
  EXPECT_EQ(c.k_codes.size(-1), 160);
  EXPECT_EQ(c.v_codes.size(-1), 96);
  auto [want_k, want_ks] = ops::quantize_rows((k - c.k_mean.unsqueeze(2)) * c.k_weight.unsqueeze(2), pw5v3.k());
  auto [want_v, want_vs] = ops::quantize_rows(v - c.v_mean.unsqueeze(2), pw5v3.v());
  EXPECT_TRUE(c.k_codes.equal(want_k));
  EXPECT_TRUE(c.v_codes.equal(want_v));
  EXPECT_TRUE(c.v_side.view(at::kShort).equal(want_vs.view(at::kShort)));
  // Each half decodes within its own code's distortion: 5-bit K rows far closer than 3-bit V rows.
  auto rel = [](const at::Tensor& a, const at::Tensor& b) { return ((a - b).pow(2).sum() / b.pow(2).sum()).item<double>(); };
  const double ek = rel(ops::dequantize_rows(c.k_codes, c.k_side, pw5v3.k(), at::kFloat),
                        (k - c.k_mean.unsqueeze(2)) * c.k_weight.unsqueeze(2));
  const double ev = rel(ops::dequantize_rows(c.v_codes, c.v_side, pw5v3.v(), at::kFloat), v - c.v_mean.unsqueeze(2));
  EXPECT_LT(ek, 0.0035);
  EXPECT_GT(ev, 0.025);
  EXPECT_LT(ev, 0.045);
}

}  // namespace
